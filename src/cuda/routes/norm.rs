//! Batch norm's training passes on a GPU, each on the route measured fastest for its layer and
//! batch (as the dense layers' routes are, in `routes.rs`):
//!
//! - `split`: the statistics (or the parameter gradients) a block a channel, or summed in parts
//!   over the samples and the parts added by a second launch where that covers more of the GPU
//!   (`batch_norm_parts`), then the element-wise kernel over the whole batch: 2–3 launches
//!   forward, and backward 2–4 with the activation's derivative;
//! - `fused P`: each pass in one launch, a cluster of P blocks a channel (P = 1, and 2, 4, 8 up
//!   to the batch on sm_90 and later), the parts' sums added through the cluster's shared
//!   memory (kernels/batch_norm.cu).
//!
//! Few values a channel (small batches) favour one launch; many favour the split route's
//! element-wise kernels over the whole GPU: neither wins everywhere, so both are timed. A route
//! is measured for a batch size the first time a training step runs it (by `Routes::prepare`,
//! before the step's graph is captured), each (device, pass, layer shape, batch, activation,
//! whether dz and dx are computed, graphs) once per process, and every later cache takes the
//! same routes. `fused1` gives the split route's bits where that route sums in one part; the
//! others round the sums otherwise (every route is deterministic). A forward timed moves the
//! running statistics at each call: they are copied to the host before and put back after.

use super::super::context::{Gpu, Kernel};
use super::super::dnn::StepRun;
use super::super::driver_error;
use super::super::launch::{int, kernel_args, View, ViewMut};
use super::super::layers::{batch_norm_train_backward, batch_norm_train_forward};
use super::super::timing::{time_routes, FirstMeasured, Timed};
use crate::activation::Activation;
use crate::chain::{Layer, Plan, Step};
use crate::error::Result;
use crate::layers::batch_norm::{self, Geometry};
use cudarc::driver::{result, CudaStream};
use std::fmt::Write;

/// How a batch norm's training pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NormRoute {
    Split,
    /// One launch, this many blocks a channel.
    Fused(usize),
}

impl NormRoute {
    fn name(self) -> String {
        match self {
            NormRoute::Split => "split".into(),
            NormRoute::Fused(parts) => format!("fused{parts}"),
        }
    }
}

/// The two passes a route is chosen for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NormPass {
    Forward,
    Backward,
}

/// The blocks a channel a fused route may take (at most 8: a portable cluster).
const PARTS: [usize; 4] = [1, 2, 4, 8];

/// What a time is of.
#[derive(Clone, Copy, PartialEq)]
struct Problem {
    ordinal: usize,
    pass: NormPass,
    channels: usize,
    pixels: usize,
    batch: usize,
    act: Activation,
    /// The backward computes dz from the output's gradient (else reads it).
    dz: bool,
    /// The backward computes dx.
    dx: bool,
    graphs: bool,
}

/// Every route timed in this process: the first time of a (problem, route) is what every cache
/// uses.
static TIMES: FirstMeasured<(Problem, NormRoute), Timed> = FirstMeasured::new();

/// A route chosen, and every route timed.
#[derive(Clone, Debug)]
struct Chosen {
    route: NormRoute,
    times: Vec<(NormRoute, Timed)>,
}

/// A batch-norm step's routes, per pass ([`NormPass`] order); None until measured.
#[derive(Clone, Debug)]
struct NormLayer {
    step: usize,
    act: Activation,
    chosen: [Option<Chosen>; 2],
}

/// The routes of one batch size.
#[derive(Clone, Debug)]
struct Table {
    batch: usize,
    layers: Vec<NormLayer>,
}

/// A cache's batch-norm routes: a table per batch size trained on.
pub(crate) struct NormRoutes {
    tables: Vec<Table>,
    /// The table the last `prepare` picked.
    current: Option<usize>,
}

impl NormRoutes {
    pub fn new() -> NormRoutes {
        NormRoutes { tables: Vec::new(), current: None }
    }

    /// The route of step `index`'s `pass` at the batch [`NormRoutes::prepare`] was last called
    /// for; `split` where none was measured.
    pub fn route(&self, index: usize, pass: NormPass) -> NormRoute {
        let layer = self.current.and_then(|t| self.tables[t].layers.iter().find(|l| l.step == index));
        layer.and_then(|l| l.chosen[pass as usize].as_ref()).map_or(NormRoute::Split, |c| c.route)
    }

