//! The fast CPU passes of a recurrent step over a batch: the samples' time loops on the threads
//! of the pool (`cpu::recurrent`), then, backward, the weight and bias gradients over all B·T
//! steps at once (`param_grads`) and the input gradient as products.

use super::packed::{pack_rows, Weights};
use super::param_grads::{parameter_gradients, Side};
use super::{packed_at, rows_at, Cell, Dims, CPREV, GATES, HPREV, STATE};
use crate::chain::Step;
use crate::cpu::gemm::{sgemm, Mat, MatMut};
use crate::cpu::recurrent::{backward_group, forward_group, forward_split, split_threads, BackSample, Sample, GROUP};
use crate::cpu::{for_chunks, SharedMut};
use crate::layers::kind::Mode;
use crate::layers::{BackPass, Pass};
use std::ops::Range;

/// The regions of a recurrent step for a batch: (x, out, gates, hprev, state, cprev; an empty
/// range for a GRU's cprev).
struct Regions {
    x: Range<usize>,
    out: Range<usize>,
    gates: Range<usize>,
    hprev: Range<usize>,
    state: Range<usize>,
    cprev: Range<usize>,
}

impl Regions {
    fn of(d: &Dims, step: &Step, region: impl Fn(usize) -> Range<usize>) -> Regions {
        let kept = |i: usize| region(step.kept.start + i);
        let cprev = if d.cell == Cell::Lstm { kept(CPREV) } else { 0..0 };
        Regions {
            x: region(step.input_region),
            out: region(step.output_region),
            gates: kept(GATES),
            hprev: kept(HPREV),
            state: kept(STATE),
            cprev,
        }
    }
}

/// Sample `s`'s part of `range`, `len` values a sample.
fn part(range: &Range<usize>, s: usize, len: usize) -> Range<usize> {
    let start = range.start + s * len;
    start..start + len
}

/// The fast forward: the samples' sequences on the threads of the pool (they are independent),
/// a group of them at a time: the input products of all their steps first, then one step after
/// another (`cpu::recurrent`). An inference of one sample on a pool of several threads splits each
/// step's units among them instead where the units are enough (`forward_split`: the same bits);
/// whether a pass of one sample runs on the pool at all is timed when the cache is made
/// (`Cache::routes`' batch-1 line).
pub(crate) fn forward(d: &Dims, step: &Step, pass: &mut Pass, mode: Mode) {
    let r = Regions::of(d, step, |i| pass.region(i));
    let params = &pass.params[step.params.clone()];
    // (the workspace's were packed for this parameter version by `Workspace::prepare`)
    let weights = if d.packed { Weights::of(d, params) } else { Weights::of(d, &pass.ws.rnn[packed_at(pass.plan, pass.index)]) };
    let (t, f, p) = (d.steps, d.features, d.padded);
    let keep = mode == Mode::Train;
    let acts = SharedMut::new(&mut *pass.acts);
    let sample = |s: usize| {
        // SAFETY: the step's regions are distinct, and sample s's part of each is its own (each
        // sample is taken once, by the one task whose chunk holds it).
        unsafe {
            Sample {
                x: acts.slice(part(&r.x, s, t * f)),
                out: acts.slice(part(&r.out, s, d.out_len())),
                gates: acts.slice(part(&r.gates, s, t * d.row())),
                hprev: acts.slice(part(&r.hprev, s, t * p)),
                state: acts.slice(part(&r.state, s, d.state_len())),
                cprev: acts.slice(part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })),
            }
        }
    };
    if pass.batch == 1 && !keep && split_threads(d, pass.pool.threads()) > 1 {
        forward_split(d, &weights, &mut sample(0), pass.pool);
        return;
    }
    for_chunks(pass.pool, pass.batch, 1, &|_, samples| {
        for first in samples.clone().step_by(GROUP) {
            let n = GROUP.min(samples.end - first);
            if n == 1 {
                // (a stream's usual call: no group to fill)
                forward_group(d, &weights, &mut [sample(first)], keep);
                continue;
            }
            let mut group: [Sample; GROUP] = std::array::from_fn(|i| if i < n { sample(first + i) } else { Sample::none() });
            forward_group(d, &weights, &mut group[..n], keep);
        }
    });
}

