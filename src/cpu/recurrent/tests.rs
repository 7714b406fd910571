use super::*;
use crate::chain::Shape;
use crate::layers::recurrent::{pack, RnnOutput, Streaming};
use crate::testutil::Rng;

/// One sample's inputs: x, the initial state, the output's gradient.
type Inputs = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The outputs of the forward and backward passes of the samples in groups of `group`, on one
/// instruction set.
fn run(isa: Isa, group: usize, d: &Dims, packed: &[f32], rows: &[f32], inputs: &[Inputs]) -> Vec<Vec<f32>> {
    let (t, p, row) = (d.steps, d.padded, d.row());
    let lstm = d.cell == Cell::Lstm;
    let mut kept: Vec<[Vec<f32>; 4]> = inputs
        .iter()
        .map(|(_, state, _)| [vec![f32::NAN; d.out_len()], vec![f32::NAN; t * row], vec![f32::NAN; t * p], state.clone()])
        .collect();
    let mut cprevs: Vec<Vec<f32>> = inputs.iter().map(|_| vec![f32::NAN; if lstm { t * p } else { 0 }]).collect();
    let w = Weights::of(d, packed);
    let mut samples: Vec<Sample> = kept
        .iter_mut()
        .zip(&mut cprevs)
        .zip(inputs)
        .map(|(([out, gates, hprev, state], cprev), (x, _, _))| Sample { x, out, gates, hprev, state, cprev })
        .collect();
    for group in samples.chunks_mut(group) {
        // SAFETY: asked for only where this CPU has it (`Isa::available`).
        unsafe { forward_group_on(isa, d, &w, group, true) }
    }
    drop(samples);
    let mut grads: Vec<[Vec<f32>; 4]> = cprevs
        .iter()
        .map(|cprev| [vec![f32::NAN; t * row], vec![f32::NAN; t * p], vec![f32::NAN; d.state_len()], vec![f32::NAN; cprev.len()]])
        .collect();
    let mut samples: Vec<BackSample> = kept
        .iter()
        .zip(&cprevs)
        .zip(inputs)
        .zip(&mut grads)
        .map(|((([_, gates, hprev, state], cprev), (_, _, dy)), [dgates, dhprev, dstate, dcprev])| BackSample {
            gates,
            hprev,
            state,
            cprev,
            dy,
            dgates,
            dhprev,
            dstate,
            dcprev,
        })
        .collect();
    for group in samples.chunks_mut(group) {
        // SAFETY: as above.
        unsafe { backward_group_on(isa, d, rows, group) }
    }
    drop(samples);
    // the units of each kept row (padding lanes hold what the lanes' arithmetic left there)
    let units =
        |v: &[f32], width: usize| -> Vec<f32> { v.chunks(width).flat_map(|r| r.chunks(p).flat_map(|b| b[..d.hidden].to_vec())).collect() };
    let mut parts = Vec::new();
    for (([out, gates, hprev, state], [dgates, dhprev, _, dcprev]), cprev) in kept.iter().zip(&grads).zip(&cprevs) {
        parts.extend([
            out.clone(),
            units(gates, row),
            units(hprev, p),
            units(state, p),
            units(cprev, p),
            units(dgates, row),
            units(dhprev, p),
            units(dcprev, p),
        ]);
    }
    parts
}

