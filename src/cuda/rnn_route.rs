//! What the cuDNN route of a GRU or LSTM layer queues in a step (`rnn_dnn.rs` chooses it and
//! sets it up).
//!
//! cuDNN runs on sequence-major data (`rnn_cudnn.rs`), flatnn keeps it batch-first: the route
//! transposes (`rnn_transpose`) between the layer's regions and its own buffers.
//!
//! Forward: the layer's parameters copied into cuDNN's weight space (device-to-device, on the
//! step's stream), the initial states gathered (`rnn_states_in`), x transposed to (steps, batch,
//! features), `cudnnRNNForward` into y (steps, batch, hidden), y transposed into the output (a
//! sequence layer's; a last-step layer's output is cuDNN's final h), the final states scattered
//! into the state rows (`rnn_states_out`). Backward: the output's gradient transposed to dy (a
//! last-step layer's dy is zeros, the output's gradient the final h's), `cudnnRNNBackwardData_v8`
//! (dx, transposed into the input's gradient where the step has one), the weight gradients'
//! space zeroed, `cudnnRNNBackwardWeights_v8` (which adds into it, reading the forward's x and
//! y), and the gradients copied over flatnn's (which a backward pass overwrites). All of it is
//! queued on the step's stream and captured in its graph.

use super::buffer::DevBuf;
use super::context::Kernel;
use super::cudnn::{cudnn_error, Handle};
use super::driver_error;
use super::exec::Raw;
use super::launch::{blocks, int, kernel_args};
use super::recurrent::Ctx;
use super::rnn_cudnn::{self as rnn, Algo, Descs, Operands, Space};
use crate::chain::Step;
use crate::error::Result;
use crate::layers::recurrent::{Cell, Dims, RnnOutput, STATE};
use cudarc::driver::result as driver;

/// A layer's buffers for the cache's capacity (see `rnn_dnn.rs`).
pub(super) struct LayerBufs {
    pub weights: DevBuf<u8>,
    /// hx, then an LSTM's cx and cy: `capacity × hidden` values each.
    pub states: DevBuf<f32>,
    /// x and y sequence-major, as the forward leaves them for the backward: `capacity × steps ×
    /// features` and `capacity × steps × hidden`.
    pub xs: DevBuf<f32>,
    pub ys: DevBuf<f32>,
    /// `capacity` sequence lengths, each the layer's steps.
    pub lengths: DevBuf<i32>,
    /// Bytes of reserve space the layer's training needs at the capacity, with any of `algos`.
    pub reserve_len: usize,
    /// The algorithms cuDNN set the layer up with at the capacity (the weight space the same
    /// size with each), and why it refused the others.
    pub algos: Vec<Algo>,
    pub refused: String,
}

/// A layer's training buffers: its reserve space and its weight gradients' space.
pub(super) struct LayerTrain {
    pub reserve: DevBuf<u8>,
    pub dweights: DevBuf<u8>,
}

/// The buffers every layer's backward uses in turn (it leaves nothing in them for later), for
/// the cache's capacity: sequence-major gradients.
pub(super) struct Scratch {
    /// Zeros, dy of every last-step layer.
    pub zeros: DevBuf<f32>,
    /// dy of a sequence layer, the output's gradient transposed.
    pub dys: DevBuf<f32>,
    /// dx, before it is transposed into the input's gradient.
    pub dxs: DevBuf<f32>,
}

/// One copy between flatnn's parameters and the weight space: `len` values from parameter
/// `param` (an offset in the flat parameters) to byte `space` of the weight space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub param: usize,
    pub space: usize,
    pub len: usize,
}

/// The copies of `step`'s tensors into a weight space whose linear layers lie at `parts` (see
/// [`Descs::weight_parts`]), merged where both sides are contiguous.
pub(super) fn runs(step: &Step, d: &Dims, parts: &[[usize; 4]]) -> Vec<Run> {
    let (g, h) = (d.gates(), d.hidden);
    let mut runs: Vec<Run> = Vec::with_capacity(parts.len() * 2);
    for (id, &[m_at, m_len, b_at, b_len]) in parts.iter().enumerate() {
        // linear layers 0..G: W_ih's gates and b_ih's; G..2G: W_hh's and b_hh's
        let (side, gate) = (id / g, id % g);
        let inputs = if side == 0 { d.features } else { h };
        runs.push(Run { param: step.tensors[side].range.start + gate * h * inputs, space: m_at, len: m_len });
        runs.push(Run { param: step.tensors[2 + side].range.start + gate * h, space: b_at, len: b_len });
    }
    merged(runs)
}

