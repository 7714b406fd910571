//! The builder a user writes (`Chain::new(..).dense(..).build()`) and the plan it compiles to.
//!
//! The plan is computed once: every layer's input and output shape, its range in the flat
//! parameter buffer, and where its pre-activation and output live in the activation buffer.
//! Everything later reads the plan; nothing re-derives a shape.
//!
//! Every size the plan derives (shapes, parameter ranges, activation regions, a convolution's
//! scratch) is computed here with checked arithmetic and is at most `MAX_VALUES` (isize::MAX / 8), so the code
//! that reads a plan multiplies and adds these sizes without checks. A size for a batch (a
//! capacity times a per-sample size) is checked where a buffer for it is made (`batch_len`).

use crate::activation::Activation;
use crate::error::{Error, Result};
pub use crate::layers::conv::ConvOptions;
pub use crate::layers::Layer;
use crate::model::Model;
use std::ops::Range;

/// The most values any size a plan derives, or any buffer for a batch, may reach (about 2⁶⁰):
/// that many f64 would already be more than `isize::MAX` bytes, the most one allocation can
/// hold, so no model that could run is refused; and below it, byte counts, sums of two sizes
/// and twice a size never overflow `usize`.
pub(crate) const MAX_VALUES: usize = isize::MAX as usize / 8;

/// `capacity × per_sample` values for a buffer of `what`, or an [`Error::Shape`] saying so when
/// that is more than [`MAX_VALUES`] (or overflows).
pub(crate) fn batch_len(capacity: usize, per_sample: usize, what: &str) -> Result<usize> {
    capacity.checked_mul(per_sample).filter(|&n| n <= MAX_VALUES).ok_or_else(|| {
        Error::Shape(format!("{what} for {capacity} samples of {per_sample} values each are more values than any buffer can hold"))
    })
}

/// `n` if it is at most [`MAX_VALUES`].
pub(crate) fn fits(n: Option<usize>) -> Option<usize> {
    n.filter(|&n| n <= MAX_VALUES)
}

/// The shape of one sample. Images are stored channel-major (C, H, W), as PyTorch does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// A vector of `n` features.
    Vector(usize),
    /// An image of `channels × height × width`.
    Image { channels: usize, height: usize, width: usize },
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

    /// Number of f32 values per sample, or `usize::MAX` where that product does not fit in
    /// `usize` (a shape [`Plan::new`] refuses: every shape of a plan has its exact length).
    pub fn len(self) -> usize {
        match self {
            Shape::Vector(n) => n,
            // min(C·H·W, usize::MAX): once saturated, a zero factor still gives 0
            Shape::Image { channels, height, width } => channels.saturating_mul(height).saturating_mul(width),
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
    /// [`Model::init`]. A mismatch is an [`Error::Shape`] naming the layer index and the shapes.
    pub fn build(self) -> Result<Model> {
        Model::from_plan(Plan::new(self.input, &self.layers)?)
    }
}

/// How a tensor's values start: drawn by the model's initialiser ([`crate::Init`]) with the
/// tensor's fans, or a constant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Drawn by [`crate::Init`] with these fan-in and fan-out (a weight).
    Fans { fan_in: usize, fan_out: usize },
    /// Every value this constant (a bias: 0).
    Constant(f32),
}

/// One named tensor of a step: its name in the layer's PyTorch module, its shape there (the
/// product is `range.len()`), its range in the flat buffer it lives in, and how it starts.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    pub fill: Fill,
}

/// A layer with everything the engine needs to run it, computed once by [`Plan::new`].
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub layer: Layer,
    pub input: Shape,
    pub output: Shape,
    /// All of the step's parameters in the flat parameter buffer (empty for pools and flatten):
    /// its tensors, in order.
    pub params: Range<usize>,
    /// Its parameter tensors (a dense or conv layer's `weight` then `bias`), in layout order.
    pub tensors: Vec<Tensor>,
    /// Activation-buffer region of the input, the pre-activation z, and the output y.
    /// `z == output` when the layer has no activation (or no parameters).
    pub input_region: usize,
    pub z_region: usize,
    pub output_region: usize,
    /// The dense or conv step whose activated output (z ≠ y) is this step's input, if any: the
    /// input gradient of this step times that activation's derivative is that step's dz.
    pub activated_input: Option<usize>,
}

