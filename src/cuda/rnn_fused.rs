//! The fused route of a GRU or an LSTM layer: every time step in one launch each way
//! (kernels/rnn_fused.cu), where the per-step route (`recurrent.rs`) launches two or three
//! kernels a step. Forward: the per-step route's input products and `rnn_begin`, then one
//! kernel for all the steps. Backward: one kernel for the backward through time, then the
//! per-step route's weight, bias and input gradients. Both write what the per-step route's
//! loops write, so a step's forward and backward could take either route each.
//!
//! A variant ([`Fused`]) keeps R of each thread's W_hh values in registers (the rest in shared
//! memory) and runs S samples a block; or, on sm_90 and later, runs its forward on a cluster of
//! C blocks, W_hh spread over their registers and h_t exchanged through their shared memory
//! (`rnn_cluster_forward`, the C of `c4`, `c8` in its name; its backward is the variant's of the
//! same R and S). A layer gets one R, the largest whose kernels fit it (R decides little where it
//! fits: the most registers was fastest or within a few percent), and its S (and C) variants
//! that fit are candidates beside the per-step route and cuDNN's algorithms, timed in
//! `rnn_dnn/measure.rs`. Their kernels are compiled apart from the main program, per (cell, R),
//! the first time a layer's candidates are listed, and kept in the [`Gpu`] for the process. Not
//! offered for a stream's layer (one step a call; nothing to fuse).

use super::context::{compile_source, Gpu};
use super::exec::Raw;
use super::launch::{int, kernel_args, launch_in_clusters};
use super::recurrent::{backward_weights, forward_inputs, Ctx, Parts};
use crate::chain::Step;
use crate::error::{Error, Result};
use crate::layers::recurrent::{Cell, Dims, RnnOutput};
use cudarc::driver::CudaFunction;
use std::ffi::c_void;
use std::sync::OnceLock;

/// Register weights a thread may keep (R), the kernels' instantiations, fewest first.
const REGISTERS: [usize; 3] = [0, 32, 64];
/// Samples a block may run (S), the kernels' instantiations.
const SAMPLES: [usize; 4] = [1, 2, 4, 8];
/// Blocks a forward may run on as a cluster (C; 1: one block, no cluster).
const CLUSTERS: [usize; 3] = [1, 4, 8];
/// The places in [`SAMPLES`] the cluster forwards are instantiated for (S = 1, 2, 4).
const CLUSTER_SAMPLES: usize = 3;
/// W_hh values a thread of a cluster forward keeps in registers (RNN_CLUSTER_KW).
const CLUSTER_KW: usize = 64;
/// Threads a block of a cluster forward may have (its `__launch_bounds__`).
const CLUSTER_THREADS: usize = 512;
/// How many variants there are.
pub(crate) const VARIANTS: usize = REGISTERS.len() * SAMPLES.len() * CLUSTERS.len();

/// The file the kernels are in (name, text).
pub(crate) const SOURCE: (&str, &str) = ("rnn_fused.cu", include_str!("../../kernels/rnn_fused.cu"));

/// What the kernels need of the main program's files: common.cu.
const COMMON: &str = include_str!("../../kernels/common.cu");

/// The kernel of `cell`'s forward or backward with `v`'s R and S: `rnn_fused_gru_forward_r32_s4`.
fn kernel_name(cell: Cell, backward: bool, v: Fused) -> String {
    let dir = if backward { "backward" } else { "forward" };
    format!("rnn_fused_{}_{dir}_r{}_s{}", cell_name(cell), v.registers(), v.samples())
}

/// The kernel of `cell`'s forward on a cluster with S = `SAMPLES[s]`: `rnn_fused_lstm_cluster_s1`.
fn cluster_kernel_name(cell: Cell, s: usize) -> String {
    format!("rnn_fused_{}_cluster_s{}", cell_name(cell), SAMPLES[s])
}

fn cell_name(cell: Cell) -> &'static str {
    match cell {
        Cell::Gru => "gru",
        Cell::Lstm => "lstm",
    }
}

/// Every kernel rnn_fused.cu defines, for the check of the kernel files' names.
#[cfg(test)]
pub(crate) fn kernel_names() -> Vec<String> {
    let variants = || Fused::all().filter(|v| v.c == 0);
    [Cell::Gru, Cell::Lstm]
        .into_iter()
        .flat_map(|cell| {
            let blocks = [false, true].into_iter().flat_map(move |backward| variants().map(move |v| kernel_name(cell, backward, v)));
            blocks.chain((0..CLUSTER_SAMPLES).map(move |s| cluster_kernel_name(cell, s)))
        })
        .collect()
}

