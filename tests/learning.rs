//! The engine learns, and it is deterministic: same seed and thread count, same bits.

use flatnn::prelude::*;
use flatnn::testutil::Rng;

/// Two interleaved spirals-ish classes: label = sign of x·y, a problem a linear model cannot solve.
fn quadrants(n: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let x = rng.uniform(2 * n);
    let labels = x.chunks(2).map(|p| u32::from(p[0] * p[1] > 0.0)).collect();
    (x, labels)
}

fn train(chain: Chain, threads: usize, optim: Optim, steps: usize) -> (Model, f32, f32) {
    let mut model = chain.build().unwrap().init(Init::HeNormal, 7).with_threads(threads).unwrap();
    let (x, labels) = quadrants(256, 3);
    let mut fwd = model.preallocate(64).unwrap();
    let mut bwd = model.preallocate_grads(64).unwrap();
    let mut opt = Optimizer::new(&model, optim).unwrap();
    let (mut first, mut last) = (f32::NAN, f32::NAN);
    for step in 0..steps {
        let b = step % 4;
        fwd.set_inputs(&x[b * 128..(b + 1) * 128]).unwrap();
        fwd.set_labels(&labels[b * 64..(b + 1) * 64]).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        last = bwd.last_loss().unwrap();
        if step == 0 {
            first = last;
        }
        opt.update(&mut model, &bwd).unwrap();
    }
    (model, first, last)
}

fn mlp() -> Chain {
    Chain::new(Input::vector(2)).dense(32, Relu).dense(32, Tanh).dense(2, Identity)
}

/// `Optimizer::train_step` takes the same step as `backprop` then `update`: the same bits after
/// 20 steps, for each kind of optimiser (on a GPU, where it is one graph: tests/gpu.rs).
#[test]
fn train_step_is_backprop_then_update() {
    for optim in [Optim::adam(1e-2), Optim::sgd(0.1, 0.9), Optim::rmsprop(1e-2)] {
        let run = |joint: bool| {
            let mut model = mlp().build().unwrap().init(Init::HeNormal, 7).with_threads(1).unwrap();
            let (x, labels) = quadrants(64, 3);
            let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
            let mut opt = Optimizer::new(&model, optim).unwrap();
            fwd.set_inputs(&x).unwrap();
            fwd.set_labels(&labels).unwrap();
            for _ in 0..20 {
                if joint {
                    opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                } else {
                    model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                    opt.update(&mut model, &bwd).unwrap();
                }
            }
            assert_eq!(opt.steps(), 20);
            model.parameters().unwrap().to_vec()
        };
        let (split, joint) = (run(false), run(true));
        let untrained = mlp().build().unwrap().init(Init::HeNormal, 7).parameters().unwrap().to_vec();
        assert!(split != untrained, "{optim:?}: the parameters moved");
        assert!(split.iter().zip(&joint).all(|(a, b)| a.to_bits() == b.to_bits()), "{optim:?}: train_step differs");
    }
}

#[test]
fn loss_falls_with_every_optimiser() {
    let optims = [
        Optim::adam(1e-2),
        Optim::adamw(1e-2, 1e-3),
        Optim::sgd(0.1, 0.9),
        Optim::Sgd { lr: 0.1, momentum: 0.9, nesterov: true, weight_decay: 0.0 },
        Optim::rmsprop(1e-3),
    ];
    for optim in optims {
        let (model, first, last) = train(mlp(), 1, optim, 400);
        assert!(last < 0.5 * first, "{optim:?}: loss {first} -> {last}");
        // and it classifies held-out points
        let (x, labels) = quadrants(200, 99);
        let mut fwd = model.preallocate(200).unwrap();
        fwd.set_inputs(&x).unwrap();
        let out = model.forward(&mut fwd).unwrap();
        let correct = out.chunks(2).zip(&labels).filter(|(o, &l)| u32::from(o[1] > o[0]) == l).count();
        assert!(correct >= 170, "{optim:?}: {correct}/200 held-out points right");
    }
}

#[test]
fn mse_regression_learns() {
    let mut model = Chain::new(Input::vector(3)).dense(16, Gelu).dense(1, Identity).build().unwrap().init(Init::GlorotUniform, 1);
    let mut rng = Rng::new(4);
    let x = rng.uniform(3 * 128);
    let t: Vec<f32> = x.chunks(3).map(|v| v[0] - 2.0 * v[1] + 0.5 * v[2] * v[2]).collect();
    let mut fwd = model.preallocate(128).unwrap();
    let mut bwd = model.preallocate_grads(128).unwrap();
    let mut opt = Optimizer::new(&model, Optim::adam(1e-2)).unwrap();
    fwd.set_inputs(&x).unwrap();
    fwd.set_targets(&t).unwrap();
    model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
    let first = bwd.last_loss().unwrap();
    for _ in 0..300 {
        model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
        opt.update(&mut model, &bwd).unwrap();
    }
    model.backprop(&mut bwd, &mut fwd, Loss::Mse).unwrap();
    let last = bwd.last_loss().unwrap();
    assert!(last < 0.05 * first, "mse {first} -> {last}");
}

