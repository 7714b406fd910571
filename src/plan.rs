//! The plan a chain compiles to ([`Plan::new`], called by `Chain::build`): every layer's shapes,
//! tensors and buffers, computed once and read by everything later; nothing re-derives a shape.
//!
//! # What a step holds
//!
//! - Its input and output [`Shape`], and the PyTorch module path that names its tensors
//!   ([`Step::module`]: `"4"` for the fifth module of the model's `nn.Sequential`, activations,
//!   pools and flatten counted as PyTorch counts them).
//! - Its parameter tensors ([`Step::tensors`]): each a name in its module (`weight`, `bias`,
//!   `weight_ih_l0`), PyTorch's shape, a range of the flat parameters, and how it starts
//!   ([`Fill`]). A layer declares any number (`LayerKind::params`); a dense or conv layer's are a
//!   weight then a bias ([`Step::weight_and_bias`]).
//! - Its buffer tensors ([`Step::buffers`]): the same, in the model's flat buffers, which are not
//!   trained but move to a device and into a model file with the parameters (batch norm's
//!   `running_mean`, saved as `1.running_mean`). They start at constants (or at a count of 0,
//!   [`Fill::Count`], which a file holds as an integer).
//! - Where its values live in a cache's activation buffer:
//!   - regions, per-sample blocks: region 0 holds the model's inputs; a step that runs writes
//!     its output region, and first its pre-activation z where it has an activation; a view
//!     (flatten) keeps its input's region. Region r of a buffer for `capacity` samples holds
//!     `capacity × regions[r]` values, sample-major; a batch uses the front.
//!   - kept regions ([`Step::kept`]): per-sample values a layer keeps from its forward pass for
//!     its backward beyond z and y (a GRU's gates at every time step, an LSTM's cell states),
//!     declared by `LayerKind::kept` and laid out after its output region. The gradient buffer
//!     has the same layout, so each kept region has a twin there the backward pass may use.
//!   - saved values ([`Step::saved`]): values per batch, not per sample (batch norm's mean and
//!     1/σ of each channel, the backward pass's), declared by `LayerKind::kept` too and laid out
//!     after every region, at the end of the buffer ([`Plan::saved_values`]): both devices'
//!     caches hold them with no buffer of their own.
//!
//! # Training and inference
//!
//! The executors run a pass in `Mode::Train` (`backprop`, `train_step`) or `Mode::Infer`
//! (`forward`, `loss`, a `Server`) and hand it to every layer, with the model's buffers
//! (written in training, read in inference) and, in training, where dropout draws its masks:
//! batch norm normalises by the batch's statistics and moves its running ones in training, and
//! uses the running ones in inference; dropout draws its mask in training and is the identity
//! in inference. A plan and a cache serve both.
//!
//! # Consumers, and residual blocks
//!
//! [`Plan::consumers`] counts, per region, the steps that read it (a view passes its input on and
//! is not one). A fusion that writes the gradient of a step's input straight into the producing
//! step's dz assumes the step is that input's only reader: the GPU dense layer's input gradient
//! times the producer's act' ([`Step::activated_input`], which the plan gives only where the
//! count is one) and the training head's layer before the last (`cuda::head`, which checks the
//! count). Only a residual block's input has two readers.
//!
//! A residual block, `Chain::residual(|c| c.dense(64, Relu).dense(64, Identity))` (see
//! `layers/residual.rs`), is flattened into the plan as three parts, with no new kind of step
//! list:
//!
//! - a `Fork` step before the body: a view (no region, nothing to run forward), so the body's
//!   first step reads the block's input region; its [`Step::skip`] is the Add's z region;
//! - the body's steps, as any others; their module paths are `"{i}.body.{j}"`, i the block's
//!   index in the `nn.Sequential` around it and j the step's in the block's own (a nested
//!   block's, `"{i}.body.{j}.body.{k}"`);
//! - an `Add` step (no tensors, module path `"{i}"`), whose [`Step::skip`] is the block's input
//!   region: the plan checks that the body's output shape is the block input's (open blocks
//!   are a stack; one left open, or an Add with none open, is an error), and the Add writes
//!   z = body output + block input, then y = act(z), into regions of its own. It is the block
//!   input's second reader. Its backward passes dz on as the gradient of the body's output,
//!   and the Fork's backward, which runs after the whole body's (steps run backward in
//!   reverse), adds dz into the gradient of the block input, which the body's first step has
//!   overwritten by then.
//!
//! With two readers, no fusion folds the block input's gradient into its producer.
//!
//! # Sizes
//!
//! Every size the plan derives (shapes, tensor ranges, activation regions, a convolution's
//! scratch) is computed here with checked arithmetic and is at most `MAX_VALUES` (isize::MAX /
//! 8), so the code that reads a plan multiplies and adds these sizes without checks. A size for
//! a batch (a capacity times a per-sample size) is checked where a buffer for it is made
//! (`batch_len`).

