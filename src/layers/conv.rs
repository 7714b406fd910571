//! Conv: 2-D cross-correlation with zero padding, as PyTorch's `nn.Conv2d`.
//! Weight (out_channels, in_channels, kh, kw) then bias (out_channels); a sample is (C, H, W).
//!
//!   z[oc, y, x] = b[oc] + Σ_{c,i,j} w[oc, c, i, j] · in[c, y·sh + i·dh − ph, x·sw + j·dw − pw]
//!
//! with dilation (dh, dw) = (1, 1) here; the 1-D convolution (`layers/conv1d.rs`) is this over a
//! height of 1, with a dilation, and shares everything below (the [`Geometry`], the lowering, the
//! plain loops, the fast path, and on the GPU `cuda/conv.rs` and cuDNN).
//!
//! The fast path (`layers/conv_fast.rs`) is `cpu::conv`: the weights packed once per parameter
//! version in the cache, and per direction and batch bucket the route (im2col + GEMM, or the
//! GEMM on shifted windows of the padded input) that was faster on this layer's shape when this
//! process first timed them (`cpu::conv::choice`). `cpu::conv` has no dilation: a dilated
//! convolution (a 1-D one with dilation > 1) runs instead through `layers/lowering.rs`, im2col
//! and a GEMM per sample, whose lowering reads dilated taps ([`packed`] says which).

#![deny(clippy::undocumented_unsafe_blocks)]

use super::conv_fast::{step_backward, step_forward};
use super::kind::{LayerKind, Mode, TensorSpec};
#[cfg(test)]
use super::split2;
use super::{BackPass, Layer, Pass};
use crate::activation::Activation;
use crate::chain::{fits, Chain, Fill, Plan, Shape, Step};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;
use crate::summary::pair;

/// A 2-D convolution (cross-correlation) with zero padding, then act: W (out_channels,
/// in_channels, kh, kw), on an image.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conv {
    pub out_channels: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub activation: Activation,
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

impl Chain {
    /// Convolution with stride 1 and no padding.
    pub fn conv(self, out_channels: usize, kernel: (usize, usize), activation: Activation) -> Chain {
        self.conv_with(out_channels, kernel, activation, ConvOptions::default())
    }

    /// Convolution with explicit stride and zero padding.
    pub fn conv_with(self, out_channels: usize, kernel: (usize, usize), activation: Activation, options: ConvOptions) -> Chain {
        let ConvOptions { stride, padding } = options;
        self.layer(Conv { out_channels, kernel, stride, padding, activation }.into())
    }
}

impl LayerKind for Conv {
    const WORD: &'static str = "conv";

    fn activation(&self) -> Option<Activation> {
        Some(self.activation)
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        let Conv { out_channels, kernel, stride, padding, .. } = *self;
        let Shape::Image { channels, height, width } = input else {
            return Err("needs an image input".into());
        };
        if out_channels == 0 || kernel.0 == 0 || kernel.1 == 0 || stride.0 == 0 || stride.1 == 0 {
            return Err("output channels, kernel and stride must be at least 1".into());
        }
        let padded = |n: usize, p: usize| p.checked_mul(2).and_then(|p| p.checked_add(n));
        let (Some(ph), Some(pw)) = (padded(height, padding.0), padded(width, padding.1)) else {
            return Err("the padded input's size overflows".into());
        };
        let Some((oh, ow)) = output_size((height, width), kernel, stride, padding, (1, 1)) else {
            return Err(format!("kernel {}×{} is larger than the padded input {ph}×{pw}", kernel.0, kernel.1));
        };
        if padding.0 >= kernel.0 || padding.1 >= kernel.1 {
            return Err("padding must be smaller than the kernel".into());
        }
        if fits(scratch_len(channels, kernel, (oh, ow), (ph, pw))).is_none() {
            return Err("lowering one sample takes more values than any buffer can hold".into());
        }
        Ok(Shape::Image { channels: out_channels, height: oh, width: ow })
    }

