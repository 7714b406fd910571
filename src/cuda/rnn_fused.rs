//! The fused route of a GRU or an LSTM layer: every time step in one launch each way
//! (kernels/rnn_fused.cu), where the per-step route (`recurrent.rs`) launches two or three
//! kernels a step. Forward: the per-step route's input products and `rnn_begin`, then one
//! kernel for all the steps. Backward: one kernel for the backward through time, then the
//! per-step route's weight, bias and input gradients. Both write what the per-step route's
//! loops write, so a step's forward and backward could take either route each.
//!
//! A variant ([`Fused`]) keeps R of each thread's W_hh values in registers (the rest in shared
//! memory) and runs S samples a block; the variants that fit the layer and the device are
//! candidates beside the per-step route and cuDNN's algorithms, timed in `rnn_dnn/measure.rs`.
//! Not offered for a stream's layer (one step a call; nothing to fuse).

use super::context::{Gpu, Kernel};
use super::exec::Raw;
use super::launch::{int, kernel_args, launch};
use super::recurrent::{backward_weights, forward_inputs, Ctx, Parts};
use crate::chain::Step;
use crate::error::Result;
use crate::layers::recurrent::{Cell, Dims, RnnOutput};
use std::ffi::c_void;

/// Register weights a thread may keep (R), the kernels' instantiations.
const REGISTERS: [usize; 3] = [0, 32, 64];
/// Samples a block may run (S), the kernels' instantiations.
const SAMPLES: [usize; 4] = [1, 2, 4, 8];
/// How many variants there are.
pub(crate) const VARIANTS: usize = REGISTERS.len() * SAMPLES.len();

/// The kernels, `[cell][backward][R's place][S's place]` (cell: GRU, LSTM).
pub(crate) const KERNELS: [[[[Kernel; SAMPLES.len()]; REGISTERS.len()]; 2]; 2] = {
    use Kernel::*;
    [
        [
            [
                [RnnFusedGruForwardR0S1, RnnFusedGruForwardR0S2, RnnFusedGruForwardR0S4, RnnFusedGruForwardR0S8],
                [RnnFusedGruForwardR32S1, RnnFusedGruForwardR32S2, RnnFusedGruForwardR32S4, RnnFusedGruForwardR32S8],
                [RnnFusedGruForwardR64S1, RnnFusedGruForwardR64S2, RnnFusedGruForwardR64S4, RnnFusedGruForwardR64S8],
            ],
            [
                [RnnFusedGruBackwardR0S1, RnnFusedGruBackwardR0S2, RnnFusedGruBackwardR0S4, RnnFusedGruBackwardR0S8],
                [RnnFusedGruBackwardR32S1, RnnFusedGruBackwardR32S2, RnnFusedGruBackwardR32S4, RnnFusedGruBackwardR32S8],
                [RnnFusedGruBackwardR64S1, RnnFusedGruBackwardR64S2, RnnFusedGruBackwardR64S4, RnnFusedGruBackwardR64S8],
            ],
        ],
        [
            [
                [RnnFusedLstmForwardR0S1, RnnFusedLstmForwardR0S2, RnnFusedLstmForwardR0S4, RnnFusedLstmForwardR0S8],
                [RnnFusedLstmForwardR32S1, RnnFusedLstmForwardR32S2, RnnFusedLstmForwardR32S4, RnnFusedLstmForwardR32S8],
                [RnnFusedLstmForwardR64S1, RnnFusedLstmForwardR64S2, RnnFusedLstmForwardR64S4, RnnFusedLstmForwardR64S8],
            ],
            [
                [RnnFusedLstmBackwardR0S1, RnnFusedLstmBackwardR0S2, RnnFusedLstmBackwardR0S4, RnnFusedLstmBackwardR0S8],
                [RnnFusedLstmBackwardR32S1, RnnFusedLstmBackwardR32S2, RnnFusedLstmBackwardR32S4, RnnFusedLstmBackwardR32S8],
                [RnnFusedLstmBackwardR64S1, RnnFusedLstmBackwardR64S2, RnnFusedLstmBackwardR64S4, RnnFusedLstmBackwardR64S8],
            ],
        ],
    ]
};