/// The fast backward (through time): the samples' steps from the last to the first on the threads
/// of the pool, a group of them in lockstep at a time (`cpu::recurrent`), which leaves every
/// step's gate gradients in the gates' twin; then the weight gradients, the bias gradients and
/// (with `need_dx`) the input gradient over all B·T steps at once, as products.
pub(crate) fn backward(d: &Dims, step: &Step, pass: &mut BackPass, need_dx: bool) {
    let r = Regions::of(d, step, |i| pass.region(i));
    let params = &pass.params[step.params.clone()];
    let rows = &mut pass.ws.rnn[rows_at(pass.plan, pass.index)][..d.rows_len()];
    pack_rows(d, params, rows);
    let rows = &*rows;
    let (t, p) = (d.steps, d.padded);
    let (acts, dacts) = (pass.acts, SharedMut::new(&mut *pass.dacts));
    let sample = |s: usize| BackSample {
        gates: &acts[part(&r.gates, s, t * d.row())],
        hprev: &acts[part(&r.hprev, s, t * p)],
        state: &acts[part(&r.state, s, d.state_len())],
        cprev: &acts[part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })],
        // SAFETY: the output's gradient is read, the kept regions' twins written: distinct
        // regions, and sample s's part of each is its own (each sample is taken once, by the one
        // task whose chunk holds it).
        dy: unsafe { dacts.slice(part(&r.out, s, d.out_len())) },
        // SAFETY: as above.
        dgates: unsafe { dacts.slice(part(&r.gates, s, t * d.row())) },
        // SAFETY: as above.
        dhprev: unsafe { dacts.slice(part(&r.hprev, s, t * p)) },
        // SAFETY: as above.
        dstate: unsafe { dacts.slice(part(&r.state, s, d.state_len())) },
        // SAFETY: as above.
        dcprev: unsafe { dacts.slice(part(&r.cprev, s, if r.cprev.is_empty() { 0 } else { t * p })) },
    };
    for_chunks(pass.pool, pass.batch, 1, &|_, samples| {
        for first in samples.clone().step_by(GROUP) {
            let n = GROUP.min(samples.end - first);
            let mut group: [BackSample; GROUP] = std::array::from_fn(|i| if i < n { sample(first + i) } else { BackSample::none() });
            backward_group(d, rows, &mut group[..n]);
        }
    });
    let (acts, dacts) = (pass.acts, &mut *pass.dacts);
    let (dx_all, rest) = dacts.split_at_mut(r.gates.start);
    let dg = &rest[..r.gates.len()];
    let m = pass.batch * t;
    let (g, f, h, row) = (d.gates(), d.features, d.hidden, d.row());
    let grads = &mut pass.grads[step.params.clone()];
    let (dw_ih, rest) = grads.split_at_mut(g * h * f);
    let (dw_hh, rest) = rest.split_at_mut(g * h * h);
    let (db_ih, db_hh) = rest.split_at_mut(g * h);
    let (x, hprev) = (&acts[r.x.clone()], &acts[r.hprev.clone()]);
    // (W_hh's rows are done with: the room takes S of both sides, see `param_grads`)
    let (room, gemm) = (&mut pass.ws.rnn[rows_at(pass.plan, pass.index)], &mut pass.ws.gemm);
    let (s_ih, s_hh) = room[..(f + h) * row].split_at_mut(f * row);
    let mut sides = [
        Side { a: x, ld: f, n: f, blocks: d.cell.input_blocks(), s: s_ih, dw: dw_ih, db: db_ih },
        Side { a: hprev, ld: p, n: h, blocks: d.cell.hidden_blocks(), s: s_hh, dw: dw_hh, db: db_hh },
    ];
    parameter_gradients(pass.pool, gemm, d, dg, m, &mut sides);
    if need_dx {
        // dX (m × F) = Σ_g dg_g (m × H) · W_ih,g (H × F)
        let w_ih = &params[..g * h * f];
        let dx = &mut dx_all[r.x.clone()];
        for (gate, &block) in d.cell.input_blocks().iter().enumerate() {
            let a = Mat { data: &dg[block * p..], rs: row, cs: 1 };
            let b = Mat { data: &w_ih[gate * h * f..], rs: f, cs: 1 };
            let beta = if gate == 0 { 0.0 } else { 1.0 };
            sgemm(pass.pool, gemm, m, f, h, 1.0, a, b, beta, MatMut { data: &mut dx[..], rs: f, cs: 1 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Shape};
    use crate::layers::recurrent::{dims, RnnOutput};
    use crate::loss::Loss;
    use crate::testutil::rel_err;
    use safetensors::SafeTensors;

    fn values(file: &SafeTensors, name: &str) -> Vec<f32> {
        let view = file.tensor(name).unwrap_or_else(|e| panic!("the fixture has no tensor {name}: {e}"));
        view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    /// The input's gradient of PyTorch's model in tests/fixtures/recurrent_{kind}.safetensors (see
    /// tests/parity_recurrent.rs, which checks the rest through the public API): the model's
    /// backward pass, then its first layer's again with the input's gradient asked for.
    fn input_gradient_matches_pytorch(kind: &str, chain: Chain) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/recurrent_{kind}.safetensors"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e}: make it with `python3 tests/fixtures/make_recurrent.py` (torch and safetensors)", path.display())
        });
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut model = chain.build().unwrap().with_threads(1).unwrap();
        let plan = model.plan.clone();
        for step in &plan.steps {
            for t in &step.tensors {
                model.params[t.range.clone()].copy_from_slice(&values(&file, &format!("{}.{}", step.module, t.name)));
            }
        }
        let (mut fwd, mut bwd) = (model.preallocate(2).unwrap(), model.preallocate_grads(2).unwrap());
        for layer in 0..2 {
            let (h, c) = (
                values(&file, &format!("h0.{layer}")),
                file.tensor(&format!("c0.{layer}")).ok().map(|_| values(&file, &format!("c0.{layer}"))),
            );
            let n = h.len() / 2;
            let state: Vec<f32> = (0..2)
                .flat_map(|s| h[s * n..][..n].iter().chain(c.as_deref().map_or(&[][..], |c| &c[s * n..][..n])).copied().collect::<Vec<_>>())
                .collect();
            fwd.set_state(layer, &state).unwrap();
        }
        fwd.set_inputs(&values(&file, "x")).unwrap();
        fwd.set_targets(&values(&file, "target")).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
        let step = &plan.steps[0];
        let mut pass = BackPass {
            plan: &plan,
            index: 0,
            params: &model.params,
            acts: &fwd.acts,
            dacts: &mut bwd.dacts,
            grads: &mut bwd.grads,
            capacity: 2,
            batch: 2,
            pool: &model.pool,
            ws: &mut fwd.ws,
            gws: &mut bwd.gws,
            // (no dropout here)
            draw: crate::layers::Draw { seed: 0, pass: 0, replica: 0 },
        };
        backward(&dims(step).unwrap(), step, &mut pass, true);
        let dx = &bwd.dacts[crate::layers::region(&plan, 0, 2, 2)];
        let err = rel_err(dx, &values(&file, "grad.x"));
        println!("{kind}: d loss / d x rel err {err:.1e}");
        assert!(err <= 1e-5, "{kind}: d loss / d x differs from PyTorch's by {err:e}");
    }

    /// A cache keeps the recurrent layers' packed weights between passes and repacks them when
    /// the parameters change: after new parameters, its outputs are a fresh cache's, bit for bit.
    #[test]
    fn new_parameters_are_repacked() {
        let chain = Chain::new(Shape::sequence(3, 2)).gru(5, RnnOutput::Sequence).lstm(17, RnnOutput::LastStep);
        let mut model = chain.build().unwrap().with_threads(1).unwrap();
        let mut rng = crate::testutil::Rng::new(4);
        let x = rng.uniform(2 * 3 * 2);
        let mut cache = model.preallocate(2).unwrap();
        cache.set_inputs(&x).unwrap();
        let before = model.forward(&mut cache).unwrap().to_vec();
        let params = rng.uniform(model.params.len());
        model.set_parameters(&params).unwrap();
        let after = model.forward(&mut cache).unwrap().to_vec();
        let mut fresh = model.preallocate(2).unwrap();
        fresh.set_inputs(&x).unwrap();
        let want = model.forward(&mut fresh).unwrap();
        assert!(before != after && after.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{after:?} vs {want:?}");
    }

    #[test]
    fn gru_input_gradient_matches_pytorch() {
        let chain = Chain::new(Shape::sequence(4, 3)).gru(5, RnnOutput::Sequence).gru(4, RnnOutput::LastStep).dense(3, crate::Identity);
        input_gradient_matches_pytorch("gru", chain);
    }

    #[test]
    fn lstm_input_gradient_matches_pytorch() {
        let chain = Chain::new(Shape::sequence(4, 3)).lstm(5, RnnOutput::Sequence).lstm(4, RnnOutput::LastStep).dense(3, crate::Identity);
        input_gradient_matches_pytorch("lstm", chain);
    }
}
