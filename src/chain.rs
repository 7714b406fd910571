//! The builder a user writes (`Chain::new(..).dense(..).build()`) and the plan it compiles to.
//!
//! The plan is computed once: every layer's input and output shape, its range in the flat
//! parameter buffer, and where its pre-activation and output live in the activation buffer.
//! Everything later reads the plan; nothing re-derives a shape.

use crate::activation::Activation;
use crate::error::{Error, Result};
use crate::model::Model;
use std::ops::Range;

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

    /// Number of f32 values per sample.
    pub fn len(self) -> usize {
        match self {
            Shape::Vector(n) => n,
            Shape::Image { channels, height, width } => channels * height * width,
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

/// One layer as the user specified it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layer {
    /// y = act(W·x + b), W (out_features, in_features).
    Dense { out_features: usize, activation: Activation },
    /// 2-D cross-correlation, W (out_channels, in_channels, kh, kw), then act.
    Conv { out_channels: usize, kernel: (usize, usize), stride: (usize, usize), padding: (usize, usize), activation: Activation },
    /// Max over each `window`, moved by `stride`, no padding.
    MaxPool { window: (usize, usize), stride: (usize, usize) },
    /// Image (C, H, W) → vector (C·H·W), in that order; no data moves.
    Flatten,
}

impl Layer {
    /// The layer's activation, if it has one.
    pub fn activation(&self) -> Activation {
        match *self {
            Layer::Dense { activation, .. } | Layer::Conv { activation, .. } => activation,
            _ => Activation::Identity,
        }
    }
}

/// Options of a convolution beyond its output channels, kernel and activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvOptions {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
}

impl Default for ConvOptions {
    fn default() -> Self {
        ConvOptions { stride: (1, 1), padding: (0, 0) }
    }
}

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

    /// Dense layer with `out_features` outputs.
    pub fn dense(self, out_features: usize, activation: Activation) -> Chain {
        self.layer(Layer::Dense { out_features, activation })
    }

    /// Convolution with stride 1 and no padding.
    pub fn conv(self, out_channels: usize, kernel: (usize, usize), activation: Activation) -> Chain {
        self.conv_with(out_channels, kernel, activation, ConvOptions::default())
    }

    /// Convolution with explicit stride and zero padding.
    pub fn conv_with(self, out_channels: usize, kernel: (usize, usize), activation: Activation, options: ConvOptions) -> Chain {
        let ConvOptions { stride, padding } = options;
        self.layer(Layer::Conv { out_channels, kernel, stride, padding, activation })
    }

    /// Max-pool with stride equal to the window.
    pub fn max_pool(self, window: (usize, usize)) -> Chain {
        self.max_pool_with(window, window)
    }

    /// Max-pool with an explicit stride.
    pub fn max_pool_with(self, window: (usize, usize), stride: (usize, usize)) -> Chain {
        self.layer(Layer::MaxPool { window, stride })
    }

    /// Image → vector.
    pub fn flatten(self) -> Chain {
        self.layer(Layer::Flatten)
    }

    /// Infers and checks every shape and lays out the buffers. Parameters start at zero: call
    /// [`Model::init`]. A mismatch is an [`Error::Shape`] naming the layer index and the shapes.
    pub fn build(self) -> Result<Model> {
        Model::from_plan(Plan::new(self.input, &self.layers)?)
    }
}

/// A layer with everything the engine needs to run it, computed once by [`Plan::new`].
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub layer: Layer,
    pub input: Shape,
    pub output: Shape,
    /// Weight then bias, in the flat parameter buffer (empty for pools and flatten).
    pub params: Range<usize>,
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
    /// Number of weights (the bias follows them in `params`).
    pub fn weight_len(&self) -> usize {
        match self.layer {
            Layer::Dense { out_features, .. } => out_features * self.input.len(),
            Layer::Conv { out_channels, kernel, .. } => out_channels * in_channels(self.input) * kernel.0 * kernel.1,
            _ => 0,
        }
    }

    /// Parameter ranges of the weight and the bias.
    pub fn weight_and_bias(&self) -> (Range<usize>, Range<usize>) {
        let split = self.params.start + self.weight_len();
        (self.params.start..split, split..self.params.end)
    }
}