/// One variant of the fused kernels: R register weights a thread, S samples a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fused {
    /// Places in [`REGISTERS`] and [`SAMPLES`].
    r: usize,
    s: usize,
}

impl Fused {
    /// Every variant, in [`Fused::index`]'s order.
    pub fn all() -> impl Iterator<Item = Fused> {
        (0..REGISTERS.len()).flat_map(|r| (0..SAMPLES.len()).map(move |s| Fused { r, s }))
    }

    /// Its place among [`VARIANTS`].
    pub fn index(self) -> usize {
        self.r * SAMPLES.len() + self.s
    }

    pub fn registers(self) -> usize {
        REGISTERS[self.r]
    }

    pub fn samples(self) -> usize {
        SAMPLES[self.s]
    }

    /// As the route report names it: `fused s4 r32`.
    pub fn name(self) -> String {
        format!("fused s{} r{}", self.samples(), self.registers())
    }

    /// Threads a block of its kernels for `cell` may have, their `__launch_bounds__`: what
    /// leaves each thread room for R register weights (and a GRU's backward for its state at 8
    /// samples) in an SM's 65536 registers.
    fn max_threads(self, cell: Cell) -> usize {
        match (self.registers(), cell) {
            (64, _) => 256,
            (_, Cell::Gru) => 384,
            (_, Cell::Lstm) => 512,
        }
    }

    /// Bytes of dynamic shared memory its (forward, backward) kernel takes for `d` (see
    /// kernels/rnn_fused.cu): the weights past the first R of each thread's `padded`, and the
    /// forward's S·P h_{t−1} and S·G·H products, or the backward's S·4·P gate gradients and S·G·P
    /// partial sums.
    pub fn shared_bytes(self, d: &Dims) -> (usize, usize) {
        let (g, h, p, s) = (d.gates(), d.hidden, d.padded, self.samples());
        let weights = p.saturating_sub(self.registers()) * g * h;
        (4 * (weights + s * p + s * g * h), 4 * (weights + s * 4 * p + s * g * p))
    }

    /// Whether its kernels can run `d`: G·H threads within their bound, R no more than a
    /// thread's `padded` values, and the shared memory of both within `shared_limit` bytes.
    pub fn fits(self, d: &Dims, shared_limit: usize) -> bool {
        let (forward, backward) = self.shared_bytes(d);
        d.gates() * d.hidden <= self.max_threads(d.cell) && self.registers() <= d.padded && forward.max(backward) <= shared_limit
    }
}

/// The variants worth timing for `d` at `batch` on a device whose blocks may have
/// `shared_limit` bytes of dynamic shared memory: those that fit, with S below twice the batch
/// (a larger S runs no more samples a block). None for a stream's layer.
pub(crate) fn candidates(d: &Dims, batch: usize, shared_limit: usize) -> Vec<Fused> {
    if d.carry || d.packed {
        return Vec::new();
    }
    Fused::all().filter(|v| v.samples() < 2 * batch.max(1) && v.fits(d, shared_limit)).collect()
}

/// The forward of the step by the fused route with `v` (see the module docs).
pub(super) fn forward(ctx: &Ctx, step: &Step, d: &Dims, v: Fused) -> Result<()> {
    forward_inputs(ctx, step, d)?;
    let f = ctx.f;
    let (params, acts) = (Raw::of(f.params), Raw::of(f.acts));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (gates, hprev) = (acts.at_mut::<f32>(r.gates.clone()).ptr(), acts.at_mut::<f32>(r.hprev.clone()).ptr());
    let cprev = if d.cell == Cell::Lstm { acts.at_mut::<f32>(r.cprev.clone()).ptr() } else { 0 };
    let state = acts.at_mut::<f32>(r.state.clone()).ptr();
    let (w_hh, b_ih, b_hh) =
        (params.at::<f32>(r.hh.clone()).ptr(), params.at::<f32>(r.b_ih.clone()).ptr(), params.at::<f32>(r.b_hh.clone()).ptr());
    debug_assert_eq!(r.out.len(), f.batch * d.out_len());
    let y = acts.at_mut::<f32>(r.out.clone()).ptr();
    let seq = i32::from(d.output == RnnOutput::Sequence);
    let (batch, steps, hidden, padded, state_len) = (int(f.batch)?, int(d.steps)?, int(d.hidden)?, int(d.padded)?, int(d.state_len())?);
    let (h_final, c_final) = d.final_slots();
    let (h_final, c_final) = (int(h_final)?, int(c_final)?);
    let mut args =
        kernel_args![gates, hprev, cprev, state, w_hh, b_ih, b_hh, y, seq, batch, steps, hidden, padded, state_len, h_final, c_final];
    run(ctx, d, v, false, &mut args)
}

