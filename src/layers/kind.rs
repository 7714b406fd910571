//! What a layer kind provides to the engine ([`LayerKind`], implemented by the spec struct in its
//! room), and the registry macro that turns the list of kinds in `layers/mod.rs` into the public
//! [`Layer`] enum and one exhaustive `match` per operation.

use super::{BackPass, Pass};
use crate::activation::Activation;
use crate::chain::{Fill, Shape, Step};
use crate::error::Result;
use crate::io::Words;
use std::fmt;

/// Whether a pass trains (batch statistics, dropout masks) or infers (running statistics, no
/// dropout), as PyTorch's `train()` / `eval()`. `backprop` and `train_step` run `Train`;
/// `forward`, `loss` and a `Server` run `Infer`. Only a training pass defines an activated
/// step's z (its backward reads it); an inference pass may leave z as it finds it or hold the
/// product without the bias there (the dense layers on both devices, the convolutions on the
/// GPU), since nothing after it reads z.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Train,
    Infer,
}

/// The model's buffers as a pass has them: read in inference; in training written too (batch
/// norm's running statistics move in every training pass, as in PyTorch).
pub(crate) enum Buffers<'a> {
    Read(&'a [f32]),
    Write(&'a mut [f32]),
}

impl Buffers<'_> {
    /// The values, for reading.
    pub fn get(&self) -> &[f32] {
        match self {
            Buffers::Read(values) => values,
            Buffers::Write(values) => values,
        }
    }

    /// The values, for writing: only a training pass has them.
    pub fn get_mut(&mut self) -> &mut [f32] {
        match self {
            Buffers::Read(_) => unreachable!("an inference pass writes no buffer"),
            Buffers::Write(values) => values,
        }
    }
}

/// One tensor a layer declares (a parameter or a buffer): its name in the layer's PyTorch module
/// (`weight`, `bias`, `running_mean`, `weight_ih_l0`), its shape there (the product is its
/// length, checked by the plan) and how it starts.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct TensorSpec {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub fill: Fill,
}

/// What a layer keeps from its forward pass for its backward pass beyond its z and y (see the
/// plan's module docs).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Kept {
    /// Per-sample lengths of regions of the activation buffer (a GRU's gates at every step).
    pub regions: Vec<usize>,
    /// Values per batch, whatever its size (batch norm's mean and 1/σ of each channel).
    pub saved: usize,
}

/// What a layer kind is to the engine. Each room (`layers/<kind>.rs`) implements it on its spec
/// struct; the registry's enum [`Layer`](super::Layer) dispatches to it, one exhaustive `match` per method.
///
/// Buffers of a pass are the plan's (see `Plan`): a step reads its input region and writes its
/// output region (and its pre-activation z, when it has an activation), at the plan's offsets
/// for the pass's capacity; its parameters are the ranges [`LayerKind::params`] declared, in
/// that order, in the flat parameter buffer.
pub(crate) trait LayerKind: Copy + fmt::Debug + PartialEq {
    /// The word that starts its entry in a model file's architecture (`dense`, `conv`, …).
    const WORD: &'static str;

    /// The activation applied to its output, where it takes one.
    fn activation(&self) -> Option<Activation> {
        None
    }

    /// True when its output is its input seen as another shape (flatten): no region of its own
    /// and nothing to run.
    fn is_view(&self) -> bool {
        false
    }

    /// How many modules of PyTorch's `nn.Sequential` it stands for, its activation apart (global
    /// average pooling: `AdaptiveAvgPool2d(1)` then `Flatten`); its tensors are named after the
    /// first ([`Step::module`](crate::chain::Step::module)).
    fn modules(&self) -> usize {
        1
    }

    /// The shape of one output sample for one `input` sample, or why the layer does not take
    /// that input (the plan adds which layer and which input). A size the room derives beyond
    /// the output's (a convolution's lowered sample) is checked here, against
    /// `plan::MAX_VALUES`; the output's own size, and the tensors', the plan checks.
    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String>;

