//! Conv1d: 1-D cross-correlation over a signal (C, L) with stride, zero padding and dilation,
//! then act, as PyTorch's `nn.Conv1d`. Weight (out_channels, in_channels, k) then bias
//! (out_channels):
//!
//!   z[oc, x] = b[oc] + Σ_{c,j} w[oc, c, j] · in[c, x·s + j·d − p]
//!
//! It is the 2-D convolution over a height of 1 (kernel (1, k), stride (1, s), padding (0, p),
//! dilation (1, d)), and runs as one: `layers/conv.rs`'s plain loops, lowering and fast path on
//! the CPU, `cuda/conv.rs` (its kernels in `kernels/conv.cu`, and cuDNN where it was measured
//! faster) on the GPU. So it has no kernel file of its own; its shape, tensors and words are
//! here.

use super::conv::{output_size, scratch_len, Geometry};
use super::conv_fast::{step_backward, step_forward};
use super::kind::{LayerKind, Mode, TensorSpec};
use super::{BackPass, Pass};
use crate::activation::Activation;
use crate::chain::{fits, Chain, Fill, Shape, Step};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// A 1-D convolution (cross-correlation) with zero padding and dilation, then act: W
/// (out_channels, in_channels, kernel), on a signal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conv1d {
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub activation: Activation,
}

/// Options of a 1-D convolution beyond its output channels, kernel and activation, PyTorch's
/// defaults by [`Default`]: stride 1, no padding, dilation 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv1dOptions {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
}

impl Default for Conv1dOptions {
    fn default() -> Self {
        Conv1dOptions { stride: 1, padding: 0, dilation: 1 }
    }
}

impl Chain {
    /// 1-D convolution with stride 1, no padding and no dilation.
    pub fn conv1d(self, out_channels: usize, kernel: usize, activation: Activation) -> Chain {
        self.conv1d_with(out_channels, kernel, activation, Conv1dOptions::default())
    }

    /// 1-D convolution with explicit stride, zero padding and dilation.
    pub fn conv1d_with(self, out_channels: usize, kernel: usize, activation: Activation, options: Conv1dOptions) -> Chain {
        let Conv1dOptions { stride, padding, dilation } = options;
        self.layer(Conv1d { out_channels, kernel, stride, padding, dilation, activation }.into())
    }
}

impl LayerKind for Conv1d {
    const WORD: &'static str = "conv1d";

    fn activation(&self) -> Option<Activation> {
        Some(self.activation)
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        let Conv1d { out_channels, kernel, stride, padding, dilation, .. } = *self;
        let Shape::Signal { channels, length } = input else {
            return Err("needs a signal input".into());
        };
        if out_channels == 0 || kernel == 0 || stride == 0 || dilation == 0 {
            return Err("output channels, kernel, stride and dilation must be at least 1".into());
        }
        let Some(padded) = padding.checked_mul(2).and_then(|p| p.checked_add(length)) else {
            return Err("the padded input's size overflows".into());
        };
        // the kernel's taps reach d·(k − 1) + 1 values
        let Some(span) = (kernel - 1).checked_mul(dilation).and_then(|s| s.checked_add(1)) else {
            return Err("the dilated kernel's size overflows".into());
        };
        let Some((_, out)) = output_size((1, length), (1, kernel), (1, stride), (0, padding), (1, dilation)) else {
            return Err(format!("kernel {kernel} dilated by {dilation} spans {span}, more than the padded input's {padded}"));
        };
        if padding >= span {
            return Err("padding must be smaller than the kernel's span".into());
        }
        if fits(scratch_len(channels, (1, kernel), (1, out), (1, padded))).is_none() {
            return Err("lowering one sample takes more values than any buffer can hold".into());
        }
        Ok(Shape::Signal { channels: out_channels, length: out })
    }

    /// `weight` (out_channels, in_channels, k), drawn with fan-in in·k and fan-out out·k; `bias`
    /// (out_channels), zero.
    fn params(&self, input: Shape, _output: Shape) -> Vec<TensorSpec> {
        let Shape::Signal { channels, .. } = input else { unreachable!("the plan gives 1-D convolutions signal inputs") };
        let (oc, k) = (self.out_channels, self.kernel);
        // the plan checks the product of the shape; these fans are at most it
        let (fan_in, fan_out) = (channels.saturating_mul(k), oc.saturating_mul(k));
        vec![
            TensorSpec { name: "weight", shape: vec![oc, channels, k], fill: Fill::Fans { fan_in, fan_out } },
            TensorSpec { name: "bias", shape: vec![oc], fill: Fill::Constant(0.0) },
        ]
    }

