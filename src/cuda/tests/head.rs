//! The head kernel (src/cuda/head.rs): which plans it takes, and (a measurement) the MLP's
//! routes and the other kernels of its training step.

use super::upload;
use crate::activation::Activation::{Identity, Relu, Sigmoid, Tanh};
use crate::chain::Shape;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::ops::{LOSS_SCRATCH, NORM_SCRATCH};
use crate::cuda::options::Tuning;
use crate::cuda::test_gpu;
use crate::init::Init;
use crate::loss::{self, Loss};
use crate::optim::{Clip, Optim, Update};
use crate::testutil::Rng;

/// Which plans the head kernel takes (src/cuda/head.rs): a last dense layer of at most 32
/// outputs and 1024 inputs, from 257 to 2048 samples, and the dense layer before it where that
/// one's weights are few enough (a deep head); whose dz it writes besides its own; how it
/// spreads a batch.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_head_takes_a_narrow_last_dense_layer() {
    use crate::chain::{Layer, Plan};
    use crate::cuda::head::{Head, MAX_INNER_WEIGHTS};
    use crate::{Conv, Dense, Flatten, MaxPool};
    let gpu = test_gpu();
    let tuning = Tuning::from_env();
    if !tuning.head {
        println!("skipped: FLATNN_HEAD=0");
        return;
    }
    let dense = |out_features, activation| Layer::Dense(Dense { out_features, activation });
    let conv = Layer::Conv(Conv { out_channels: 4, kernel: (3, 3), stride: (1, 1), padding: (0, 0), activation: Relu });
    let pool = Layer::MaxPool(MaxPool { window: (2, 2), stride: (2, 2) });
    // (input, layers, (the layer before it runs too, the step whose dz it writes from the
    // first layer's input gradient)), for plans it takes
    type Case = (Shape, Vec<Layer>, Option<(Option<usize>, Option<usize>)>);
    // 129 activated layers: the one before the last is step 128, whose dz is not folded in
    let deep_chain: Vec<Layer> = std::iter::repeat_n(dense(16, Relu), 129).chain([dense(10, Identity)]).collect();
    let cases: [Case; 11] = [
        // the MLP: deep, and the first layer is activated, so the head writes its dz
        (Shape::vector(784), vec![dense(128, Relu), dense(64, Relu), dense(10, Identity)], Some((Some(1), Some(0)))),
        // a whole model, so no input gradient
        (Shape::vector(100), vec![dense(1, Identity)], Some((None, None))),
        // deep over an identity layer that takes the plan's input: no input gradient to write
        (Shape::vector(20), vec![dense(30, Identity), dense(32, Sigmoid)], Some((Some(0), None))),
        // the layer before has too many weights to be staged: the producer's dz as before
        (Shape::vector(100), vec![dense(200, Relu), dense(1, Identity)], Some((None, Some(0)))),
        (Shape::vector(MAX_INNER_WEIGHTS / 16), vec![dense(16, Tanh), dense(3, Identity)], Some((Some(0), None))),
        // the layer before is step 128: no producer past 127, so not deep (its activation
        // would be skipped), and its input gradient goes to its output region
        (Shape::vector(8), deep_chain, Some((None, None))),
        // after a flatten of a convolution: that convolution's dz
        (Shape::image(2, 6, 6), vec![conv, Layer::Flatten(Flatten), dense(5, Tanh)], Some((None, Some(0)))),
        // after a max-pool: the input gradient goes to the pool's output region
        (Shape::image(2, 6, 6), vec![conv, pool, Layer::Flatten(Flatten), dense(5, Tanh)], Some((None, None))),
        // no dense layer at the end, too many outputs, too many inputs
        (Shape::image(2, 6, 6), vec![conv, Layer::Flatten(Flatten)], None),
        (Shape::vector(8), vec![dense(33, Relu)], None),
        (Shape::vector(1025), vec![dense(3, Relu)], None),
    ];
    for (input, layers, want) in cases {
        let plan = Plan::new(input, &layers).unwrap();
        let head = Head::of(&gpu, &plan, 1024, 1024, Loss::LogitCrossEntropy, &tuning);
        // FLATNN_HEAD=1 keeps the head to the last layer (then a deep head's producer is the
        // layer before)
        let want = want.map(|(inner, producer)| match inner {
            Some(i) if !tuning.deep_head => (None, (layers[i].activation() != Identity).then_some(i)),
            _ => (inner, producer),
        });
        let got = head.map(|h| (h.step, h.first(), h.inner(), h.producer));
        let want = want.map(|(inner, producer)| (layers.len() - 1, inner.unwrap_or(layers.len() - 1), inner, producer));
        assert_eq!(got, want, "{layers:?}");
    }
    // from 257 to 2048 samples only; a warp a sample (a deep head: over twice the blocks, and up
    // to 512 samples two warps a sample), at most 128 blocks (the loss's partials)
    let blocks = |plan: &Plan, batch| Head::of(&gpu, plan, 4096, batch, Loss::LogitCrossEntropy, &tuning).map(|h| h.blocks());
    let plan = Plan::new(Shape::vector(100), &[dense(200, Relu), dense(1, Identity)]).unwrap();
    assert_eq!([1, 256, 257, 1024, 2048, 2049].map(|b| blocks(&plan, b)), [None, None, Some(33), Some(128), Some(128), None]);
    let plan = Plan::new(Shape::vector(784), &[dense(128, Relu), dense(64, Relu), dense(10, Identity)]).unwrap();
    let deep = if tuning.deep_head {
        [None, None, Some(65), Some(128), Some(128), None]
    } else {
        [None, None, Some(33), Some(128), Some(128), None]
    };
    assert_eq!([1, 256, 257, 1024, 2048, 2049].map(|b| blocks(&plan, b)), deep);
    // deep up to 1024 samples only (one a warp)
    let inner = |b| Head::of(&gpu, &plan, 4096, b, Loss::LogitCrossEntropy, &tuning).map(|h| h.inner().is_some());
    assert_eq!([257, 1024, 1025, 2048].map(inner), [Some(tuning.deep_head), Some(tuning.deep_head), Some(false), Some(false)]);
    // two warps a sample up to 512 (a deep head), so partial sums a unit of warps
    let partials = |b| Head::of(&gpu, &plan, 4096, b, Loss::LogitCrossEntropy, &tuning).map(|h| h.partials());
    let want = if tuning.deep_head {
        [Some(65 * 4), Some(128 * 4), Some(128 * 8), Some(128 * 8)]
    } else {
        [257usize, 512, 513, 1024].map(|b| Some(b.div_ceil(8) * 8))
    };
    assert_eq!([257, 512, 513, 1024].map(partials), want);
    // the kernel computes cross-entropy and MSE alone: it refuses the other losses
    for loss in [Loss::Mse, Loss::BceWithLogits, Loss::L1, Loss::SmoothL1 { beta: 1.0 }] {
        assert_eq!(Head::of(&gpu, &plan, 1024, 1024, loss, &tuning).is_some(), loss == Loss::Mse, "{loss:?}");
    }
}

