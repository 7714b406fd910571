//! Trains a classifier on MNIST and reports, per epoch, training loss, test accuracy, seconds
//! and samples/s. On a GPU both data sets live in device memory and each shuffled batch is
//! gathered there by a kernel; on the CPU the loader copies each batch into the cache.
//!
//!   cargo run --release --example mnist -- [--model mlp|cnn|lenet] [--epochs N] [--batch N]
//!       [--lr X] [--optimizer adam|adamw|sgd|rmsprop] [--threads N] [--seed N]
//!       [--device cpu|cuda|cuda:N|auto] [--data DIR] [--save FILE] [--load FILE]

use flatnn::data::{Dataset, DeviceDataset, Loader, Split};
use flatnn::models;
use flatnn::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

struct Options {
    model: String,
    epochs: usize,
    batch: usize,
    lr: Option<f32>,
    optimizer: String,
    threads: Option<usize>,
    seed: u64,
    device: String,
    data: PathBuf,
    save: Option<PathBuf>,
    load: Option<PathBuf>,
}

const USAGE: &str = "usage: mnist [--model mlp|cnn|lenet] [--epochs N] [--batch N] [--lr X] [--optimizer adam|adamw|sgd|rmsprop] \
                     [--threads N] [--seed N] [--device cpu|cuda|cuda:N|auto] [--data DIR] [--save FILE] [--load FILE]";

