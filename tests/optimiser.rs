//! What an optimiser does around its rule: clipping by global norm and by value, L2 weight
//! decay and learning-rate schedules, inside the update, checked against the formulas on the
//! CPU, and on a GPU (`#[ignore]`d: `--include-ignored` where there is one) against the CPU,
//! inside the step's graph.

use flatnn::prelude::*;
use flatnn::testutil::Rng;

fn mlp() -> Chain {
    Chain::new(Input::vector(5)).dense(16, Tanh).dense(3, Identity)
}

/// A model, its buffers and a fixed batch of 8.
fn setup(threads: usize) -> (Model, Cache, Grads) {
    let model = mlp().build().unwrap().init(Init::HeNormal, 11).with_threads(threads).unwrap();
    let (mut fwd, bwd) = (model.preallocate(8).unwrap(), model.preallocate_grads(8).unwrap());
    let mut rng = Rng::new(4);
    fwd.set_inputs(&rng.uniform(8 * 5)).unwrap();
    fwd.set_labels(&[0, 1, 2, 0, 1, 2, 2, 1]).unwrap();
    (model, fwd, bwd)
}

/// One SGD step (no momentum) with `clip` and decay λ from the model's parameters p and
/// gradients g: the parameters after it, the ‖g‖ it reports, and (p, g).
fn sgd_step(clip: Clip, decay: f32) -> (Vec<f32>, f32, Vec<f32>, Vec<f32>) {
    let (mut model, mut fwd, mut bwd) = setup(1);
    let mut opt = Optimizer::new(&model, Optim::sgd(0.5, 0.0).with_weight_decay(decay)).unwrap();
    opt.set_clip(clip).unwrap();
    assert!(opt.grad_norm().unwrap().is_nan(), "no norm before a step");
    let p = model.parameters().unwrap().to_vec();
    model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
    let g = bwd.gradients().unwrap().to_vec();
    opt.update(&mut model, &bwd).unwrap();
    assert_eq!(bwd.gradients().unwrap(), &g[..], "the gradient buffers keep the gradient as computed");
    (model.parameters().unwrap().to_vec(), opt.grad_norm().unwrap(), p, g)
}

#[test]
fn clipping_and_decay_follow_pytorchs_formulas() {
    // the gradients' own norm, to pick bounds that clip
    let (_, none, p, g) = sgd_step(Clip::None, 0.0);
    assert!(none.is_nan(), "no norm is computed without clipping by norm");
    let norm = g.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
    assert!(norm > 0.1, "{norm}");

    // by norm, to a quarter of it: p − lr·g·max/(‖g‖ + 1e-6)
    let max_norm = norm / 4.0;
    let (after, reported, ..) = sgd_step(Clip::Norm(max_norm), 0.0);
    assert_eq!(reported, norm, "the norm before clipping");
    let coef = max_norm / (norm + 1e-6);
    let want: Vec<f32> = p.iter().zip(&g).map(|(&p, &g)| p - 0.5 * (g * coef)).collect();
    assert_eq!(after, want);
    // a bound above the norm changes nothing
    assert_eq!(sgd_step(Clip::Norm(2.0 * norm), 0.0).0, sgd_step(Clip::None, 0.0).0);

    // by value: each to [−c, c]
    let c = g.iter().map(|v| v.abs()).fold(0.0, f32::max) / 3.0;
    let (after, ..) = sgd_step(Clip::Value(c), 0.0);
    let want: Vec<f32> = p.iter().zip(&g).map(|(&p, &g)| p - 0.5 * g.clamp(-c, c)).collect();
    assert_eq!(after, want);
    assert!(g.iter().any(|v| v.abs() > c), "some values were clipped");

    // L2 decay after clipping: p − lr·(clip(g) + λp)
    let (after, ..) = sgd_step(Clip::Value(c), 0.1);
    let want: Vec<f32> = p.iter().zip(&g).map(|(&p, &g)| p - 0.5 * (g.clamp(-c, c) + 0.1 * p)).collect();
    assert_eq!(after, want);
}

/// Each step takes the schedule's rate at its position: plain SGD moves every parameter by
/// exactly rate·g.
#[test]
fn a_schedule_sets_each_steps_rate() {
    let (mut model, mut fwd, mut bwd) = setup(2);
    let mut opt = Optimizer::new(&model, Optim::sgd(0.4, 0.0)).unwrap();
    let schedule = Schedule::Cosine { warmup: 2, total: 6, min_lr: 0.01 };
    opt.set_schedule(schedule).unwrap();
    for s in 0..8u64 {
        let rate = opt.lr();
        assert_eq!(rate, schedule.lr(0.4, s), "step {s}");
        let p = model.parameters().unwrap().to_vec();
        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        let g = bwd.gradients().unwrap().to_vec();
        opt.update(&mut model, &bwd).unwrap();
        let want: Vec<f32> = p.iter().zip(&g).map(|(&p, &g)| p - rate * g).collect();
        assert_eq!(model.parameters().unwrap(), &want[..], "step {s}");
    }
    assert_eq!(opt.config().lr(), 0.4, "the base rate stays");
    assert_eq!(opt.lr(), 0.01, "past the end, the floor");
    assert!(opt.set_schedule(Schedule::Exponential { gamma: -1.0 }).is_err());
    assert!(opt.set_clip(Clip::Norm(-1.0)).is_err());
    assert_eq!(opt.schedule(), schedule);
}