/// The source of the kernels of (`cell`, R = `registers`): common.cu, then rnn_fused.cu; with the
/// defines that select them (with `clusters`, the cluster forwards too).
fn program(cell: Cell, registers: usize, clusters: bool) -> (String, Vec<String>) {
    let source = format!("// ---- kernels/common.cu\n{COMMON}\n// ---- kernels/rnn_fused.cu\n{}\n", SOURCE.1);
    let cell_define = match cell {
        Cell::Gru => "RNN_GRU",
        Cell::Lstm => "RNN_LSTM",
    };
    let mut defines = vec![format!("-DRNN_FUSED_CELL={cell_define}"), format!("-DRNN_FUSED_R={registers}")];
    if clusters {
        defines.push("-DRNN_FUSED_CLUSTERS".into());
    }
    (source, defines)
}

/// The kernels of one (cell, R) loaded on a device.
pub(crate) struct Module {
    /// `[backward][S's place]`, flattened; then the cluster forwards by S's place, where the
    /// device has clusters.
    functions: Vec<CudaFunction>,
    /// Bytes of dynamic shared memory a block of any of them may have.
    shared_limit: usize,
}

/// A device's fused kernels, `[cell][R's place]`, each (cell, R) compiled and loaded the first
/// time a layer's candidates need it; Err (why) where that failed, for the process.
#[derive(Default)]
pub(crate) struct Modules([[OnceLock<std::result::Result<Module, String>>; REGISTERS.len()]; 2]);

impl Modules {
    fn slot(&self, cell: Cell, r: usize) -> &OnceLock<std::result::Result<Module, String>> {
        &self.0[usize::from(cell == Cell::Lstm)][r]
    }
}

/// The kernels of (`cell`, R's place `r`) on `gpu`, compiled and loaded now (NVRTC, then the
/// module, the shared memory opt-in).
fn load(gpu: &Gpu, cell: Cell, r: usize) -> Result<Module> {
    let (major, minor) = gpu.compute_capability();
    let clusters = gpu.has_clusters();
    let (source, defines) = program(cell, REGISTERS[r], clusters);
    let defines: Vec<&str> = defines.iter().map(String::as_str).collect();
    let cubin = compile_source(c"rnn_fused.cu", source, (major as i32, minor as i32), &defines)?;
    let cluster_forwards = if clusters { CLUSTER_SAMPLES } else { 0 };
    let names: Vec<String> = [false, true]
        .into_iter()
        .flat_map(|backward| (0..SAMPLES.len()).map(move |s| kernel_name(cell, backward, Fused { r, s, c: 0 })))
        .chain((0..cluster_forwards).map(|s| cluster_kernel_name(cell, s)))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (functions, shared_limit) = gpu.load_kernels(cubin, &names)?;
    Ok(Module { functions, shared_limit })
}

/// One variant of the fused kernels: R register weights a thread, S samples a block, and the
/// forward on one block or on a cluster of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fused {
    /// Places in [`REGISTERS`], [`SAMPLES`] and [`CLUSTERS`].
    r: usize,
    s: usize,
    c: usize,
}

impl Fused {
    /// Every variant, in [`Fused::index`]'s order.
    pub fn all() -> impl Iterator<Item = Fused> {
        (0..REGISTERS.len()).flat_map(|r| (0..SAMPLES.len()).flat_map(move |s| (0..CLUSTERS.len()).map(move |c| Fused { r, s, c })))
    }

    /// Its place among [`VARIANTS`].
    pub fn index(self) -> usize {
        (self.r * SAMPLES.len() + self.s) * CLUSTERS.len() + self.c
    }

    pub fn registers(self) -> usize {
        REGISTERS[self.r]
    }

    pub fn samples(self) -> usize {
        SAMPLES[self.s]
    }

    /// Blocks its forward runs on (1: no cluster).
    pub fn cluster(self) -> usize {
        CLUSTERS[self.c]
    }

    /// Whether its forward runs on a cluster of blocks.
    pub fn clustered(self) -> bool {
        self.cluster() > 1
    }

