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
//! The spaces are the largest that any of cuDNN's RNN algorithms (`rnn_cudnn.rs`) allowed by
//! `Tuning::rnn_algos` (`FLATNN_RNN_ALGO`) and set up by cuDNN at the capacity needs; where that
//! work space cannot be had, the largest the standard algorithm needs, and the algorithms needing
//! more are not used.
//!
//! A cuDNN descriptor carries the batch, so for each (batch, TF32) that runs, the first time it
//! does (before its graph is captured), a [`Setup`] is made: per layer and algorithm cuDNN takes at
//! that batch its descriptors (a dynamic persistent algorithm's kernels compiled then) and where
//! cuDNN keeps each of its tensors (the copies between flatnn's flat parameters and cuDNN's
//! weight space, merged where both sides are contiguous), and, for the mode (inference; or a
//! training step's forward and backward together, which must take one route and one algorithm:
//! cuDNN's backward reads what its forward kept in the reserve space), the per-step route and
//! each algorithm timed as a step runs them (`timing.rs`), the fastest kept. An algorithm cuDNN
//! refuses, at the descriptors, the sizes or a call, is not a candidate (the report says why).
//! The timing runs on the cache's live buffers and writes only what the step overwrites; a
//! stream's layer (whose forward writes its final state over its initial one) has its states put
//! back after. A measurement is made once per process for a (device, layer shape, batch, TF32,
//! mode) and reused by every later cache, as the convolutions' are.
//!
//! What the cuDNN route queues in a step is `rnn_route.rs`'s.

use super::buffer::DevBuf;
use super::context::Gpu;
use super::cudnn::Handle;
use super::dnn::StepRun;
use super::exec::Raw;
use super::options::{Convs, RnnAlgos, Tuning};
use super::recurrent::{backward_steps, forward_steps, Ctx};
use super::rnn_cudnn::{rnn_functions_present, Algo, Descs};
use super::rnn_route::{runs, LayerBufs, LayerTrain, Route, Run, Scratch};
use super::timing::{add_note, time_calls, time_once, FirstMeasured, SLOW};
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
    /// Which of cuDNN's algorithms it allows (`FLATNN_RNN_ALGO`).
    rnn_algos: RnnAlgos,
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
    /// The algorithm cuDNN runs the mode with; None: the per-step route.
    cudnn: Option<Algo>,
    /// Per call, in a graph (or eager where the model's graphs are off); NaN where not measured.
    own_us: f32,
    /// Per algorithm, in [`Algo::ALL`]'s order.
    cudnn_us: [f32; ALGOS],
}

const ALGOS: usize = Algo::ALL.len();

/// Work queued on a stream, as the timing functions take it.
type Work<'a> = dyn Fn() -> Result<()> + 'a;

impl Default for Choice {
    fn default() -> Self {
        Choice { decided: false, cudnn: None, own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS] }
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
    /// The algorithms cuDNN set the layer up with at this batch (none: `note` says why).
    candidates: Vec<Candidate>,
    /// Inference, training.
    choices: [Choice; 2],
    note: String,
}

/// One algorithm's descriptors for a layer and batch, and the copies of the layer's tensors into
/// its weight space.
struct Candidate {
    descs: Descs,
    runs: Vec<Run>,
}