    /// Readies the batch-norm steps of a training step on `f.batch` samples: the first time
    /// that batch trains, measures both passes' routes; later only picks its table. Nothing for
    /// a forward alone (inference normalises by the running statistics, on one route).
    pub fn prepare(&mut self, s: &StepRun) -> Result<()> {
        let (Some(_), batch) = (s.b, s.f.batch) else { return Ok(()) };
        let index = match self.tables.iter().position(|t| t.batch == batch) {
            Some(index) => index,
            None => {
                self.tables.push(new_table(s.plan, batch));
                self.tables.len() - 1
            }
        };
        self.current = Some(index);
        for layer in &mut self.tables[index].layers {
            for pass in [NormPass::Forward, NormPass::Backward] {
                if layer.chosen[pass as usize].is_none() {
                    layer.chosen[pass as usize] = Some(choose(s, &s.plan.steps[layer.step], layer.act, pass)?);
                }
            }
        }
        Ok(())
    }

    /// One line per batch size, batch-norm step and pass: the route chosen and its µs, then
    /// the others timed, fastest first (`(one call)`: not timed further after a first look).
    pub fn report(&self) -> String {
        let mut lines = Vec::new();
        for table in &self.tables {
            for layer in &table.layers {
                for pass in [NormPass::Forward, NormPass::Backward] {
                    let Some(chosen) = &layer.chosen[pass as usize] else { continue };
                    let mut times = chosen.times.clone();
                    times.sort_by(|a, b| a.1.us.total_cmp(&b.1.us));
                    let us = times.iter().find(|t| t.0 == chosen.route).map_or(f32::NAN, |t| t.1.us);
                    let mut line = format!(
                        "batch {} step {} batch norm, {}: {} {us:.1} µs",
                        table.batch,
                        layer.step,
                        pass_name(pass),
                        chosen.route.name()
                    );
                    let others: Vec<String> = times
                        .iter()
                        .filter(|t| t.0 != chosen.route)
                        .map(|(r, t)| format!("{} {:.1}{}", r.name(), t.us, if t.one_call { " (one call)" } else { "" }))
                        .collect();
                    if !others.is_empty() {
                        let _ = write!(line, " (others: {})", others.join(", "));
                    }
                    lines.push(line);
                }
            }
        }
        lines.join("\n")
    }
}

fn pass_name(pass: NormPass) -> &'static str {
    match pass {
        NormPass::Forward => "forward",
        NormPass::Backward => "backward",
    }
}

/// A table for `batch`, nothing measured yet: every batch-norm step of `plan`.
fn new_table(plan: &Plan, batch: usize) -> Table {
    let layers = plan
        .steps
        .iter()
        .enumerate()
        .filter_map(|(step, s)| {
            let Layer::BatchNorm(norm) = s.layer else { return None };
            Some(NormLayer { step, act: norm.activation, chosen: [None, None] })
        })
        .collect();
    Table { batch, layers }
}

/// The routes that fit `pass` of a batch norm over `batch` samples on `gpu`.
fn candidates(gpu: &Gpu, batch: usize) -> Vec<NormRoute> {
    let fused = PARTS.iter().filter(|&&p| p == 1 || (gpu.has_clusters() && p <= batch)).map(|&p| NormRoute::Fused(p));
    std::iter::once(NormRoute::Split).chain(fused).collect()
}

/// Times every route of `pass` of batch-norm step `step` (each at most once per process) and
/// keeps the fastest; `split` where none could be timed.
fn choose(s: &StepRun, step: &Step, act: Activation, pass: NormPass) -> Result<Chosen> {
    let StepRun { gpu, stream, plan, f, b, options, .. } = *s;
    let b = b.expect("batch-norm routes are measured for training steps");
    let g = Geometry::of(step, f.batch);
    // as a training pass runs them: dz computed where the step has an activation of its own
    // (unless the layer after writes it: then read, which this times as computed), dx unless
    // the input is the model's
    let (dz, dx) = (step.z_region != step.output_region, step.input_region != 0);
    let key = Problem {
        ordinal: gpu.ordinal(),
        pass,
        channels: g.channels,
        pixels: g.pixels,
        batch: f.batch,
        act,
        dz,
        dx,
        graphs: options.graphs,
    };
    let run = |route: NormRoute| match pass {
        NormPass::Forward => batch_norm_train_forward(gpu, stream, plan, f, step, act, route),
        NormPass::Backward => batch_norm_train_backward(gpu, stream, plan, (f, b), step, act, route, (dz, dx)),
    };
    let known = |route: NormRoute| TIMES.get(&(key, route));
    let routes = candidates(gpu, f.batch);
    let running =
        if pass == NormPass::Forward && routes.iter().any(|&r| known(r).is_none()) { Some(Running::save(s, step)?) } else { None };
    let times = time_routes(gpu, stream, options.graphs, routes, known, |r, t| TIMES.keep((key, r), t), &run);
    if let Some(running) = running {
        running.restore(s)?;
    }
    let route = times.iter().filter(|t| !t.1.us.is_nan()).min_by(|a, b| a.1.us.total_cmp(&b.1.us)).map_or(NormRoute::Split, |t| t.0);
    Ok(Chosen { route, times })
}