    /// Its parameter tensors on `input`, in the order of their ranges in the flat parameters.
    fn params(&self, _input: Shape, _output: Shape) -> Vec<TensorSpec> {
        Vec::new()
    }

    /// Its buffer tensors on `input`: values that are not trained but belong to the model
    /// (running statistics), each starting at a constant, in the order of their ranges in the
    /// model's flat buffers.
    fn buffers(&self, _input: Shape, _output: Shape) -> Vec<TensorSpec> {
        Vec::new()
    }

    /// What it keeps from its forward pass for its backward pass beyond its z and y; None where
    /// a size overflows.
    fn kept(&self, _input: Shape, _output: Shape) -> Option<Kept> {
        Some(Kept { regions: Vec::new(), saved: 0 })
    }

    /// Its architecture entry in a model file: [`LayerKind::WORD`] and the numbers that make it.
    fn describe(&self) -> String;

    /// The layer from the words of its entry (the first being [`LayerKind::WORD`]).
    fn parse(words: &Words) -> Result<Self>;

    /// What it is, with the sizes that make it, for the summary: `Dense(784 → 128)`.
    fn summary(&self, input: Shape) -> String;

    /// The fast CPU forward of `step` over the pass's batch.
    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode);

    /// The fast CPU backward of `step`: its parameters' gradients (overwritten) and, where the
    /// pass needs it ([`BackPass::needs_dx`]), the gradient of its input (overwritten), from the
    /// gradient of its output.
    fn backward(&self, step: &Step, pass: &mut BackPass);

    /// The plain-loop forward (the spec), as [`LayerKind::forward`].
    #[cfg(test)]
    fn spec_forward<F: crate::float::Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, mode: Mode);

    /// The plain-loop backward (the spec), as [`LayerKind::backward`].
    #[cfg(test)]
    fn spec_backward<F: crate::float::Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>);

    /// The GPU forward of `step`: its launches, queued on the pass's stream.
    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()>;

    /// The GPU backward of `step`, as [`LayerKind::backward`], queued.
    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()>;
}

/// One line of the registry: the kind's variant, its room (`src/layers/<room>.rs`) and its
/// kernel file (`kernels/<room>.cu`), or None where it needs none.
#[cfg(test)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Registered {
    pub kind: &'static str,
    pub room: &'static str,
    pub kernels: Option<&'static str>,
}