use crate::activation::Activation;
use crate::chain::Shape;
use crate::error::{Error, Result};
use crate::layers::{Kept, Layer, TensorSpec};
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

/// How a tensor's values start: drawn by the model's initialiser ([`crate::Init`]) with the
/// tensor's fans, or a constant (a buffer's always is).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Drawn by [`crate::Init`] with these fan-in and fan-out (a weight).
    Fans { fan_in: usize, fan_out: usize },
    /// Every value this constant (a bias: 0).
    Constant(f32),
    /// A count that starts at 0 (batch norm's `num_batches_tracked`): a buffer, held as f32
    /// like every other (exact up to 2²⁴), and written to a model file as PyTorch keeps it, a
    /// 64-bit integer.
    Count,
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
    /// The PyTorch module path that names its tensors in a model file (`"4"`: `4.weight`).
    pub module: String,
    /// All of the step's parameters in the flat parameter buffer (empty for pools and flatten):
    /// its tensors, in order.
    pub params: Range<usize>,
    /// Its parameter tensors (a dense or conv layer's `weight` then `bias`), in layout order.
    pub tensors: Vec<Tensor>,
    /// Its buffer tensors (ranges of the model's flat buffers), in layout order.
    pub buffers: Vec<Tensor>,
    /// Activation-buffer region of the input, the pre-activation z, and the output y.
    /// `z == output` when the layer has no activation (or no parameters). z is defined after a
    /// training pass only (see `layers::Mode`).
    pub input_region: usize,
    pub z_region: usize,
    pub output_region: usize,
    /// The regions it keeps for its backward pass beyond z and y (after its output region);
    /// `kept.end` is the number of regions up to and including this step's.
    pub kept: Range<usize>,
    /// Its values per batch kept for its backward pass: offsets in the plan's saved values
    /// ([`Plan::saved_values`]).
    pub saved: Range<usize>,
    /// The dense or conv step whose activated output (z ≠ y) is this step's input and no other
    /// step's ([`Plan::consumers`]), if any: the input gradient of this step times that
    /// activation's derivative is that step's dz.
    pub activated_input: Option<usize>,
    /// A residual block's other region: for its `Add` step, the block's input region, which it
    /// adds to the body's output; for its `Fork` step, the `Add` step's z region, whose gradient
    /// the fork adds into the block input's. None for every other step.
    pub skip: Option<usize>,
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

/// The compiled chain: steps, parameter and buffer counts, and the layout of activations.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub input: Shape,
    pub steps: Vec<Step>,
    pub param_len: usize,
    /// Values of the model's flat buffers (running statistics and the like).
    pub buffer_len: usize,
    /// Per-sample length of each activation region; region r holds `capacity × len` values.
    pub regions: Vec<usize>,
    /// Steps that read each region (views not counted).
    pub consumers: Vec<usize>,
    /// Values per batch the steps keep for their backward passes, after the regions.
    pub saved_len: usize,
}

