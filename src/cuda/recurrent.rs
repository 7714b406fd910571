//! A GRU or an LSTM run on the GPU (the layout is `layers/recurrent.rs`'s), by one of three
//! routes, chosen per layer, batch size and mode (inference; training's forward and backward
//! together) by measurement when the batch size first runs (`rnn_dnn.rs`): cuDNN's RNN kernels
//! where cuDNN loads, flatnn's fused route (`rnn_fused.rs`, one kernel for all the steps), or
//! its per-step route, here (also what runs where nothing was measured).
//!
//! The per-step route. Forward: the input products of every step as one batched cuBLAS product,
//! the initial state into the first step's rows (`rnn_begin`), then each step's recurrent
//! products (cuBLAS, added to its input products) and a kernel for its gates (kernels/gru.cu,
//! kernels/lstm.cu). Backward through time: each step's gate gradients (a kernel) and
//! ∂L/∂h_{t−1} (products); then the weight gradients over all B·T steps as products, and the
//! bias gradients in two kernels. All of it is queued on the pass's stream, so a training step's
//! graph holds every time step: two or three launches a step each way, one after another.
//!
//! Also the cache's side of the recurrent states (`Cache::set_state` and the like).

use super::blas::{Blas, DevMat, DevMatMut};
use super::context::{Gpu, Kernel};
use super::driver_error;
use super::exec::{Backward, Forward, GpuBackward, GpuForward, Raw};
use super::launch::{blocks, int, kernel_args};
use super::rnn_dnn::RnnRoute;
use super::rnn_fused;
use super::state::DevCache;
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::recurrent::{dims, Cell, Dims, RnnOutput, CPREV, GATES, HPREV, STATE};
use crate::layers::{region, Mode};
use cudarc::driver::{result, CudaStream};
use std::ops::Range;

/// What a recurrent step's launches need, whichever runs them (a pass, or the measuring of the
/// routes): the device, the cache's cuBLAS handle, the model's stream, the plan, the pass's
/// buffers (`b` in training), the step's index and whether its input gradient is needed.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub gpu: &'a Gpu,
    pub blas: &'a Blas,
    pub stream: &'a CudaStream,
    pub plan: &'a Plan,
    pub f: &'a Forward<'a>,
    pub b: Option<&'a Backward<'a>>,
    pub index: usize,
    pub need_dx: bool,
}

impl Ctx<'_> {
    /// Values of region `r` for the batch.
    pub fn region(&self, r: usize) -> Range<usize> {
        region(self.plan, r, self.f.capacity, self.f.batch)
    }

    /// The backward pass's buffers.
    pub fn b(&self) -> &Backward<'_> {
        self.b.expect("a backward pass has gradient buffers")
    }
}

/// A recurrent step's regions for the batch, and its four tensors' ranges in the parameters
/// (and in their gradients).
pub(super) struct Parts {
    pub x: Range<usize>,
    pub out: Range<usize>,
    pub gates: Range<usize>,
    pub hprev: Range<usize>,
    pub state: Range<usize>,
    pub cprev: Range<usize>,
    pub ih: Range<usize>,
    pub hh: Range<usize>,
    pub b_ih: Range<usize>,
    pub b_hh: Range<usize>,
}

impl Parts {
    pub fn of(step: &Step, d: &Dims, region: impl Fn(usize) -> Range<usize>) -> Parts {
        let kept = |i: usize| region(step.kept.start + i);
        let tensor = |i: usize| step.tensors[i].range.clone();
        Parts {
            x: region(step.input_region),
            out: region(step.output_region),
            gates: kept(GATES),
            hprev: kept(HPREV),
            state: kept(STATE),
            cprev: if d.cell == Cell::Lstm { kept(CPREV) } else { 0..0 },
            ih: tensor(0),
            hh: tensor(1),
            b_ih: tensor(2),
            b_hh: tensor(3),
        }
    }
}

/// The values a kernel touches writing `rows` rows of `len` values `stride` apart from `start`.
fn strided(start: usize, rows: usize, stride: usize, len: usize) -> Range<usize> {
    start..start + (rows - 1) * stride + len
}

