//! GRU and LSTM layers through cuDNN's RNN kernels where cuDNN loads and they were measured
//! faster than flatnn's per-step route (`recurrent.rs`); the per-step route everywhere else, so a
//! machine without cuDNN (or whose cuDNN refuses a layer) still runs every model.
//!
//! `FLATNN_CUDNN` (`dnn.rs`) decides here too: `0` the per-step route only (no cuDNN handle is
//! made), `1` cuDNN wherever it sets the layer up and runs it, `auto` (default) the faster.
//!
//! A cache with recurrent layers owns one cuDNN handle for them, bound to the stream of the model
//! using the cache. At its first step (or forward call) it allocates, for its capacity, per layer:
//! cuDNN's weight space, the packed states (h₀, and an LSTM's c₀ and c_T: cuDNN takes and gives
//! states packed, flatnn keeps them in each sample's state row), x and y sequence-major (cuDNN's
//! layout; flatnn's is batch-first), and the sequence lengths cuDNN reads on the device; and one
//! work space for all layers, the largest any needs at the capacity. At its first training step:
//! per layer the reserve space and the weight gradients' space, and for all layers in turn the
//! sequence-major dx and dy, and zeros for the sequence gradient of a last-step layer. Nothing is
//! allocated in a step. Where any of it cannot be had, the layers concerned take the per-step route.
//!
//! A cuDNN descriptor carries the batch, so for each (batch, TF32) that runs, the first time it
//! does (before its graph is captured), a [`Setup`] is made: per layer its descriptors, where
//! cuDNN keeps each of its tensors (the copies between flatnn's flat parameters and cuDNN's
//! weight space, merged where both sides are contiguous), and, for the mode (inference; or a
//! training step's forward and backward together, which must take one route: cuDNN's backward
//! reads what its forward kept in the reserve space), both routes timed as a step runs them
//! (`timing.rs`), the faster kept. The timing runs on the cache's live buffers and writes only
//! what the step overwrites; a stream's layer (whose forward writes its final state over its
//! initial one) has its states put back after. A measurement is made once per process for a
//! (device, layer shape, batch, TF32, mode) and reused by every later cache, as the
//! convolutions' are.
//!
//! What the cuDNN route queues in a step is `rnn_route.rs`'s.

use super::buffer::DevBuf;
use super::context::Gpu;
use super::cudnn::Handle;
use super::dnn::StepRun;
use super::exec::Raw;
use super::options::Convs;
use super::recurrent::{backward_steps, forward_steps, Ctx};
use super::rnn_cudnn::{rnn_functions_present, Descs};
use super::rnn_route::{runs, LayerBufs, LayerTrain, Route, Run, Scratch};
use super::timing::{add_note, time_calls, FirstMeasured};
use super::{device_wide, driver_error, guarded_result};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::recurrent::{dims, Cell, Dims, RnnOutput, STATE};
use cudarc::driver::{result as driver, CudaStream};
use std::fmt::Write;
use std::sync::Arc;

/// (batch, TF32) setups kept: as `dnn.rs`'s.
const SLOTS: usize = 2 * super::graph::Graphs::SLOTS;

/// The recurrent layers of a cache: cuDNN where it is used, and what to report.
pub(crate) struct RnnDnn {
    inner: Option<Inner>,
    /// Why cuDNN is not used, where the plan has recurrent layers and it is not.
    note: String,
}