impl Plan {
    /// Shape inference and checks; see [`crate::Chain::build`]. A size that does not fit (more
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
        let mut steps: Vec<Step> = Vec::with_capacity(layers.len());
        // `acts`: the values of one sample's activations so far (the sum of `regions`)
        let (mut shape, mut region, mut acts) = (input, 0usize, input.len());
        let (mut param_len, mut buffer_len, mut saved_len) = (0usize, 0usize, 0usize);
        // the module path: the open residual blocks' bodies (`"3.body."`) and the index in the
        // innermost `nn.Sequential`
        let (mut prefix, mut module) = (String::new(), 0usize);
        let mut blocks: Vec<Block> = Vec::new();
        let mut activated = None;
        for (index, layer) in layers.iter().enumerate() {
            let too_large = |what: &str| {
                Error::Shape(format!("layer {index} ({layer:?}) with input {shape}: {what} more values than any buffer can hold"))
            };
            // an Add closes the innermost block, and is that block's module in the sequence around it
            let closed = match layer {
                Layer::Add(_) => Some(close_block(&mut blocks, index, layer, shape)?),
                _ => None,
            };
            if let Some(block) = &closed {
                (prefix, module) = (block.prefix.clone(), block.module);
            }
            let output = output_shape(index, layer, shape)?;
            if output.len() > MAX_VALUES {
                return Err(too_large(&format!("its output {output} has")));
            }
            let (tensors, params_end) = lay_out(layer.params(shape, output), param_len, "parameters").map_err(|e| too_large(&e))?;
            let buffer_specs = layer.buffers(shape, output);
            debug_assert!(buffer_specs.iter().all(|t| matches!(t.fill, Fill::Constant(_) | Fill::Count)), "a buffer starts at a constant");
            let (buffers, buffers_end) = lay_out(buffer_specs, buffer_len, "buffers").map_err(|e| too_large(&e))?;
            let Kept { regions: kept, saved } =
                layer.kept(shape, output).ok_or_else(|| too_large("what it keeps for its backward pass is"))?;
            let saved_end = fits(saved_len.checked_add(saved)).ok_or_else(|| too_large("the values per batch kept up to it are"))?;
            let mut step = Step {
                layer: *layer,
                input: shape,
                output,
                module: format!("{prefix}{module}"),
                params: param_len..params_end,
                tensors,
                buffers,
                input_region: region,
                z_region: region,
                output_region: region,
                kept: regions.len()..regions.len(),
                saved: saved_len..saved_end,
                activated_input: activated,
                skip: closed.as_ref().map(|block| block.region),
            };
            (param_len, buffer_len, saved_len) = (params_end, buffers_end, saved_end);
            if let Layer::Fork(_) = layer {
                // the body's modules are `{module}.body.{j}`: a block holds its body's nn.Sequential
                let body = format!("{prefix}{module}.body.");
                blocks.push(Block { fork: index, region, shape, prefix: std::mem::replace(&mut prefix, body), module });
                module = 0;
            } else {
                // PyTorch's nn.Sequential counts the activation as a module of its own
                module += layer.modules() + usize::from(layer.activation() != Activation::Identity);
            }
            if !layer.is_view() {
                let z = (layer.activation() != Activation::Identity).then_some(output.len());
                let new: Vec<usize> = z.into_iter().chain([output.len()]).chain(kept).collect();
                acts = fits(new.iter().try_fold(acts, |sum, &n| sum.checked_add(n)))
                    .ok_or_else(|| too_large("one sample's activations up to it are"))?;
                regions.extend(&new);
                step.output_region = step.kept.start + usize::from(z.is_some());
                step.z_region = step.kept.start;
                step.kept = step.output_region + 1..regions.len();
                // (a flatten step keeps its input region, and so the step that activated it)
                activated = (step.z_region != step.output_region).then_some(index);
            }
            if let Some(block) = closed {
                steps[block.fork].skip = Some(step.z_region);
            }
            (shape, region) = (output, step.output_region);
            steps.push(step);
        }
        if let Some(block) = blocks.last() {
            return Err(Error::Shape(format!("the residual block opened at layer {} is never closed (by an Add)", block.fork)));
        }
        // a step reads its input region, and an Add its block's input too (a view reads nothing)
        let mut consumers = vec![0; regions.len()];
        for step in steps.iter().filter(|s| !s.layer.is_view()) {
            consumers[step.input_region] += 1;
            if let Some(skip) = step.skip {
                consumers[skip] += 1;
            }
        }
        for step in &mut steps {
            if consumers[step.input_region] > 1 {
                step.activated_input = None;
            }
        }
        Ok(Plan { input, steps, param_len, buffer_len, regions, consumers, saved_len })
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

    /// Total activation-buffer length for `capacity` samples (the regions, then the saved
    /// values); an [`Error::Shape`] if that is more values than any buffer can hold.
    pub fn acts_len(&self, capacity: usize) -> Result<usize> {
        let per_sample = self.regions.iter().try_fold(0usize, |sum, &r| sum.checked_add(r)).unwrap_or(usize::MAX);
        let regions = batch_len(capacity, per_sample, "activations")?;
        fits(regions.checked_add(self.saved_len)).ok_or_else(|| {
            let what = format!("activations for {capacity} samples and {} values kept per batch", self.saved_len);
            Error::Shape(format!("{what} are more values than any buffer can hold"))
        })
    }

    /// Where `step`'s values per batch ([`Step::saved`]) are in an activation buffer of
    /// `capacity` samples: after every region.
    pub fn saved_values(&self, step: &Step, capacity: usize) -> Range<usize> {
        let start = self.region_offset(self.regions.len(), capacity);
        start + step.saved.start..start + step.saved.end
    }
}

/// A residual block opened by a `Fork` step and not yet closed by its `Add`.
struct Block {
    /// The fork's step index.
    fork: usize,
    /// The block's input: its region and shape.
    region: usize,
    shape: Shape,
    /// The module path of the sequence around the block, and the block's index in it.
    prefix: String,
    module: usize,
}

