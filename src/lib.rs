//! flatnn: a neural-network engine for programs where latency and predictability matter.
//!
//! A model's shapes are fixed when it is built; every buffer it will touch (parameters,
//! gradients, activations, optimiser state, scratch) is allocated once, and a training step or
//! an inference call then allocates nothing, on the CPU or on an NVIDIA GPU.
//!
//! ```
//! use flatnn::prelude::*;
//!
//! let model = Chain::new(Input::vector(4)).dense(8, Relu).dense(3, Identity).build()?;
//! let mut model = model.init(Init::GlorotNormal, 42).with_threads(1)?;
//! let mut fwd = model.preallocate(2)?;
//! let mut bwd = model.preallocate_grads(2)?;
//! let mut opt = Optimizer::new(&model, Optim::adam(1e-2))?;
//! fwd.set_inputs(&[0.1, 0.2, 0.3, 0.4, 1.0, 0.0, -1.0, 0.5])?;
//! fwd.set_labels(&[2, 0])?;
//! model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
//! let first = bwd.last_loss()?;
//! for _ in 0..50 {
//!     // backprop, then the update (on a GPU, one graph)
//!     opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
//! }
//! model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
//! assert!(bwd.last_loss()? < first);
//! # Ok::<(), flatnn::Error>(())
//! ```
//!
//! # What a model is made of
//!
//! A [`Chain`] starts from an [`Input`] shape and adds layers; [`Chain::build`] infers and
//! checks every shape once (a mismatch is an [`Error::Shape`] naming the layer and the shapes)
//! and gives a [`Model`]. Samples are laid out as PyTorch lays them out, batch first:
//! [`Input::vector`]`(n)`, [`Input::image`]`(channels, height, width)`, whose arguments come
//! in the order of the data's (C, H, W) layout, or [`Input::signal`]`(channels, length)`.
//!
//! - **Layers**: [`Chain::dense`] (y = act(W·x + b)), [`Chain::conv`] / [`Chain::conv_with`]
//!   (2-D cross-correlation, stride and zero padding in [`ConvOptions`]), [`Chain::max_pool`] /
//!   [`Chain::max_pool_with`], [`Chain::avg_pool`] / [`Chain::avg_pool_with`],
//!   [`Chain::global_avg_pool`] (each channel's mean, as a vector), [`Chain::conv1d`] /
//!   [`Chain::conv1d_with`] (over a signal, [`Input::signal`]; stride, zero padding and dilation in
//!   [`Conv1dOptions`]), [`Chain::max_pool1d`] / [`Chain::max_pool1d_with`] ([`Pool1dOptions`]),
//!   [`Chain::flatten`] (image, sequence or signal to vector), [`Chain::softmax`] (probabilities
//!   out, as a last layer), [`Chain::batch_norm`] /
//!   [`Chain::batch_norm_with`], [`Chain::layer_norm`], [`Chain::dropout`], and residual blocks
//!   of any of them, [`Chain::residual`] / [`Chain::residual_with`] (training passes run batch
//!   norm and dropout as PyTorch's `train()`, inference as `eval()`: see [`Model`]).
//! - **Activations** ([`Activation`]), per dense or conv layer: [`Identity`], [`Relu`],
//!   [`LeakyRelu`], [`Tanh`], [`Sigmoid`], [`Gelu`] (erf), [`Silu`], [`Elu`], [`Softplus`].
//! - **Losses** ([`Loss`]): [`Loss::LogitCrossEntropy`] (softmax cross-entropy on logits with
//!   integer class labels, [`Cache::set_labels`]), a mean over the batch; [`Loss::Mse`],
//!   [`Loss::BceWithLogits`], [`Loss::L1`] and [`Loss::SmoothL1`] (real-valued targets,
//!   [`Cache::set_targets`]), means over the batch and the outputs. [`Model::predict`] gives
//!   each sample's class, [`Model::accuracy`] a batch's score.
//! - **Optimisers** ([`Optim`], bound to a model by [`Optimizer`]): SGD (momentum, Nesterov),
//!   Adam, AdamW, RMSProp, with PyTorch's update rules and `weight_decay`
//!   ([`Optim::with_weight_decay`]); gradient clipping by global norm or by value ([`Clip`],
//!   [`Optimizer::set_clip`]; [`Optimizer::grad_norm`] reads the norm); learning-rate
//!   schedules ([`Schedule`]: step, exponential, cosine with warm-up, one-cycle;
//!   [`Optimizer::set_schedule`]). All of it is one pass over the flat parameters per step.
//! - **Initialisers** ([`Init`]): Glorot and He (normal or uniform), LeCun normal, zeros, from
//!   a seed.
//!
//! `println!("{model}")` prints a summary: each layer with its output shape, parameters and
//! activation, the totals and the device.
//!
//! # The life of a model
//!
//! ```no_run
//! use flatnn::prelude::*;
//! # let (images, labels) = (vec![0.0f32; 128 * 784], vec![0u32; 128]);
//!
//! // build: the plan (shapes, parameter layout), then the parameters
//! let model = flatnn::models::mlp().build()?.init(Init::HeNormal, 1);
//! // to a device: the best one here (CUDA if it works, else the CPU; FLATNN_DEVICE overrides)
//! let device = flatnn::device();
//! let mut model = model.to(&device)?;
//! // preallocate: everything a step needs, for batches of up to 128
//! let mut fwd = model.preallocate(128)?;                 // inputs, targets, activations
//! let mut bwd = model.preallocate_grads(128)?;           // gradients, the parameters' layout
//! let mut opt = Optimizer::new(&model, Optim::adam(1e-3))?;
//! opt.set_schedule(Schedule::cosine(100, 10_000))?;      // warm-up, then a cosine to zero
//! opt.set_clip(Clip::Norm(1.0))?;
//! // step: forward, loss, backward and update (on a GPU one CUDA graph, queued)
//! fwd.set_inputs(&images)?;
//! fwd.set_labels(&labels)?;
//! opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
//! let loss = bwd.last_loss()?;                           // the loss stays on the device until asked
//! let val = model.loss(&mut fwd, Loss::LogitCrossEntropy)?; // inference mode, no backward pass
//! let scores = model.forward(&mut fwd)?;                 // inference
//! // save: PyTorch's names (a model file), or the model with its optimiser (a checkpoint)
//! model.save("mlp.safetensors")?;
//! model.save_checkpoint(&opt, "run.safetensors")?;       // model.load_checkpoint(&mut opt, ..) resumes
//! let same = Model::load("mlp.safetensors")?;            // loads on a machine with no GPU
//! # Ok::<(), flatnn::Error>(())
//! ```
//!
//! A batch smaller than the capacity runs in the same buffers; a larger one is an
//! [`Error::Capacity`], never a reallocation. Bad input is an [`Error`] saying what to change.
//! [`data`] reads data sets (MNIST's IDX files; your own vectors with class labels or
//! real-valued targets, [`data::Dataset`]) and loads shuffled batches straight into a cache:
//! [`data::Loader`] on the CPU, [`data::DeviceDataset`] (the data in device memory, batches
//! gathered there) or [`data::StreamingLoader`] (copies overlapping the steps) on a GPU.
//!
//! # Devices
//!
//! A [`Device`] is `Device::Cpu` or `Device::Cuda(n)`. On the CPU a model runs on its own pool
//! of threads (one a physical core, or [`Model::with_threads`], or `FLATNN_THREADS`). On a GPU
//! its parameters, caches, gradients and optimiser state live in device memory; it owns a
//! stream, its steps are queued there and the host waits only where a value comes back.
//! [`device()`], [`gpu_or_cpu()`], [`gpu()`] and [`cpu()`] pick or move; [`ToDevice`] moves a
//! model, its optimiser and caches (and tuples, `Vec`s and `Option`s of them) together;
//! [`GpuOptions`] turns CUDA graphs, TF32 and cuDNN's non-deterministic algorithms on or off.
//! CUDA is loaded at run time: the crate builds, and runs on the CPU, with no CUDA installed. Several GPUs train one model through
//! [`DataParallel`] (a replica a GPU, the gradients averaged by NCCL inside each step's graph;
//! one process for all GPUs, or one process a GPU on one host or several).
//!
//! # Serving
//!
//! [`Model::serve`] gives a [`Server`] for a program that makes many small inference calls:
//! on a GPU, a small dense model is answered by a kernel that stays resident between calls; any
//! other model by [`Model::forward`] on a cache of its own.
//!
//! # Threads
//!
//! [`Model`] is `Send + Sync`: threads may share one model (`&Model`), each with its own
//! [`Cache`] for `forward` or `loss` (a CPU model's thread pool then takes their calls in
//! turn). Training needs `&mut Model`, so one thread trains a model at a time; on a GPU, models
//! trained from several threads run on their own streams and overlap.
//!
//! # Examples
//!
//! In `examples/` (`cargo run --release --example NAME`; each file's first lines give its
//! options): `mnist` (trains the MLP, a CNN or LeNet-5 on MNIST, shipped with the crate), `latency`
//! (batch-1 inference latency, through `forward` or a [`Server`]), `multi_model` (several
//! models trained at once on one GPU), `step_time` (one kind of call at one batch size, for
//! profilers) and `launch_floor` (what the GPU driver alone costs here).