/// `runs` in parameter order, each run that follows the one before on both sides joined to it.
fn merged(mut runs: Vec<Run>) -> Vec<Run> {
    runs.sort_by_key(|r| r.param);
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        match out.last_mut() {
            Some(last) if last.param + last.len == r.param && last.space + last.len * size_of::<f32>() == r.space => last.len += r.len,
            _ => out.push(r),
        }
    }
    out
}

/// A layer's cuDNN route for one pass: the handle, the layer's descriptors for the batch and the
/// copies of its tensors, and its buffers.
pub(super) struct Route<'a> {
    pub handle: &'a Handle,
    pub descs: &'a Descs,
    pub runs: &'a [Run],
    pub bufs: &'a LayerBufs,
    pub work: &'a DevBuf<u8>,
    /// Reserve space and weight gradients' space (training), and the scratch.
    pub train: Option<(&'a LayerTrain, &'a Scratch)>,
}

impl Route<'_> {
    /// The forward (and in training the backward) pass of the step, as a training step or an
    /// inference call runs them; what the routes are timed on.
    pub fn run(&self, ctx: &Ctx, step: &Step, d: &Dims, training: bool) -> Result<()> {
        self.forward(ctx, step, d, training)?;
        if training {
            self.backward(ctx, step, d)?;
        }
        Ok(())
    }

    /// The operands of the step for the batch, in the route's buffers (sequence-major): x, y,
    /// the states, a last-step layer's final h (its output), and with gradient buffers
    /// (training) dx, dy and a last-step layer's dhy (its output's gradient).
    fn operands(&self, ctx: &Ctx, step: &Step, d: &Dims) -> Operands {
        let (batch, h) = (ctx.f.batch, d.hidden);
        let (x_len, y_len) = (batch * d.steps * d.features, batch * d.steps * h);
        let out = ctx.region(step.output_region);
        debug_assert_eq!((ctx.region(step.input_region).len(), out.len()), (x_len, batch * d.out_len()));
        let lstm = d.cell == Cell::Lstm;
        // hx, cx, cy: `capacity × hidden` values apart, the batch's first
        let apart = self.bufs.states.len() / if lstm { 3 } else { 1 };
        let states = |k: usize| self.bufs.states.view(k * apart..k * apart + batch * h).ptr();
        let last_step = d.output == RnnOutput::LastStep;
        let mut o = Operands {
            lengths: self.bufs.lengths.view(0..batch).ptr(),
            x: self.bufs.xs.view(0..x_len).ptr(),
            y: self.bufs.ys.view(0..y_len).ptr(),
            hy: if last_step { Raw::of(ctx.f.acts).at::<f32>(out.clone()).ptr() } else { 0 },
            hx: states(0),
            cx: if lstm { states(1) } else { 0 },
            cy: if lstm { states(2) } else { 0 },
            ..Operands::default()
        };
        if let (Some(b), Some((_, scratch))) = (ctx.b, self.train) {
            o.dx = scratch.dxs.view(0..x_len).ptr();
            let dout = Raw::of(b.dacts).at::<f32>(out).ptr();
            (o.dy, o.dhy) = match last_step {
                true => (scratch.zeros.view(0..y_len).ptr(), dout),
                false => (scratch.dys.view(0..y_len).ptr(), 0),
            };
        }
        o
    }

    /// The cuDNN route's forward of the step (see the module docs).
    pub fn forward(&self, ctx: &Ctx, step: &Step, d: &Dims, training: bool) -> Result<()> {
        let descs = self.descs;
        let (gpu, stream) = (ctx.gpu, ctx.stream);
        let o = self.operands(ctx, step, d);
        gpu.bind()?;
        let (params, weights) = (ctx.f.params.ptr(), self.bufs.weights.ptr());
        for run in self.runs {
            let bytes = run.len * size_of::<f32>();
            debug_assert!(run.param + run.len <= step.params.end && run.space + bytes <= self.bufs.weights.len());
            let (to, from) = (weights + run.space as u64, params + (run.param * size_of::<f32>()) as u64);
            // SAFETY: `len` values inside the parameters and inside the weight space (checked
            // when the runs were made from cuDNN's offsets), queued in the stream's order.
            unsafe { driver::memcpy_dtod_async(to, from, bytes, stream.cu_stream()) }
                .map_err(|e| driver_error("copying a recurrent layer's weights for cuDNN", e))?;
        }
        let state_range = ctx.region(step.kept.start + STATE);
        let state = Raw::of(ctx.f.acts).at_mut::<f32>(state_range).ptr();
        let (batch, hidden, padded, state_len) = (int(ctx.f.batch)?, int(d.hidden)?, int(d.padded)?, int(d.state_len())?);
        let n = ctx.f.batch * d.hidden;
        let (hx, cx) = (o.hx, o.cx);
        let mut args = kernel_args![state, hx, cx, batch, hidden, padded, state_len];
        gpu.launch_args(stream, Kernel::RnnStatesIn, (blocks(n), 1), 0, &mut args)?;
        let acts = Raw::of(ctx.f.acts);
        let x = acts.at::<f32>(ctx.region(step.input_region)).ptr();
        transpose(ctx, x, o.x, [ctx.f.batch, d.steps, d.features])?;
        let reserve: Space = match self.train.filter(|_| training) {
            Some((t, _)) => (t.reserve.ptr(), t.reserve.len()),
            None if training => unreachable!("a training route has its reserve space"),
            None => (0, 0),
        };
        // SAFETY: descriptors of this layer and batch; the operands lie in the cache's buffers
        // for the batch (`operands`), the spaces are this layer's and the cache's, at least the
        // sizes cuDNN asked for at this batch (checked in `layer_setup`).
        unsafe { rnn::forward(self.handle, descs, training, &o, (weights, self.bufs.weights.len()), self.work_space(), reserve) }
            .map_err(|e| cudnn_error(&format!("cudnnRNNForward of step {}", ctx.index), e))?;
        if d.output == RnnOutput::Sequence {
            let out = acts.at::<f32>(ctx.region(step.output_region)).ptr();
            transpose(ctx, o.y, out, [d.steps, ctx.f.batch, d.hidden])?;
        }
        // the final h: y's last step, (batch, hidden)
        let h_src = o.y + ((d.steps - 1) * n * size_of::<f32>()) as u64;
        let h_stride = hidden;
        let (h_at, c_at) = d.final_slots();
        let (h_at, c_at, cy) = (int(h_at)?, int(c_at)?, o.cy);
        let mut args = kernel_args![h_src, h_stride, cy, state, batch, hidden, h_at, c_at, state_len];
        gpu.launch_args(stream, Kernel::RnnStatesOut, (blocks(n), 1), 0, &mut args)
    }

    /// The cuDNN route's backward of the step (see the module docs), after its training forward.
    pub fn backward(&self, ctx: &Ctx, step: &Step, d: &Dims) -> Result<()> {
        let descs = self.descs;
        let (LayerTrain { reserve, dweights }, _) = self.train.expect("a training route has its training buffers");
        let b = ctx.b();
        let stream = ctx.stream;
        let o = self.operands(ctx, step, d);
        ctx.gpu.bind()?;
        let weights = (self.bufs.weights.ptr(), self.bufs.weights.len());
        let (reserve, dw) = ((reserve.ptr(), reserve.len()), (dweights.ptr(), dweights.len()));
        let what = |call: &str| format!("{call} of step {}", ctx.index);
        let dacts = Raw::of(b.dacts);
        if d.output == RnnOutput::Sequence {
            let dout = dacts.at::<f32>(ctx.region(step.output_region)).ptr();
            transpose(ctx, dout, o.dy, [ctx.f.batch, d.steps, d.hidden])?;
        }
        // SAFETY: as in `forward`; the reserve space holds what this layer's training forward
        // kept, queued before in the stream's order.
        unsafe { rnn::backward_data(self.handle, descs, &o, weights, self.work_space(), reserve) }
            .map_err(|e| cudnn_error(&what("cudnnRNNBackwardData_v8"), e))?;
        if ctx.need_dx {
            let dx = dacts.at_mut::<f32>(ctx.region(step.input_region)).ptr();
            transpose(ctx, o.dx, dx, [d.steps, ctx.f.batch, d.features])?;
        }
        // SAFETY: the layer's weight gradients' space, whole, queued in the stream's order.
        unsafe { driver::memset_d8_async(dw.0, 0, dw.1, stream.cu_stream()) }
            .map_err(|e| driver_error("zeroing a recurrent layer's weight gradients", e))?;
        // SAFETY: as above.
        unsafe { rnn::backward_weights(self.handle, descs, &o, dw, self.work_space(), reserve) }
            .map_err(|e| cudnn_error(&what("cudnnRNNBackwardWeights_v8"), e))?;
        let grads = b.grads.ptr();
        assert!(step.params.end <= b.grads.len(), "a recurrent step's gradients past the buffer");
        for run in self.runs {
            let (to, from) = (grads + (run.param * size_of::<f32>()) as u64, dw.0 + run.space as u64);
            // SAFETY: as the weights' copies in `forward`, the other way, into the gradients
            // (the parameters' layout).
            unsafe { driver::memcpy_dtod_async(to, from, run.len * size_of::<f32>(), stream.cu_stream()) }
                .map_err(|e| driver_error("copying a recurrent layer's weight gradients from cuDNN", e))?;
        }
        Ok(())
    }

    fn work_space(&self) -> Space {
        (self.work.ptr(), self.work.len())
    }
}