/// The innermost open block, closed by `layer` (an Add, step `index`) on the body's output
/// `shape`; an [`Error::Shape`] where no block is open or the body changed the shape.
fn close_block(blocks: &mut Vec<Block>, index: usize, layer: &Layer, shape: Shape) -> Result<Block> {
    let err = |what: String| Error::Shape(format!("layer {index} ({layer:?}) with input {shape}: {what}"));
    let block = blocks.pop().ok_or_else(|| err("no residual block is open (a Fork comes first)".into()))?;
    if block.shape != shape {
        let what = format!("the residual block opened at layer {} takes {} but its body gives {shape}", block.fork, block.shape);
        return Err(err(format!("{what}: a block must give back its input's shape")));
    }
    Ok(block)
}

/// The layer's output shape on `input`, or an [`Error::Shape`] naming the layer and the input.
fn output_shape(index: usize, layer: &Layer, input: Shape) -> Result<Shape> {
    let err = |what: String| Error::Shape(format!("layer {index} ({layer:?}) with input {input}: {what}"));
    if let Some(act) = layer.takes_activation() {
        if let (Some(value), Some(name)) = (act.param(), act.param_name()) {
            if !value.is_finite() {
                return Err(err(format!("the {name} {value} is not a finite number")));
            }
        }
    }
    layer.output_shape(input).map_err(err)
}