    /// As the route report names it: `fused s4 r32`, `fused s1 r32 c8` (forward on clusters of 8).
    pub fn name(self) -> String {
        match self.clustered() {
            false => format!("fused s{} r{}", self.samples(), self.registers()),
            true => format!("fused s{} r{} c{}", self.samples(), self.registers(), self.cluster()),
        }
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
    /// partial sums; a cluster forward's 2·S·L h and S·G·U products (see [`ClusterShape`]).
    pub fn shared_bytes(self, d: &Dims) -> (usize, usize) {
        let (g, h, p, s) = (d.gates(), d.hidden, d.padded, self.samples());
        let weights = p.saturating_sub(self.registers()) * g * h;
        let forward = match self.clustered() {
            false => 4 * (weights + s * p + s * g * h),
            true => {
                let shape = ClusterShape::of(d, self.cluster());
                4 * (2 * s * shape.len + s * g * shape.units)
            }
        };
        (forward, 4 * (weights + s * 4 * p + s * g * p))
    }

    /// Whether its kernels can run `d`: G·H threads within their bound, R no more than a
    /// thread's `padded` values, and the shared memory of both within `shared_limit` bytes; a
    /// cluster forward's S instantiated, every block of the cluster owning a unit, and its
    /// threads within their bound.
    pub fn fits(self, d: &Dims, shared_limit: usize) -> bool {
        let (forward, backward) = self.shared_bytes(d);
        let blocks = d.gates() * d.hidden <= self.max_threads(d.cell) && self.registers() <= d.padded;
        let cluster = !self.clustered() || {
            let shape = ClusterShape::of(d, self.cluster());
            self.s < CLUSTER_SAMPLES && shape.units * (self.cluster() - 1) < d.hidden && shape.threads <= CLUSTER_THREADS
        };
        blocks && cluster && forward.max(backward) <= shared_limit
    }
}

/// How a cluster forward of C blocks splits a layer (kernels/rnn_fused.cu, rnn_cluster_forward):
/// U units a block, each of its G·U rows of W_hh over `split` threads of [`CLUSTER_KW`] register
/// weights (split a power of two, split·KW = `len` ≥ padded), G·U·split threads rounded up to
/// whole warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ClusterShape {
    units: usize,
    len: usize,
    threads: usize,
}

impl ClusterShape {
    fn of(d: &Dims, cluster: usize) -> ClusterShape {
        let units = d.hidden.div_ceil(cluster);
        let split = d.padded.div_ceil(CLUSTER_KW).next_power_of_two();
        ClusterShape { units, len: split * CLUSTER_KW, threads: (d.gates() * units * split).next_multiple_of(32) }
    }
}

/// The place in [`REGISTERS`] of the R a layer `d` gets on a device whose blocks may have
/// `shared_limit` bytes of dynamic shared memory: the largest whose kernels fit it at one sample
/// a block (the least shared memory). None where none does, and for a stream's layer.
fn registers_for(d: &Dims, shared_limit: usize) -> Option<usize> {
    if d.carry || d.packed {
        return None;
    }
    (0..REGISTERS.len()).rev().find(|&r| Fused { r, s: 0, c: 0 }.fits(d, shared_limit))
}

/// The variants worth timing for `d` at `batch` with `shared_limit` (see [`registers_for`]):
/// the layer's R with each S that fits, below twice the batch (a larger S runs no more samples
/// a block), each on one block and, with `clusters`, on each cluster that fits (its `fits`
/// covers its backward, the block kernel's, whose shared memory is never below the block
/// forward's).
fn candidates(d: &Dims, batch: usize, shared_limit: usize, clusters: bool) -> Vec<Fused> {
    let Some(r) = registers_for(d, shared_limit) else { return Vec::new() };
    let fits = |v: Fused| v.samples() < 2 * batch.max(1) && v.fits(d, shared_limit);
    let cs = if clusters { CLUSTERS.len() } else { 1 };
    (0..SAMPLES.len()).flat_map(|s| (0..cs).map(move |c| Fused { r, s, c })).filter(|&v| fits(v)).collect()
}

