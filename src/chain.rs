//! The builder a user writes (`Chain::new(..).dense(..).build()`), and the shapes of samples.
//! `build` compiles the chain to a [`Plan`] (src/plan.rs): every layer's shapes, tensors and
//! buffer regions, computed once.
//!
//! # Shapes
//!
//! A sample is laid out as PyTorch lays out one sample of a batch-first tensor: a vector of
//! features; an image (C, H, W), channel-major; a sequence (steps, features), step-major, as
//! PyTorch's recurrent layers take it with `batch_first=True` (`x[n, t, f]`).
//!
//! A 1-D convolution's input, PyTorch's `(N, C, L)`, is channel-major: the transpose of a
//! sequence. It has a shape of its own, `Signal { channels, length }`, rather than be read
//! as an `Image { channels, height: 1, width: length }`, so that summaries and errors name it as
//! the user wrote it (`signal(1×256)`, not `image(1×1×256)`), 2-D layers refuse it, and a model
//! that feeds a convolution over time into a recurrent layer states the transpose between them
//! (as `x.transpose(1, 2)` does in PyTorch) instead of reading one layout as the other. The 1-D
//! convolution runs as the 2-D one over a height of 1 (a `conv::Geometry` with kernel (1, k)):
//! the shape is what the user sees and the plan checks, the memory is the same.

use crate::error::Result;
pub use crate::layers::conv::ConvOptions;
pub use crate::layers::Layer;
use crate::model::Model;
pub(crate) use crate::plan::{batch_len, fits};
pub use crate::plan::{Fill, Plan, Step, Tensor};

/// The shape of one sample, batch-first as PyTorch lays it out: images channel-major (C, H, W),
/// sequences step-major (steps, features), signals channel-major (C, L).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// A vector of `n` features.
    Vector(usize),
    /// An image of `channels × height × width`.
    Image { channels: usize, height: usize, width: usize },
    /// A sequence of `steps` time steps of `features` values each, step-major.
    Sequence { steps: usize, features: usize },
    /// A signal of `channels` rows of `length` values each, channel-major: what a 1-D
    /// convolution takes (PyTorch's `(N, C, L)`).
    Signal { channels: usize, length: usize },
}

impl Shape {
    /// A vector input of `n` features.
    pub fn vector(n: usize) -> Shape {
        Shape::Vector(n)
    }

    /// An image input of `channels` planes of `height × width` pixels, given in the order of
    /// its data layout (C, H, W), as PyTorch's `(N, C, H, W)` tensors lay out each sample.
    pub fn image(channels: usize, height: usize, width: usize) -> Shape {
        Shape::Image { channels, height, width }
    }

    /// A sequence input of `steps` time steps of `features` values each, step-major, as
    /// PyTorch's recurrent layers take one sample with `batch_first=True`.
    pub fn sequence(steps: usize, features: usize) -> Shape {
        Shape::Sequence { steps, features }
    }

    /// A signal input of `channels` rows of `length` values each, channel-major, as PyTorch's
    /// `Conv1d` takes one sample `(C, L)`.
    pub fn signal(channels: usize, length: usize) -> Shape {
        Shape::Signal { channels, length }
    }

    /// Number of f32 values per sample, or `usize::MAX` where that product does not fit in
    /// `usize` (a shape [`Plan::new`] refuses: every shape of a plan has its exact length).
    pub fn len(self) -> usize {
        match self {
            Shape::Vector(n) => n,
            // min(C·H·W, usize::MAX): once saturated, a zero factor still gives 0
            Shape::Image { channels, height, width } => channels.saturating_mul(height).saturating_mul(width),
            Shape::Sequence { steps, features } => steps.saturating_mul(features),
            Shape::Signal { channels, length } => channels.saturating_mul(length),
        }
    }

    /// True when a sample has no values.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Vector(n) => write!(f, "vector({n})"),
            Shape::Image { channels, height, width } => write!(f, "image({channels}×{height}×{width})"),
            Shape::Sequence { steps, features } => write!(f, "sequence({steps}×{features})"),
            Shape::Signal { channels, length } => write!(f, "signal({channels}×{length})"),
        }
    }
}

/// The model's input; an alias of [`Shape`] for the builder's vocabulary.
pub type Input = Shape;

/// A list of layers from an input shape; [`Chain::build`] checks it and makes a [`Model`].
#[derive(Clone, Debug)]
pub struct Chain {
    input: Shape,
    layers: Vec<Layer>,
}

impl Chain {
    /// A chain starting from `input`.
    pub fn new(input: Shape) -> Chain {
        Chain { input, layers: Vec::new() }
    }

    /// Appends a layer.
    pub fn layer(mut self, layer: Layer) -> Chain {
        self.layers.push(layer);
        self
    }

    /// Infers and checks every shape and lays out the buffers. Parameters start at zero: call
    /// [`Model::init`]. A mismatch is an [`Error::Shape`](crate::Error::Shape) naming the layer index and the shapes.
    pub fn build(self) -> Result<Model> {
        Model::from_plan(Plan::new(self.input, &self.layers)?)
    }
}