fn in_channels(shape: Shape) -> usize {
    match shape {
        Shape::Image { channels, .. } => channels,
        Shape::Vector(_) => 0,
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
    /// Shape inference and checks; see [`Chain::build`].
    pub fn new(input: Shape, layers: &[Layer]) -> Result<Plan> {
        if input.is_empty() {
            return Err(Error::Shape(format!("the input {input} has no values")));
        }
        if layers.is_empty() {
            return Err(Error::Shape("the chain has no layers".into()));
        }
        let mut regions = vec![input.len()];
        let mut steps = Vec::with_capacity(layers.len());
        let (mut shape, mut region, mut param_len) = (input, 0usize, 0usize);
        let mut activated = None;
        for (index, layer) in layers.iter().enumerate() {
            let output = output_shape(index, layer, shape)?;
            let mut step = Step {
                layer: *layer,
                input: shape,
                output,
                params: 0..0,
                input_region: region,
                z_region: region,
                output_region: region,
                activated_input: activated,
            };
            let n_params = step.weight_len() + bias_len(layer);
            step.params = param_len..param_len + n_params;
            param_len += n_params;
            if *layer != Layer::Flatten {
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

    /// Offset of region `r` in an activation buffer of `capacity` samples.
    pub fn region_offset(&self, r: usize, capacity: usize) -> usize {
        self.regions[..r].iter().sum::<usize>() * capacity
    }

    /// Total activation-buffer length for `capacity` samples.
    pub fn acts_len(&self, capacity: usize) -> usize {
        self.regions.iter().sum::<usize>() * capacity
    }
}

fn bias_len(layer: &Layer) -> usize {
    match *layer {
        Layer::Dense { out_features, .. } => out_features,
        Layer::Conv { out_channels, .. } => out_channels,
        _ => 0,
    }
}

fn output_shape(index: usize, layer: &Layer, input: Shape) -> Result<Shape> {
    let err = |what: String| Err(Error::Shape(format!("layer {index} ({layer:?}) with input {input}: {what}")));
    if let Activation::LeakyRelu(slope) = layer.activation() {
        if !slope.is_finite() {
            return err(format!("the leaky ReLU slope {slope} is not a finite number"));
        }
    }
    match (*layer, input) {
        (Layer::Dense { out_features, .. }, Shape::Vector(_)) => {
            if out_features == 0 {
                return err("a Dense layer needs at least one output".into());
            }
            Ok(Shape::Vector(out_features))
        }
        (Layer::Dense { .. }, Shape::Image { .. }) => err("a Dense layer needs a vector input: add .flatten() before it".into()),
        (Layer::Conv { out_channels, kernel, stride, padding, .. }, Shape::Image { height, width, .. }) => {
            if out_channels == 0 || kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
                return err("output channels, kernel and stride must be at least 1".into());
            }
            let (ph, pw) = (height + 2 * padding.0, width + 2 * padding.1);
            if kernel.0 > ph || kernel.1 > pw {
                return err(format!("kernel {}×{} is larger than the padded input {ph}×{pw}", kernel.0, kernel.1));
            }
            if padding.0 >= kernel.0 || padding.1 >= kernel.1 {
                return err("padding must be smaller than the kernel".into());
            }
            Ok(Shape::Image { channels: out_channels, height: (ph - kernel.0) / stride.0 + 1, width: (pw - kernel.1) / stride.1 + 1 })
        }
        (Layer::MaxPool { window, stride }, Shape::Image { channels, height, width }) => {
            if window.0 == 0 || window.1 == 0 || stride.0 == 0 || stride.1 == 0 {
                return err("window and stride must be at least 1".into());
            }
            if window.0 > height || window.1 > width {
                return err(format!("window {}×{} is larger than the input {height}×{width}", window.0, window.1));
            }
            Ok(Shape::Image { channels, height: (height - window.0) / stride.0 + 1, width: (width - window.1) / stride.1 + 1 })
        }
        (Layer::Conv { .. } | Layer::MaxPool { .. }, Shape::Vector(_)) => err("needs an image input".into()),
        (Layer::Flatten, Shape::Image { .. }) => Ok(Shape::Vector(input.len())),
        (Layer::Flatten, Shape::Vector(_)) => err("the input is already a vector".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::*;

    #[test]
    fn lenet_shapes_and_layout() {
        let plan = Plan::new(
            Shape::image(1, 28, 28),
            &[
                Layer::Conv { out_channels: 6, kernel: (5, 5), stride: (1, 1), padding: (2, 2), activation: Relu },
                Layer::MaxPool { window: (2, 2), stride: (2, 2) },
                Layer::Conv { out_channels: 16, kernel: (5, 5), stride: (1, 1), padding: (0, 0), activation: Relu },
                Layer::MaxPool { window: (2, 2), stride: (2, 2) },
                Layer::Flatten,
                Layer::Dense { out_features: 120, activation: Relu },
                Layer::Dense { out_features: 10, activation: Identity },
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
            (Shape::image(1, 8, 8), vec![Layer::Dense { out_features: 3, activation: Relu }], "layer 0"),
            (Shape::vector(4), vec![Layer::Flatten], "already a vector"),
            (Shape::image(1, 4, 4), vec![Layer::MaxPool { window: (5, 5), stride: (5, 5) }], "larger than the input 4×4"),
            (Shape::image(1, 4, 4), vec![Layer::Flatten, Layer::Dense { out_features: 0, activation: Relu }], "layer 1"),
            (Shape::vector(0), vec![Layer::Dense { out_features: 1, activation: Relu }], "no values"),
            (Shape::vector(3), vec![], "no layers"),
            (
                Shape::image(1, 3, 3),
                vec![Layer::Conv { out_channels: 1, kernel: (4, 4), stride: (1, 1), padding: (0, 0), activation: Relu }],
                "kernel 4×4",
            ),
            (Shape::vector(3), vec![Layer::MaxPool { window: (1, 1), stride: (1, 1) }], "image input"),
            (Shape::vector(3), vec![Layer::Dense { out_features: 2, activation: LeakyRelu(f32::NAN) }], "slope NaN"),
        ];
        for (input, layers, needle) in cases {
            match Plan::new(input, &layers) {
                Err(Error::Shape(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
                other => panic!("expected a shape error for {layers:?}, got {other:?}"),
            }
        }
    }
}
