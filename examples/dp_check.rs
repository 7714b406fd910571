//! Data-parallel training on every GPU of the machine (n ≥ 2) against one GPU, for the MLP and
//! LeNet-5 (the models of tests/multi_gpu.rs), with the controls that tell a fault from
//! rounding amplified by training. Every figure is a relative error ‖a − b‖ / ‖b‖.
//!
//!   cargo run --release --example dp_check        (two or more CUDA devices and NCCL; ~1 minute)
//!
//! Per model, 20 steps of SGD (lr 0.05, momentum 0.9) clipped to norm 5, global batches of 512
//! and 511 in turn (the test's), unless a line says otherwise:
//! - controls: one GPU against the CPU, and against one GPU whose initial parameters were moved
//!   by about one rounding (× (1 ± 1e-7)): how far rounding alone carries this training;
//! - n GPUs against one GPU on the whole batch (parameters and losses after 20 steps); again
//!   with graphs off, without clipping, and with batches of 512 only (each with its control);
//! - every step of the first run: the reduced gradients against their shares' (each share run
//!   on one GPU alone, on the same device, parameters and batch size as its replica: the same
//!   kernels, so ~1e-7 unless the reduction or the shares are wrong), and against the whole
//!   batch's on one GPU from the same parameters (other kernels for 512 samples: a ReLU or a
//!   max-pool that flips shows as a spike).
//!
//! The controls, the first run and its per-step figures again in child processes with
//! `FLATNN_CUDNN=0` (flatnn's convolutions) and `1` (cuDNN's wherever it has one), a setting
//! read once per process.
//!
//! Reading it: n GPUs about as far from one GPU as the one-rounding control, and every step
//! within ~1e-6 of its shares: rounding amplified by the training, no fault. A step far from
//! its shares: a fault in the data-parallel step (which step and which setting say where).

use flatnn::models::{lenet5, mlp};
use flatnn::prelude::*;
use flatnn::testutil::{batch, rel_err, Rng};
use flatnn::Result;
use std::process::Command;
use std::time::Instant;

/// Set in the child processes.
const CHILD: &str = "FLATNN_DP_CHECK_CHILD";

type Data = Vec<(Vec<f32>, Vec<u32>)>;

/// An optimiser and its clipping.
type Rule = (Optim, Clip);

/// 20 global batches of `sizes[i % sizes.len()]` samples.
fn data(model: &Model, sizes: &[usize]) -> Data {
    let mut rng = Rng::new(5);
    (0..20).map(|i| batch(&mut rng, model, sizes[i % sizes.len()])).collect()
}

/// `model` with every parameter moved by about one rounding, up or down at random.
fn moved(model: &Model) -> Result<Model> {
    let mut model = model.to(&Device::Cpu)?;
    let params = model.parameters_mut()?;
    let signs = Rng::new(9).uniform(params.len());
    params.iter_mut().zip(signs).for_each(|(p, s)| *p *= 1.0 + 1e-7 * s.signum());
    Ok(model)
}

/// The parameters and the losses after the steps of `data` on `device`, each on a whole batch.
fn one(model: &Model, device: Device, (optim, clip): Rule, data: &Data) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut model = model.to(&device)?;
    let (mut cache, mut grads) = (model.preallocate(512)?, model.preallocate_grads(512)?);
    let mut opt = Optimizer::new(&model, optim)?;
    opt.set_clip(clip)?;
    let mut losses = Vec::new();
    for (x, labels) in data {
        cache.set_inputs(x)?;
        cache.set_labels(labels)?;
        opt.train_step(&mut model, &mut grads, &mut cache, Loss::LogitCrossEntropy)?;
        losses.push(grads.last_loss()?);
    }
    Ok((model.parameters()?.into_owned(), losses))
}

/// One GPU's gradients of a batch, at parameters given each time.
struct Probe {
    model: Model,
    cache: Cache,
    grads: Grads,
}

impl Probe {
    fn new(model: &Model, device: Device, capacity: usize) -> Result<Probe> {
        let model = model.to(&device)?;
        Ok(Probe { cache: model.preallocate(capacity)?, grads: model.preallocate_grads(capacity)?, model })
    }

    fn gradients(&mut self, params: &[f32], x: &[f32], labels: &[u32]) -> Result<Vec<f32>> {
        self.model.set_parameters(params)?;
        self.cache.set_inputs(x)?;
        self.cache.set_labels(labels)?;
        self.model.backprop(&mut self.grads, &mut self.cache, Loss::LogitCrossEntropy)?;
        Ok(self.grads.gradients()?.into_owned())
    }
}

/// What n GPUs did: parameters and losses, and per step (where checked) the reduced gradients'
/// distance from their shares' and from the whole batch's.
struct Run {
    params: Vec<f32>,
    losses: Vec<f32>,
    shares: Vec<f64>,
    whole: Vec<f64>,
}

/// Every CUDA device of the machine.
fn every_gpu() -> Vec<Device> {
    (0..flatnn::cuda::device_count()).map(Device::Cuda).collect()
}