/// The variants worth timing for `d` at `batch` on `gpu` ([`candidates`]), their kernels
/// compiled and loaded on the first need of their (cell, R) in the process. Err (why) where
/// that failed: the layer then has no fused candidates.
pub(crate) fn prepare(gpu: &Gpu, d: &Dims, batch: usize) -> std::result::Result<Vec<Fused>, String> {
    let fused = candidates(d, batch, gpu.shared_optin(), gpu.has_clusters());
    let Some(r) = fused.first().map(|v| v.r) else { return Ok(fused) };
    let module = gpu.rnn_fused.slot(d.cell, r).get_or_init(|| load(gpu, d.cell, r).map_err(|e| e.to_string()));
    let module = module.as_ref().map_err(|why| format!("the fused kernels r{} could not be had: {why}", REGISTERS[r]))?;
    Ok(fused.into_iter().filter(|v| v.fits(d, module.shared_limit)).collect())
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
/// per S samples, or a forward's cluster of C blocks per S samples (see [`ClusterShape`]).
fn run(ctx: &Ctx, d: &Dims, v: Fused, backward: bool, args: &mut [*mut c_void]) -> Result<()> {
    let gpu: &Gpu = ctx.gpu;
    let (forward_bytes, backward_bytes) = v.shared_bytes(d);
    let shared = if backward { backward_bytes } else { forward_bytes };
    // loaded by `prepare`, which listed `v`: never compiled here, inside a step
    let module = match gpu.rnn_fused.slot(d.cell, v.r).get() {
        Some(Ok(module)) => module,
        _ => return Err(Error::Cuda { what: format!("{} was run before its kernels were loaded", v.name()) }),
    };
    assert!(v.fits(d, module.shared_limit), "{} does not fit this layer", v.name());
    let slices = ctx.f.batch.div_ceil(v.samples());
    let (function, grid, threads, cluster) = match v.clustered() && !backward {
        false => (&module.functions[usize::from(backward) * SAMPLES.len() + v.s], slices, d.gates() * d.hidden, 1),
        true => {
            let function = module.functions.get(2 * SAMPLES.len() + v.s);
            let function = function.ok_or_else(|| Error::Cuda { what: format!("{}: this device has no cluster kernels", v.name()) })?;
            (function, slices * v.cluster(), ClusterShape::of(d, v.cluster()).threads, v.cluster())
        }
    };
    let grid = int(grid)? as u32;
    assert_eq!(ctx.stream.context().cu_ctx(), gpu.ctx.cu_ctx(), "a stream of another device");
    gpu.bind()?;
    // SAFETY: `args` are the kernel's parameters in order with their C types (built above from
    // the step's regions and tensors for the batch, each holding what the kernel touches for
    // `batch` samples, and sizes checked to be ints); the block's threads and shared memory are
    // within what the kernel was compiled and opted in for (`fits`); a cluster kernel, loaded
    // only on sm_90 and later, gets a grid of whole clusters of the size it is written for
    // (any); it calls after_prior() first.
    unsafe {
        launch_in_clusters(
            function.cu_function(),
            (grid, 1, 1),
            (threads as u32, 1, 1),
            shared as u32,
            ctx.stream.cu_stream(),
            gpu.dependent_launch,
            cluster as u32,
            args,
        )
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

    /// The defines of each (cell, R) select exactly its 8 kernels in rnn_fused.cu, the ones
    /// `load` looks up, each launching its own instantiation within the thread bound `fits`
    /// assumes; the program has what they call.
    #[test]
    fn each_cell_and_r_compiles_its_own_kernels() {
        let text = SOURCE.1;
        let macro_body = |name: &str| {
            let body = &text[text.find(&format!("#define {name}(")).unwrap_or_else(|| panic!("rnn_fused.cu defines {name}"))..];
            body[..body.find("\n#").unwrap_or(body.len())].replace("\\\n", " ")
        };
        // a kernel: its name from its arguments (as `kernel_name` forms it), its instantiation,
        // its bound
        let kernel = macro_body("RNN_FUSED_KERNEL");
        assert!(kernel.starts_with("#define RNN_FUSED_KERNEL(cell, CELL, dir, DIR, R, S, BOUND)"), "{kernel}");
        for part in [
            "__launch_bounds__(BOUND, 1) void rnn_fused_##cell##_##dir##_r##R##_s##S(",
            "RNN_FUSED_##DIR##_PARAMS) { after_prior(); rnn_fused_##dir<CELL, R, S>(RNN_FUSED_##DIR##_ARGS); }",
        ] {
            assert!(kernel.contains(part), "RNN_FUSED_KERNEL lacks {part:?}: {kernel}");
        }
        // a (cell, R)'s 8, in the order `load` looks them up
        let calls: Vec<String> =
            macro_body("RNN_FUSED_KERNELS").split("RNN_FUSED_KERNEL(").skip(1).map(|c| c[..c.find(')').unwrap()].to_string()).collect();
        let expected: Vec<String> = [("forward", "FORWARD"), ("backward", "BACKWARD")]
            .into_iter()
            .flat_map(|(dir, upper)| SAMPLES.map(|s| format!("cell, CELL, {dir}, {upper}, R, {s}, BOUND")))
            .collect();
        assert_eq!(calls, expected);
        for (cell, cell_const, name) in [(Cell::Gru, "RNN_GRU", "gru"), (Cell::Lstm, "RNN_LSTM", "lstm")] {
            for (r, registers) in REGISTERS.into_iter().enumerate() {
                let (source, defines) = program(cell, registers, false);
                assert_eq!(defines, [format!("-DRNN_FUSED_CELL={cell_const}"), format!("-DRNN_FUSED_R={registers}")]);
                let (_, with_clusters) = program(cell, registers, true);
                assert_eq!(with_clusters[..2], defines[..]);
                assert_eq!(with_clusters[2..], ["-DRNN_FUSED_CLUSTERS"]);
                assert!(source.contains(COMMON) && source.contains(SOURCE.1));
                let v = Fused { r, s: 0, c: 0 };
                let block = format!(
                    "\n#if RNN_FUSED_CELL == {cell_const} && RNN_FUSED_R == {registers}\nRNN_FUSED_KERNELS({name}, {cell_const}, {registers}, {})\n#endif\n",
                    v.max_threads(cell)
                );
                assert_eq!(text.matches(&block).count(), 1, "rnn_fused.cu lacks {block:?}");
                assert_eq!(kernel_name(cell, true, Fused { s: 2, ..v }), format!("rnn_fused_{name}_backward_r{registers}_s4"));
            }
        }
        assert_eq!(text.matches("\n#if RNN_FUSED_CELL == ").count(), 2 * REGISTERS.len(), "one block a (cell, R)");
        // the cluster forwards: each cell's, under RNN_FUSED_CLUSTERS, each its cell's
        // rnn_cluster_forward with its S
        for (cell, cell_const) in [(Cell::Gru, "RNN_GRU"), (Cell::Lstm, "RNN_LSTM")] {
            let condition = format!("\n#if defined(RNN_FUSED_CLUSTERS) && RNN_FUSED_CELL == {cell_const}\n");
            let block = &SOURCE.1[SOURCE.1.find(&condition).unwrap_or_else(|| panic!("no block {condition}"))..];
            let block = &block[condition.len()..block.find("\n#endif").unwrap()];
            let found: Vec<(&str, &str)> = block
                .split("void ")
                .skip(1)
                .map(|k| (&k[..k.find('(').unwrap()], k[k.find("rnn_cluster_forward<").unwrap()..].split_once('>').unwrap().0))
                .collect();
            let expected: Vec<(String, String)> = (0..CLUSTER_SAMPLES)
                .map(|s| (cluster_kernel_name(cell, s), format!("rnn_cluster_forward<{cell_const}, {}", SAMPLES[s])))
                .collect();
            let found: Vec<(String, String)> = found.iter().map(|(n, i)| (n.to_string(), i.to_string())).collect();
            assert_eq!(found, expected, "{condition}");
        }
        assert_eq!(kernel_names().len(), 2 * (2 * REGISTERS.len() * SAMPLES.len() + CLUSTER_SAMPLES));
        assert_eq!(Fused::all().map(Fused::index).collect::<Vec<_>>(), (0..VARIANTS).collect::<Vec<_>>());
    }

    /// A layer's R: the largest whose kernels fit it.
    #[test]
    fn a_layer_gets_the_largest_r_that_fits() {
        let registers = |d: &Dims, limit: usize| registers_for(d, limit).map(|r| REGISTERS[r]);
        assert_eq!(registers(&dims(Cell::Gru, 64, Streaming::No), LIMIT), Some(64));
        // 512 threads: past R = 64's bound of 256
        assert_eq!(registers(&dims(Cell::Lstm, 128, Streaming::No), LIMIT), Some(32));
        // padded 16: no room for 32 register values
        assert_eq!(registers(&dims(Cell::Gru, 12, Streaming::No), LIMIT), Some(0));
        // padded 48: room for 32, not 64
        assert_eq!(registers(&dims(Cell::Gru, 40, Streaming::No), LIMIT), Some(32));
        // r32's backward at one sample needs 4·(96·512 + 4·128 + 4·128) = 200 704 bytes (r0's more)
        assert_eq!(registers(&dims(Cell::Lstm, 128, Streaming::No), 200_000), None);
        // 4·129 = 516 threads: past every LSTM bound (512)
        assert_eq!(registers(&dims(Cell::Lstm, 129, Streaming::No), LIMIT), None);
        assert_eq!(registers(&dims(Cell::Gru, 64, Streaming::Carry), LIMIT), None);
    }

    /// The shared memory of the zoo's layers, worked out by hand from the layouts in
    /// kernels/rnn_fused.cu.
    #[test]
    fn shared_memory_follows_the_layout() {
        let variant = |registers: usize, samples: usize| {
            Fused::all().find(|v| v.registers() == registers && v.samples() == samples && !v.clustered()).unwrap()
        };
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
        // a cluster forward of the LSTM 128 on 8 blocks, 2 samples: 16 units a block, each row
        // over 2 threads of 64 weights (L = 128); 2·2·128 h and 2·4·16 products
        let clustered = |registers: usize, samples: usize, cluster: usize| {
            Fused::all().find(|v| v.registers() == registers && v.samples() == samples && v.cluster() == cluster).unwrap()
        };
        assert_eq!(clustered(32, 2, 8).shared_bytes(&lstm), (4 * (512 + 128), variant(32, 2).shared_bytes(&lstm).1));
        assert_eq!(ClusterShape::of(&lstm, 8), ClusterShape { units: 16, len: 128, threads: 128 });
        assert_eq!(ClusterShape::of(&lstm, 4), ClusterShape { units: 32, len: 128, threads: 256 });
        // GRU 200 (padded 208): 4 threads a row (a power of two), 3·25·4 = 300 threads, whole warps
        let wide = dims(Cell::Gru, 200, Streaming::No);
        assert_eq!(ClusterShape::of(&wide, 8), ClusterShape { units: 25, len: 256, threads: 320 });
        // GRU 12 on 8 blocks of 2 units: the eighth would own none
        assert!(clustered(0, 1, 4).fits(&small, LIMIT) && !clustered(0, 1, 8).fits(&small, LIMIT));
        // LSTM 256 on 4 blocks: 4·64·4 = 1024 threads, past the bound of 512; on 8, 512
        let lstm256 = dims(Cell::Lstm, 256, Streaming::No);
        assert_eq!((ClusterShape::of(&lstm256, 4).threads, ClusterShape::of(&lstm256, 8).threads), (1024, 512));
        // no cluster forward with 8 samples
        assert!(!clustered(32, 8, 8).fits(&lstm, LIMIT));
    }

    #[test]
    fn candidates_fit_and_cover_the_batch_without_waste() {
        let names = |d: &Dims, batch: usize| candidates(d, batch, LIMIT, false).iter().map(|v| v.name()).collect::<Vec<_>>();
        let lstm = dims(Cell::Lstm, 128, Streaming::No);
        assert_eq!(names(&lstm, 64), ["fused s1 r32", "fused s2 r32", "fused s4 r32", "fused s8 r32"]);
        // S below twice the batch: at 3 samples, S = 4 covers them, S = 8 would idle
        assert_eq!(names(&lstm, 3), ["fused s1 r32", "fused s2 r32", "fused s4 r32"]);
        assert_eq!(names(&dims(Cell::Gru, 64, Streaming::No), 1), ["fused s1 r64"]);
        assert_eq!(names(&dims(Cell::Gru, 40, Streaming::No), 8), ["fused s1 r32", "fused s2 r32", "fused s4 r32", "fused s8 r32"]);
        // 3·129 = 387 threads: past every bound of a GRU's kernels (384; 256 for R = 64)
        assert!(candidates(&dims(Cell::Gru, 129, Streaming::No), 8, LIMIT, true).is_empty());
        // a stream's layer runs one step a call
        assert!(candidates(&dims(Cell::Gru, 64, Streaming::Carry), 8, LIMIT, true).is_empty());
        // with clusters: each S up to 4 on clusters of 4 and 8 too, where they fit
        let clustered = |d: &Dims, batch: usize| candidates(d, batch, LIMIT, true).iter().map(|v| v.name()).collect::<Vec<_>>();
        assert_eq!(
            clustered(&lstm, 64),
            [
                "fused s1 r32",
                "fused s1 r32 c4",
                "fused s1 r32 c8",
                "fused s2 r32",
                "fused s2 r32 c4",
                "fused s2 r32 c8",
                "fused s4 r32",
                "fused s4 r32 c4",
                "fused s4 r32 c8",
                "fused s8 r32"
            ]
        );
        assert_eq!(clustered(&dims(Cell::Gru, 64, Streaming::No), 1), ["fused s1 r64", "fused s1 r64 c4", "fused s1 r64 c8"]);
        assert_eq!(clustered(&dims(Cell::Gru, 12, Streaming::No), 1), ["fused s1 r0", "fused s1 r0 c4"]);
    }
}