/// Fields drop in order: setups (descriptors), buffers, handle.
struct Inner {
    setups: Vec<Setup>,
    /// Next setup replaced when `SLOTS` are kept.
    next: usize,
    /// The setup the last `prepare` picked.
    current: Option<usize>,
    bufs: Option<Bufs>,
    /// The plan's recurrent steps: (index, sizes).
    layers: Vec<(usize, Dims)>,
    handle: Handle,
    stream: Arc<CudaStream>,
    gpu: Arc<Gpu>,
    /// Which routes the model's tuning allows (`FLATNN_CUDNN`, as for the convolutions).
    convs: Convs,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The buffers and the handle may still be used by queued work.
        if self.gpu.bind().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

/// The buffers for the cache's capacity (see the module docs).
struct Bufs {
    capacity: usize,
    /// Per recurrent layer; Err where cuDNN refused it or its buffers could not be had.
    layers: Vec<std::result::Result<LayerBufs, String>>,
    work: DevBuf<u8>,
    /// Made at the first training step; Err where they could not be had.
    train: Option<std::result::Result<TrainBufs, String>>,
}

struct TrainBufs {
    /// Per recurrent layer (None for a layer that has no `LayerBufs`).
    layers: Vec<Option<LayerTrain>>,
    scratch: Scratch,
}

/// One mode of one layer: which route runs it, and what was measured to decide.
#[derive(Clone, Copy, Debug)]
struct Choice {
    decided: bool,
    use_cudnn: bool,
    /// Per call, in a graph (or eager where the model's graphs are off); NaN where not measured.
    own_us: f32,
    cudnn_us: f32,
}

impl Default for Choice {
    fn default() -> Self {
        Choice { decided: false, use_cudnn: false, own_us: f32::NAN, cudnn_us: f32::NAN }
    }
}

/// The recurrent layers' descriptors and choices for one batch size and arithmetic.
struct Setup {
    batch: usize,
    tf32: bool,
    /// Per recurrent layer, as `Inner::layers`.
    layers: Vec<LayerSetup>,
}

struct LayerSetup {
    /// None where cuDNN refused the layer at this batch (`note` says why).
    descs: Option<Descs>,
    runs: Vec<Run>,
    /// Inference, training.
    choices: [Choice; 2],
    note: String,
}

impl RnnDnn {
    /// For a cache of `plan` (of any capacity), on `stream`. Never fails: where cuDNN is
    /// missing, refused by `FLATNN_CUDNN` or fails to give a handle, every recurrent layer takes
    /// the per-step route and the report says why.
    pub fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, plan: &Plan, convs: Convs) -> RnnDnn {
        let layers: Vec<(usize, Dims)> = plan.steps.iter().enumerate().filter_map(|(i, s)| Some((i, dims(s)?))).collect();
        let off = |why: String| RnnDnn { inner: None, note: why };
        if layers.is_empty() {
            return off(String::new());
        }
        if convs == Convs::Own {
            return off(format!("FLATNN_CUDNN={}", Convs::Own.setting()));
        }
        if !rnn_functions_present() {
            return off("no cuDNN 9 library with the RNN functions found".into());
        }
        let handle = guarded_result(|| {
            gpu.bind()?;
            Handle::new(stream)
        });
        match handle {
            Ok(handle) => RnnDnn {
                inner: Some(Inner {
                    setups: Vec::with_capacity(SLOTS),
                    next: 0,
                    current: None,
                    bufs: None,
                    layers,
                    handle,
                    stream: Arc::clone(stream),
                    gpu: Arc::clone(gpu),
                    convs,
                }),
                note: String::new(),
            },
            Err(e) => off(format!("setting it up failed: {e}")),
        }
    }