pub mod activation;
pub mod cache;
pub mod chain;
pub(crate) mod checkpoint;
pub(crate) mod clip;
pub(crate) mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_off.rs"]
pub(crate) mod dev;
#[cfg(feature = "cuda")]
pub(crate) use cuda::state as dev;
pub mod device;
pub mod error;
pub(crate) mod float;
pub mod gemm;
pub mod init;
pub mod io;
pub(crate) mod layers;
pub mod loss;
pub mod model;
pub mod models;
pub mod optim;
#[cfg(feature = "cuda")]
pub mod parallel;
pub(crate) mod plan;
pub(crate) mod predict;
pub(crate) mod schedule;
pub mod serve;
pub mod stream;
pub(crate) mod summary;
#[doc(hidden)]
pub mod testutil;

pub use activation::Activation::{self, Elu, Gelu, Identity, LeakyRelu, Relu, Sigmoid, Silu, Softplus, Tanh};
pub use cache::{Cache, Grads};
pub use chain::{Chain, ConvOptions, Input, Layer, Plan, Shape};
pub use dev::{Convs, GpuOptions, RnnAlgos, Tuning};
pub use device::{cpu, device, gpu, gpu_or_cpu, Device, ToDevice};
pub use error::{Error, Result};
pub use init::Init;
pub use layers::{
    avgpool::AvgPool,
    conv::Conv,
    conv1d::{Conv1d, Conv1dOptions},
    dense::Dense,
    flatten::Flatten,
    globalpool::GlobalAvgPool,
    gru::Gru,
    lstm::Lstm,
    pool::MaxPool,
    pool1d::{MaxPool1d, Pool1dOptions},
    recurrent::RnnOutput,
    softmax::Softmax,
};
pub use layers::{batch_norm::BatchNorm, dropout::Dropout, layer_norm::LayerNorm, residual::Add, residual::Fork};
pub use loss::Loss;
pub use model::Model;
pub use optim::{Clip, Optim, Optimizer};
#[cfg(feature = "cuda")]
pub use parallel::{DataParallel, Group};
pub use schedule::Schedule;
pub use serve::Server;
pub use stream::Stream;

/// Everything a training program needs, in one import.
pub mod prelude {
    pub use crate::{
        Activation, Cache, Chain, Clip, Conv1dOptions, ConvOptions, Device, Elu, Error, Gelu, GpuOptions, Grads, Identity, Init, Input,
        LeakyRelu, Loss, Model, Optim, Optimizer, Pool1dOptions, Relu, RnnOutput, Schedule, Server, Shape, Sigmoid, Silu, Softplus, Stream,
        Tanh, ToDevice,
    };
    #[cfg(feature = "cuda")]
    pub use crate::{DataParallel, Group};
}