impl Step {
    /// Number of weights: the length of its `weight` tensor (0 where it has none).
    pub fn weight_len(&self) -> usize {
        self.tensors.iter().find(|t| t.name == "weight").map_or(0, |t| t.range.len())
    }

    /// The ranges of the weight and the bias of a step whose tensors are exactly those two, in
    /// that order (dense, conv).
    pub fn weight_and_bias(&self) -> (Range<usize>, Range<usize>) {
        let [weight, bias] = &self.tensors[..] else {
            unreachable!("{:?} has no weight and bias", self.layer);
        };
        debug_assert_eq!((weight.name, bias.name), ("weight", "bias"));
        (weight.range.clone(), bias.range.clone())
    }
}

/// The compiled chain: steps, parameter count and the per-sample layout of activations.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub input: Shape,
    pub steps: Vec<Step>,
    pub param_len: usize,
    /// Per-sample length of each activation region; region r holds `capacity × len` values.
    pub regions: Vec<usize>,
}

impl Plan {
    /// Shape inference and checks; see [`Chain::build`]. A size that does not fit (more
    /// than isize::MAX / 8 values, or overflowing) is an [`Error::Shape`] naming the layer.
    pub fn new(input: Shape, layers: &[Layer]) -> Result<Plan> {
        if input.is_empty() {
            return Err(Error::Shape(format!("the input {input} has no values")));
        }
        if input.len() > MAX_VALUES {
            return Err(Error::Shape(format!("the input {input} has more values than any buffer can hold")));
        }
        if layers.is_empty() {
            return Err(Error::Shape("the chain has no layers".into()));
        }
        let mut regions = vec![input.len()];
        let mut steps = Vec::with_capacity(layers.len());
        // `acts`: the values of one sample's activations so far (the sum of `regions`)
        let (mut shape, mut region, mut param_len, mut acts) = (input, 0usize, 0usize, input.len());
        let mut activated = None;
        for (index, layer) in layers.iter().enumerate() {
            let too_large = |what: &str| {
                Error::Shape(format!("layer {index} ({layer:?}) with input {shape}: {what} more values than any buffer can hold"))
            };
            let output = output_shape(index, layer, shape)?;
            if output.len() > MAX_VALUES {
                return Err(too_large(&format!("its output {output} has")));
            }
            let specs = layer.params(shape, output);
            let lens: Option<Vec<usize>> = specs.iter().map(|t| t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))).collect();
            let n_params = lens.as_ref().and_then(|lens| fits(lens.iter().try_fold(0usize, |n, &l| n.checked_add(l))));
            let n_params = n_params.ok_or_else(|| too_large("its parameters are"))?;
            let params_end = fits(param_len.checked_add(n_params)).ok_or_else(|| too_large("the parameters up to it are"))?;
            let mut start = param_len;
            let tensors = specs
                .into_iter()
                .zip(lens.unwrap_or_default())
                .map(|(t, len)| {
                    start += len;
                    Tensor { name: t.name, shape: t.shape, range: start - len..start, fill: t.fill }
                })
                .collect();
            let mut step = Step {
                layer: *layer,
                input: shape,
                output,
                params: param_len..params_end,
                tensors,
                input_region: region,
                z_region: region,
                output_region: region,
                activated_input: activated,
            };
            param_len = params_end;
            if !layer.is_view() {
                let new_regions = if layer.activation() == Activation::Identity { 1 } else { 2 };
                acts = fits(output.len().checked_mul(new_regions).and_then(|n| n.checked_add(acts)))
                    .ok_or_else(|| too_large("one sample's activations up to it are"))?;
                if layer.activation() != Activation::Identity {
                    regions.push(output.len());
                    step.z_region = regions.len() - 1;
                }
                regions.push(output.len());
                step.output_region = regions.len() - 1;
                if layer.activation() == Activation::Identity {
                    step.z_region = step.output_region;
                }
                // (a flatten step keeps its input region, and so the step that activated it)
                activated = (step.z_region != step.output_region).then_some(index);
            }
            (shape, region) = (output, step.output_region);
            steps.push(step);
        }
        Ok(Plan { input, steps, param_len, regions })
    }

    /// The model's output shape.
    pub fn output(&self) -> Shape {
        self.steps.last().map_or(self.input, |s| s.output)
    }

    /// Offset of region `r` in an activation buffer of `capacity` samples. The buffer exists,
    /// so `acts_len(capacity)` was Ok: the offset is at most that, and nothing overflows.
    pub(crate) fn region_offset(&self, r: usize, capacity: usize) -> usize {
        debug_assert!(self.acts_len(capacity).is_ok(), "no activation buffer holds {capacity} samples");
        self.regions[..r].iter().sum::<usize>() * capacity
    }

    /// Total activation-buffer length for `capacity` samples; an [`Error::Shape`] if that is
    /// more values than any buffer can hold.
    pub fn acts_len(&self, capacity: usize) -> Result<usize> {
        let per_sample = self.regions.iter().try_fold(0usize, |sum, &r| sum.checked_add(r)).unwrap_or(usize::MAX);
        batch_len(capacity, per_sample, "activations")
    }
}