    /// Moves the handle to `stream` (after the work queued on its old one); a no-op when it is
    /// there.
    pub fn rebind(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        match &mut self.inner {
            Some(c) if !Arc::ptr_eq(&c.stream, stream) => {
                c.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
                c.gpu.bind()?;
                c.handle.set_stream(stream)?;
                c.stream = Arc::clone(stream);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Readies the recurrent layers for a step on `f.batch` samples (a training step's with
    /// `b`): the buffers at the first call, the descriptors the first time a batch size (or
    /// TF32 setting) runs, and each layer's route for the mode, measured the first time it runs.
    /// Call it before the step is run or captured, on the model's stream (after
    /// [`RnnDnn::rebind`]); it may wait for the device.
    pub fn prepare(&mut self, s: &StepRun) -> Result<()> {
        let Some(c) = &mut self.inner else { return Ok(()) };
        let training = s.b.is_some();
        if c.bufs.is_none() {
            c.bufs = Some(c.allocate(s.f.capacity, s.options.tf32)?);
        }
        if training {
            c.allocate_training()?;
        }
        let index = match c.setups.iter().position(|x| x.batch == s.f.batch && x.tf32 == s.options.tf32) {
            Some(index) => index,
            None => c.add_setup(s.plan, s.f.batch, s.options.tf32),
        };
        c.current = Some(index);
        let mut layers = std::mem::take(&mut c.setups[index].layers);
        let outcome = (|| {
            for (i, layer) in layers.iter_mut().enumerate() {
                if !layer.choices[training as usize].decided {
                    c.decide(i, layer, s)?;
                }
            }
            Ok(())
        })();
        c.setups[index].layers = layers;
        outcome
    }

    /// Step `index`'s cuDNN route for a pass on `batch` samples in the mode, where it was chosen
    /// for the batch prepared last; None where the per-step route runs it.
    pub(super) fn route(&self, index: usize, batch: usize, training: bool) -> Option<Route<'_>> {
        let c = self.inner.as_ref()?;
        let setup = c.setups.get(c.current?)?;
        // descriptors made for another batch must never run on this one
        debug_assert_eq!(setup.batch, batch, "Dnn::prepare was not called for this batch");
        if setup.batch != batch {
            return None;
        }
        let i = c.layers.iter().position(|&(step, _)| step == index)?;
        c.route(setup, i, training)
    }

    /// One line per recurrent layer and batch size set up: each mode's route and the times
    /// measured (or a first line saying why cuDNN is not used). Empty without recurrent layers.
    pub fn report(&self) -> String {
        let Some(c) = &self.inner else {
            return if self.note.is_empty() {
                String::new()
            } else {
                format!("recurrent layers: cuDNN not used ({}): per-step", self.note)
            };
        };
        let mut out = String::new();
        for setup in &c.setups {
            for (&(index, d), layer) in c.layers.iter().zip(&setup.layers) {
                let arith = if setup.tf32 { "TF32" } else { "FP32" };
                let sep = if out.is_empty() { "" } else { "\n" };
                let _ = write!(out, "{sep}batch {} {arith}, step {index} {}:", setup.batch, label(&d));
                for (mode, ch) in ["inference", "training"].iter().zip(&layer.choices) {
                    let _ = write!(out, " {mode} ");
                    if !ch.decided {
                        out.push_str("not measured yet;");
                    } else if ch.use_cudnn {
                        let _ = write!(out, "cudnn {:.1} µs (per-step {:.1} µs);", ch.cudnn_us, ch.own_us);
                    } else {
                        let _ = write!(out, "per-step {:.1} µs (cudnn {:.1} µs);", ch.own_us, ch.cudnn_us);
                    }
                }
                if !layer.note.is_empty() {
                    let _ = write!(out, " note: {}", layer.note);
                }
            }
        }
        out
    }
}

/// `GRU 3→17 over 6 steps, sequence`
fn label(d: &Dims) -> String {
    let output = match d.output {
        RnnOutput::Sequence => "sequence",
        RnnOutput::LastStep => "last step",
    };
    let carry = if d.carry { ", carried state" } else { "" };
    format!("{} {}→{} over {} steps, {output}{carry}", d.cell.name(), d.features, d.hidden, d.steps)
}

/// Values of `capacity × per` (checked), or an error for the report.
fn times(capacity: usize, per: usize) -> std::result::Result<usize, String> {
    capacity.checked_mul(per).ok_or_else(|| format!("{capacity} × {per} values overflow"))
}

impl Inner {
    /// The buffers for `capacity` samples (see the module docs). A layer cuDNN refuses, or
    /// whose buffers cannot be had, gets an Err (the per-step route runs it); an error only
    /// where the device fails otherwise.
    fn allocate(&self, capacity: usize, tf32: bool) -> Result<Bufs> {
        self.gpu.bind()?;
        let mut work_len = 0usize;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (_, d) in &self.layers {
            let layer = self.layer_bufs(d, capacity, tf32, &mut work_len);
            layers.push(layer);
        }
        // one work space, the largest any layer needs at the capacity in either mode
        let work = DevBuf::zeros(&self.gpu, &self.stream, work_len);
        let work = match work {
            Ok(work) => work,
            Err(e) => {
                let why = format!("its work space ({work_len} bytes) could not be had: {e}");
                layers.iter_mut().for_each(|l| *l = Err(why.clone()));
                DevBuf::zeros(&self.gpu, &self.stream, 0)?
            }
        };
        Ok(Bufs { capacity, layers, work, train: None })
    }

    /// One layer's buffers for `capacity` samples; `work_len` raised to what it needs.
    fn layer_bufs(&self, d: &Dims, capacity: usize, tf32: bool, work_len: &mut usize) -> std::result::Result<LayerBufs, String> {
        // the sizes at the capacity, with either math type (a cache may serve models of both)
        let (mut weights_len, mut reserve_len) = (None, 0usize);
        // cuDNN's first RNN calls load its library of RNN kernels
        let exclusive = device_wide();
        for tf32 in [tf32, !tf32] {
            let descs = Descs::new(&self.handle, d, capacity, tf32)?;
            let space = descs.weight_space(&self.handle).map_err(|e| e.to_string())?;
            if *weights_len.get_or_insert(space) != space {
                return Err("cuDNN's weight space differs between math types".into());
            }
            for training in [false, true] {
                let (work, reserve) = descs.temp_spaces(&self.handle, training).map_err(|e| e.to_string())?;
                *work_len = (*work_len).max(work);
                reserve_len = reserve_len.max(reserve);
            }
        }
        drop(exclusive);
        let cells = if d.cell == Cell::Lstm { 3 } else { 1 };
        let states = times(capacity, cells * d.hidden)?;
        let (xs, ys) = (times(capacity, d.steps * d.features)?, times(capacity, d.steps * d.hidden)?);
        let steps = i32::try_from(d.steps).map_err(|_| format!("{} steps exceed cuDNN's 32-bit integers", d.steps))?;
        let had = |what: &str, e: crate::error::Error| format!("its {what} could not be had: {e}");
        let (gpu, stream) = (&self.gpu, &self.stream);
        Ok(LayerBufs {
            weights: DevBuf::zeros(gpu, stream, weights_len.unwrap_or(0)).map_err(|e| had("weight space", e))?,
            states: DevBuf::zeros(gpu, stream, states).map_err(|e| had("packed states", e))?,
            xs: DevBuf::zeros(gpu, stream, xs).map_err(|e| had("sequence-major input", e))?,
            ys: DevBuf::zeros(gpu, stream, ys).map_err(|e| had("sequence-major output", e))?,
            lengths: DevBuf::from_host(gpu, stream, &vec![steps; capacity]).map_err(|e| had("sequence lengths", e))?,
            reserve_len,
        })
    }

    /// The training buffers, at the first training step (see the module docs).
    fn allocate_training(&mut self) -> Result<()> {
        let Some(bufs) = &mut self.bufs else { return Ok(()) };
        if bufs.train.is_some() {
            return Ok(());
        }
        self.gpu.bind()?;
        let (gpu, stream, capacity) = (&self.gpu, &self.stream, bufs.capacity);
        // the largest any layer needs, per sample
        let most = |per: &dyn Fn(&Dims) -> usize| self.layers.iter().map(|(_, d)| per(d)).max().unwrap_or(0);
        let zeros_len = most(&|d| if d.output == RnnOutput::LastStep { d.steps * d.hidden } else { 0 });
        let dys_len = most(&|d| if d.output == RnnOutput::Sequence { d.steps * d.hidden } else { 0 });
        let dxs_len = most(&|d| d.steps * d.features);
        let outcome = (|| -> std::result::Result<TrainBufs, String> {
            let scratch = |per: usize| DevBuf::zeros(gpu, stream, times(capacity, per)?).map_err(|e| e.to_string());
            let scratch = Scratch { zeros: scratch(zeros_len)?, dys: scratch(dys_len)?, dxs: scratch(dxs_len)? };
            let mut layers = Vec::with_capacity(bufs.layers.len());
            for layer in &bufs.layers {
                let pair = match layer {
                    Ok(l) => Some(LayerTrain {
                        reserve: DevBuf::zeros(gpu, stream, l.reserve_len).map_err(|e| e.to_string())?,
                        dweights: DevBuf::zeros(gpu, stream, l.weights.len()).map_err(|e| e.to_string())?,
                    }),
                    Err(_) => None,
                };
                layers.push(pair);
            }
            Ok(TrainBufs { layers, scratch })
        })();
        bufs.train = Some(outcome.map_err(|e| format!("the training buffers could not be had: {e}")));
        Ok(())
    }

    /// A new setup for (batch, tf32), nothing measured yet; its index.
    fn add_setup(&mut self, plan: &Plan, batch: usize, tf32: bool) -> usize {
        // (as in `layer_bufs`; nothing here allocates device memory)
        let exclusive = device_wide();
        let layers = (0..self.layers.len()).map(|i| self.layer_setup(plan, i, batch, tf32)).collect();
        drop(exclusive);
        let setup = Setup { batch, tf32, layers };
        if self.setups.len() < SLOTS {
            self.setups.push(setup);
            self.setups.len() - 1
        } else {
            let index = self.next;
            self.setups[index] = setup;
            self.next = (self.next + 1) % SLOTS;
            index
        }
    }

    /// Layer `i`'s descriptors for `batch` and the copies of its tensors, checked against the
    /// buffers made for the capacity; without descriptors (and a note) where cuDNN refuses it.
    fn layer_setup(&self, plan: &Plan, i: usize, batch: usize, tf32: bool) -> LayerSetup {
        let refused = |note: String| LayerSetup { descs: None, runs: Vec::new(), choices: [Choice::default(); 2], note };
        let (index, d) = self.layers[i];
        let Some(bufs) = &self.bufs else { return refused("no buffers".into()) };
        let layer = match &bufs.layers[i] {
            Ok(layer) => layer,
            Err(why) => return refused(why.clone()),
        };
        let descs = match Descs::new(&self.handle, &d, batch, tf32) {
            Ok(descs) => descs,
            Err(why) => return refused(why),
        };
        let checked = (|| {
            let space = descs.weight_space(&self.handle)?;
            let (work, _) = descs.temp_spaces(&self.handle, false)?;
            let (train_work, reserve) = descs.temp_spaces(&self.handle, true)?;
            if space != layer.weights.len() || work.max(train_work) > bufs.work.len() || reserve > layer.reserve_len {
                return Err(crate::error::Error::Cuda {
                    what: format!("at batch {batch} cuDNN needs spaces larger than at the capacity {}", bufs.capacity),
                });
            }
            let parts = descs.weight_parts(&self.handle, &d, layer.weights.ptr(), space)?;
            Ok(runs(&plan.steps[index], &d, &parts))
        })();
        match checked {
            Ok(runs) => LayerSetup { descs: Some(descs), runs, choices: [Choice::default(); 2], note: String::new() },
            Err(e) => refused(e.to_string()),
        }
    }

    /// Layer `i`'s cuDNN route in `setup` for the mode, where it is chosen and set up.
    fn route<'a>(&'a self, setup: &'a Setup, i: usize, training: bool) -> Option<Route<'a>> {
        let layer = &setup.layers[i];
        let choice = layer.choices[training as usize];
        if !(choice.decided && choice.use_cudnn) {
            return None;
        }
        self.route_of(layer, i, training)
    }

    /// Layer `i`'s cuDNN route with `layer`'s setup, whatever was chosen, where it is set up.
    fn route_of<'a>(&'a self, layer: &'a LayerSetup, i: usize, training: bool) -> Option<Route<'a>> {
        let descs = layer.descs.as_ref()?;
        let bufs = self.bufs.as_ref()?;
        let layer_bufs = bufs.layers[i].as_ref().ok()?;
        let train = match training {
            true => {
                let t = bufs.train.as_ref()?.as_ref().ok()?;
                Some((t.layers[i].as_ref()?, &t.scratch))
            }
            false => None,
        };
        Some(Route { handle: &self.handle, descs, runs: &layer.runs, bufs: layer_bufs, work: &bufs.work, train })
    }

    /// Records the route of layer `i` for the mode of `s`: as measured before in this process
    /// for the same device, shape, batch, arithmetic and mode, else measured now. A failure of
    /// cuDNN, or of timing either route, leaves the per-step route chosen (with a note).
    fn decide(&self, i: usize, layer: &mut LayerSetup, s: &StepRun) -> Result<()> {
        let (index, d) = self.layers[i];
        let training = s.b.is_some();
        let key = MeasureKey { ordinal: s.gpu.ordinal(), dims: d, batch: s.f.batch, tf32: s.options.tf32, training };
        let ctx = step_ctx(s, index);
        let step = &s.plan.steps[index];
        let m = match MEASURED.get(&key) {
            Some(m) => m,
            None => match self.measure(i, layer, &ctx, step, &d, s.options.graphs)? {
                Some(m) => MEASURED.keep(key, m),
                // not measured: nothing kept for other caches, which may have what this one lacks
                None => Measured { own_us: f32::NAN, cudnn_us: f32::NAN, cudnn_ok: false, note: self.unavailable(training) },
            },
        };
        let mut use_cudnn = m.cudnn_ok && (self.convs == Convs::Cudnn || m.cudnn_us < m.own_us);
        if let (true, Some(route)) = (use_cudnn, self.route_of(layer, i, training)) {
            // Run it eagerly before any capture (measuring did, in the cache that measured): a
            // new handle's first call may load modules or allocate, which would break a capture
            // running on another thread.
            let ran = self.states_kept(&ctx, step, &d, || {
                let _exclusive = device_wide();
                route.run(&ctx, step, &d, training)?;
                ctx.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))
            });
            if let Err(e) = ran {
                note(&mut layer.note, training, &format!("cuDNN failed: {e}"));
                use_cudnn = false;
            }
        } else {
            use_cudnn = false;
        }
        layer.choices[training as usize] = Choice { decided: true, use_cudnn, own_us: m.own_us, cudnn_us: m.cudnn_us };
        if !m.note.is_empty() {
            note(&mut layer.note, training, &m.note);
        }
        Ok(())
    }

    /// Times the per-step route (unless `FLATNN_CUDNN=1`) and cuDNN's for layer `i` in the mode
    /// of `ctx` (a training step's forward and backward together), as a step runs them; None
    /// where this cache has no cuDNN route for the layer (its note, or `unavailable`, says why).
    fn measure(&self, i: usize, layer: &LayerSetup, ctx: &Ctx, step: &Step, d: &Dims, graphs: bool) -> Result<Option<Measured>> {
        let training = ctx.b.is_some();
        let mut m = Measured { own_us: f32::NAN, cudnn_us: f32::NAN, cudnn_ok: false, note: String::new() };
        let Some(route) = self.route_of(layer, i, training) else { return Ok(None) };
        self.states_kept(ctx, step, d, || {
            if self.convs == Convs::Measured {
                let own = || {
                    forward_steps(ctx, step, d)?;
                    if training {
                        backward_steps(ctx, step, d)?;
                    }
                    Ok(())
                };
                match time_calls(ctx.gpu, ctx.stream, graphs, &own) {
                    Ok(us) => m.own_us = us,
                    Err(e) => {
                        m.note = format!("timing the per-step route failed ({e}): per-step chosen");
                        return Ok(());
                    }
                }
            }
            match time_calls(ctx.gpu, ctx.stream, graphs, &|| route.run(ctx, step, d, training)) {
                Ok(us) => (m.cudnn_us, m.cudnn_ok) = (us, true),
                Err(e) => m.note = format!("cuDNN failed: {e}"),
            }
            Ok(())
        })?;
        Ok(Some(m))
    }

    /// Why a layer has no cuDNN route for the mode beyond what its setup's note says: the
    /// training buffers could not be had.
    fn unavailable(&self, training: bool) -> String {
        match self.bufs.as_ref().and_then(|b| b.train.as_ref()) {
            Some(Err(why)) if training => why.clone(),
            _ => String::new(),
        }
    }

    /// Runs `work` with the step's state rows put back after it where its layer carries its
    /// state (a stream's: its forward writes the final state over the initial one).
    fn states_kept<T>(&self, ctx: &Ctx, step: &Step, d: &Dims, work: impl FnOnce() -> Result<T>) -> Result<T> {
        if !d.carry {
            return work();
        }
        let state = ctx.region(step.kept.start + STATE);
        let bytes = state.len() * size_of::<f32>();
        let kept = DevBuf::<f32>::zeros(&self.gpu, ctx.stream, state.len())?;
        let at = Raw::of(ctx.f.acts).at_mut::<f32>(state).ptr();
        let copy = |dst: u64, src: u64| {
            // SAFETY: both hold `bytes` bytes (the state rows of the batch; a buffer of as many
            // values), queued in the stream's order.
            unsafe { driver::memcpy_dtod_async(dst, src, bytes, ctx.stream.cu_stream()) }
                .map_err(|e| driver_error("keeping a recurrent state", e))
        };
        copy(kept.ptr(), at)?;
        let outcome = work();
        copy(at, kept.ptr())?;
        ctx.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))?;
        outcome
    }
}

/// The launches' context for step `index` of the step about to run.
fn step_ctx<'a>(s: &'a StepRun<'a>, index: usize) -> Ctx<'a> {
    let need_dx = s.plan.steps[index].input_region != 0;
    Ctx { gpu: s.gpu, blas: s.blas, stream: s.stream, plan: s.plan, f: s.f, b: s.b, index, need_dx }
}

/// What a measurement is of: the device, the layer's sizes, the batch, the arithmetic and the
/// mode.
#[derive(Clone, Copy, PartialEq, Eq)]
struct MeasureKey {
    ordinal: usize,
    dims: Dims,
    batch: usize,
    tf32: bool,
    training: bool,
}

/// Both routes timed (µs per call; NaN where not), and whether cuDNN ran.
#[derive(Clone)]
struct Measured {
    own_us: f32,
    cudnn_us: f32,
    cudnn_ok: bool,
    note: String,
}

/// Every measurement made in this process: the first one of a key is what every cache uses.
static MEASURED: FirstMeasured<MeasureKey, Measured> = FirstMeasured::new();

fn note(notes: &mut String, training: bool, what: &str) {
    add_note(notes, if training { "training" } else { "inference" }, what);
}