/// Where a step's output row goes: the layer's output at step t (every step's, or the last's),
/// as (offset, row stride); None where the step has none.
fn output_row(d: &Dims, out: &Range<usize>, t: usize) -> Option<(usize, usize)> {
    match d.output {
        RnnOutput::Sequence => Some((out.start + t * d.hidden, d.steps * d.hidden)),
        RnnOutput::LastStep if t + 1 == d.steps => Some((out.start, d.hidden)),
        RnnOutput::LastStep => None,
    }
}

/// A recurrent step's forward on the GPU in `mode`, by the route chosen for it (see the module
/// docs).
pub(crate) fn forward(pass: &GpuForward, step: &Step, d: &Dims, mode: Mode) -> Result<()> {
    let GpuForward { gpu, blas, stream, plan, f, index, .. } = *pass;
    let ctx = Ctx { gpu, blas, stream, plan, f, b: None, index, need_dx: false };
    let training = mode == Mode::Train;
    match f.dnn.and_then(|dnn| dnn.rnn().route(index, f.batch, training)) {
        Some(RnnRoute::Cudnn(route)) => route.forward(&ctx, step, d, training),
        Some(RnnRoute::Fused(v)) => rnn_fused::forward(&ctx, step, d, v),
        None => forward_steps(&ctx, step, d),
    }
}

/// A recurrent step's backward on the GPU, by the route its training forward took.
pub(crate) fn backward(pass: &mut GpuBackward, step: &Step, d: &Dims) -> Result<()> {
    let GpuBackward { gpu, blas, stream, plan, f, b, index, need_dx, .. } = *pass;
    let ctx = Ctx { gpu, blas, stream, plan, f, b: Some(b), index, need_dx };
    match f.dnn.and_then(|dnn| dnn.rnn().route(index, f.batch, true)) {
        Some(RnnRoute::Cudnn(route)) => route.backward(&ctx, step, d),
        Some(RnnRoute::Fused(v)) => rnn_fused::backward(&ctx, step, d, v),
        None => backward_steps(&ctx, step, d),
    }
}

/// gate g's weights in `range` as B of a product X·B, B[j, u] = W[g·H + u, j] (PyTorch's rows
/// of `inner`, F or H), and the values from one gate's to the next's.
fn weights<'a>(params: Raw, range: &Range<usize>, h: usize, inner: usize) -> (DevMat<'a>, usize) {
    (DevMat { data: params.at(range.clone()), rs: 1, cs: inner }, h * inner)
}

/// What a forward does before its time steps, by either route: the input products of every
/// step into the gates (gates[row, g·p + u] = Σ_j x[row, j]·W_ih[g·H + u, j]), and the initial
/// state into the first step's rows (`rnn_begin`).
pub(super) fn forward_inputs(ctx: &Ctx, step: &Step, d: &Dims) -> Result<()> {
    let Ctx { gpu, blas, stream, f, .. } = *ctx;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (batch, steps, features, h, p, row) = (f.batch, d.steps, d.features, d.hidden, d.padded, d.row());
    assert!(!d.packed, "the packed layout is the CPU's");
    let xm = DevMat { data: acts.at(r.x.clone()), rs: features, cs: 1 };
    let gm = DevMatMut { data: acts.at_mut(r.gates.clone()), rs: row, cs: 1 };
    blas.sgemm_batched(d.gates(), batch * steps, h, features, 1.0, (xm, 0), weights(params, &r.ih, h, features), 0.0, (gm, p))?;
    let cprev = if d.cell == Cell::Lstm { acts.at_mut::<f32>(r.cprev.clone()).ptr() } else { 0 };
    let (state, hprev) = (acts.at::<f32>(r.state.clone()).ptr(), acts.at_mut::<f32>(r.hprev.clone()).ptr());
    let (b, t_len, hidden, padded, state_len) = (int(batch)?, int(steps)?, int(h)?, int(p)?, int(d.state_len())?);
    let _ = int(batch * h)?;
    let mut args = kernel_args![state, hprev, cprev, b, t_len, hidden, padded, state_len];
    gpu.launch_args(stream, Kernel::RnnBegin, (blocks(batch * h), 1), 0, &mut args)
}