/// Not a check but a measurement: the MLP's routes at a batch (784-128-64-10; batch from
/// `FLATNN_TIMES_BATCH`, default 128), every route of every dense layer and direction timed as
/// a graph of ten dependent launches, as a step runs them (`Cache::routes`); then the step's
/// other kernels, timed the same way. On a GPU: `cargo test --release --lib -- --ignored
/// --nocapture kernel_times_of_the_mlp_step`.
#[test]
#[ignore]
fn kernel_times_of_the_mlp_step() {
    use crate::cuda::timing::time_calls;
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(16);
    let batch: usize = std::env::var("FLATNN_TIMES_BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(128);
    let tuning = Tuning::from_env();
    {
        let device = crate::device::Device::Cuda(0);
        let model = crate::models::mlp().build().unwrap().init(Init::HeNormal, 3).to(&device).unwrap();
        let (mut fwd, mut bwd) = (model.preallocate(batch).unwrap(), model.preallocate_grads(batch).unwrap());
        let (x, labels) = crate::testutil::batch(&mut rng, &model, batch);
        fwd.set_inputs(&x).unwrap();
        fwd.set_labels(&labels).unwrap();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        println!("routes of the MLP at {batch}:\n{}", fwd.routes());
    }
    let mut random = |n: usize| upload(&stream, &rng.uniform(n));
    // every operand and output below fits in this many values
    let len = 785 * batch.max(128);
    let (x, w, out, z, y) = (random(len), random(len), random(len), random(len), random(len));
    let (xp, wp, op, zp, yp) = (View::of(&x).ptr(), View::of(&w).ptr(), View::of(&out).ptr(), View::of(&z).ptr(), View::of(&y).ptr());
    // SAFETY (both): views of live buffers at least that long, used only on this stream
    let v = |p: u64, n: usize| unsafe { View::<f32>::from_raw(p, n) };
    let vm = |p: u64, n: usize| unsafe { ViewMut::<f32>::from_raw(p, n) };
    let time = |what: String, work: &dyn Fn() -> crate::error::Result<()>| {
        println!("{what:<40} {:7.2} us", time_calls(&gpu, &stream, true, work).unwrap());
    };
    let labels = upload(&stream, &(0..batch as u32).map(|i| i % 10).collect::<Vec<_>>());
    let (loss, scratch) = (upload(&stream, &[0.0f64; 3]), upload(&stream, &[0.0f64; LOSS_SCRATCH]));
    let (lp, sp) = (View::of(&loss).ptr(), View::of(&scratch).ptr());
    time(format!("softmax_xent {batch}x10"), &|| {
        // SAFETY: as above
        let (l, s) = unsafe { (ViewMut::<f64>::from_raw(lp, 3), ViewMut::<f64>::from_raw(sp, LOSS_SCRATCH)) };
        gpu.softmax_xent(&stream, 10, batch, v(xp, batch * 10), View::of(&labels), vm(op, batch * 10), l, s)
    });
    // the head kernel (src/cuda/head.rs): forward 3, the loss and input gradient 3 in one, and
    // with a deep head forward 2 and input gradient 2 too
    {
        use crate::chain::{Layer, Plan};
        use crate::cuda::head::{Head, HeadBuffers};
        let dense = |out_features, activation| Layer::Dense(crate::Dense { out_features, activation });
        let plan = Plan::new(Shape::vector(784), &[dense(128, Relu), dense(64, Relu), dense(10, Identity)]).unwrap();
        if let Some(head) = Head::of(&gpu, &plan, batch, batch, Loss::LogitCrossEntropy, &tuning) {
            let (params, acts, dacts) =
                (random(plan.param_len), random(plan.acts_len(batch).unwrap()), random(plan.acts_len(batch).unwrap()));
            let buffers = HeadBuffers {
                params: View::of(&params).ptr(),
                acts: View::of(&acts).ptr(),
                dacts: View::of(&dacts).ptr(),
                labels: View::of(&labels).ptr(),
                targets: 0,
                partials: sp + 8,
                clear: (0, 0),
            };
            let deep = if head.inner().is_some() { ", deep: 64x128 too" } else { "" };
            time(format!("head {batch}x10x64{deep} ({} blocks)", head.blocks()), &|| {
                gpu.dense_head(&stream, &head, batch, loss::Loss::LogitCrossEntropy, &buffers, true)
            });
        }
    }
    let n = 109_386;
    let (p, g, state) = (random(n), random(n), random(2 * n));
    let (pp, gp, statep) = (View::of(&p).ptr(), View::of(&g).ptr(), View::of(&state).ptr());
    let (adam, norm) = (Update { config: Optim::adam(1e-4), clip: Clip::None }, upload(&stream, &[0.0f64; NORM_SCRATCH]));
    time(format!("adam {n}"), &|| gpu.optim_step(&stream, adam, 3, n, vm(pp, n), v(gp, n), vm(statep, 2 * n), View::of(&norm)));
    // the element-wise kernels beside cuBLAS's products
    time(format!("bias_act {batch}x128"), &|| {
        gpu.bias_act(&stream, Relu, v(wp, 128), 128, 1, batch, vm(zp, batch * 128), Some(vm(yp, batch * 128)), true)
    });
    time(format!("act_backward {batch}x128"), &|| {
        gpu.act_backward(&stream, Relu, batch * 128, v(zp, batch * 128), v(yp, batch * 128), v(xp, batch * 128), vm(op, batch * 128))
    });
    time(format!("bias_grad 128 over {batch}"), &|| gpu.bias_grad(&stream, 128, 1, batch, v(zp, batch * 128), vm(yp, 128), None));
}
