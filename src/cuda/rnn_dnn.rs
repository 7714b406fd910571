//! GRU and LSTM layers by the route measured fastest for each layer, batch size, arithmetic and
//! mode: flatnn's per-step route (`recurrent.rs`), its fused route (`rnn_fused.rs`, in the
//! variants that fit) or cuDNN's RNN kernels where cuDNN loads; the per-step route where nothing
//! was measured, so a machine without cuDNN (or whose cuDNN refuses a layer) still runs every
//! model.
//!
//! `FLATNN_CUDNN` (`dnn.rs`) decides here too: `0` flatnn's routes only (no cuDNN handle is
//! made), `1` cuDNN wherever it sets the layer up and runs it, `auto` (default) the fastest.
//! `FLATNN_RNN_ALGO` may narrow the candidates (`options.rs`: cuDNN's algorithms, `fused`,
//! `per_step`).
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
//! that batch its descriptors and where
//! cuDNN keeps each of its tensors (the copies between flatnn's flat parameters and cuDNN's
//! weight space, merged where both sides are contiguous). Then each layer's route for the mode is
//! measured (`rnn_dnn/measure.rs`, which also writes the report). An algorithm cuDNN refuses, at
//! the descriptors, the sizes or a call, is not a candidate (the report says why).
//!
//! What the cuDNN route queues in a step is `rnn_route.rs`'s.

mod measure;

use super::buffer::DevBuf;
use super::context::Gpu;
use super::cudnn::Handle;
use super::dnn::StepRun;
use super::options::{Convs, RnnAlgos, Tuning};
use super::rnn_cudnn::{rnn_functions_present, Algo, Descs};
use super::rnn_fused::{Fused, VARIANTS};
use super::rnn_route::{runs, LayerBufs, LayerTrain, Route, Run, Scratch};
use super::timing::add_note;
use super::{device_wide, guarded_result};
use crate::chain::{Plan, Step};
use crate::error::Result;
use crate::layers::recurrent::{dims, Cell, Dims, RnnOutput};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// (batch, TF32) setups kept: as `dnn.rs`'s.
const SLOTS: usize = 2 * super::graph::Graphs::SLOTS;

/// The recurrent layers of a cache: their routes, cuDNN's where it is used, and what to report.
pub(crate) struct RnnDnn {
    /// None where the plan has no recurrent layers.
    inner: Option<Inner>,
    /// Why cuDNN is not used, where the plan has recurrent layers and it is not.
    note: String,
}

/// The route a recurrent layer's pass takes, where it is not the per-step one.
pub(super) enum RnnRoute<'a> {
    Cudnn(Route<'a>),
    Fused(Fused),
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
    /// None where cuDNN is not used (`RnnDnn::note` says why).
    handle: Option<Handle>,
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
    /// The algorithm cuDNN runs the mode with, or the fused variant; neither: the per-step route.
    cudnn: Option<Algo>,
    fused: Option<Fused>,
    /// Per call, in a graph (or eager where the model's graphs are off); NaN where not measured.
    own_us: f32,
    /// Per algorithm, in [`Algo::ALL`]'s order.
    cudnn_us: [f32; ALGOS],
    /// Per fused variant, in [`Fused::all`]'s order.
    fused_us: [f32; VARIANTS],
}

const ALGOS: usize = Algo::ALL.len();

