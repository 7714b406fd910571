//! The networks the examples, benches and tests train, as chains ready to build.

use crate::activation::Activation::{Gelu, Identity, Relu, Sigmoid};
use crate::chain::{Chain, ConvOptions, Input};
use crate::layers::recurrent::RnnOutput;

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

/// The autoencoder 784-256-64-256-784: ReLU inside, sigmoid output (for MSE against inputs in
/// [0, 1]).
pub fn autoencoder() -> Chain {
    Chain::new(Input::vector(784)).dense(256, Relu).dense(64, Relu).dense(256, Relu).dense(784, Sigmoid)
}

/// The wide MLP 512-1024-1024-16 with GELU (the erf form, PyTorch's default `nn.GELU()`), for
/// cross-entropy over 16 classes.
pub fn gelu_mlp() -> Chain {
    Chain::new(Input::vector(512)).dense(1024, Gelu).dense(1024, Gelu).dense(16, Identity)
}

/// A small VGG-style CNN on 3×32×32 images (C×H×W, CIFAR-sized): two conv 3×3×16 pad 1, max-pool
/// 2, two conv 3×3×32 pad 1, max-pool 2, flatten (32×8×8), dense 64, dense 10; ReLU throughout.
pub fn vgg_small() -> Chain {
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    Chain::new(Input::image(3, 32, 32))
        .conv_with(16, (3, 3), Relu, same)
        .conv_with(16, (3, 3), Relu, same)
        .max_pool((2, 2))
        .conv_with(32, (3, 3), Relu, same)
        .conv_with(32, (3, 3), Relu, same)
        .max_pool((2, 2))
        .flatten()
        .dense(64, Relu)
        .dense(10, Identity)
}

/// A small ResNet on 3×32×32 images (C×H×W, CIFAR-sized): conv 3×3×16 pad 1, batch norm, ReLU,
/// then three residual blocks (conv 3×3×16 pad 1, batch norm, ReLU, conv 3×3×16 pad 1, batch
/// norm; ReLU after the sum), global average pool, dense 10; for cross-entropy.
pub fn resnet_small() -> Chain {
    let same = ConvOptions { stride: (1, 1), padding: (1, 1) };
    let block = |c: Chain| c.conv_with(16, (3, 3), Identity, same).batch_norm_with(Relu).conv_with(16, (3, 3), Identity, same).batch_norm();
    Chain::new(Input::image(3, 32, 32))
        .conv_with(16, (3, 3), Identity, same)
        .batch_norm_with(Relu)
        .residual_with(Relu, block)
        .residual_with(Relu, block)
        .residual_with(Relu, block)
        .global_avg_pool()
        .dense(10, Identity)
}

/// A 1-D CNN over signals of 1×256 values (C×L, a time series), 4 classes: conv1d 16 k7 (ReLU),
/// max-pool 2, conv1d 32 k5 (ReLU), global average pool, dense 4; for cross-entropy.
pub fn ts_conv1d() -> Chain {
    Chain::new(Input::signal(1, 256)).conv1d(16, 7, Relu).max_pool1d(2).conv1d(32, 5, Relu).global_avg_pool().dense(4, Identity)
}

/// A GRU of 64 units over sequences of 128 steps of one feature, its last hidden state into one
/// output (for MSE): a one-step-ahead regressor of a signal.
pub fn gru_seq() -> Chain {
    Chain::new(Input::sequence(128, 1)).gru(64, RnnOutput::LastStep).dense(1, Identity)
}

/// An LSTM of 128 units over sequences of 64 steps of 8 features, its last hidden state into 4
/// class scores (for cross-entropy).
pub fn lstm_seq() -> Chain {
    Chain::new(Input::sequence(64, 8)).lstm(128, RnnOutput::LastStep).dense(4, Identity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Shape;

    /// Parameters of a dense layer, of a k×k convolution and of a 1-D one of k, weights and
    /// biases.
    fn dense(inputs: usize, outputs: usize) -> usize {
        inputs * outputs + outputs
    }
    fn conv(in_channels: usize, out_channels: usize, k: usize) -> usize {
        in_channels * out_channels * k * k + out_channels
    }
    fn conv1d(in_channels: usize, out_channels: usize, k: usize) -> usize {
        in_channels * out_channels * k + out_channels
    }
    /// A batch norm's weight and bias.
    fn batch_norm(channels: usize) -> usize {
        2 * channels
    }
    /// A recurrent layer of `gates` gates: W_ih, W_hh and both biases.
    fn recurrent(gates: usize, inputs: usize, hidden: usize) -> usize {
        gates * hidden * (inputs + hidden + 2)
    }

    /// Each network has the parameter count and output shape its description implies (the
    /// zoo's peers are checked against the same counts).
    #[test]
    fn zoo_models_have_the_described_shapes() {
        let cases = [
            (autoencoder(), dense(784, 256) + dense(256, 64) + dense(64, 256) + dense(256, 784), 784),
            (gelu_mlp(), dense(512, 1024) + dense(1024, 1024) + dense(1024, 16), 16),
            (vgg_small(), conv(3, 16, 3) + conv(16, 16, 3) + conv(16, 32, 3) + conv(32, 32, 3) + dense(32 * 8 * 8, 64) + dense(64, 10), 10),
            (ts_conv1d(), conv1d(1, 16, 7) + conv1d(16, 32, 5) + dense(32, 4), 4),
            (resnet_small(), conv(3, 16, 3) + batch_norm(16) + 3 * 2 * (conv(16, 16, 3) + batch_norm(16)) + dense(16, 10), 10),
            (gru_seq(), recurrent(3, 1, 64) + dense(64, 1), 1),
            (lstm_seq(), recurrent(4, 8, 128) + dense(128, 4), 4),
        ];
        for (chain, params, outputs) in cases {
            let model = chain.build().unwrap();
            assert_eq!(model.parameters().unwrap().len(), params, "{model:?}");
            assert_eq!(model.output_shape(), Shape::Vector(outputs), "{model:?}");
        }
        // Conv1d(0) ReLU(1) MaxPool1d(2) Conv1d(3) ReLU(4) AdaptiveAvgPool1d(5) Flatten(6) Linear(7),
        // as benches/peers/zoo_models.py's twin names them
        let plan = ts_conv1d().build().unwrap().plan().clone();
        assert_eq!(plan.steps.iter().map(|s| s.module.as_str()).collect::<Vec<_>>(), ["0", "2", "3", "5", "7"]);
        // Conv2d(0) BatchNorm2d(1) ReLU(2), then each Residual(Conv2d BatchNorm2d ReLU Conv2d
        // BatchNorm2d) and its ReLU (3 and 4, 5 and 6, 7 and 8), AdaptiveAvgPool2d(9) Flatten(10)
        // Linear(11), as the twin names them
        let plan = resnet_small().build().unwrap().plan().clone();
        let modules: Vec<&str> = plan.steps.iter().map(|s| s.module.as_str()).collect();
        let block = |i: usize| {
            [format!("{i}"), format!("{i}.body.0"), format!("{i}.body.1"), format!("{i}.body.3"), format!("{i}.body.4"), format!("{i}")]
        };
        let want: Vec<String> = ["0".to_string(), "1".to_string()]
            .into_iter()
            .chain([3, 5, 7].into_iter().flat_map(block))
            .chain(["9".into(), "11".into()])
            .collect();
        assert_eq!(modules, want);
    }
}