fn parse() -> Result<Options, String> {
    let mut o = Options {
        model: "mlp".into(),
        epochs: 10,
        batch: 128,
        lr: None,
        optimizer: "adam".into(),
        threads: None,
        seed: 1,
        device: "auto".into(),
        data: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/mnist"),
        save: None,
        load: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |v: &str| v.parse::<usize>().map_err(|_| format!("{flag}: {v:?} is not a whole number"));
        match flag.as_str() {
            "--model" => o.model = value,
            "--epochs" => o.epochs = number(&value)?,
            "--batch" => o.batch = number(&value)?,
            "--lr" => o.lr = Some(value.parse().map_err(|_| format!("--lr: {value:?} is not a number"))?),
            "--optimizer" => o.optimizer = value,
            "--threads" => o.threads = Some(number(&value)?),
            "--seed" => o.seed = number(&value)? as u64,
            "--device" => o.device = value,
            "--data" => o.data = value.into(),
            "--save" => o.save = Some(value.into()),
            "--load" => o.load = Some(value.into()),
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !["mlp", "cnn", "lenet"].contains(&o.model.as_str()) {
        return Err(format!("--model must be mlp, cnn or lenet, not {:?}", o.model));
    }
    Ok(o)
}

fn chain(name: &str) -> Chain {
    match name {
        "mlp" => models::mlp(),
        "cnn" => models::simplenns_cnn(),
        _ => models::lenet5(),
    }
}

fn optimizer(name: &str, lr: Option<f32>) -> Result<Optim, String> {
    Ok(match name {
        "adam" => Optim::adam(lr.unwrap_or(2e-3)),
        "adamw" => Optim::adamw(lr.unwrap_or(1e-3), 1e-4),
        "sgd" => Optim::Sgd { lr: lr.unwrap_or(0.05), momentum: 0.9, nesterov: true, weight_decay: 0.0 },
        "rmsprop" => Optim::rmsprop(lr.unwrap_or(1e-3)),
        _ => return Err(format!("--optimizer must be adam, adamw, sgd or rmsprop, not {name:?}")),
    })
}

/// A data set, with its copy in device memory when the model runs on a GPU.
struct Data {
    host: Dataset,
    device: Option<DeviceDataset>,
}

impl Data {
    fn new(host: Dataset, device: &Device) -> flatnn::Result<Data> {
        let device = if device.is_cuda() { Some(host.to_device(device, 10)?) } else { None };
        Ok(Data { host, device })
    }

    /// The loader's next batch into `cache`: gathered on the device, or copied on the host.
    fn next_batch(&mut self, loader: &mut Loader, cache: &mut Cache) -> flatnn::Result<Option<usize>> {
        match &mut self.device {
            Some(device) => loader.next_device_batch(device, cache),
            None => loader.next_batch(&self.host, cache),
        }
    }

    fn len(&self) -> usize {
        self.host.len()
    }
}

/// Fraction of `data` classified right, in batches through `fwd`.
fn accuracy(model: &Model, fwd: &mut Cache, data: &mut Data, loader: &mut Loader) -> flatnn::Result<f64> {
    loader.rewind();
    let (mut right, mut seen) = (0usize, 0usize);
    while let Some(batch) = data.next_batch(loader, fwd)? {
        let out = model.forward(fwd)?;
        let labels = &data.host.labels()[seen..seen + batch];
        for (scores, &label) in out.chunks_exact(10).zip(labels) {
            let best = scores.iter().enumerate().fold(0, |b, (i, &s)| if s > scores[b] { i } else { b });
            right += usize::from(best as u32 == label);
        }
        seen += batch;
    }
    Ok(right as f64 / seen as f64)
}

fn run(o: Options) -> Result<(), Box<dyn std::error::Error>> {
    if !o.data.is_dir() {
        return Err(format!("data directory {} not found (pass --data DIR)", o.data.display()).into());
    }
    let device = Device::parse(&o.device)?;
    let mut test = Data::new(Dataset::mnist(&o.data, Split::Test)?, &device)?;
    let mut test_loader = Loader::new(test.len(), o.batch, 0, false)?;
    if let Some(path) = &o.load {
        let model = Model::load(path)?.to(&device)?;
        let mut fwd = model.preallocate(o.batch)?;
        let acc = accuracy(&model, &mut fwd, &mut test, &mut test_loader)?;
        println!("{} on {device}: test accuracy {:.2}%", path.display(), 100.0 * acc);
        return Ok(());
    }
    let mut train = Data::new(Dataset::mnist(&o.data, Split::Train)?, &device)?;
    let mut model = chain(&o.model).build()?.init(Init::HeNormal, o.seed);
    if let Some(threads) = o.threads {
        model = model.with_threads(threads)?;
    }
    let mut model = model.to(&device)?;
    let mut fwd = model.preallocate(o.batch)?;
    let mut bwd = model.preallocate_grads(o.batch)?;
    let mut opt = Optimizer::new(&model, optimizer(&o.optimizer, o.lr)?)?;
    let mut train_loader = Loader::new(train.len(), o.batch, o.seed, false)?;
    println!(
        "{} ({} parameters) on {}, batch {}, {:?}",
        o.model,
        model.plan().param_len,
        match device {
            Device::Cpu => format!("the CPU, {} threads", model.threads()),
            Device::Cuda(n) => format!("CUDA device {n} ({}), data in device memory", Device::Cuda(n).name()?),
        },
        o.batch,
        opt.config()
    );
    let bar_style = ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {msg}").map_err(|e| e.to_string())?.progress_chars("=> ");
    let base_lr = opt.config().lr();
    for epoch in 1..=o.epochs {
        // cosine decay per epoch, from the base rate to near zero: the last epochs settle
        // instead of bouncing around the optimum
        let decay = 0.5 * (1.0 + (std::f32::consts::PI * (epoch - 1) as f32 / o.epochs as f32).cos());
        opt.set_lr(base_lr * decay)?;
        let bar = ProgressBar::new(train_loader.batches() as u64).with_style(bar_style.clone()).with_prefix(format!("epoch {epoch}"));
        let start = Instant::now();
        train_loader.shuffle();
        let mut batches = 0usize;
        bwd.mean_loss()?;
        while train.next_batch(&mut train_loader, &mut fwd)?.is_some() {
            opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
            batches += 1;
            if batches.is_multiple_of(100) {
                // reading the loss waits for the device: only every 100 steps
                bar.set_position(batches as u64);
                bar.set_message(format!("loss {:.4}", bwd.last_loss()?));
            }
        }
        let epoch_loss = bwd.mean_loss()?;
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let acc = accuracy(&model, &mut fwd, &mut test, &mut test_loader)?;
        println!(
            "epoch {epoch:>2}  loss {:.4}  test accuracy {:.2}%  {:.2} s  {:.0} samples/s",
            epoch_loss,
            100.0 * acc,
            seconds,
            train.len() as f64 / seconds
        );
    }
    if let Some(path) = &o.save {
        model.save(path)?;
        println!("saved {}", path.display());
    }
    Ok(())
}

fn main() {
    let result = parse().map_err(Into::into).and_then(run);
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