/// Every optimiser with every kind of clipping, decay and a one-cycle schedule still learns
/// the batch, and the thread count does not change a bit of it.
#[test]
fn every_combination_trains_and_is_deterministic() {
    let optims = [Optim::adam(1e-2), Optim::adamw(1e-2, 1e-2), Optim::sgd(0.1, 0.9), Optim::rmsprop(1e-2)];
    for optim in optims {
        for clip in [Clip::None, Clip::Norm(0.5), Clip::Value(0.05)] {
            let run = |threads: usize| {
                let (mut model, mut fwd, mut bwd) = setup(threads);
                let mut opt = Optimizer::new(&model, optim.with_weight_decay(optim.weight_decay().max(1e-3))).unwrap();
                opt.set_clip(clip).unwrap();
                opt.set_schedule(Schedule::one_cycle(60)).unwrap();
                model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                let first = bwd.last_loss().unwrap();
                for _ in 0..60 {
                    opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                }
                (first, bwd.last_loss().unwrap(), model.parameters().unwrap().to_vec(), opt.grad_norm().unwrap())
            };
            let (first, last, one, norm) = run(1);
            let (.., two, norm_two) = run(2);
            assert!(last < 0.5 * first, "{optim:?} {clip:?}: loss {first} -> {last}");
            assert!(one.iter().zip(&two).all(|(a, b)| a.to_bits() == b.to_bits()), "{optim:?} {clip:?}: threads changed the result");
            assert_eq!(norm.to_bits(), norm_two.to_bits());
            assert_eq!(norm.is_nan(), !matches!(clip, Clip::Norm(_)), "{clip:?}: {norm}");
        }
    }
}

/// On a GPU, `train_step` (one graph: backprop, the norm's kernel, the update) and `backprop`
/// then `update` with clipping, decay and a schedule against the CPU over 20 steps; the bound
/// and the clipping change between steps (new arguments in the graph, or a new graph).
#[cfg(feature = "cuda")]
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn clipping_decay_and_schedules_on_the_gpu_match_the_cpu() {
    let device = flatnn::testutil::cuda_device();
    let optims = [Optim::adam(1e-2).with_weight_decay(1e-3), Optim::sgd(0.1, 0.9).with_weight_decay(1e-3), Optim::rmsprop(1e-2)];
    for optim in optims {
        for graphs in [true, false] {
            let run = |device: &Device| {
                let (model, fwd, bwd) = setup(1);
                let model = model.with_gpu_options(GpuOptions { graphs, tf32: false, ..GpuOptions::default() }).unwrap();
                let (mut model, mut fwd, mut bwd) =
                    (model.to(device).unwrap(), fwd.to_device(device).unwrap(), bwd.to_device(device).unwrap());
                let mut opt = Optimizer::new(&model, optim).unwrap();
                opt.set_schedule(Schedule::cosine(3, 20)).unwrap();
                let mut norms = Vec::new();
                for step in 0..20 {
                    let clip = [Clip::Norm(0.3), Clip::Norm(1.0), Clip::Value(0.05), Clip::None][step / 2 % 4];
                    opt.set_clip(clip).unwrap();
                    if step % 3 == 0 {
                        model.backprop(&mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                        opt.update(&mut model, &bwd).unwrap();
                    } else {
                        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
                    }
                    norms.push(opt.grad_norm().unwrap());
                }
                (model.parameters().unwrap().to_vec(), opt.state().unwrap().to_vec(), norms)
            };
            let (cpu, gpu) = (run(&Device::Cpu), run(&device));
            let name = format!("{optim:?} graphs={graphs}");
            flatnn::testutil::assert_close(&gpu.0, &cpu.0, 1e-6, 1e-4, &format!("{name}: parameters"));
            flatnn::testutil::assert_close(&gpu.1, &cpu.1, 1e-7, 1e-4, &format!("{name}: state"));
            for (i, (g, c)) in gpu.2.iter().zip(&cpu.2).enumerate() {
                assert!(g.is_nan() == c.is_nan() && (g.is_nan() || (g - c).abs() <= 1e-5 * c), "{name}: norm at step {i}: {g} vs {c}");
            }
        }
    }
}