/// The backward of the step by the fused route with `v`, after a forward by either route (see
/// the module docs).
pub(super) fn backward(ctx: &Ctx, step: &Step, d: &Dims, v: Fused) -> Result<()> {
    assert!(!d.carry, "a stream's model is not trained");
    let (f, b) = (ctx.f, ctx.b());
    let (params, acts, dacts) = (Raw::of(f.params), Raw::of(f.acts), Raw::of(b.dacts));
    let r = Parts::of(step, d, |i| ctx.region(i));
    let (gates, hprev) = (acts.at::<f32>(r.gates.clone()).ptr(), acts.at::<f32>(r.hprev.clone()).ptr());
    let lstm = d.cell == Cell::Lstm;
    let cprev = if lstm { acts.at::<f32>(r.cprev.clone()).ptr() } else { 0 };
    let state = acts.at::<f32>(r.state.clone()).ptr();
    let w_hh = params.at::<f32>(r.hh.clone()).ptr();
    let dy = dacts.at::<f32>(r.out.clone()).ptr();
    let seq = i32::from(d.output == RnnOutput::Sequence);
    let (dgates, dhprev) = (dacts.at_mut::<f32>(r.gates.clone()).ptr(), dacts.at_mut::<f32>(r.hprev.clone()).ptr());
    let dcprev = if lstm { dacts.at_mut::<f32>(r.cprev.clone()).ptr() } else { 0 };
    let (batch, steps, hidden, padded, state_len) = (int(f.batch)?, int(d.steps)?, int(d.hidden)?, int(d.padded)?, int(d.state_len())?);
    let c_final = int(d.final_slots().1)?;
    let mut args =
        kernel_args![gates, hprev, cprev, state, w_hh, dy, seq, dgates, dhprev, dcprev, batch, steps, hidden, padded, state_len, c_final];
    run(ctx, d, v, true, &mut args)?;
    backward_weights(ctx, step, d)
}