/// The per-step route's forward (see the module docs).
pub(super) fn forward_steps(ctx: &Ctx, step: &Step, d: &Dims) -> Result<()> {
    forward_inputs(ctx, step, d)?;
    let Ctx { gpu, blas, stream, f, .. } = *ctx;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (batch, steps, h, p, row) = (f.batch, d.steps, d.hidden, d.padded, d.row());
    let (b, t_len, hidden, padded) = (int(batch)?, int(steps)?, int(h)?, int(p)?);
    let (w_hh, gap) = weights(params, &r.hh, h, h);
    let (h_final, c_final) = d.final_slots();
    let (b_ih, b_hh) = (params.at::<f32>(r.b_ih.clone()).ptr(), params.at::<f32>(r.b_hh.clone()).ptr());
    for t in 0..steps {
        // the recurrent products, added to the input products (a GRU's n: into block 3)
        let hm = DevMat { data: acts.at(r.hprev.start + t * p..r.hprev.end), rs: steps * p, cs: 1 };
        let gates_t = r.gates.start + t * row..r.gates.end;
        let c = DevMatMut { data: acts.at_mut(gates_t.clone()), rs: steps * row, cs: 1 };
        match d.cell {
            Cell::Gru => {
                blas.sgemm_batched(2, batch, h, h, 1.0, (hm, 0), (w_hh, gap), 1.0, (c, p))?;
                let w_n = DevMat { data: params.at(r.hh.start + 2 * gap..r.hh.end), ..w_hh };
                let c_n = DevMatMut { data: acts.at_mut(gates_t.start + 3 * p..gates_t.end), rs: steps * row, cs: 1 };
                blas.sgemm(batch, h, h, 1.0, hm, w_n, 0.0, c_n)?;
            }
            Cell::Lstm => blas.sgemm_batched(4, batch, h, h, 1.0, (hm, 0), (w_hh, gap), 1.0, (c, p))?,
        }
        // h_t (c_t): the next step's row, or the state's final slot
        let last = t + 1 == steps;
        let (h_at, h_step) = if last { (r.state.start + h_final, d.state_len()) } else { (r.hprev.start + (t + 1) * p, steps * p) };
        let (c_at, c_step) = if last { (r.state.start + c_final, d.state_len()) } else { (r.cprev.start + (t + 1) * p, steps * p) };
        let h_out = acts.at_mut::<f32>(strided(h_at, batch, h_step, h)).ptr();
        let (y, y_step) = match output_row(d, &r.out, t) {
            Some((at, stride)) => (acts.at_mut::<f32>(strided(at, batch, stride, h)).ptr(), stride),
            None => (0, 0),
        };
        let gates = acts.at_mut::<f32>(r.gates.clone()).ptr();
        let (h_stride, y_stride, tt) = (int(h_step)?, int(y_step)?, int(t)?);
        match d.cell {
            Cell::Gru => {
                let hprev = acts.at::<f32>(r.hprev.clone()).ptr();
                let mut args = kernel_args![gates, hprev, b_ih, b_hh, h_out, h_stride, y, y_stride, b, t_len, tt, hidden, padded];
                gpu.launch_args(stream, Kernel::GruStep, (blocks(batch * h), 1), 0, &mut args)?;
            }
            Cell::Lstm => {
                let cprev = acts.at::<f32>(r.cprev.clone()).ptr();
                let c_out = acts.at_mut::<f32>(strided(c_at, batch, c_step, h)).ptr();
                let c_stride = int(c_step)?;
                let mut args =
                    kernel_args![gates, cprev, b_ih, b_hh, h_out, h_stride, c_out, c_stride, y, y_stride, b, t_len, tt, hidden, padded];
                gpu.launch_args(stream, Kernel::LstmStep, (blocks(batch * h), 1), 0, &mut args)?;
            }
        }
    }
    Ok(())
}

/// The runs of adjacent gate blocks whose recurrent-side gradients multiply adjacent rows of
/// W_hh, as (first block, blocks, first gate): with no padding between blocks, a GRU's r and z
/// then n (block 3), an LSTM's four at once; else one gate at a time.
fn hidden_runs(d: &Dims) -> Vec<(usize, usize, usize)> {
    let blocks = d.cell.hidden_blocks();
    let mut runs: Vec<(usize, usize, usize)> = Vec::with_capacity(blocks.len());
    for (gate, &block) in blocks.iter().enumerate() {
        match runs.last_mut() {
            Some((first, count, _)) if d.padded == d.hidden && *first + *count == block => *count += 1,
            _ => runs.push((block, 1, gate)),
        }
    }
    runs
}

