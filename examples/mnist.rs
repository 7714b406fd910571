//! Trains a classifier on MNIST and reports, per epoch, training loss, test loss and accuracy,
//! seconds and samples/s. On a GPU both data sets live in device memory and each shuffled batch
//! is gathered there by a kernel; on the CPU the loader copies each batch into the cache. The
//! learning rate follows the library's cosine schedule over the whole run.
//!
//!   cargo run --release --example mnist -- --help

use flatnn::data::{Dataset, DeviceDataset, Loader, Split};
use flatnn::models;
use flatnn::prelude::*;
use indicatif::{ProgressBar, ProgressState, ProgressStyle};
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
    devices: Option<String>,
    data: PathBuf,
    save: Option<PathBuf>,
    load: Option<PathBuf>,
}

const USAGE: &str = "\
Trains a classifier on MNIST (60,000 training images, 10,000 test images, shipped in data/mnist)
and reports, per epoch, the training loss, the test loss and accuracy, seconds and samples/s.

usage: cargo run --release --example mnist -- [OPTIONS]

options (default in brackets):
  --model NAME        the network [mlp]:
                        mlp    784-128-64-10, ReLU, on the image as a vector (109,386 parameters)
                        cnn    SimpleNNs' CNN: conv 5x5x16, max-pool 2, conv 3x3x8, max-pool 4,
                               dense 10, ReLU (1,906 parameters)
                        lenet  LeNet-5 with ReLU: conv 5x5x6 (pad 2), max-pool 2, conv 5x5x16,
                               max-pool 2, dense 120, 84, 10 (61,706 parameters)
  --epochs N          passes over the training images, at least 1 [10]
  --batch N           samples per step [128]
  --optimizer NAME    adam, adamw (weight decay 1e-4), sgd (momentum 0.9, Nesterov) or rmsprop [adam]
  --lr X              base learning rate, decayed to 0 over the run by a cosine
                      [adam 2e-3, adamw 1e-3, sgd 0.05, rmsprop 1e-3]
  --threads N         CPU threads [FLATNN_THREADS, else one per physical core]
  --seed N            initialisation and shuffling [1]
  --device DEVICE     cpu, cuda, cuda:N, or auto: CUDA device 0 where it works, else the CPU;
                      FLATNN_DEVICE=cpu|cuda|cuda:N overrides auto [auto]
  --devices LIST      train data-parallel on these GPUs, e.g. cuda:0,cuda:1 (NCCL needed:
                      libnccl.so.2 on the library path): each holds a replica and an equal
                      shard of the training images and takes batch/GPUs samples a step [none]
  --data DIR          the four MNIST IDX files, raw or gzipped [data/mnist of this crate]
  --save FILE         after training, write the model as safetensors (PyTorch's names) [none]
  --load FILE         instead of training, evaluate a saved model (or checkpoint) [none]
  -h, --help          this text";

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
        devices: None,
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
        let value = args.next().ok_or_else(|| format!("{flag} needs a value (see --help)"))?;
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
            "--devices" => o.devices = Some(value),
            "--data" => o.data = value.into(),
            "--save" => o.save = Some(value.into()),
            "--load" => o.load = Some(value.into()),
            _ => return Err(format!("unknown option {flag} (see --help)")),
        }
    }
    if !["mlp", "cnn", "lenet"].contains(&o.model.as_str()) {
        return Err(format!("--model must be mlp, cnn or lenet, not {:?}", o.model));
    }
    if o.epochs == 0 {
        return Err("--epochs must be at least 1".into());
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

/// The mean loss on `data` and the fraction of it classified right, in batches through `fwd`
/// (inference mode: `Model::loss` runs the forward pass and leaves the outputs in the cache).
fn evaluate(model: &Model, fwd: &mut Cache, data: &mut Data, loader: &mut Loader) -> flatnn::Result<(f64, f64)> {
    loader.rewind();
    let (mut loss, mut right, mut seen) = (0.0, 0usize, 0usize);
    while let Some(batch) = data.next_batch(loader, fwd)? {
        loss += f64::from(model.loss(fwd, Loss::LogitCrossEntropy)?) * batch as f64;
        let labels = &data.host.labels()[seen..seen + batch];
        for (scores, &label) in fwd.outputs().chunks_exact(10).zip(labels) {
            let best = scores.iter().enumerate().fold(0, |b, (i, &s)| if s > scores[b] { i } else { b });
            right += usize::from(best as u32 == label);
        }
        seen += batch;
    }
    Ok((loss / seen as f64, right as f64 / seen as f64))
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
        let (loss, acc) = evaluate(&model, &mut fwd, &mut test, &mut test_loader)?;
        println!("{} on {device}: test loss {loss:.4}, accuracy {:.2}%", path.display(), 100.0 * acc);
        return Ok(());
    }
    if let Some(list) = &o.devices {
        let devices = list.split(',').map(Device::parse).collect::<flatnn::Result<Vec<_>>>()?;
        #[cfg(feature = "cuda")]
        return data_parallel(&o, &devices);
        #[cfg(not(feature = "cuda"))]
        return Err(format!("--devices {devices:?} needs flatnn's `cuda` feature").into());
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
    // from the base rate down to zero along a cosine, step by step over the whole run: the last
    // epochs settle instead of bouncing around the optimum
    let steps = (o.epochs * train_loader.batches()) as u64;
    opt.set_schedule(Schedule::cosine(0, steps))?;
    println!("{model}");
    let place = match device {
        Device::Cpu => "on the CPU".to_string(),
        Device::Cuda(n) => format!("on CUDA device {n} ({}), data in device memory", Device::Cuda(n).name()?),
    };
    println!("{} {place}, batch {}, {:?}, cosine schedule over {steps} steps", o.model, o.batch, opt.config());
    // the bar counts samples, so its rate is samples/s; indicatif redraws at most 20 times a
    // second, whatever the calls
    let bar_style = ProgressStyle::with_template("{prefix} [{bar:25}] {percent:>3}% {rate} eta {eta} {msg}")
        .map_err(|e| e.to_string())?
        .with_key("rate", |state: &ProgressState, w: &mut dyn std::fmt::Write| {
            let _ = write!(w, "{:.0} samples/s", state.per_sec());
        })
        .progress_chars("=> ");
    for epoch in 1..=o.epochs {
        let bar = ProgressBar::new(train.len() as u64).with_style(bar_style.clone()).with_prefix(format!("epoch {epoch}"));
        let start = Instant::now();
        let (mut shown, mut steps) = (start, 0u32);
        train_loader.shuffle();
        bwd.mean_loss()?;
        while let Some(batch) = train.next_batch(&mut train_loader, &mut fwd)? {
            opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy)?;
            // an atomic add and a clock read (indicatif draws at most 20 times a second)
            bar.inc(batch as u64);
            steps += 1;
            if steps.is_multiple_of(32) && shown.elapsed().as_millis() >= 500 {
                // reading the loss waits for the device: twice a second at most
                bar.set_message(format!("loss {:.4}", bwd.last_loss()?));
                shown = Instant::now();
            }
        }
        let epoch_loss = bwd.mean_loss()?;
        let seconds = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let (test_loss, acc) = evaluate(&model, &mut fwd, &mut test, &mut test_loader)?;
        println!(
            "epoch {epoch:>2}  loss {epoch_loss:.4}  test loss {test_loss:.4}  accuracy {:.2}%  {seconds:.2} s  {:.0} samples/s",
            100.0 * acc,
            train.len() as f64 / seconds
        );
    }
    if let Some(path) = &o.save {
        model.save(path)?;
        println!("saved {}", path.display());
    }
    Ok(())
}