#[test]
fn same_seed_same_threads_same_bits() {
    let cnn = || Chain::new(Input::image(1, 6, 6)).conv(4, (3, 3), Relu).max_pool((2, 2)).flatten().dense(2, Identity);
    for threads in [1, 2] {
        let run = |chain: Chain| {
            let mut model = chain.build().unwrap().init(Init::GlorotNormal, 11).with_threads(threads).unwrap();
            let mut rng = Rng::new(5);
            let in_len = model.input_shape().len();
            let x = rng.uniform(16 * in_len);
            let labels: Vec<u32> = (0..16).map(|_| rng.below(2) as u32).collect();
            let mut fwd = model.preallocate(16).unwrap();
            let mut bwd = model.preallocate_grads(16).unwrap();
            let mut opt = Optimizer::new(&model, Optim::adam(1e-2)).unwrap();
            for _ in 0..50 {
                fwd.set_inputs(&x).unwrap();
                fwd.set_labels(&labels).unwrap();
                model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                opt.update(&mut model, &bwd).unwrap();
            }
            model.parameters().unwrap().iter().map(|p| p.to_bits()).collect::<Vec<u32>>()
        };
        assert_eq!(run(cnn()), run(cnn()), "cnn, {threads} threads");
        let mlp16 = || Chain::new(Input::image(1, 6, 6)).flatten().dense(64, Relu).dense(2, Identity);
        assert_eq!(run(mlp16()), run(mlp16()), "mlp, {threads} threads");
    }
}

/// The real data: 3,000 MNIST training images, two epochs of the MLP, then 1,000 test images,
/// classified far above chance (10 %).
#[test]
fn mnist_mlp_learns_from_a_few_thousand_images() {
    use flatnn::data::{Dataset, Loader, Split};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
    let train = Dataset::mnist(&dir, Split::Train).unwrap().take(3000);
    let test = Dataset::mnist(&dir, Split::Test).unwrap().take(1000);
    let mut model = flatnn::models::mlp().build().unwrap().init(Init::HeNormal, 1).with_threads(2).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(64).unwrap(), model.preallocate_grads(64).unwrap());
    let mut opt = Optimizer::new(&model, Optim::adam(2e-3)).unwrap();
    let mut loader = Loader::new(train.len(), 64, 1, false).unwrap();
    for _ in 0..2 {
        loader.shuffle();
        while loader.next_batch(&train, &mut fwd).unwrap().is_some() {
            model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
            opt.update(&mut model, &bwd).unwrap();
        }
    }
    let mut test_loader = Loader::new(test.len(), 64, 0, false).unwrap();
    let (mut right, mut seen) = (0, 0);
    while let Some(n) = test_loader.next_batch(&test, &mut fwd).unwrap() {
        let out = model.forward(&mut fwd).unwrap();
        for (scores, &label) in out.chunks_exact(10).zip(&test.labels()[seen..seen + n]) {
            let best = (0..10).fold(0, |b, i| if scores[i] > scores[b] { i } else { b });
            right += usize::from(best as u32 == label);
        }
        seen += n;
    }
    let accuracy = right as f64 / seen as f64;
    println!("MLP on 3,000 MNIST images, 2 epochs: test accuracy {:.1}% on 1,000", 100.0 * accuracy);
    assert!(accuracy > 0.80, "accuracy {accuracy}");
}

/// `Model::loss` is a validation loss: the value `backprop` reports on the same batch, bit for
/// bit, for both losses, with no gradient buffers touched; and it needs its targets.
#[test]
fn a_loss_without_a_backward_pass_is_backprops_value() {
    let mut rng = Rng::new(6);
    let model = Chain::new(Input::vector(4)).dense(9, Tanh).dense(3, Identity).build().unwrap().init(Init::HeNormal, 2);
    let (mut fwd, mut bwd) = (model.preallocate(16).unwrap(), model.preallocate_grads(16).unwrap());
    fwd.set_inputs(&rng.uniform(13 * 4)).unwrap();
    assert!(matches!(model.loss(&mut fwd, Loss::LogitCrossEntropy), Err(Error::Shape(_))), "no labels set");
    fwd.set_labels(&(0..13).map(|i| i % 3).collect::<Vec<_>>()).unwrap();
    fwd.set_targets(&rng.uniform(13 * 3)).unwrap();
    for loss in [Loss::LogitCrossEntropy, Loss::Mse] {
        let value = model.loss(&mut fwd, loss).unwrap();
        model.backprop(&mut bwd, &mut fwd, loss).unwrap();
        assert_eq!(value.to_bits(), bwd.last_loss().unwrap().to_bits(), "{loss:?}");
        assert!(value.is_finite() && value > 0.0);
    }
    // the gradients are those of the last backprop, not changed by a loss evaluation
    let grads = bwd.gradients().unwrap().to_vec();
    model.loss(&mut fwd, Loss::LogitCrossEntropy).unwrap();
    assert_eq!(bwd.gradients().unwrap(), &grads[..]);
}