/// The per-step route's backward through time (see the module docs).
pub(super) fn backward_steps(ctx: &Ctx, step: &Step, d: &Dims) -> Result<()> {
    assert!(!d.carry, "a stream's model is not trained");
    let Ctx { gpu, blas, stream, f, .. } = *ctx;
    let b = ctx.b();
    let (params, acts, dacts) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(b.dacts));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (batch, steps, h, p, row) = (f.batch, d.steps, d.hidden, d.padded, d.row());
    let (bb, t_len, hidden, padded) = (int(batch)?, int(steps)?, int(h)?, int(p)?);
    let (gates, dgates) = (acts.at::<f32>(r.gates.clone()).ptr(), dacts.at_mut::<f32>(r.gates.clone()).ptr());
    let dhprev = dacts.at_mut::<f32>(r.hprev.clone()).ptr();
    let (_, c_final) = d.final_slots();
    let runs = hidden_runs(d);
    for t in (0..steps).rev() {
        let (dy, dy_step) = match output_row(d, &r.out, t) {
            Some((at, stride)) => (dacts.at::<f32>(strided(at, batch, stride, h)).ptr(), stride),
            None => (0, 0),
        };
        let (dy_stride, tt) = (int(dy_step)?, int(t)?);
        match d.cell {
            Cell::Gru => {
                let hprev = acts.at::<f32>(r.hprev.clone()).ptr();
                let mut args = kernel_args![gates, hprev, dy, dy_stride, dgates, dhprev, bb, t_len, tt, hidden, padded];
                gpu.launch_args(stream, Kernel::GruStepBackward, (blocks(batch * h), 1), 0, &mut args)?;
            }
            Cell::Lstm => {
                let (c_at, c_step) =
                    if t + 1 == steps { (r.state.start + c_final, d.state_len()) } else { (r.cprev.start + (t + 1) * p, steps * p) };
                let c_now = acts.at::<f32>(strided(c_at, batch, c_step, h)).ptr();
                let (cprev, dcprev) = (acts.at::<f32>(r.cprev.clone()).ptr(), dacts.at_mut::<f32>(r.cprev.clone()).ptr());
                let c_stride = int(c_step)?;
                let mut args =
                    kernel_args![gates, cprev, c_now, c_stride, dy, dy_stride, dgates, dhprev, dcprev, bb, t_len, tt, hidden, padded];
                gpu.launch_args(stream, Kernel::LstmStepBackward, (blocks(batch * h), 1), 0, &mut args)?;
            }
        }
        // ∂L/∂h_{t−1} (B × H) += da_h (B × blocks·H) · W_hh rows (blocks·H × H), a run at a time
        for &(first, count, gate) in &runs {
            let a = DevMat { data: dacts.at(r.gates.start + t * row + first * p..r.gates.end), rs: steps * row, cs: 1 };
            let w = DevMat { data: params.at(r.hh.start + gate * h * h..r.hh.end), rs: h, cs: 1 };
            let c = DevMatMut { data: dacts.at_mut(r.hprev.start + t * p..r.hprev.end), rs: steps * p, cs: 1 };
            blas.sgemm(batch, h, count * h, 1.0, a, w, 1.0, c)?;
        }
    }
    backward_weights(ctx, step, d)
}