#[test]
fn every_instruction_set_and_group_gives_the_same_bits() {
    let isas: Vec<Isa> = [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()).collect();
    let mut rng = Rng::new(6);
    for cell in [Cell::Gru, Cell::Lstm] {
        for (hidden, features, steps) in [(1, 1, 1), (16, 3, 4), (17, 2, 3), (40, 5, 2), (64, 1, 2)] {
            for output in [RnnOutput::Sequence, RnnOutput::LastStep] {
                let d = Dims::new(cell, hidden, output, Streaming::No, Shape::sequence(steps, features));
                let g = d.gates();
                let params = rng.uniform(g * hidden * (features + hidden + 2));
                let mut packed = vec![0.0; d.packed_len()];
                pack(&d, &params, &mut packed);
                let mut rows = vec![0.0; d.rows_len()];
                for (dst, src) in rows.chunks_exact_mut(d.padded).zip(params[g * hidden * features..].chunks_exact(hidden)) {
                    dst[..hidden].copy_from_slice(src);
                }
                // a group of five (the forward pass with AVX-512 takes a GRU's four and one, an
                // LSTM's five at once, with AVX2 four and one; the backward four and one), and
                // each sample alone
                let inputs: Vec<Inputs> =
                    (0..5).map(|_| (rng.uniform(steps * features), rng.uniform(d.state_len()), rng.uniform(d.out_len()))).collect();
                let want = run(isas[0], 1, &d, &packed, &rows, &inputs);
                for (isa, group) in isas.iter().flat_map(|&isa| [(isa, 1), (isa, 5)]).skip(1) {
                    let got = run(isa, group, &d, &packed, &rows, &inputs);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let same = a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits());
                        assert!(
                            same,
                            "{cell:?} {hidden}×{features}×{steps} {output:?}: {isa:?} in groups of {group} differs from {:?} \
                             alone in part {i}",
                            isas[0]
                        );
                    }
                }
            }
        }
    }
    println!("compared {:?}", isas);
}

/// An inference of one sample with its steps' units split among a pool's threads
/// ([`forward_split`]) gives the outputs, the h (c) of every step and the final states of the
/// whole steps ([`forward_group`]), bit for bit: GRUs and LSTMs of 2 to 7 parts a step, on pools
/// of 1 to 3 threads (more threads than parts too), sequences and last steps.
#[test]
fn a_step_split_among_threads_gives_the_whole_steps_bits() {
    let mut rng = Rng::new(8);
    let pools: Vec<Pool> = [1, 2, 3].into_iter().map(|threads| Pool::new(threads).unwrap()).collect();
    for cell in [Cell::Gru, Cell::Lstm] {
        for (hidden, features, steps) in [(40, 3, 1), (64, 1, 9), (100, 5, 4), (200, 2, 3)] {
            for output in [RnnOutput::Sequence, RnnOutput::LastStep] {
                let d = Dims::new(cell, hidden, output, Streaming::No, Shape::sequence(steps, features));
                assert!(sequence::split_parts(&d) > 1, "{hidden} units: one part");
                let params = rng.uniform(d.gates() * hidden * (features + hidden + 2));
                let mut packed = vec![0.0; d.packed_len()];
                pack(&d, &params, &mut packed);
                let w = Weights::of(&d, &packed);
                let (x, state0) = (rng.uniform(steps * features), rng.uniform(d.state_len()));
                let (p, lstm) = (d.padded, cell == Cell::Lstm);
                // out, hprev, state, cprev after a pass (the units of each row)
                let pass = |split: Option<&Pool>| {
                    let (mut out, mut gates, mut hprev) =
                        (vec![f32::NAN; d.out_len()], vec![f32::NAN; steps * d.row()], vec![f32::NAN; steps * p]);
                    let (mut state, mut cprev) = (state0.clone(), vec![f32::NAN; if lstm { steps * p } else { 0 }]);
                    let mut s = Sample { x: &x, out: &mut out, gates: &mut gates, hprev: &mut hprev, state: &mut state, cprev: &mut cprev };
                    match split {
                        Some(pool) => forward_split(&d, &w, &mut s, pool),
                        None => forward_group(&d, &w, &mut [s], false),
                    }
                    let units = |v: &[f32]| -> Vec<u32> { v.chunks(p).flat_map(|r| r[..hidden].iter().map(|v| v.to_bits())).collect() };
                    [out.iter().map(|v| v.to_bits()).collect(), units(&hprev), units(&state), units(&cprev)]
                };
                let want = pass(None);
                for pool in &pools {
                    let what = format!("{cell:?} {hidden}×{features}×{steps} {output:?} on {} threads", pool.threads());
                    assert_eq!(pass(Some(pool)), want, "{what}");
                }
            }
        }
    }
}