/// Queues `dst` (b, a, k) = `src` (a, b, k) with its first two axes swapped, on the step's
/// stream (`rnn_transpose`).
fn transpose(ctx: &Ctx, src: u64, dst: u64, [a, b, k]: [usize; 3]) -> Result<()> {
    let n = a * b * k;
    let (a, b, k) = (int(a)?, int(b)?, int(k)?);
    int(n)?;
    let mut args = kernel_args![src, dst, a, b, k];
    ctx.gpu.launch_args(ctx.stream, Kernel::RnnTranspose, (blocks(n), 1), 0, &mut args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Shape};
    use crate::layers::recurrent::dims;

    /// cuDNN's linear layers laid out as PyTorch's tensors (the matrices of both sides, then the
    /// biases of both sides) give one copy of the whole layer; laid out otherwise, copies that
    /// take every parameter once, each gate's part to where cuDNN keeps it.
    #[test]
    fn runs_put_each_gate_where_cudnn_keeps_it() {
        for (chain, hidden, features) in [
            (Chain::new(Shape::sequence(5, 3)).gru(4, RnnOutput::Sequence), 4, 3),
            (Chain::new(Shape::sequence(2, 7)).lstm(5, RnnOutput::LastStep), 5, 7),
        ] {
            let model = chain.build().unwrap();
            let step = &model.plan.steps[0];
            let d = dims(step).unwrap();
            let (g, h, f) = (d.gates(), hidden, features);
            let matrix = |id: usize| if id < g { id * h * f } else { g * h * f + (id - g) * h * h };
            let len = |id: usize| h * if id < g { f } else { h };
            let bias = |id: usize| g * h * (f + h) + id * h;
            let pytorch: Vec<[usize; 4]> = (0..2 * g).map(|id| [matrix(id) * 4, len(id), bias(id) * 4, h]).collect();
            assert_eq!(runs(step, &d, &pytorch), vec![Run { param: step.params.start, space: 0, len: step.params.len() }]);
            // each gate's matrix then its bias, the gates in reverse order
            let mut at = 0;
            let mut other = vec![[0; 4]; 2 * g];
            for id in (0..2 * g).rev() {
                other[id] = [at * 4, len(id), (at + len(id)) * 4, h];
                at += len(id) + h;
            }
            let mut seen = vec![0; step.params.len()];
            for r in runs(step, &d, &other) {
                for k in 0..r.len {
                    let param = r.param + k - step.params.start;
                    seen[param] += 1;
                    // the same value on both sides: where PyTorch keeps it, where cuDNN does
                    let id = (0..2 * g)
                        .find(|&id| (matrix(id)..matrix(id) + len(id)).contains(&param) || (bias(id)..bias(id) + h).contains(&param))
                        .unwrap();
                    let want = if param >= bias(0) { other[id][2] / 4 + param - bias(id) } else { other[id][0] / 4 + param - matrix(id) };
                    assert_eq!(r.space / 4 + k, want, "parameter {param}");
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        }
    }

    #[test]
    fn runs_merge_where_both_sides_are_contiguous() {
        let run = |param, space, len| Run { param, space, len };
        // out of order; 0..4 → 0..16 bytes and 4..6 → 16..24 join; 6..8 lies elsewhere in the space
        let runs = merged(vec![run(4, 16, 2), run(6, 40, 2), run(0, 0, 4), run(8, 48, 1)]);
        assert_eq!(runs, vec![run(0, 0, 6), run(6, 40, 3)]);
    }
}