impl Default for Choice {
    fn default() -> Self {
        Choice { decided: false, cudnn: None, fused: None, own_us: f32::NAN, cudnn_us: [f32::NAN; ALGOS], fused_us: [f32::NAN; VARIANTS] }
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
    /// `FLATNN_CUDNN` or fails to give a handle, flatnn's routes are measured alone and the
    /// report says why.
    pub fn new(gpu: &Arc<Gpu>, stream: &Arc<CudaStream>, plan: &Plan, tuning: Tuning) -> RnnDnn {
        let convs = tuning.convs;
        let layers: Vec<(usize, Dims)> = plan.steps.iter().enumerate().filter_map(|(i, s)| Some((i, dims(s)?))).collect();
        if layers.is_empty() {
            return RnnDnn { inner: None, note: String::new() };
        }
        let handle = if convs == Convs::Own {
            Err(format!("FLATNN_CUDNN={}", Convs::Own.setting()))
        } else if !rnn_functions_present() {
            Err("no cuDNN 9 library with the RNN functions found".into())
        } else {
            guarded_result(|| {
                gpu.bind()?;
                Handle::new(stream)
            })
            .map_err(|e| format!("setting it up failed: {e}"))
        };
        let (handle, note) = match handle {
            Ok(handle) => (Some(handle), String::new()),
            Err(why) => (None, why),
        };
        let inner = Inner {
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
        };
        RnnDnn { inner: Some(inner), note }
    }

    /// Moves the handle (where there is one) to `stream` (after the work queued on its old one);
    /// a no-op when it is there.
    pub fn rebind(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let Some(c) = &mut self.inner else { return Ok(()) };
        match &c.handle {
            Some(handle) => handle.move_to(&c.gpu, &mut c.stream, stream),
            None => {
                c.stream = Arc::clone(stream);
                Ok(())
            }
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

    /// Step `index`'s route for a pass on `batch` samples in the mode, where cuDNN's or the
    /// fused one was chosen for the batch prepared last; None where the per-step route runs it.
    pub(super) fn route(&self, index: usize, batch: usize, training: bool) -> Option<RnnRoute<'_>> {
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
}

impl Inner {
    /// The cuDNN handle, or why there is none (for the report).
    fn handle(&self) -> std::result::Result<&Handle, String> {
        self.handle.as_ref().ok_or_else(|| "cuDNN not used".to_string())
    }
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
        self.handle()?;
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
        let handle = self.handle()?;
        let descs = Descs::new(handle, d, batch, tf32, algo)?;
        let space = descs.weight_space(handle).map_err(|e| e.to_string())?;
        let (work, _) = descs.temp_spaces(handle, false).map_err(|e| e.to_string())?;
        let (train_work, reserve) = descs.temp_spaces(handle, true).map_err(|e| e.to_string())?;
        Ok([space, work.max(train_work), reserve])
    }

    /// The training buffers, at the first training step (see the module docs).
    fn allocate_training(&mut self) -> Result<()> {
        let Some(bufs) = &mut self.bufs else { return Ok(()) };
        if bufs.train.is_some() {
            return Ok(());
        }
        if bufs.layers.iter().all(|layer| layer.is_err()) {
            bufs.train = Some(Err("cuDNN sets up no layer".into()));
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
        // (as in `layer_bufs`: cuDNN may load modules here; nothing here allocates device
        // memory otherwise)
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
                // (without a handle the report's first line says why)
                if self.handle.is_some() {
                    setup.note = why.clone();
                }
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
        let handle = self.handle()?;
        let descs = Descs::new(handle, d, batch, tf32, algo)?;
        let space = descs.weight_space(handle).map_err(|e| e.to_string())?;
        let (work, _) = descs.temp_spaces(handle, false).map_err(|e| e.to_string())?;
        let (train_work, reserve) = descs.temp_spaces(handle, true).map_err(|e| e.to_string())?;
        if space != layer.weights.len() || work.max(train_work) > bufs.work.len() || reserve > layer.reserve_len {
            return Err(format!("at batch {batch} cuDNN asks for spaces the buffers made for the capacity {} lack", bufs.capacity));
        }
        let parts = descs.weight_parts(handle, d, layer.weights.ptr(), space).map_err(|e| e.to_string())?;
        Ok(Candidate { runs: runs(step, d, &parts), descs })
    }

    /// Layer `i`'s route in `setup` for the mode, where cuDNN's (set up) or the fused one is
    /// chosen.
    fn route<'a>(&'a self, setup: &'a Setup, i: usize, training: bool) -> Option<RnnRoute<'a>> {
        let layer = &setup.layers[i];
        let choice = layer.choices[training as usize];
        if !choice.decided {
            return None;
        }
        if let Some(v) = choice.fused {
            return Some(RnnRoute::Fused(v));
        }
        self.route_of(layer, i, choice.cudnn?, training).map(RnnRoute::Cudnn)
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
        Some(Route {
            handle: self.handle.as_ref()?,
            descs: &candidate.descs,
            runs: &candidate.runs,
            bufs: layer_bufs,
            work: &bufs.work,
            train,
        })
    }
}
