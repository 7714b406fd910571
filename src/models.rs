//! The networks the examples, benches and tests train, as chains ready to build.

use crate::activation::Activation::{Identity, Relu};
use crate::chain::{Chain, ConvOptions, Input};

/// The MLP 784-128-64-10 with ReLU, for 28×28 images given as vectors (MNIST).
pub fn mlp() -> Chain {
    Chain::new(Input::vector(784)).dense(128, Relu).dense(64, Relu).dense(10, Identity)
}

/// LeNet-5 with ReLU on 1×28×28 images (C×H×W): conv 5×5×6 pad 2, max-pool 2, conv 5×5×16, max-pool 2,
/// dense 120, 84, 10.
pub fn lenet5() -> Chain {
    Chain::new(Input::image(1, 28, 28))
        .conv_with(6, (5, 5), Relu, ConvOptions { stride: (1, 1), padding: (2, 2) })
        .max_pool((2, 2))
        .conv(16, (5, 5), Relu)
        .max_pool((2, 2))
        .flatten()
        .dense(120, Relu)
        .dense(84, Relu)
        .dense(10, Identity)
}

/// The SimpleNNs documentation CNN on 1×28×28 images (C×H×W): conv 5×5×16, max-pool 2, conv 3×3×8,
/// max-pool 4, flatten, dense 10.
pub fn simplenns_cnn() -> Chain {
    Chain::new(Input::image(1, 28, 28))
        .conv(16, (5, 5), Relu)
        .max_pool((2, 2))
        .conv(8, (3, 3), Relu)
        .max_pool((4, 4))
        .flatten()
        .dense(10, Identity)
}

/// The SimpleNNs documentation regression network 100-200(ReLU)-1.
pub fn simplenns_mlp() -> Chain {
    Chain::new(Input::vector(100)).dense(200, Relu).dense(1, Identity)
}