    /// `weight` (out_channels, in_channels, kh, kw), drawn with fan-in in·kh·kw and fan-out
    /// out·kh·kw; `bias` (out_channels), zero.
    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let Shape::Image { channels, .. } = input else { unreachable!("the plan gives convolutions image inputs") };
        let (oc, (kh, kw)) = (self.out_channels, self.kernel);
        // the plan checks the product of the shape; these fans are at most it
        let (fan_in, fan_out) = (channels.saturating_mul(kh * kw), oc.saturating_mul(kh * kw));
        vec![
            TensorSpec { name: "weight", shape: vec![oc, channels, kh, kw], fill: Fill::Fans { fan_in, fan_out } },
            TensorSpec { name: "bias", shape: vec![oc], fill: Fill::Constant(0.0) },
        ]
    }

    /// `conv OUT KH KW SH SW PH PW ACTIVATION`
    fn describe(&self) -> String {
        let Conv { out_channels, kernel, stride, padding, activation } = *self;
        format!("conv {out_channels} {} {} {} {} {} {} {}", kernel.0, kernel.1, stride.0, stride.1, padding.0, padding.1, activation.name())
    }

    fn parse(words: &Words) -> Result<Conv> {
        let [out_channels, kh, kw, sh, sw, ph, pw] = words.numbers()?;
        Ok(Conv { out_channels, kernel: (kh, kw), stride: (sh, sw), padding: (ph, pw), activation: words.activation(8)? })
    }

    fn summary(&self, input: Shape) -> String {
        let channels = match input {
            Shape::Image { channels, .. } => channels,
            Shape::Vector(_) | Shape::Sequence { .. } | Shape::Signal { .. } => 0,
        };
        let Conv { out_channels, kernel, stride, padding, .. } = *self;
        format!("Conv({channels} → {out_channels}, {}×{}, stride {}, pad {})", kernel.0, kernel.1, pair(stride), pair(padding))
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        step_forward(&self.geometry(step), self.activation, step, pass, mode);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        step_backward(&self.geometry(step), self.activation, step, pass);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        step_forward_spec(&self.geometry(step), self.activation, step, pass);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        step_backward_spec(&self.geometry(step), self.activation, step, pass);
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, mode: Mode) -> Result<()> {
        let g = self.geometry(step);
        crate::cuda::conv::conv_forward(pass, step, self.activation, (g.out_channels, g.ohw()), mode)
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        let g = self.geometry(step);
        crate::cuda::conv::conv_backward(pass, step, self.activation, (g.out_channels, g.ohw()))
    }
}

/// Whether a convolution runs on `cpu::conv` with packed weights: all but the dilated ones,
/// which `cpu::conv` does not compute.
pub(crate) fn packed(g: &Geometry) -> bool {
    g.dilation == (1, 1)
}

/// A convolution step's plain-loop forward.
#[cfg(test)]
pub(crate) fn step_forward_spec<F: Float>(g: &Geometry, activation: Activation, step: &Step, pass: &mut super::spec::Pass<F>) {
    let (x, z) = (pass.region(step.input_region), pass.region(step.z_region));
    let (w, b) = step.weight_and_bias();
    let (xs, zs) = split2(pass.acts, x, z);
    forward_spec(g, pass.batch, &pass.params[w], &pass.params[b], xs, zs);
    pass.activate(step, activation);
}

/// A convolution step's plain-loop backward.
#[cfg(test)]
pub(crate) fn step_backward_spec<F: Float>(g: &Geometry, activation: Activation, step: &Step, pass: &mut super::spec::BackPass<F>) {
    let batch = pass.batch;
    pass.weighted(step, activation, |w, x, dz, dw, db, dx| backward_spec(g, batch, w, x, dz, dw, db, dx));
}

impl Conv {
    fn geometry(&self, step: &Step) -> Geometry {
        Geometry::new(step.input, step.output, self.kernel, self.stride, self.padding, (1, 1))
    }
}

/// The output (OH, OW) of a convolution over (H, W): in each dimension, n inputs padded by p on
/// each side, read by k taps d apart (which span d·(k − 1) + 1 inputs) at stride s, give
/// ⌊(n + 2p − d·(k − 1) − 1)/s⌋ + 1 outputs, PyTorch's rule. None where a kernel, stride or
/// dilation is 0, a size overflows, or a kernel's span is more than its padded input. Both
/// convolutions' shape rules take their sizes from it (a 1-D one as a height of 1).
pub(crate) fn output_size(
    input: (usize, usize),
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
) -> Option<(usize, usize)> {
    let size = |n: usize, k: usize, s: usize, p: usize, d: usize| {
        if d == 0 {
            return None;
        }
        let padded = p.checked_mul(2)?.checked_add(n)?;
        let span = k.checked_sub(1)?.checked_mul(d)?.checked_add(1)?;
        Some(padded.checked_sub(span)?.checked_div(s)? + 1)
    };
    Some((size(input.0, kernel.0, stride.0, padding.0, dilation.0)?, size(input.1, kernel.1, stride.1, padding.1, dilation.1)?))
}

/// Values a convolution lowers one sample into, an upper bound of both devices' scratch:
/// C·kh·kw × OH·OW (the lowered sample), then C·(H + 2·ph)·(W + 2·pw) (the padded input copy
/// of [`Geometry::col_len`]). None when that overflows.
pub(crate) fn scratch_len(channels: usize, kernel: (usize, usize), output: (usize, usize), padded: (usize, usize)) -> Option<usize> {
    let lowered = channels.checked_mul(kernel.0)?.checked_mul(kernel.1)?.checked_mul(output.0)?.checked_mul(output.1)?;
    let padded = channels.checked_mul(padded.0)?.checked_mul(padded.1)?;
    lowered.checked_add(padded)
}