/// What a backward does after its time steps, by either route: the weight gradients over all
/// B·T steps as products, the bias gradients (`rnn_bias_grad`, `rnn_bias_join`), and the
/// input's gradient where it is needed.
pub(super) fn backward_weights(ctx: &Ctx, step: &Step, d: &Dims) -> Result<()> {
    let Ctx { gpu, blas, stream, f, need_dx, .. } = *ctx;
    let b = ctx.b();
    let (params, acts, dacts, grads) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(b.dacts), Raw::of(b.grads));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (batch, steps, features, h, p, row, g) = (f.batch, d.steps, d.features, d.hidden, d.padded, d.row(), d.gates());
    let (hidden, padded) = (int(h)?, int(p)?);
    let dgates = dacts.at_mut::<f32>(r.gates.clone()).ptr();
    let m = batch * steps;
    // dW_ih,g (H × F) = da_gᵀ · X (m × F) for blocks 0, 1, 2(, 3); dW_hh,g (H × H) = da_hgᵀ ·
    // H_prev (m × H, rows of `padded`) for a GRU's r, z, then n (block 3), an LSTM's 0..3
    let xm = DevMat { data: acts.at(r.x.clone()), rs: features, cs: 1 };
    let hm = DevMat { data: acts.at(r.hprev.clone()), rs: p, cs: 1 };
    let input_blocks = [(0, 0), (1, 1), (2, 2), (3, 3)];
    let gate_blocks: &[(usize, usize)] = match d.cell {
        Cell::Gru => &[(0, 0), (1, 1), (3, 2)],
        Cell::Lstm => &input_blocks,
    };
    for (blocks, v, width, dw) in [(&input_blocks[..g], xm, features, r.ih.clone()), (gate_blocks, hm, h, r.hh.clone())] {
        for (block, gate, count) in block_runs(blocks, p == h) {
            let a = DevMat { data: dacts.at(r.gates.start + block * p..r.gates.end), rs: 1, cs: row };
            let c = DevMatMut { data: grads.at_mut(dw.start + gate * h * width..dw.end), rs: width, cs: 1 };
            blas.sgemm(count * h, width, m, 1.0, a, v, 0.0, c)?;
        }
    }
    let (db_ih, db_hh) = (grads.at_mut::<f32>(r.b_ih.clone()).ptr(), grads.at_mut::<f32>(r.b_hh.clone()).ptr());
    let parts = bias_parts(m, p);
    let partials = Raw::of(b.partials).at_mut::<f32>(0..parts * row).ptr();
    let (rows, chunk, count, gg) = (int(m)?, int(m.div_ceil(parts))?, int(parts)?, int(g)?);
    let mut args = kernel_args![dgates, partials, rows, padded, chunk];
    gpu.launch_args(stream, Kernel::RnnBiasGrad, (row.div_ceil(BIAS_COLS) as u32, count as u32), 0, &mut args)?;
    let mut args = kernel_args![partials, db_ih, db_hh, count, gg, hidden, padded];
    gpu.launch_args(stream, Kernel::RnnBiasJoin, (blocks(row), 1), 0, &mut args)?;
    if need_dx {
        // dX (m × F) = Σ_g da_g (m × H) · W_ih,g (H × F): one product where no padding parts the
        // blocks, else one a gate
        let dx = || DevMatMut { data: dacts.at_mut(r.x.clone()), rs: features, cs: 1 };
        for (i, (gate, _, count)) in block_runs(&input_blocks[..g], p == h).enumerate() {
            let a = DevMat { data: dacts.at(r.gates.start + gate * p..r.gates.end), rs: row, cs: 1 };
            let w = DevMat { data: params.at(r.ih.start + gate * h * features..r.ih.end), rs: features, cs: 1 };
            let beta = if i == 0 { 0.0 } else { 1.0 };
            blas.sgemm(m, features, count * h, 1.0, a, w, beta, dx())?;
        }
    }
    Ok(())
}

/// Columns of the gates rows a block of `rnn_bias_grad` sums (RNN_BIAS_COLS in kernels/gru.cu).
const BIAS_COLS: usize = 32;
/// The bias gradients' sums are split into parts while the columns give fewer blocks than this
/// (about four an SM); a constant, not measured per card, so the sums' bits depend on the sizes
/// alone ...
const BIAS_BLOCKS: usize = 512;
/// ... and each part sums at least this many steps.
const BIAS_MIN_ROWS: usize = 512;

/// Into how many parts `rnn_bias_grad` splits the sums over `rows` steps (B·T) of gates rows of
/// `4·padded` values; the partial sums then take `parts × 4·padded` values of `b.partials`.
pub(crate) fn bias_parts(rows: usize, padded: usize) -> usize {
    let tiles = (4 * padded).div_ceil(BIAS_COLS);
    BIAS_BLOCKS.div_ceil(tiles).min(rows.div_ceil(BIAS_MIN_ROWS)).max(1)
}

/// Values of `b.partials` the plan's recurrent layers' bias gradients need at `capacity`.
pub(crate) fn bias_partials_len(plan: &Plan, capacity: usize) -> usize {
    let need = |d: Dims| bias_parts(capacity * d.steps, d.padded) * d.row();
    plan.steps.iter().filter_map(dims).map(need).max().unwrap_or(0)
}