impl RnnDnn {
    /// For a cache of `plan` (of any capacity), on `stream`, for models whose recurrent layers
    /// take the routes `tuning` allows. Never fails: where cuDNN is missing, refused by
    /// `FLATNN_CUDNN` or fails to give a handle, every recurrent layer takes the per-step route and
    /// the report says why.
    pub fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, plan: &Plan, tuning: Tuning) -> RnnDnn {
        let convs = tuning.convs;
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
                    rnn_algos: tuning.rnn_algos,
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
        let not_understood = Tuning::rnn_algo_not_understood().filter(|_| c.rnn_algos == RnnAlgos::ALL);
        let mut out = match not_understood {
            Some(value) => format!("recurrent layers: FLATNN_RNN_ALGO={value:?} not understood, every cuDNN algorithm tried"),
            None => String::new(),
        };
        for setup in &c.setups {
            for (&(index, d), layer) in c.layers.iter().zip(&setup.layers) {
                let arith = if setup.tf32 { "TF32" } else { "FP32" };
                let sep = if out.is_empty() { "" } else { "\n" };
                let _ = write!(out, "{sep}batch {} {arith}, step {index} {}:", setup.batch, label(&d));
                for (mode, ch) in ["inference", "training"].iter().zip(&layer.choices) {
                    let _ = write!(out, " {mode} ");
                    if !ch.decided {
                        out.push_str("not measured yet;");
                        continue;
                    }
                    // the times of the algorithms that ran, but `chosen`
                    let others = |chosen: Option<Algo>| {
                        let ran = Algo::ALL.into_iter().filter(|&a| Some(a) != chosen && !ch.cudnn_us[a.index()].is_nan());
                        ran.map(|a| format!("{} {:.1} µs", a.name(), ch.cudnn_us[a.index()])).collect::<Vec<_>>().join(", ")
                    };
                    match ch.cudnn {
                        Some(a) => {
                            let (us, rest) = (ch.cudnn_us[a.index()], others(Some(a)));
                            let sep = if rest.is_empty() { "" } else { ", cudnn " };
                            let _ = write!(out, "cudnn {} {us:.1} µs (per-step {:.1} µs{sep}{rest});", a.name(), ch.own_us);
                        }
                        None => {
                            let ran = others(None);
                            let ran = if ran.is_empty() { "not run".into() } else { ran };
                            let _ = write!(out, "per-step {:.1} µs (cudnn {ran});", ch.own_us);
                        }
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
        let (mut layers, mut needs) = (Vec::with_capacity(self.layers.len()), Vec::with_capacity(self.layers.len()));
        for (_, d) in &self.layers {
            match self.layer_bufs(d, capacity, tf32) {
                Ok((layer, work)) => {
                    layers.push(Ok(layer));
                    needs.push(work);
                }
                Err(why) => {
                    layers.push(Err(why));
                    needs.push([0; ALGOS]);
                }
            }
        }
        // one work space, the largest any layer needs at the capacity in either mode with any of
        // its algorithms; else the largest the standard algorithm needs
        let most = |algos: &[Algo]| needs.iter().flat_map(|work| algos.iter().map(|a| work[a.index()])).max().unwrap_or(0);
        let (all, standard) = (most(&Algo::ALL), most(&[Algo::Standard]));
        let mut work = DevBuf::zeros(&self.gpu, &self.stream, all);
        if let (Err(e), true) = (&work, standard < all) {
            let why = format!("its work space ({all} bytes) could not be had: {e}");
            work = DevBuf::zeros(&self.gpu, &self.stream, standard);
            for (layer, need) in layers.iter_mut().zip(&needs) {
                let Ok(l) = layer else { continue };
                let dropped: Vec<Algo> = l.algos.iter().copied().filter(|a| need[a.index()] > standard).collect();
                for a in dropped {
                    l.algos.retain(|&b| b != a);
                    add_note(&mut l.refused, a.name(), &why);
                }
                if l.algos.is_empty() {
                    *layer = Err(l.refused.clone());
                }
            }
        }
        let work = match work {
            Ok(work) => work,
            Err(e) => {
                let why = format!("its work space ({} bytes) could not be had: {e}", standard.min(all));
                layers.iter_mut().for_each(|l| *l = Err(why.clone()));
                DevBuf::zeros(&self.gpu, &self.stream, 0)?
            }
        };
        Ok(Bufs { capacity, layers, work, train: None })
    }

    /// One layer's buffers for `capacity` samples, and the work space each algorithm needs (in
    /// `Algo::ALL`'s order; 0 for one cuDNN refused).
    fn layer_bufs(&self, d: &Dims, capacity: usize, tf32: bool) -> std::result::Result<(LayerBufs, [usize; ALGOS]), String> {
        // the sizes at the capacity, with either math type (a cache may serve models of both)
        let (mut weights_len, mut reserve_len, mut work) = (None, 0usize, [0usize; ALGOS]);
        let (mut algos, mut refused) = (Vec::new(), String::new());
        // cuDNN's first RNN calls load its library of RNN kernels
        let exclusive = device_wide();
        for algo in Algo::ALL.into_iter().filter(|a| self.rnn_algos.allows(a.index())) {
            let mut why = String::new();
            for tf32 in [tf32, !tf32] {
                match self.sizes(d, capacity, tf32, algo) {
                    Ok([space, w, reserve]) if *weights_len.get_or_insert(space) == space => {
                        work[algo.index()] = work[algo.index()].max(w);
                        reserve_len = reserve_len.max(reserve);
                        if !algos.contains(&algo) {
                            algos.push(algo);
                        }
                    }
                    Ok([space, ..]) => {
                        why = format!("its weight space ({space} bytes) is not the others' ({})", weights_len.unwrap_or(0));
                    }
                    Err(e) => why = e,
                }
            }
            if !algos.contains(&algo) {
                add_note(&mut refused, algo.name(), &why);
            }
        }
        drop(exclusive);
        if algos.is_empty() {
            return Err(if refused.is_empty() { "FLATNN_RNN_ALGO allows no cuDNN algorithm".into() } else { refused });
        }
        let cells = if d.cell == Cell::Lstm { 3 } else { 1 };
        let states = times(capacity, cells * d.hidden)?;
        let (xs, ys) = (times(capacity, d.steps * d.features)?, times(capacity, d.steps * d.hidden)?);
        let steps = i32::try_from(d.steps).map_err(|_| format!("{} steps exceed cuDNN's 32-bit integers", d.steps))?;
        let had = |what: &str, e: crate::error::Error| format!("its {what} could not be had: {e}");
        let (gpu, stream) = (&self.gpu, &self.stream);
        let layer = LayerBufs {
            weights: DevBuf::zeros(gpu, stream, weights_len.unwrap_or(0)).map_err(|e| had("weight space", e))?,
            states: DevBuf::zeros(gpu, stream, states).map_err(|e| had("packed states", e))?,
            xs: DevBuf::zeros(gpu, stream, xs).map_err(|e| had("sequence-major input", e))?,
            ys: DevBuf::zeros(gpu, stream, ys).map_err(|e| had("sequence-major output", e))?,
            lengths: DevBuf::from_host(gpu, stream, &vec![steps; capacity]).map_err(|e| had("sequence lengths", e))?,
            reserve_len,
            algos,
            refused,
        };
        Ok((layer, work))
    }

    /// The bytes of the weight space, of the work space (the larger of the modes') and of the
    /// reserve space layer `d` needs for `batch` samples with `algo` and the math type.
    fn sizes(&self, d: &Dims, batch: usize, tf32: bool, algo: Algo) -> std::result::Result<[usize; 3], String> {
        let descs = Descs::new(&self.handle, d, batch, tf32, algo)?;
        let space = descs.weight_space(&self.handle).map_err(|e| e.to_string())?;
        let (work, _) = descs.temp_spaces(&self.handle, false).map_err(|e| e.to_string())?;
        let (train_work, reserve) = descs.temp_spaces(&self.handle, true).map_err(|e| e.to_string())?;
        Ok([space, work.max(train_work), reserve])
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
        // (as in `layer_bufs`, and a dynamic persistent algorithm's kernels are compiled and
        // loaded here; nothing here allocates device memory otherwise)
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

    /// Layer `i`'s candidates for `batch`: for each algorithm set up at the capacity that cuDNN
    /// also takes at this batch, its descriptors and the copies of its tensors, checked against
    /// the buffers made for the capacity; the note says why the others are not candidates.
    fn layer_setup(&self, plan: &Plan, i: usize, batch: usize, tf32: bool) -> LayerSetup {
        let mut setup = LayerSetup { candidates: Vec::new(), choices: [Choice::default(); 2], note: String::new() };
        let (index, d) = self.layers[i];
        let Some(bufs) = &self.bufs else {
            setup.note = "no buffers".into();
            return setup;
        };
        let layer = match &bufs.layers[i] {
            Ok(layer) => layer,
            Err(why) => {
                setup.note = why.clone();
                return setup;
            }
        };
        setup.note = layer.refused.clone();
        for &algo in &layer.algos {
            match self.candidate(&plan.steps[index], &d, layer, bufs, (batch, tf32), algo) {
                Ok(candidate) => setup.candidates.push(candidate),
                Err(why) => add_note(&mut setup.note, algo.name(), &why),
            }
        }
        setup
    }

    /// The descriptors of `step`'s layer `d` (whose buffers are `layer`) for (batch, TF32) and
    /// `algo`, and the copies of its tensors, where cuDNN takes them and the buffers made for the
    /// capacity have the spaces it asks for.
    fn candidate(
        &self,
        step: &Step,
        d: &Dims,
        layer: &LayerBufs,
        bufs: &Bufs,
        (batch, tf32): (usize, bool),
        algo: Algo,
    ) -> std::result::Result<Candidate, String> {
        let descs = Descs::new(&self.handle, d, batch, tf32, algo)?;
        let space = descs.weight_space(&self.handle).map_err(|e| e.to_string())?;
        let (work, _) = descs.temp_spaces(&self.handle, false).map_err(|e| e.to_string())?;
        let (train_work, reserve) = descs.temp_spaces(&self.handle, true).map_err(|e| e.to_string())?;
        if space != layer.weights.len() || work.max(train_work) > bufs.work.len() || reserve > layer.reserve_len {
            return Err(format!("at batch {batch} cuDNN asks for spaces the buffers made for the capacity {} lack", bufs.capacity));
        }
        let parts = descs.weight_parts(&self.handle, d, layer.weights.ptr(), space).map_err(|e| e.to_string())?;
        Ok(Candidate { runs: runs(step, d, &parts), descs })
    }

    /// Layer `i`'s cuDNN route in `setup` for the mode, where it is chosen and set up.
    fn route<'a>(&'a self, setup: &'a Setup, i: usize, training: bool) -> Option<Route<'a>> {
        let layer = &setup.layers[i];
        let choice = layer.choices[training as usize];
        let algo = choice.cudnn.filter(|_| choice.decided)?;
        self.route_of(layer, i, algo, training)
    }

    /// Layer `i`'s cuDNN route with `layer`'s setup and `algo`, whatever was chosen, where it is
    /// set up.
    fn route_of<'a>(&'a self, layer: &'a LayerSetup, i: usize, algo: Algo, training: bool) -> Option<Route<'a>> {
        let candidate = layer.candidates.iter().find(|c| c.descs.algo() == algo)?;
        let bufs = self.bufs.as_ref()?;
        let layer_bufs = bufs.layers[i].as_ref().ok()?;
        let train = match training {
            true => {
                let t = bufs.train.as_ref()?.as_ref().ok()?;
                Some((t.layers[i].as_ref()?, &t.scratch))
            }
            false => None,
        };
        Some(Route { handle: &self.handle, descs: &candidate.descs, runs: &candidate.runs, bufs: layer_bufs, work: &bufs.work, train })
    }

    /// Records the route of layer `i` for the mode of `s`: as measured before in this process
    /// for the same device, shape, batch, arithmetic and mode, else measured now; cuDNN's
    /// fastest algorithm where it beat the per-step route (or `FLATNN_CUDNN=1`). A failure of
    /// cuDNN, or of timing the per-step route, leaves the per-step route chosen (with a note).
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
                None => Measured { own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], note: self.unavailable(training) },
            },
        };
        // the fastest of this setup's algorithms that ran (a measurement kept by another cache
        // may time algorithms this one lacks)
        let timed = layer.candidates.iter().map(|c| (c.descs.algo(), m.cudnn_us[c.descs.algo().index()]));
        let fastest = timed.filter(|(_, us)| !us.is_nan()).min_by(|a, b| a.1.total_cmp(&b.1));
        let mut cudnn = fastest.filter(|&(_, us)| self.convs == Convs::Cudnn || us < m.own_us).map(|(algo, _)| algo);
        if let Some(algo) = cudnn {
            // Run it eagerly before any capture (measuring did, in the cache that measured): a
            // new handle's first call may load modules or allocate, which would break a capture
            // running on another thread.
            let ran = match self.route_of(layer, i, algo, training) {
                Some(route) => self.states_kept(&ctx, step, &d, || {
                    let _exclusive = device_wide();
                    route.run(&ctx, step, &d, training)?;
                    ctx.stream.synchronize().map_err(|e| driver_error("waiting for a stream", e))
                }),
                None => Err(crate::error::Error::Cuda { what: "its buffers are missing".into() }),
            };
            if let Err(e) = ran {
                note(&mut layer.note, training, &format!("cuDNN {} failed: {e}", algo.name()));
                cudnn = None;
            }
        }
        layer.choices[training as usize] = Choice { decided: true, cudnn, own_us: m.own_us, cudnn_us: m.cudnn_us };
        if !m.note.is_empty() {
            note(&mut layer.note, training, &m.note);
        }
        Ok(())
    }

    /// Times the per-step route (unless `FLATNN_CUDNN=1`) and each of cuDNN's algorithms set up
    /// for layer `i` in the mode of `ctx` (a training step's forward and backward together), as
    /// a step runs them; None where this cache has no cuDNN route for the layer (its note, or
    /// `unavailable`, says why). An algorithm that fails is left untimed, with a note.
    fn measure(&self, i: usize, layer: &LayerSetup, ctx: &Ctx, step: &Step, d: &Dims, graphs: bool) -> Result<Option<Measured>> {
        let training = ctx.b.is_some();
        let mut m = Measured { own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], note: String::new() };
        let routes: Vec<Route> = layer.candidates.iter().filter_map(|c| self.route_of(layer, i, c.descs.algo(), training)).collect();
        if routes.is_empty() {
            return Ok(None);
        }
        self.states_kept(ctx, step, d, || {
            let own = || {
                forward_steps(ctx, step, d)?;
                if training {
                    backward_steps(ctx, step, d)?;
                }
                Ok(())
            };
            let runs: Vec<_> = routes.iter().map(|route| move || route.run(ctx, step, d, training)).collect();
            // (None: the per-step route, timed unless cuDNN is forced)
            let mut candidates: Vec<(Option<Algo>, &Work)> = Vec::new();
            if self.convs == Convs::Measured {
                candidates.push((None, &own));
            }
            candidates.extend(routes.iter().zip(&runs).map(|(route, run)| (Some(route.descs.algo()), run as &Work)));
            // a first look at each (one eager call); timed in full only near the fastest look
            let looks: Vec<Result<f32>> = candidates.iter().map(|(_, run)| time_once(ctx.gpu, ctx.stream, *run)).collect();
            let fastest = looks.iter().filter_map(|look| look.as_ref().ok()).fold(f32::INFINITY, |a, &b| a.min(b));
            for ((algo, run), look) in candidates.into_iter().zip(looks) {
                let us = match look {
                    Ok(once) if once > SLOW * fastest => Ok(once),
                    Ok(_) => time_calls(ctx.gpu, ctx.stream, graphs, run),
                    Err(e) => Err(e),
                };
                match (algo, us) {
                    (None, Ok(us)) => m.own_us = us,
                    (None, Err(e)) => {
                        m.note = format!("timing the per-step route failed ({e}): per-step chosen");
                        return Ok(());
                    }
                    (Some(algo), Ok(us)) => m.cudnn_us[algo.index()] = us,
                    (Some(algo), Err(e)) => {
                        let sep = if m.note.is_empty() { "" } else { "; " };
                        let _ = write!(m.note, "{sep}cuDNN {} failed: {e}", algo.name());
                    }
                }
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

/// Both routes timed, cuDNN's per algorithm in [`Algo::ALL`]'s order (µs per call; NaN where
/// not timed or where it failed).
#[derive(Clone)]
struct Measured {
    own_us: f32,
    cudnn_us: [f32; ALGOS],
    note: String,
}

/// Every measurement made in this process: the first one of a key is what every cache uses.
static MEASURED: FirstMeasured<MeasureKey, Measured> = FirstMeasured::new();

fn note(notes: &mut String, training: bool, what: &str) {
    add_note(notes, if training { "training" } else { "inference" }, what);
}