/// The geometry of a step, which must be a convolution's (2-D or 1-D).
pub(crate) fn geometry(step: &Step) -> Geometry {
    match step.layer {
        Layer::Conv(conv) => conv.geometry(step),
        Layer::Conv1d(conv) => conv.geometry(step),
        _ => unreachable!("not a convolution: {:?}", step.layer),
    }
}

/// Whether `layer` is a convolution, 2-D or 1-D (what [`geometry`] takes).
pub(crate) fn is_conv(layer: &Layer) -> bool {
    matches!(layer, Layer::Conv(_) | Layer::Conv1d(_))
}

/// The plan's convolution steps, 2-D and 1-D.
pub(crate) fn steps(plan: &Plan) -> impl Iterator<Item = &Step> {
    plan.steps.iter().filter(|s| is_conv(&s.layer))
}

/// The plan's convolutions that run through the lowering below, not `cpu::conv` ([`packed`]).
pub(crate) fn lowered_steps(plan: &Plan) -> impl Iterator<Item = &Step> {
    steps(plan).filter(|s| !packed(&geometry(s)))
}

/// The longest lowered sample (im2col columns) of any convolution in the plan that runs
/// through the lowering ([`lowered_steps`]; at most `plan::MAX_VALUES`: the shape rule checked
/// a bound of it).
pub(crate) fn max_col_len(plan: &Plan) -> usize {
    lowered_steps(plan).map(|s| geometry(s).col_len()).max().unwrap_or(0)
}

/// Geometry of one convolution, derived from its plan step: a 1-D one's is a 2-D one's of height
/// 1 (kernel (1, k), stride (1, s), padding (0, p), dilation (1, d)).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub out_height: usize,
    pub out_width: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    /// The spacing of the kernel's taps: tap (i, j) reads input (y·sh + i·dh − ph, x·sw + j·dw − pw).
    pub dilation: (usize, usize),
}

impl Geometry {
    /// From the layer's input and output shapes (images, or signals as images of height 1) and
    /// its kernel, stride, padding and dilation.
    pub fn new(
        input: Shape,
        output: Shape,
        kernel: (usize, usize),
        stride: (usize, usize),
        padding: (usize, usize),
        dilation: (usize, usize),
    ) -> Geometry {
        let planes = |shape| match shape {
            Shape::Image { channels, height, width } => (channels, height, width),
            Shape::Signal { channels, length } => (channels, 1, length),
            Shape::Vector(_) | Shape::Sequence { .. } => unreachable!("the plan gives convolutions images or signals"),
        };
        let ((channels, height, width), (oc, oh, ow)) = (planes(input), planes(output));
        let (in_channels, out_channels, out_height, out_width) = (channels, oc, oh, ow);
        Geometry { in_channels, height, width, out_channels, out_height, out_width, kernel, stride, padding, dilation }
    }

    /// Rows of the lowered matrix: C·kh·kw.
    pub fn ckk(&self) -> usize {
        self.in_channels * self.kernel.0 * self.kernel.1
    }

    /// Output pixels per channel: OH·OW.
    pub fn ohw(&self) -> usize {
        self.out_height * self.out_width
    }

    pub(crate) fn in_len(&self) -> usize {
        self.in_channels * self.height * self.width
    }

    pub(crate) fn out_len(&self) -> usize {
        self.out_channels * self.ohw()
    }

    /// Floats of a lowered sample: CKK × OHW.
    pub fn lowered_len(&self) -> usize {
        self.ckk() * self.ohw()
    }

    /// (H + 2·ph, W + 2·pw): the input as the lowering reads it.
    pub(crate) fn padded_size(&self) -> (usize, usize) {
        (self.height + 2 * self.padding.0, self.width + 2 * self.padding.1)
    }

    /// Floats of the zero-padded input copy, C × (H + 2·ph) × (W + 2·pw); 0 without padding
    /// (the input is read in place).
    pub(crate) fn padded_len(&self) -> usize {
        let (hp, wp) = self.padded_size();
        if self.padding == (0, 0) {
            0
        } else {
            self.in_channels * hp * wp
        }
    }

    /// Scratch floats one thread needs: a lowered sample, then the padded input copy.
    pub fn col_len(&self) -> usize {
        self.lowered_len() + self.padded_len()
    }