/// A batch-norm step's running statistics and count, copied to the host.
struct Running {
    ranges: [std::ops::Range<usize>; 3],
    values: [Vec<f32>; 3],
}

impl Running {
    fn save(s: &StepRun, step: &Step) -> Result<Running> {
        let buffers = s.f.buffers.expect("a model with batch norm has buffers");
        let ranges = [0, 1, 2].map(|i| step.buffers[i].range.clone());
        let mut values = ranges.clone().map(|r| vec![0.0f32; r.len()]);
        // copies with a wait, as the measurements' eager calls make (see `timing.rs`)
        let _exclusive = super::super::device_wide();
        s.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        for (range, out) in ranges.iter().zip(&mut values) {
            let at = buffers.view(range.clone()).ptr();
            // SAFETY: the range lies in the model's buffers (a step's buffer tensor), `out`
            // holds as many values, and the host waits below before reading it.
            unsafe { result::memcpy_dtoh_async(&mut out[..], at, s.stream.cu_stream()) }
                .map_err(|e| driver_error("copying the running statistics", e))?;
        }
        s.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        Ok(Running { ranges, values })
    }

    fn restore(self, s: &StepRun) -> Result<()> {
        let buffers = s.f.buffers.expect("a model with batch norm has buffers");
        let _exclusive = super::super::device_wide();
        s.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        for (range, values) in self.ranges.iter().zip(&self.values) {
            let at = buffers.view(range.clone()).ptr();
            // SAFETY: the range lies in the model's buffers (a step's buffer tensor); the
            // stream was waited for above and is again below, so nothing reads it meanwhile.
            unsafe { result::memcpy_htod_async(at, &values[..], s.stream.cu_stream()) }
                .map_err(|e| driver_error("putting back the running statistics", e))?;
        }
        s.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))
    }
}

/// What a backward computes dz = dy ⊙ act'(z) from: z, y, dy and the activation.
pub(crate) type FromDy<'a> = (View<'a, f32>, View<'a, f32>, View<'a, f32>, Activation);

