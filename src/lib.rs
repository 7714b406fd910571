//! flatnn: a neural-network engine for programs where latency and predictability matter.
//!
//! A model's shapes are fixed when it is built; every buffer it will touch (parameters,
//! gradients, activations, optimiser state, scratch) is allocated once, and a training step or
//! an inference call then allocates nothing.
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

pub mod activation;
pub mod cache;
pub mod chain;
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
pub mod serve;
#[doc(hidden)]
pub mod testutil;

pub use activation::Activation::{self, Gelu, Identity, LeakyRelu, Relu, Sigmoid, Tanh};
pub use cache::{Cache, Grads};
pub use chain::{Chain, ConvOptions, Input, Layer, Plan, Shape};
pub use dev::GpuOptions;
pub use device::{cpu, device, gpu, gpu_or_cpu, Device, ToDevice};
pub use error::{Error, Result};
pub use init::Init;
pub use loss::Loss;
pub use model::Model;
pub use optim::{Optim, Optimizer};
pub use serve::Server;

/// Everything a training program needs, in one import.
pub mod prelude {
    pub use crate::{
        Activation, Cache, Chain, ConvOptions, Device, Error, Gelu, GpuOptions, Grads, Identity, Init, Input, LeakyRelu, Loss, Model,
        Optim, Optimizer, Relu, Server, Shape, Sigmoid, Tanh, ToDevice,
    };
}