/// The products over gate blocks `blocks` ((gradient block, gate) pairs, in order) as runs
/// (first block, first gate, count) of blocks that lie side by side both in a gates row and in
/// the weights (`merge`: no padding parts the blocks), each one product. One plain product a
/// run rather than a batched one: over the B·T steps K is large and M, N small, where cuBLAS
/// splits the sum over K in a plain product and not in a batched one (a GRU of 64 units at 256
/// samples of 128 steps: 1.2 ms batched on an H200).
fn block_runs(blocks: &[(usize, usize)], merge: bool) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let &(block, gate) = blocks.get(at)?;
        let mut count = 1;
        while merge && blocks.get(at + count) == Some(&(block + count, gate + count)) {
            count += 1;
        }
        at += count;
        Some((block, gate, count))
    })
}

impl DevCache {
    /// Copies `values` into the activations from `at`, after the work queued on the cache's
    /// stream, and waits for the copy.
    pub(crate) fn write_acts(&mut self, at: usize, values: &[f32]) -> Result<()> {
        assert!(at + values.len() <= self.acts.len(), "write_acts: past the activations");
        self.acts.gpu().bind()?;
        let dst = self.acts.ptr() + (at * size_of::<f32>()) as u64;
        // SAFETY: the range lies inside `acts` (checked above); the host waits below, so
        // `values` outlives the copy.
        unsafe { result::memcpy_htod_async(dst, values, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying a state to the device", e))?;
        self.stream.synchronize().map_err(|e| driver_error("waiting for a copy to the device", e))
    }

    /// Zeros the activations `range`, queued on the cache's stream.
    pub(crate) fn zero_acts(&mut self, range: Range<usize>) -> Result<()> {
        assert!(range.end <= self.acts.len(), "zero_acts: past the activations");
        self.acts.gpu().bind()?;
        let dst = self.acts.ptr() + (range.start * size_of::<f32>()) as u64;
        // SAFETY: the range lies inside `acts` (checked above); the work after it on the stream
        // sees the zeros.
        unsafe { result::memset_d8_async(dst, 0, range.len() * size_of::<f32>(), self.stream.cu_stream()) }
            .map_err(|e| driver_error("zeroing a state on the device", e))
    }

    /// Copies the activations from `at` into `out`, after the work queued on the cache's stream.
    pub(crate) fn read_acts(&self, at: usize, out: &mut [f32]) -> Result<()> {
        assert!(at + out.len() <= self.acts.len(), "read_acts: past the activations");
        self.acts.gpu().bind()?;
        let src = self.acts.ptr() + (at * size_of::<f32>()) as u64;
        // SAFETY: the range lies inside `acts` (checked above); the host waits below before it
        // reads `out`.
        unsafe { result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying a state from the device", e))?;
        self.stream.synchronize().map_err(|e| driver_error("waiting for a copy from the device", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_blocks_merge_only_where_both_sides_are_side_by_side() {
        let runs = |blocks: &[(usize, usize)], merge| block_runs(blocks, merge).collect::<Vec<_>>();
        // a GRU's recurrent side: r, z together, n (block 3) alone
        assert_eq!(runs(&[(0, 0), (1, 1), (3, 2)], true), [(0, 0, 2), (3, 2, 1)]);
        assert_eq!(runs(&[(0, 0), (1, 1), (2, 2), (3, 3)], true), [(0, 0, 4)]);
        // padding parts every block
        assert_eq!(runs(&[(0, 0), (1, 1), (3, 2)], false), [(0, 0, 1), (1, 1, 1), (3, 2, 1)]);
        assert_eq!(runs(&[], true), []);
    }

    #[test]
    fn bias_parts_grow_with_the_steps_and_cover_them() {
        let mut last = 1;
        for rows in [1, 511, 512, 513, 4096, 32768, 1 << 20] {
            for padded in [4, 20, 64, 128, 1024] {
                let parts = bias_parts(rows, padded);
                assert!(parts >= 1 && (parts - 1) * rows.div_ceil(parts) < rows, "{rows} rows, {parts} parts");
            }
            let parts = bias_parts(rows, 64);
            assert!(parts >= last, "parts shrink at {rows} rows");
            last = parts;
        }
    }
}