/// The steps of `data` on every GPU; with `check`, each step's reduced gradients against
/// one GPU's from the parameters before it.
fn many(model: &Model, (optim, clip): Rule, data: &Data, check: bool) -> Result<Run> {
    let devices = every_gpu();
    let world = devices.len();
    let mut dp = DataParallel::new(model, &devices, 512, optim)?;
    dp.configure(|opt| opt.set_clip(clip))?;
    let mut probes = match check {
        true => Some((
            devices.iter().map(|&d| Probe::new(model, d, 512usize.div_ceil(world))).collect::<Result<Vec<_>>>()?,
            Probe::new(model, Device::Cuda(0), 512)?,
        )),
        false => None,
    };
    let mut run = Run { params: Vec::new(), losses: Vec::new(), shares: Vec::new(), whole: Vec::new() };
    let per_sample = model.input_shape().len();
    for (x, labels) in data {
        let before = if check { dp.parameters()? } else { Vec::new() };
        dp.set_inputs(x)?;
        dp.set_labels(labels)?;
        dp.train_step(Loss::LogitCrossEntropy)?;
        run.losses.push(dp.last_loss()?);
        let Some((shares, whole)) = &mut probes else { continue };
        let got = dp.gradients()?;
        // the shares as DataParallel cuts them (contiguous, the first batch % n one sample
        // larger), weighted as its reduction weighs them
        let batch = labels.len();
        let mut want = vec![0f64; got.len()];
        let mut start = 0;
        for (rank, probe) in shares.iter_mut().enumerate() {
            let len = batch / world + usize::from(rank < batch % world);
            let g = probe.gradients(&before, &x[start * per_sample..(start + len) * per_sample], &labels[start..start + len])?;
            let weight = f64::from((len as f64 / batch as f64) as f32);
            want.iter_mut().zip(&g).for_each(|(w, g)| *w += weight * f64::from(*g));
            start += len;
        }
        let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
        run.shares.push(rel_err(&got, &want));
        run.whole.push(rel_err(&got, &whole.gradients(&before, x, labels)?));
    }
    run.params = dp.parameters()?;
    Ok(run)
}

/// Prints one comparison: a run against one GPU's (parameters, losses), and its control.
fn line(what: &str, run: &(Vec<f32>, Vec<f32>), one: &(Vec<f32>, Vec<f32>), control: Option<&(Vec<f32>, Vec<f32>)>) {
    let control = control.map_or(String::new(), |c| format!("   (control, 1 GPU moved one rounding: {:.1e})", rel_err(&c.0, &one.0)));
    println!("  {what:<38} parameters {:.1e}  losses {:.1e}{control}", rel_err(&run.0, &one.0), rel_err(&run.1, &one.1));
}

fn check(name: &str, chain: Chain, full: bool) -> Result<()> {
    let model = chain.build()?.init(Init::HeNormal, 3);
    let moved = moved(&model)?;
    let test: Rule = (Optim::sgd(0.05, 0.9), Clip::Norm(5.0));
    let both = data(&model, &[512, 511]);
    println!("{name}: 20 steps, batches 512/511, SGD(0.05, 0.9) clipped to norm 5, against 1 GPU on the whole batch:");
    let reference = one(&model, Device::Cuda(0), test, &both)?;
    if full {
        line("CPU", &one(&model, Device::Cpu, test, &both)?, &reference, None);
    }
    line("1 GPU, parameters moved one rounding", &one(&moved, Device::Cuda(0), test, &both)?, &reference, None);
    let gpus = format!("{} GPUs", every_gpu().len());
    let run = many(&model, test, &both, true)?;
    line(&gpus, &(run.params, run.losses), &reference, None);
    let max = |v: &[f64]| v.iter().copied().fold(0f64, f64::max);
    let over = run.whole.iter().filter(|&&e| e > 1e-5).count();
    let steps: Vec<String> = run.whole.iter().map(|e| format!("{e:.0e}")).collect();
    println!("  every step, reduced gradients against their shares': max {:.1e}", max(&run.shares));
    println!("  ... against the whole batch on 1 GPU: max {:.1e}, {over} of 20 over 1e-5: {}", max(&run.whole), steps.join(" "));
    if !full {
        return Ok(());
    }
    let eager = model.to(&Device::Cpu)?.with_gpu_options(GpuOptions { graphs: false, ..GpuOptions::default() })?;
    let run = many(&eager, test, &both, false)?;
    line(&format!("{gpus}, graphs off"), &(run.params, run.losses), &reference, None);
    let plain: Rule = (test.0, Clip::None);
    let reference = one(&model, Device::Cuda(0), plain, &both)?;
    let run = many(&model, plain, &both, false)?;
    let control = one(&moved, Device::Cuda(0), plain, &both)?;
    line(&format!("{gpus}, no clipping"), &(run.params, run.losses), &reference, Some(&control));
    let full_only = data(&model, &[512]);
    let reference = one(&model, Device::Cuda(0), test, &full_only)?;
    let run = many(&model, test, &full_only, false)?;
    let control = one(&moved, Device::Cuda(0), test, &full_only)?;
    line(&format!("{gpus}, batches of 512 only"), &(run.params, run.losses), &reference, Some(&control));
    Ok(())
}

fn run(full: bool) -> Result<()> {
    check("mlp", mlp(), full)?;
    check("lenet", lenet5(), full)
}

fn main() {
    let setting = std::env::var("FLATNN_CUDNN").unwrap_or_else(|_| "unset (auto)".into());
    if std::env::var_os(CHILD).is_some() {
        if let Err(e) = run(false) {
            println!("error: {e}");
        }
        return;
    }
    let start = Instant::now();
    // the children run beside this process (their figures do not depend on timing)
    let children: Vec<_> = ["0", "1"]
        .into_iter()
        .map(|value| {
            let exe = std::env::current_exe().expect("this program's path");
            let child = std::thread::spawn(move || Command::new(exe).env(CHILD, "1").env("FLATNN_CUDNN", value).output());
            (value, child)
        })
        .collect();
    println!("=== FLATNN_CUDNN {setting}");
    if let Err(e) = run(true) {
        println!("error: {e}");
    }
    for (value, child) in children {
        println!("\n=== FLATNN_CUDNN={value} (a child process)");
        match child.join().expect("the thread waiting for a child") {
            Ok(out) => print!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
            Err(e) => println!("error: cannot start it: {e}"),
        }
    }
    println!("\n{:.1} s", start.elapsed().as_secs_f64());
}