/// Training on several GPUs: a replica a GPU, each with an equal shard of the training
/// images in its memory and a loader of its own, batch/GPUs samples a step each; the
/// gradients averaged over the global batch by NCCL inside each step's graph. The test set is
/// evaluated on the first GPU's replica.
#[cfg(feature = "cuda")]
fn data_parallel(o: &Options, devices: &[Device]) -> Result<(), Box<dyn std::error::Error>> {
    let world = devices.len();
    if !o.batch.is_multiple_of(world) {
        return Err(format!("--batch {} is not a multiple of the {world} GPUs", o.batch).into());
    }
    let model = chain(&o.model).build()?.init(Init::HeNormal, o.seed);
    let mut dp = DataParallel::new(&model, devices, o.batch, optimizer(&o.optimizer, o.lr)?)?;
    let train = Dataset::mnist(&o.data, Split::Train)?;
    let shard_len = train.len() / world;
    let mut shards = Vec::new();
    for (rank, device) in devices.iter().enumerate() {
        let picked = rank * shard_len..(rank + 1) * shard_len;
        let samples: Vec<f32> = picked.clone().flat_map(|i| train.sample(i).expect("a sample of the set").iter().copied()).collect();
        let shard = Dataset::from_labels(&samples, &train.labels()[picked], train.shape())?;
        let loader = Loader::new(shard_len, o.batch / world, o.seed + rank as u64, false)?;
        shards.push((shard.to_device(device, 10)?, loader));
    }
    let steps = (o.epochs * shards[0].1.batches()) as u64;
    dp.configure(|opt| opt.set_schedule(Schedule::cosine(0, steps)))?;
    let mut test = Data::new(Dataset::mnist(&o.data, Split::Test)?, &devices[0])?;
    let mut test_loader = Loader::new(test.len(), o.batch, 0, false)?;
    let mut fwd = dp.model().preallocate(o.batch)?;
    println!("{}", dp.model());
    let names = devices.iter().map(|d| Ok(format!("{d} ({})", d.name()?))).collect::<flatnn::Result<Vec<_>>>()?;
    println!(
        "{} data-parallel on {}: global batch {}, {:?}, cosine schedule over {steps} steps",
        o.model,
        names.join(", "),
        o.batch,
        dp.optimizer().config()
    );
    for epoch in 1..=o.epochs {
        let start = Instant::now();
        shards.iter_mut().for_each(|(_, loader)| loader.shuffle());
        dp.mean_loss()?;
        let mut seen = 0usize;
        'epoch: loop {
            for (cache, (shard, loader)) in dp.caches_mut()?.zip(&mut shards) {
                match loader.next_device_batch(shard, cache)? {
                    Some(batch) => seen += batch,
                    // equal shards, equal loaders: every replica's epoch ends at the same step
                    None => break 'epoch,
                }
            }
            dp.train_step(Loss::LogitCrossEntropy)?;
        }
        let epoch_loss = dp.mean_loss()?;
        let seconds = start.elapsed().as_secs_f64();
        let (test_loss, acc) = evaluate(dp.model(), &mut fwd, &mut test, &mut test_loader)?;
        println!(
            "epoch {epoch:>2}  loss {epoch_loss:.4}  test loss {test_loss:.4}  accuracy {:.2}%  {seconds:.2} s  {:.0} samples/s",
            100.0 * acc,
            seen as f64 / seconds
        );
    }
    if let Some(path) = &o.save {
        dp.synchronize()?;
        dp.model().save(path)?;
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