/// Lays `specs` out one after another from `start` in a flat buffer of `what` (parameters,
/// buffers): the tensors and where they end; or, where their sizes overflow, which part of the
/// error to say ("its parameters are", or "the parameters up to it are").
fn lay_out(specs: Vec<TensorSpec>, start: usize, what: &str) -> std::result::Result<(Vec<Tensor>, usize), String> {
    let lens: Option<Vec<usize>> = specs.iter().map(|t| t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))).collect();
    let total = lens.as_ref().and_then(|lens| fits(lens.iter().try_fold(0usize, |n, &l| n.checked_add(l))));
    let total = total.ok_or_else(|| format!("its {what} are"))?;
    let end = fits(start.checked_add(total)).ok_or_else(|| format!("the {what} up to it are"))?;
    let mut at = start;
    let tensors = specs
        .into_iter()
        .zip(lens.unwrap_or_default())
        .map(|(t, len)| {
            at += len;
            Tensor { name: t.name, shape: t.shape, range: at - len..at, fill: t.fill }
        })
        .collect();
    Ok((tensors, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::*;
    use crate::chain::Chain;
    use crate::chain::Shape;
    use crate::layers::residual::{Add, Fork};
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
    fn steps_name_their_modules_and_regions_count_their_readers() {
        let lenet = crate::models::lenet5().build().unwrap();
        let plan = &*lenet.plan;
        // Conv2d(0) ReLU(1) MaxPool2d(2) Conv2d(3) ReLU(4) MaxPool2d(5) Flatten(6) Linear(7) ReLU(8)
        // Linear(9) ReLU(10) Linear(11)
        let modules: Vec<&str> = plan.steps.iter().map(|s| s.module.as_str()).collect();
        assert_eq!(modules, ["0", "2", "3", "5", "6", "7", "9", "11"]);
        // the regions' readers: none for a z (its activation's pass reads it in place) or the
        // last output (the loss's); flatten is no reader, the dense layer after it is
        assert_eq!(plan.consumers, [1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0]);
        // nothing kept or saved: each step's kept regions are empty, after its output
        for step in &plan.steps {
            assert!(step.saved.is_empty() && step.buffers.is_empty(), "{step:?}");
            assert_eq!(step.kept, step.output_region + 1..step.output_region + 1, "{step:?}");
        }
        assert_eq!((plan.buffer_len, plan.saved_len), (0, 0));
        let names: Vec<(&str, &[usize])> = plan.steps[0].tensors.iter().map(|t| (t.name, &t.shape[..])).collect();
        assert_eq!(names, [("weight", &[6, 1, 5, 5][..]), ("bias", &[6][..])]);
        assert_eq!(plan.steps[0].tensors[0].fill, Fill::Fans { fan_in: 25, fan_out: 150 });
        assert_eq!(plan.steps[5].tensors[0].fill, Fill::Fans { fan_in: 400, fan_out: 120 });
        assert_eq!(plan.steps[5].tensors[1].fill, Fill::Constant(0.0));
    }

    /// A block's body is named `{i}.body.{j}` (nested blocks too), the Add is the block's module
    /// and its activation one more; the block input has two readers (the body's first step and
    /// the Add), so no step folds its gradient into the producer; Fork and Add point at each
    /// other's regions; a body that changes the shape, a block left open and an Add with no
    /// block are errors.
    #[test]
    fn residual_blocks_nest_name_their_bodies_and_count_the_skip_as_a_reader() {
        let plan = Chain::new(Shape::vector(4))
            .dense(4, Relu)
            .residual_with(Relu, |c| c.dense(4, Tanh).residual(|c| c.dense(4, Identity)).batch_norm())
            .dense(2, Identity)
            .build()
            .unwrap()
            .plan()
            .clone();
        let modules: Vec<&str> = plan.steps.iter().map(|s| s.module.as_str()).collect();
        // Linear(0) ReLU(1) Residual(2: Linear Tanh Residual(Linear) BatchNorm1d) ReLU(3) Linear(4)
        assert_eq!(modules, ["0", "2", "2.body.0", "2.body.2", "2.body.2.body.0", "2.body.2", "2.body.3", "2", "4"]);
        let (outer_fork, inner_fork, inner_add, outer_add) = (&plan.steps[1], &plan.steps[3], &plan.steps[5], &plan.steps[7]);
        // the dense layer's y is the outer block's input: read by the body's first step and the Add
        let block_input = plan.steps[0].output_region;
        assert_eq!((outer_fork.input_region, outer_fork.output_region), (block_input, block_input));
        assert_eq!(outer_add.skip, Some(block_input));
        assert_eq!(outer_fork.skip, Some(outer_add.z_region));
        assert_ne!(outer_add.z_region, outer_add.output_region, "the block's ReLU has a y of its own");
        assert_eq!(plan.consumers[block_input], 2);
        assert_eq!(plan.steps[2].activated_input, None, "the body's first step is not the block input's only reader");
        assert_eq!(inner_add.skip, Some(plan.steps[2].output_region));
        assert_eq!(inner_fork.skip, Some(inner_add.z_region));
        assert_eq!(plan.steps[8].activated_input, Some(7), "the Add's activation folds into the layer after it");
        let names: Vec<String> = crate::io::tensors(&plan).into_iter().map(|t| t.name).collect();
        for name in ["0.weight", "2.body.0.bias", "2.body.2.body.0.weight", "2.body.3.weight", "2.body.3.bias", "4.weight"] {
            assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
        }
        let buffers: Vec<String> = crate::io::buffer_tensors(&plan).into_iter().map(|t| t.name).collect();
        assert_eq!(buffers, ["2.body.3.num_batches_tracked", "2.body.3.running_mean", "2.body.3.running_var"]);

        let errors = [
            (Chain::new(Shape::vector(4)).residual(|c| c.dense(3, Relu)), "takes vector(4) but its body gives vector(3)"),
            (Chain::new(Shape::vector(4)).layer(Fork.into()).dense(4, Relu), "opened at layer 0 is never closed"),
            (Chain::new(Shape::vector(4)).dense(4, Relu).layer(Add { activation: Relu }.into()), "no residual block is open"),
        ];
        for (chain, needle) in errors {
            match chain.build() {
                Err(Error::Shape(msg)) => assert!(msg.contains(needle), "{msg:?} lacks {needle:?}"),
                other => panic!("expected a shape error with {needle:?}, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_sequence_is_step_major_and_flattens_to_a_vector() {
        let seq = Shape::sequence(8, 3);
        assert_eq!((seq.len(), seq.to_string()), (24, "sequence(8×3)".to_string()));
        assert_eq!(Shape::sequence(usize::MAX, 2).len(), usize::MAX);
        let plan = Plan::new(seq, &[Flatten.into(), Dense { out_features: 2, activation: Relu }.into()]).unwrap();
        assert_eq!(plan.steps[0].output, Shape::Vector(24));
        assert_eq!(plan.output(), Shape::Vector(2));
        for (layer, needle) in [
            (Layer::from(Dense { out_features: 2, activation: Relu }), "needs a vector input: add .flatten()"),
            (Conv { out_channels: 1, kernel: (1, 1), stride: (1, 1), padding: (0, 0), activation: Relu }.into(), "needs an image input"),
            (MaxPool { window: (1, 1), stride: (1, 1) }.into(), "needs an image input"),
        ] {
            let err = Plan::new(seq, &[layer]).unwrap_err().to_string();
            assert!(err.contains("with input sequence(8×3)") && err.contains(needle), "{err}");
        }
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
            (Shape::vector(3), vec![Layer::Dense(Dense { out_features: 2, activation: Elu(f32::INFINITY) })], "ELU alpha inf"),
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