/// The layer's output shape on `input`, or an [`Error::Shape`] naming the layer and the input.
fn output_shape(index: usize, layer: &Layer, input: Shape) -> Result<Shape> {
    let err = |what: String| Error::Shape(format!("layer {index} ({layer:?}) with input {input}: {what}"));
    if let Some(Activation::LeakyRelu(slope)) = layer.takes_activation() {
        if !slope.is_finite() {
            return Err(err(format!("the leaky ReLU slope {slope} is not a finite number")));
        }
    }
    layer.output_shape(input).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::*;
    use crate::layers::{conv::Conv, dense::Dense, flatten::Flatten, pool::MaxPool};

    #[test]
    fn lenet_shapes_and_layout() {
        let plan = Plan::new(
            Shape::image(1, 28, 28),
            &[
                Layer::Conv(Conv { out_channels: 6, kernel: (5, 5), stride: (1, 1), padding: (2, 2), activation: Relu }),
                Layer::MaxPool(MaxPool { window: (2, 2), stride: (2, 2) }),
                Layer::Conv(Conv { out_channels: 16, kernel: (5, 5), stride: (1, 1), padding: (0, 0), activation: Relu }),
                Layer::MaxPool(MaxPool { window: (2, 2), stride: (2, 2) }),
                Layer::Flatten(Flatten),
                Layer::Dense(Dense { out_features: 120, activation: Relu }),
                Layer::Dense(Dense { out_features: 10, activation: Identity }),
            ],
        )
        .unwrap();
        let outs: Vec<Shape> = plan.steps.iter().map(|s| s.output).collect();
        assert_eq!(outs[0], Shape::image(6, 28, 28));
        assert_eq!(outs[1], Shape::image(6, 14, 14));
        assert_eq!(outs[2], Shape::image(16, 10, 10));
        assert_eq!(outs[3], Shape::image(16, 5, 5));
        assert_eq!(outs[4], Shape::Vector(400));
        assert_eq!(plan.param_len, (6 * 25 + 6) + (16 * 6 * 25 + 16) + (120 * 400 + 120) + (10 * 120 + 10));
        // flatten aliases its input region; identity layers have z == y
        assert_eq!(plan.steps[4].output_region, plan.steps[3].output_region);
        assert_eq!(plan.steps[6].z_region, plan.steps[6].output_region);
        assert_ne!(plan.steps[5].z_region, plan.steps[5].output_region);
        assert_eq!(plan.steps[0].weight_and_bias(), (0..150, 150..156));
        // each step's input came from an activated step: conv → pool, dense 120 → dense 10
        let activated: Vec<Option<usize>> = plan.steps.iter().map(|s| s.activated_input).collect();
        assert_eq!(activated, [None, Some(0), None, Some(2), None, None, Some(5)]);
    }

    #[test]
    fn mismatches_name_the_layer_and_shapes() {
        let cases: Vec<(Shape, Vec<Layer>, &str)> = vec![
            (Shape::image(1, 8, 8), vec![Layer::Dense(Dense { out_features: 3, activation: Relu })], "layer 0"),
            (Shape::vector(4), vec![Layer::Flatten(Flatten)], "already a vector"),
            (Shape::image(1, 4, 4), vec![Layer::MaxPool(MaxPool { window: (5, 5), stride: (5, 5) })], "larger than the input 4×4"),
            (Shape::image(1, 4, 4), vec![Layer::Flatten(Flatten), Layer::Dense(Dense { out_features: 0, activation: Relu })], "layer 1"),
            (Shape::vector(0), vec![Layer::Dense(Dense { out_features: 1, activation: Relu })], "no values"),
            (Shape::vector(3), vec![], "no layers"),
            (
                Shape::image(1, 3, 3),
                vec![Layer::Conv(Conv { out_channels: 1, kernel: (4, 4), stride: (1, 1), padding: (0, 0), activation: Relu })],
                "kernel 4×4",
            ),
            (Shape::vector(3), vec![Layer::MaxPool(MaxPool { window: (1, 1), stride: (1, 1) })], "image input"),
            (Shape::vector(3), vec![Layer::Dense(Dense { out_features: 2, activation: LeakyRelu(f32::NAN) })], "slope NaN"),
        ];
        for (input, layers, needle) in cases {
            match Plan::new(input, &layers) {
                Err(Error::Shape(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
                other => panic!("expected a shape error for {layers:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn sizes_that_overflow_are_refused_naming_the_layer() {
        let dense = |out_features| Layer::Dense(Dense { out_features, activation: Relu });
        let conv =
            |out_channels, kernel, padding| Layer::Conv(Conv { out_channels, kernel, stride: (1, 1), padding, activation: Identity });
        let huge = 1usize << 62;
        let cases: Vec<(Shape, Vec<Layer>, &str)> = vec![
            // (2⁶³ + 1)·1·2 wrapped to 2 values in release builds
            (Shape::image((1 << 63) + 1, 1, 2), vec![Layer::Flatten(Flatten)], "the input image(9223372036854775809×1×2) has more values"),
            (Shape::vector(usize::MAX), vec![dense(1)], "the input vector"),
            (Shape::vector(1 << 32), vec![dense(1 << 32)], "layer 0 (Dense { out_features: 4294967296, activation: Relu }) with input vector(4294967296): its parameters are"),
            (Shape::vector(3), vec![dense(huge)], "layer 0 (Dense { out_features: 4611686018427387904, activation: Relu }) with input vector(3): its output vector(4611686018427387904) has"),
            (Shape::vector(1 << 30), vec![dense(1 << 29), dense(1 << 31)], "layer 1 (Dense"),
            (
                Shape::image(1, 1 << 29, 1 << 30),
                vec![Layer::MaxPool(MaxPool { window: (1, 1), stride: (1, 1) })],
                "layer 0 (MaxPool { window: (1, 1), stride: (1, 1) }) with input image(1×536870912×1073741824): one sample's activations up to it are",
            ),
            (Shape::image(1, 2, 2), vec![conv(1, (1, 1), (usize::MAX / 2, 0))], "layer 0 (Conv"),
            (Shape::image(1, 2, 2), vec![conv(1, (1, 1), (usize::MAX / 2, 0))], "the padded input's size overflows"),
            (Shape::image(1 << 20, 1 << 10, 1 << 10), vec![conv(1 << 30, (1 << 10, 1 << 10), (0, 0))], "its parameters are"),
            (Shape::image(1 << 12, 1 << 14, 1 << 14), vec![conv(1, (1 << 10, 1 << 10), (1 << 9, 1 << 9))], "lowering one sample takes"),
            (Shape::image(1, 1 << 29, 1 << 29), vec![conv(1 << 31, (1, 1), (0, 0))], "its output image(2147483648×536870912×536870912) has"),
        ];
        for (input, layers, needle) in cases {
            match Plan::new(input, &layers) {
                Err(Error::Shape(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
                other => panic!("expected a shape error for {input} {layers:?}, got {other:?}"),
            }
        }
        // a plan's sizes fit, and so do its batch buffers up to MAX_VALUES values, no further
        let plan = Plan::new(Shape::vector(4), &[dense(5), Layer::Dense(Dense { out_features: 3, activation: Identity })]).unwrap();
        assert_eq!(plan.acts_len(2).unwrap(), 2 * (4 + 5 + 5 + 3));
        for capacity in [usize::MAX, MAX_VALUES / 17 + 1] {
            let err = plan.acts_len(capacity).unwrap_err();
            assert!(err.to_string().contains(&format!("activations for {capacity} samples of 17 values each")), "{err}");
        }
        assert_eq!(Shape::image(usize::MAX, 2, 0).len(), 0);
        assert_eq!(Shape::image(1 << 40, 1 << 40, 1).len(), usize::MAX);
    }
}