impl Gpu {
    /// `batch_norm_train_forward`: [`Gpu::batch_norm_stats`] and then [`Gpu::batch_norm_apply`]
    /// (from the batch's statistics) in one launch, `parts` blocks a channel in a cluster.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_norm_train_forward(
        &self,
        stream: &CudaStream,
        g: &Geometry,
        parts: usize,
        x: View<f32>,
        (z, y): (ViewMut<f32>, Option<(ViewMut<f32>, Activation)>),
        (mean, inv): (ViewMut<f32>, ViewMut<f32>),
        [running_mean, running_var, count]: [ViewMut<f32>; 3],
        (gamma, beta): (View<f32>, View<f32>),
    ) -> Result<()> {
        let (c, len) = (g.channels, g.batch * g.channels * g.pixels);
        assert!(
            x.len() >= len && z.len() >= len && y.as_ref().is_none_or(|(y, _)| y.len() >= len),
            "batch_norm_train_forward: short x, z or y"
        );
        assert!(
            [mean.len(), inv.len(), running_mean.len(), running_var.len(), gamma.len(), beta.len()].iter().all(|&l| l >= c)
                && !count.is_empty(),
            "batch_norm_train_forward: short view"
        );
        let ((act, slope), y) = match y {
            Some((y, act)) => (act.gpu_code(), y.ptr()),
            None => (Activation::Identity.gpu_code(), 0),
        };
        let (x, z, mean, inv, rm, rv, count, gamma, beta) =
            (x.ptr(), z.ptr(), mean.ptr(), inv.ptr(), running_mean.ptr(), running_var.ptr(), count.ptr(), gamma.ptr(), beta.ptr());
        let _ = int(len)?;
        let (channels, pixels, batch, chunk) = (int(c)?, int(g.pixels)?, int(g.batch)?, int(g.batch.div_ceil(parts))?);
        let (momentum, eps) = (batch_norm::MOMENTUM, batch_norm::EPS);
        let args = kernel_args![x, z, y, mean, inv, rm, rv, count, gamma, beta, act, slope, channels, pixels, batch, chunk, momentum, eps];
        self.run_clusters(stream, Kernel::BatchNormTrainForward, int(c * parts)? as u32, parts as u32, args)
    }

    /// `batch_norm_train_backward`: dz = dy ⊙ act'(z) where `from_dy` gives (z, y, dy, act)
    /// (else `dz` holds it), then [`Gpu::batch_norm_param_grads`] and, where `dx` is given,
    /// [`Gpu::batch_norm_input_grad`], in one launch, `parts` blocks a channel in a cluster.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn batch_norm_train_backward(
        &self,
        stream: &CudaStream,
        g: &Geometry,
        parts: usize,
        x: View<f32>,
        (from_dy, dz): (Option<FromDy>, ViewMut<f32>),
        dx: Option<ViewMut<f32>>,
        (mean, inv): (View<f32>, View<f32>),
        gamma: View<f32>,
        (dgamma, dbeta): (ViewMut<f32>, ViewMut<f32>),
    ) -> Result<()> {
        let (c, len) = (g.channels, g.batch * g.channels * g.pixels);
        assert!(
            x.len() >= len && dz.len() >= len && dx.as_ref().is_none_or(|dx| dx.len() >= len),
            "batch_norm_train_backward: short x, dz or dx"
        );
        assert!(
            from_dy.as_ref().is_none_or(|(z, y, dy, _)| z.len() >= len && y.len() >= len && dy.len() >= len),
            "batch_norm_train_backward: short z, y or dy"
        );
        assert!(
            [mean.len(), inv.len(), gamma.len(), dgamma.len(), dbeta.len()].iter().all(|&l| l >= c),
            "batch_norm_train_backward: short view"
        );
        let (z, y, dy, (act, slope), reads) = match from_dy {
            Some((z, y, dy, act)) => (z.ptr(), y.ptr(), dy.ptr(), act.gpu_code(), act.derivative_reads()),
            None => (0, 0, 0, Activation::Identity.gpu_code(), 0),
        };
        let (x, dz, dx) = (x.ptr(), dz.ptr(), dx.map_or(0, |dx| dx.ptr()));
        let (mean, inv, gamma, dgamma, dbeta) = (mean.ptr(), inv.ptr(), gamma.ptr(), dgamma.ptr(), dbeta.ptr());
        let _ = int(len)?;
        let (channels, pixels, batch, chunk) = (int(c)?, int(g.pixels)?, int(g.batch)?, int(g.batch.div_ceil(parts))?);
        let inv_count = (1.0 / g.n() as f64) as f32;
        let args = kernel_args![
            x, z, y, dy, dz, dx, mean, inv, gamma, dgamma, dbeta, act, slope, reads, channels, pixels, batch, chunk, inv_count
        ];
        self.run_clusters(stream, Kernel::BatchNormTrainBackward, int(c * parts)? as u32, parts as u32, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::{Chain, Input};
    use crate::{Identity, Relu};

    /// A table holds every batch-norm step with its activation; a route not measured (or with no
    /// table picked) is `split`; the report gives a line per batch, step and pass measured: the
    /// route chosen and its time, then the others fastest first, one-call looks marked.
    #[test]
    fn routes_default_to_split_and_the_report_names_each_step_and_pass() {
        let plan = Chain::new(Input::image(3, 8, 8)).conv(4, (3, 3), Identity).batch_norm_with(Relu).conv(4, (3, 3), Identity).batch_norm();
        let plan = plan.build().unwrap().plan().clone();
        let mut table = new_table(&plan, 8);
        assert_eq!(table.layers.iter().map(|l| (l.step, l.act)).collect::<Vec<_>>(), [(1, Relu), (3, Identity)]);
        let t = |us, one_call| Timed { us, one_call };
        let times = vec![(NormRoute::Split, t(9.0, false)), (NormRoute::Fused(1), t(40.0, true)), (NormRoute::Fused(2), t(3.3, false))];
        table.layers[0].chosen[0] = Some(Chosen { route: NormRoute::Fused(2), times });
        table.layers[1].chosen[1] = Some(Chosen { route: NormRoute::Split, times: vec![(NormRoute::Split, t(5.0, false))] });
        let mut routes = NormRoutes { tables: vec![table], current: None };
        assert_eq!(routes.route(1, NormPass::Forward), NormRoute::Split, "no table picked");
        routes.current = Some(0);
        assert_eq!(routes.route(1, NormPass::Forward), NormRoute::Fused(2));
        assert_eq!(routes.route(1, NormPass::Backward), NormRoute::Split, "not measured");
        assert_eq!(routes.route(0, NormPass::Forward), NormRoute::Split, "not a batch norm");
        let want = "batch 8 step 1 batch norm, forward: fused2 3.3 µs (others: split 9.0, fused1 40.0 (one call))\n\
                    batch 8 step 3 batch norm, backward: split 5.0 µs";
        assert_eq!(routes.report(), want);
    }
}
