//! Flatten: an image (C, H, W) seen as a vector of C·H·W values, a sequence (steps, features)
//! as one of steps·features, or a signal (C, L) as one of C·L, in that order, as PyTorch's
//! `nn.Flatten` gives them. No data moves: the step keeps its input's region, so it has nothing
//! to run on either device, and no kernels.

use super::kind::{LayerKind, Mode};
use super::{BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Image, sequence or signal → vector, in the sample's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flatten;

impl Chain {
    /// Image, sequence or signal → vector.
    pub fn flatten(self) -> Chain {
        self.layer(Flatten.into())
    }
}

impl LayerKind for Flatten {
    const WORD: &'static str = "flatten";

    fn is_view(&self) -> bool {
        true
    }

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        match input {
            Shape::Image { .. } | Shape::Sequence { .. } | Shape::Signal { .. } => Ok(Shape::Vector(input.len())),
            Shape::Vector(_) => Err("the input is already a vector".into()),
        }
    }

    /// `flatten`
    fn describe(&self) -> String {
        Self::WORD.into()
    }

    fn parse(words: &Words) -> Result<Flatten> {
        match words.len() {
            1 => Ok(Flatten),
            _ => Err(words.unknown()),
        }
    }

    fn summary(&self, _input: Shape) -> String {
        "Flatten".into()
    }

    fn forward(&self, _step: &Step, _pass: &mut Pass, _mode: Mode) {}

    fn backward(&self, _step: &Step, _pass: &mut BackPass) {}

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, _step: &Step, _pass: &mut super::spec::Pass<F>, _mode: Mode) {}

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, _step: &Step, _pass: &mut super::spec::BackPass<F>) {}

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, _step: &Step, _pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, _step: &Step, _pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        Ok(())
    }
}