/// Launches `v`'s forward or backward kernel for the batch with `args`: a block of G·H threads
/// per S samples.
fn run(ctx: &Ctx, d: &Dims, v: Fused, backward: bool, args: &mut [*mut c_void]) -> Result<()> {
    let gpu: &Gpu = ctx.gpu;
    let (forward_bytes, backward_bytes) = v.shared_bytes(d);
    let shared = if backward { backward_bytes } else { forward_bytes };
    assert!(v.fits(d, gpu.rnn_fused_shared_limit()), "{} does not fit this layer", v.name());
    let cell = usize::from(d.cell == Cell::Lstm);
    let kernel = KERNELS[cell][usize::from(backward)][v.r][v.s];
    let grid = int(ctx.f.batch.div_ceil(v.samples()))? as u32;
    let threads = (d.gates() * d.hidden) as u32;
    assert_eq!(ctx.stream.context().cu_ctx(), gpu.ctx.cu_ctx(), "a stream of another device");
    gpu.bind()?;
    // SAFETY: `args` are the kernel's parameters in order with their C types (built above from
    // the step's regions and tensors for the batch, each holding what the kernel touches for
    // `batch` samples, and sizes checked to be ints); the block's threads and shared memory are
    // within what the kernel was compiled and opted in for (`fits`); it calls after_prior()
    // first.
    unsafe {
        launch(gpu.function(kernel), (grid, 1, 1), (threads, 1, 1), shared as u32, ctx.stream.cu_stream(), gpu.dependent_launch, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;
    use crate::layers::recurrent::Streaming;

    fn dims(cell: Cell, hidden: usize, streaming: Streaming) -> Dims {
        Dims::new(cell, hidden, RnnOutput::LastStep, streaming, Shape::sequence(5, 3))
    }

    /// H100's and H200's opt-in limit of shared memory a block (227 KB).
    const LIMIT: usize = 232_448;

    /// Each variant's kernels are the ones named for its cell, direction, R and S.
    #[test]
    fn each_variant_launches_its_own_kernels() {
        for v in Fused::all() {
            for (cell, cell_name) in [(0, "gru"), (1, "lstm")] {
                for (backward, dir) in [(0, "forward"), (1, "backward")] {
                    let name = super::super::context::KERNELS[KERNELS[cell][backward][v.r][v.s] as usize];
                    assert_eq!(name, format!("rnn_fused_{cell_name}_{dir}_r{}_s{}", v.registers(), v.samples()));
                }
            }
        }
        assert_eq!(Fused::all().map(Fused::index).collect::<Vec<_>>(), (0..VARIANTS).collect::<Vec<_>>());
    }

    /// The shared memory of the zoo's layers, worked out by hand from the layouts in
    /// kernels/rnn_fused.cu.
    #[test]
    fn shared_memory_follows_the_layout() {
        let variant =
            |registers: usize, samples: usize| Fused::all().find(|v| v.registers() == registers && v.samples() == samples).unwrap();
        // GRU 64, all weights in shared memory: 64·192 weights, h 64, products 192 (forward);
        // gate gradients 4·64, partial sums 192 (backward)
        assert_eq!(variant(0, 1).shared_bytes(&dims(Cell::Gru, 64, Streaming::No)), (4 * (12_288 + 64 + 192), 4 * (12_288 + 256 + 192)));
        // LSTM 128 with 32 in registers, 8 samples: 96·512 weights; 8·128 h and 8·512 products,
        // or 8·512 gate gradients and 8·512 partial sums
        let lstm = dims(Cell::Lstm, 128, Streaming::No);
        assert_eq!(variant(32, 8).shared_bytes(&lstm), (4 * (49_152 + 1_024 + 4_096), 4 * (49_152 + 4_096 + 4_096)));
        assert!(variant(32, 8).fits(&lstm, LIMIT));
        assert!(!variant(32, 8).fits(&lstm, 200_000), "past the limit");
        // all of it in shared memory is 256 KB; 64 a thread is 512 threads past R = 64's bound
        assert!(!variant(0, 1).fits(&lstm, LIMIT) && !variant(64, 1).fits(&lstm, LIMIT));
        // padded 16 (12 units): no room for 32 register values
        let small = dims(Cell::Gru, 12, Streaming::No);
        assert_eq!(small.padded, 16);
        assert!(variant(0, 8).fits(&small, LIMIT) && !variant(32, 1).fits(&small, LIMIT));
    }

    #[test]
    fn candidates_fit_and_cover_the_batch_without_waste() {
        let names = |d: &Dims, batch: usize| candidates(d, batch, LIMIT).iter().map(|v| v.name()).collect::<Vec<_>>();
        let lstm = dims(Cell::Lstm, 128, Streaming::No);
        assert_eq!(names(&lstm, 64), ["fused s1 r32", "fused s2 r32", "fused s4 r32", "fused s8 r32"]);
        // S below twice the batch: at 3 samples, S = 4 covers them, S = 8 would idle
        assert_eq!(names(&lstm, 3), ["fused s1 r32", "fused s2 r32", "fused s4 r32"]);
        assert_eq!(names(&dims(Cell::Gru, 64, Streaming::No), 1), ["fused s1 r0", "fused s1 r32", "fused s1 r64"]);
        // 3·129 = 387 threads: past every bound of a GRU's kernels (384; 256 for R = 64)
        assert!(candidates(&dims(Cell::Gru, 129, Streaming::No), 8, LIMIT).is_empty());
        // a stream's layer runs one step a call
        assert!(candidates(&dims(Cell::Gru, 64, Streaming::Carry), 8, LIMIT).is_empty());
    }
}
