//! The zoo's networks on flatnn's side (one entry per model, named as in
//! `benches/peers/zoo_models.py`), and flatnn's measurements.

use crate::figures::{Figure, Place, Task, FLATNN};
use crate::timing::{self, failure, Measured, Series, Skip, Timing};
use crate::Result;
use ::flatnn::models;
use ::flatnn::prelude::*;
use ::flatnn::testutil::Rng;

pub struct ZooModel {
    pub name: &'static str,
    pub chain: fn() -> Chain,
    pub loss: Loss,
}

/// The zoo. A new model: a function in `flatnn::models`, a line here, a line in `zoo_models.py`.
pub const ZOO: [ZooModel; 10] = [
    ZooModel { name: "mlp", chain: models::mlp, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "lenet5", chain: models::lenet5, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "simplenn", chain: models::simplenns_mlp, loss: Loss::Mse },
    ZooModel { name: "autoencoder", chain: models::autoencoder, loss: Loss::Mse },
    ZooModel { name: "gelu_mlp", chain: models::gelu_mlp, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "vgg_small", chain: models::vgg_small, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "ts_conv1d", chain: models::ts_conv1d, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "resnet_small", chain: models::resnet_small, loss: Loss::LogitCrossEntropy },
    ZooModel { name: "gru_seq", chain: models::gru_seq, loss: Loss::Mse },
    ZooModel { name: "lstm_seq", chain: models::lstm_seq, loss: Loss::LogitCrossEntropy },
];

/// Seed of the weights (He normal) and of the data.
const SEED: u64 = 11;

/// The model on `place` (`gpu`: CUDA device 0, where `place` is a GPU), initialised.
pub fn build(zoo: &ZooModel, place: Place, gpu: Option<Device>) -> Result<Model> {
    let model = (zoo.chain)().build()?.init(Init::HeNormal, SEED);
    match (place, gpu) {
        (Place::Cpu1, _) => model.with_threads(1),
        (Place::Cpu, _) => Ok(model),
        (Place::Gpu | Place::GpuTf32 | Place::GpuNd | Place::GpuTf32Nd, Some(device)) => {
            let tf32 = matches!(place, Place::GpuTf32 | Place::GpuTf32Nd);
            let options = GpuOptions { tf32, deterministic: !place.nondeterministic(), ..GpuOptions::default() };
            model.with_gpu_options(options)?.to(&device)
        }
        (_, None) => Err(Error::Config("no CUDA device".into())),
    }
}

/// A batch of inputs (uniform in [−1, 1)), and labels (uniform in 0..classes) or MSE targets
/// (uniform in [−1, 1)), as the peers draw theirs.
pub fn data(model: &Model, loss: Loss, batch: usize, seed: u64) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let inputs = rng.uniform(batch * model.input_shape().len());
    let outputs = model.output_shape().len();
    if loss.takes_labels() {
        (inputs, (0..batch).map(|_| rng.below(outputs) as u32).collect(), Vec::new())
    } else {
        (inputs, Vec::new(), rng.uniform(batch * outputs))
    }
}

/// A cache for `batch` filled with a batch for `loss`, and the host inputs.
fn filled_cache(model: &Model, loss: Loss, batch: usize) -> Result<(Cache, Vec<f32>)> {
    let mut cache = model.preallocate(batch)?;
    let (inputs, labels, targets) = data(model, loss, batch, SEED);
    cache.set_inputs(&inputs)?;
    if loss.takes_labels() {
        cache.set_labels(&labels)?
    } else {
        cache.set_targets(&targets)?
    }
    Ok((cache, inputs))
}

/// One task at one batch, in a cache already filled.
fn measure(model: &mut Model, cache: &mut Cache, inputs: &[f32], loss: Loss, task: Task, timing: &Timing) -> Result<Measured, Skip> {
    match task {
        Task::Train => {
            let mut grads = model.preallocate_grads(cache.capacity())?;
            let mut opt = Optimizer::new(model, Optim::adam(1e-3))?;
            timing::repeated(timing, |end| {
                opt.train_step(model, &mut grads, cache, loss)?;
                if end {
                    // reading the loss waits for a GPU's queued steps (and costs nothing on the CPU)
                    grads.last_loss()?;
                }
                Ok(())
            })
        }
        Task::Infer => timing::repeated(timing, |_| model.forward(cache).map(|_| ())),
        Task::Latency => timing::single(timing, |_| {
            cache.set_inputs(inputs)?;
            model.forward(cache).map(|_| ())
        }),
    }
}

/// flatnn's side of one model on one place: the model, built once, and a series per task.
pub struct Runner {
    zoo: &'static ZooModel,
    place: Place,
    model: std::result::Result<Model, String>,
    series: Vec<(Task, Series)>,
    /// Each batch's `Cache::routes` after its tasks ran (what every layer ran on, and why).
    pub routes: String,
}

impl Runner {
    pub fn new(zoo: &'static ZooModel, place: Place, gpu: Option<Device>) -> Runner {
        let model = build(zoo, place, gpu).map_err(|e| failure(&e));
        Runner { zoo, place, model, series: Task::ALL.iter().map(|&t| (t, Series::default())).collect(), routes: String::new() }
    }

    fn figure(&self, task: Task, batch: usize, result: std::result::Result<Measured, String>) -> Figure {
        let (seconds, p99, calls, note) = match result {
            Ok(m) => (Some(m.seconds), m.p99, m.calls, None),
            Err(note) => (None, None, 0, Some(note)),
        };
        Figure { model: self.zoo.name.into(), place: self.place, task, batch, runner: FLATNN.into(), seconds, p99, calls, note }
    }

    /// flatnn's figures for `tasks` at `batch` (called with batches ascending).
    pub fn batch(&mut self, batch: usize, tasks: &[Task], timing: &Timing) -> Vec<Figure> {
        let (zoo, place) = (self.zoo, self.place);
        let model = match &mut self.model {
            Ok(model) => model,
            Err(why) => {
                let why = why.clone();
                return tasks.iter().map(|&t| self.figure(t, batch, Err(why.clone()))).collect();
            }
        };
        let (mut cache, inputs) = match filled_cache(model, zoo.loss, batch) {
            Ok(filled) => filled,
            Err(e) => return tasks.iter().map(|&t| self.figure(t, batch, Err(failure(&e)))).collect(),
        };
        let mut results = Vec::new();
        for &task in tasks {
            let series = &mut self.series.iter_mut().find(|s| s.0 == task).expect("a series per task").1;
            let result = match series.skip(batch, timing) {
                Some(why) => Err(why),
                None => series.record(batch, measure(model, &mut cache, &inputs, zoo.loss, task, timing)),
            };
            results.push((task, result));
        }
        let tasks: Vec<String> = tasks.iter().map(|t| t.to_string()).collect();
        self.routes += &format!("== {} {place} batch {batch} ({})\n{}\n", zoo.name, tasks.join(", "), cache.routes());
        let figures: Vec<Figure> = results.into_iter().map(|(task, result)| self.figure(task, batch, result)).collect();
        for f in &figures {
            let shown = f.seconds.map_or_else(|| f.note.clone().unwrap_or_default(), crate::figures::fmt_seconds);
            eprintln!("flatnn: {} {place} {} {batch}: {shown}", zoo.name, f.task);
        }
        figures
    }
}