    /// `conv1d OUT K STRIDE PADDING DILATION ACTIVATION`
    fn describe(&self) -> String {
        let Conv1d { out_channels, kernel, stride, padding, dilation, activation } = *self;
        format!("conv1d {out_channels} {kernel} {stride} {padding} {dilation} {}", activation.name())
    }

    fn parse(words: &Words) -> Result<Conv1d> {
        let [out_channels, kernel, stride, padding, dilation] = words.numbers()?;
        Ok(Conv1d { out_channels, kernel, stride, padding, dilation, activation: words.activation(6)? })
    }

    fn summary(&self, input: Shape) -> String {
        let channels = match input {
            Shape::Signal { channels, .. } => channels,
            Shape::Vector(_) | Shape::Image { .. } | Shape::Sequence { .. } => 0,
        };
        let Conv1d { out_channels, kernel, stride, padding, dilation, .. } = *self;
        let dilated = if dilation == 1 { String::new() } else { format!(", dilation {dilation}") };
        format!("Conv1d({channels} → {out_channels}, {kernel}, stride {stride}, pad {padding}{dilated})")
    }

    fn forward(&self, step: &Step, pass: &mut Pass, mode: Mode) {
        step_forward(&self.geometry(step), self.activation, step, pass, mode);
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        step_backward(&self.geometry(step), self.activation, step, pass);
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        super::conv::step_forward_spec(&self.geometry(step), self.activation, step, pass);
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        super::conv::step_backward_spec(&self.geometry(step), self.activation, step, pass);
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

impl Conv1d {
    /// The 2-D convolution's geometry over a height of 1.
    pub(crate) fn geometry(&self, step: &Step) -> Geometry {
        Geometry::new(step.input, step.output, (1, self.kernel), (1, self.stride), (0, self.padding), (1, self.dilation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Identity, Relu, Tanh};

    #[test]
    fn lengths_follow_pytorchs_rule() {
        // L_out = ⌊(L + 2p − d·(k − 1) − 1) / s⌋ + 1, as nn.Conv1d
        let cases = [(256, 7, 1, 0, 1, 250), (125, 5, 1, 0, 1, 121), (19, 3, 2, 2, 3, 9), (10, 4, 3, 1, 2, 2), (5, 5, 1, 0, 1, 1)];
        for (length, kernel, stride, padding, dilation, want) in cases {
            let options = Conv1dOptions { stride, padding, dilation };
            let model = Chain::new(Shape::signal(2, length)).conv1d_with(3, kernel, Relu, options).build().unwrap();
            assert_eq!(model.output_shape(), Shape::signal(3, want), "L {length} k {kernel} s {stride} p {padding} d {dilation}");
            assert_eq!(model.plan.steps[0].tensors[0].shape, [3, 2, kernel]);
        }
        for (input, options, needle) in [
            (Shape::image(1, 1, 8), Conv1dOptions::default(), "needs a signal input"),
            (Shape::signal(1, 4), Conv1dOptions { dilation: 2, ..Conv1dOptions::default() }, "spans 5, more than the padded input's 4"),
            (Shape::signal(1, 8), Conv1dOptions { padding: 3, ..Conv1dOptions::default() }, "padding must be smaller"),
            (Shape::signal(1, 8), Conv1dOptions { stride: 0, ..Conv1dOptions::default() }, "at least 1"),
        ] {
            let err = Chain::new(input).conv1d_with(2, 3, Identity, options).build().unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn gradients_and_the_fast_path_match_the_spec() {
        use crate::layers::gradcheck::{fast_matches_spec, gradients_match_finite_differences};
        let strided = Conv1dOptions { stride: 2, padding: 2, dilation: 3 };
        let chain =
            || Chain::new(Shape::signal(2, 19)).conv1d_with(3, 3, Tanh, strided).conv1d(4, 2, crate::Gelu).flatten().dense(3, Identity);
        gradients_match_finite_differences("conv1d", chain(), &[crate::Loss::LogitCrossEntropy], 31);
        for threads in [1, 2, 3] {
            fast_matches_spec(&chain().build().unwrap().with_threads(threads).unwrap(), 32, "conv1d");
        }
    }
}