    /// Input pixel read by lowered row `r` = (c, i, j) at output pixel (y, x), if not padding.
    #[cfg(test)]
    pub(crate) fn source(&self, c: usize, i: usize, j: usize, y: usize, x: usize) -> Option<usize> {
        let iy = (y * self.stride.0 + i * self.dilation.0).checked_sub(self.padding.0).filter(|&v| v < self.height)?;
        let ix = (x * self.stride.1 + j * self.dilation.1).checked_sub(self.padding.1).filter(|&v| v < self.width)?;
        Some((c * self.height + iy) * self.width + ix)
    }
}

#[cfg(test)]
/// Plain-loop forward (the spec), bias included.
pub fn forward_spec<F: Float>(g: &Geometry, batch: usize, w: &[F], b: &[F], x: &[F], z: &mut [F]) {
    let (kh, kw) = g.kernel;
    for s in 0..batch {
        let (xs, zs) = (&x[s * g.in_len()..], &mut z[s * g.out_len()..]);
        for oc in 0..g.out_channels {
            for y in 0..g.out_height {
                for xo in 0..g.out_width {
                    let mut acc = b[oc];
                    for c in 0..g.in_channels {
                        for i in 0..kh {
                            for j in 0..kw {
                                if let Some(src) = g.source(c, i, j, y, xo) {
                                    acc += w[((oc * g.in_channels + c) * kh + i) * kw + j] * xs[src];
                                }
                            }
                        }
                    }
                    zs[(oc * g.out_height + y) * g.out_width + xo] = acc;
                }
            }
        }
    }
}

#[cfg(test)]
/// Plain-loop backward (the spec): dW, db overwritten; dX overwritten when given.
#[allow(clippy::too_many_arguments)]
pub fn backward_spec<F: Float>(
    g: &Geometry,
    batch: usize,
    w: &[F],
    x: &[F],
    dz: &[F],
    dw: &mut [F],
    db: &mut [F],
    mut dx: Option<&mut [F]>,
) {
    let (kh, kw) = g.kernel;
    dw.iter_mut().chain(db.iter_mut()).for_each(|v| *v = F::ZERO);
    if let Some(dx) = dx.as_deref_mut() {
        dx[..batch * g.in_len()].iter_mut().for_each(|v| *v = F::ZERO);
    }
    for s in 0..batch {
        for oc in 0..g.out_channels {
            for y in 0..g.out_height {
                for xo in 0..g.out_width {
                    let d = dz[s * g.out_len() + (oc * g.out_height + y) * g.out_width + xo];
                    db[oc] += d;
                    for c in 0..g.in_channels {
                        for i in 0..kh {
                            for j in 0..kw {
                                if let Some(src) = g.source(c, i, j, y, xo) {
                                    let wi = ((oc * g.in_channels + c) * kh + i) * kw + j;
                                    dw[wi] += d * x[s * g.in_len() + src];
                                    if let Some(dx) = dx.as_deref_mut() {
                                        dx[s * g.in_len() + src] += d * w[wi];
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::output_size;

    /// Every small (n, k, s, p, d) in both dimensions against PyTorch's formula in signed
    /// arithmetic: a size where the span fits the padded input, else None; None for a zero kernel,
    /// stride or dilation and for sizes that overflow.
    #[test]
    fn output_size_is_pytorchs_rule() {
        let rule = |n: usize, k: usize, s: usize, p: usize, d: usize| {
            let (n, k, s, p, d) = (n as i64, k as i64, s as i64, p as i64, d as i64);
            let room = n + 2 * p - d * (k - 1) - 1;
            (room >= 0).then(|| (room / s + 1) as usize)
        };
        for n in 1..9 {
            for k in 1..5 {
                for s in 1..4 {
                    for p in 0..4 {
                        for d in 1..4 {
                            let want = rule(n, k, s, p, d);
                            assert_eq!(output_size((n, 1), (k, 1), (s, 1), (p, 0), (d, 1)), want.map(|o| (o, 1)), "{:?}", (n, k, s, p, d));
                            assert_eq!(output_size((3, n), (2, k), (1, s), (1, p), (2, d)), want.map(|o| (3, o)), "{:?}", (n, k, s, p, d));
                        }
                    }
                }
            }
        }
        for (kernel, stride, dilation) in [((0, 1), (1, 1), (1, 1)), ((1, 1), (1, 0), (1, 1)), ((2, 1), (1, 1), (0, 1))] {
            assert_eq!(output_size((5, 5), kernel, stride, (0, 0), dilation), None);
        }
        assert_eq!(output_size((5, 5), (3, 3), (1, 1), (usize::MAX / 2, 0), (1, 1)), None);
        assert_eq!(output_size((5, 5), (3, usize::MAX), (1, 1), (0, 0), (1, 2)), None);
    }
}