/// The registry: `layers! { Kind(room::Spec, "room.cu"), Other(other::Spec, none), … }` makes
/// the public `enum Layer` (one tuple variant per kind, holding the room's spec struct), its
/// `From` conversions, a `Debug` that shows the spec alone, [`Registered`] lines, the kernel
/// sources in registry order, and the dispatch: one exhaustive `match` per operation of
/// [`LayerKind`].
macro_rules! layers {
    (@source none) => { None };
    (@source $file:literal) => {
        Some(($file, include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $file))))
    };
    (@file none) => { None };
    (@file $file:literal) => { Some($file) };
    ($( $(#[$doc:meta])* $kind:ident($room:ident::$spec:ident, $kernels:tt) ),* $(,)?) => {
        /// One layer as the user specified it: its kind, holding the kind's settings.
        #[derive(Clone, Copy, PartialEq)]
        pub enum Layer {
            $( $(#[$doc])* $kind($room::$spec), )*
        }

        $(
            impl From<$room::$spec> for Layer {
                fn from(layer: $room::$spec) -> Layer {
                    Layer::$kind(layer)
                }
            }
        )*

        impl std::fmt::Debug for Layer {
            /// The kind's settings alone, as `Dense { out_features: 10, activation: Relu }`.
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self { $( Layer::$kind(layer) => std::fmt::Debug::fmt(layer, f), )* }
            }
        }

        /// Every kind, in registry order.
        #[cfg(test)]
        pub(crate) const REGISTRY: &[kind::Registered] = &[
            $( kind::Registered { kind: stringify!($kind), room: stringify!($room), kernels: layers!(@file $kernels) }, )*
        ];

        /// The layers' kernel files (name, text), in registry order, for NVRTC.
        #[cfg(feature = "cuda")]
        pub(crate) const KERNEL_SOURCES: &[Option<(&str, &str)>] = &[ $( layers!(@source $kernels), )* ];

        impl Layer {
            /// The activation applied to its output (identity where it takes none).
            pub fn activation(&self) -> crate::activation::Activation {
                self.takes_activation().unwrap_or(crate::activation::Activation::Identity)
            }

            /// Its activation where it takes one (dense, conv), else None.
            pub(crate) fn takes_activation(&self) -> Option<crate::activation::Activation> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::activation(layer), )* }
            }

            pub(crate) fn is_view(&self) -> bool {
                match self { $( Layer::$kind(layer) => kind::LayerKind::is_view(layer), )* }
            }

            pub(crate) fn modules(&self) -> usize {
                match self { $( Layer::$kind(layer) => kind::LayerKind::modules(layer), )* }
            }

            pub(crate) fn output_shape(&self, input: crate::chain::Shape) -> std::result::Result<crate::chain::Shape, String> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::output_shape(layer, input), )* }
            }

            pub(crate) fn params(&self, input: crate::chain::Shape, output: crate::chain::Shape) -> Vec<kind::TensorSpec> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::params(layer, input, output), )* }
            }

            pub(crate) fn buffers(&self, input: crate::chain::Shape, output: crate::chain::Shape) -> Vec<kind::TensorSpec> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::buffers(layer, input, output), )* }
            }

            pub(crate) fn kept(&self, input: crate::chain::Shape, output: crate::chain::Shape) -> Option<kind::Kept> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::kept(layer, input, output), )* }
            }

            pub(crate) fn describe(&self) -> String {
                match self { $( Layer::$kind(layer) => kind::LayerKind::describe(layer), )* }
            }

            /// The layer an architecture entry describes, by its first word; None where no kind
            /// has that word.
            pub(crate) fn parse(words: &crate::io::Words) -> Option<crate::error::Result<Layer>> {
                $(
                    if words.first() == <$room::$spec as kind::LayerKind>::WORD {
                        return Some(<$room::$spec as kind::LayerKind>::parse(words).map(Layer::$kind));
                    }
                )*
                None
            }

            pub(crate) fn summary(&self, input: crate::chain::Shape) -> String {
                match self { $( Layer::$kind(layer) => kind::LayerKind::summary(layer, input), )* }
            }

            pub(crate) fn forward(&self, step: &crate::chain::Step, pass: &mut Pass, mode: kind::Mode) {
                match self { $( Layer::$kind(layer) => kind::LayerKind::forward(layer, step, pass, mode), )* }
            }

            pub(crate) fn backward(&self, step: &crate::chain::Step, pass: &mut BackPass) {
                match self { $( Layer::$kind(layer) => kind::LayerKind::backward(layer, step, pass), )* }
            }

            #[cfg(test)]
            pub(crate) fn spec_forward<F: crate::float::Float>(&self, step: &crate::chain::Step, pass: &mut spec::Pass<F>, mode: kind::Mode) {
                match self { $( Layer::$kind(layer) => kind::LayerKind::spec_forward(layer, step, pass, mode), )* }
            }

            #[cfg(test)]
            pub(crate) fn spec_backward<F: crate::float::Float>(&self, step: &crate::chain::Step, pass: &mut spec::BackPass<F>) {
                match self { $( Layer::$kind(layer) => kind::LayerKind::spec_backward(layer, step, pass), )* }
            }

            #[cfg(feature = "cuda")]
            pub(crate) fn gpu_forward(
                &self,
                step: &crate::chain::Step,
                pass: &crate::cuda::exec::GpuForward,
                mode: kind::Mode,
            ) -> crate::error::Result<()> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::gpu_forward(layer, step, pass, mode), )* }
            }

            #[cfg(feature = "cuda")]
            pub(crate) fn gpu_backward(&self, step: &crate::chain::Step, pass: &mut crate::cuda::exec::GpuBackward) -> crate::error::Result<()> {
                match self { $( Layer::$kind(layer) => kind::LayerKind::gpu_backward(layer, step, pass), )* }
            }
        }
    };
}
pub(crate) use layers;
