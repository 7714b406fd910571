//! Batch-1 inference of the dense zoo models against their memory floor, one thread.
//!
//!   cargo bench --bench floor -- [--models mlp,simplenn,autoencoder,gelu_mlp] [--rounds N]
//!       [--quick] [--layers] [--batch N]
//!
//! A batch-1 forward of a dense network reads each parameter once and does two FLOPs with it,
//! so it can go no faster than its parameters stream from the cache level that holds them
//! between calls: L2 where they fit, else L3. For each model, built as the zoo's `infer` task
//! builds it (He normal, seed 11, one thread, a cache for one sample with its inputs set):
//!
//! - `bytes`: its parameters (weights and biases), 4 bytes each;
//! - `read`: what one thread reads from a buffer of exactly those bytes (64-byte aligned, warm
//!   in the caches, read again and again) with 16-lane loads where the CPU has AVX-512, else
//!   8-lane ones, into 8 independent sums: GB/s (10⁹ bytes);
//! - `floor` = bytes / read; `forward`: `Model::forward`'s time per call; `ratio` = forward / floor.
//!
//! Times are process CPU time (see `common/measure.rs`): each round measures, for each model,
//! the read and the forward (which goes first alternates by round), and the table gives the
//! least of the rounds' medians. With `--layers`, each round also times, for each dense layer,
//! a model of that layer alone with the model's values of its parameters (its activation, and
//! again with the identity) and its product alone (`flatnn::gemm`, the weights packed once as
//! the layer packs them, or in place for one output as the layer reads them): where the whole
//! model's time goes, and what a layer adds to its product (the bias, the activation, the call).
//! The last column, the forward less the sum of its layers alone, is what passing from layer to
//! layer costs where the model's parameters fit the cache its layers' do; where they do not, it
//! also holds what reading them from further away costs, as a layer alone reads its own from
//! nearer. The kernels are those of `FLATNN_ISA` (the best the CPU has).
//!
//! `--batch N` (1) runs every forward and product on N samples: the floor is then only a
//! reference (each parameter does 2·N FLOPs), and the layer table's products give their
//! GFLOP/s (2·N·in·out per call): where a batch's time goes, product, bias and activation.

#[path = "common/measure.rs"]
mod measure;

use flatnn::gemm::{Gemm, Mat, MatMut};
use flatnn::models;
use flatnn::prelude::*;
use flatnn::testutil::Rng;
use flatnn::Result;
use measure::{least, Sampling};
use std::time::Duration;

/// A zoo model's name and its chain.
type Named = (&'static str, fn() -> Chain);

/// The dense models of the zoo, named as there.
const MODELS: [Named; 4] =
    [("mlp", models::mlp), ("simplenn", models::simplenns_mlp), ("autoencoder", models::autoencoder), ("gelu_mlp", models::gelu_mlp)];

/// The zoo's seed, of the weights and of the inputs.
const SEED: u64 = 11;

struct Args {
    models: Vec<Named>,
    rounds: usize,
    quick: bool,
    layers: bool,
    batch: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { models: MODELS.to_vec(), rounds: 5, quick: false, layers: false, batch: 1 };
    let mut rounds = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or_else(|| Error::Config(format!("{arg} needs a value")));
        match arg.as_str() {
            "--bench" => {}
            "--models" => {
                args.models = value()?
                    .split(',')
                    .map(|name| {
                        MODELS
                            .into_iter()
                            .find(|m| m.0 == name)
                            .ok_or_else(|| Error::Config(format!("--models: no dense zoo model {name:?}")))
                    })
                    .collect::<Result<_>>()?
            }
            "--rounds" => rounds = Some(value()?.parse::<usize>().map_err(|e| Error::Config(format!("--rounds: {e}")))?.max(1)),
            "--quick" => args.quick = true,
            "--layers" => args.layers = true,
            "--batch" => args.batch = value()?.parse::<usize>().map_err(|e| Error::Config(format!("--batch: {e}")))?.max(1),
            other => return Err(Error::Config(format!("unknown argument {other:?}"))),
        }
    }
    args.rounds = rounds.unwrap_or(if args.quick { 1 } else { 5 });
    Ok(args)
}

/// A buffer of `bytes` (rounded up to whole 512-byte blocks) whose first value is 64-byte
/// aligned: the values from `start` on.
struct Aligned {
    data: Vec<f32>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(bytes: usize) -> Aligned {
        let len = bytes.div_ceil(512) * 128;
        let data = vec![1.0f32; len + 16];
        let start = data.as_ptr().align_offset(64);
        Aligned { data, start, len }
    }

    fn values(&self) -> &[f32] {
        &self.data[self.start..][..self.len]
    }
}

/// Σ of a buffer, 16 lanes × 8 independent sums (enough loads in flight that the caches, not
/// an add's latency, set the pace); `x.len()` a multiple of 128.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 8];
    for block in x.chunks_exact(128) {
        for (v, a) in acc.iter_mut().enumerate() {
            // SAFETY: values 16·v..16·v + 16 of a block of 128.
            *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(block.as_ptr().add(16 * v)) });
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)))
}

/// As [`sum_avx512`] with 8 lanes; `x.len()` a multiple of 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    for block in x.chunks_exact(64) {
        for (v, a) in acc.iter_mut().enumerate() {
            // SAFETY: values 8·v..8·v + 8 of a block of 64.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(block.as_ptr().add(8 * v)) });
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: 8 values.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v))) };
    out.iter().sum()
}

/// The widest read loop this CPU has, and its name.
fn reader() -> (fn(&[f32]) -> f32, &'static str) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected; the buffers are whole blocks of 128 values.
            return (|x| unsafe { sum_avx512(x) }, "16-lane");
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected; the buffers are whole blocks of 128 values.
            return (|x| unsafe { sum_avx2(x) }, "8-lane");
        }
    }
    (|x| x.iter().sum(), "scalar")
}

/// Seconds per read of the whole buffer.
fn read_time(buffer: &Aligned, sampling: Sampling) -> f64 {
    let (read, _) = reader();
    sampling.per_call(|| {
        std::hint::black_box(read(std::hint::black_box(buffer.values())));
    })
}

/// Bytes of the unified cache of `level` (2 or 3) of CPU 0, as /sys gives it.
fn cache_bytes(level: u32) -> Option<usize> {
    (0..8).find_map(|i| {
        let read = |f: &str| std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/{f}")).ok();
        if read("level")?.trim() != level.to_string() || read("type")?.trim() != "Unified" {
            return None;
        }
        let size = read("size")?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit()).unwrap_or(size.len()));
        let scale = match unit {
            "K" => 1 << 10,
            "M" => 1 << 20,
            "" => 1,
            _ => return None,
        };
        digits.parse::<usize>().ok().map(|d| d * scale)
    })
}

/// A model on one thread with a cache for `batch` samples, its inputs set as the zoo sets them.
fn ready(model: Model, batch: usize) -> Result<(Model, Cache)> {
    let model = model.with_threads(1)?;
    let mut cache = model.preallocate(batch)?;
    cache.set_inputs(&Rng::new(SEED).uniform(batch * model.input_shape().len()))?;
    Ok((model, cache))
}

/// Seconds per `Model::forward`.
fn forward_time(model: &Model, cache: &mut Cache, sampling: Sampling) -> Result<f64> {
    let mut failed = None;
    let seconds = sampling.per_call(|| {
        if let Err(e) = model.forward(cache) {
            failed = Some(e);
        }
    });
    failed.map_or(Ok(seconds), Err)
}

/// One dense layer of a model, and what `--layers` times of it.
struct DenseLayer {
    inputs: usize,
    outputs: usize,
    activation: Activation,
    /// Its weights and bias.
    bytes: usize,
    /// A model of the layer alone with the model's values of its parameters, then the same
    /// with the identity.
    alone: [(Model, Cache); 2],
    /// Wᵀ (in × out) packed once for the product alone (none for one output: read in place).
    packed: Option<flatnn::gemm::PackedB>,
    weights: Vec<f32>,
    x: Vec<f32>,
    z: Vec<f32>,
    gemm: Gemm,
    batch: usize,
}

impl DenseLayer {
    fn of(model: &Model, batch: usize) -> Result<Vec<DenseLayer>> {
        let params = model.parameters()?;
        let mut layers = Vec::new();
        for step in &model.plan().steps {
            let flatnn::Layer::Dense(dense) = &step.layer else { continue };
            let (inputs, outputs, activation) = (step.input.len(), dense.out_features, dense.activation);
            let values = &params[step.params.clone()];
            let alone = |act: Activation| -> Result<(Model, Cache)> {
                let mut m = Chain::new(Input::vector(inputs)).dense(outputs, act).build()?.init(Init::HeNormal, SEED);
                m.set_parameters(values)?;
                ready(m, batch)
            };
            let weights = values[..inputs * outputs].to_vec();
            let gemm = Gemm::new(1)?;
            // B = Wᵀ: element (i, o) at w[o·in + i]
            let packed = (outputs > 1).then(|| gemm.pack(inputs, outputs, Mat { data: &weights, rs: 1, cs: inputs })).transpose()?;
            layers.push(DenseLayer {
                inputs,
                outputs,
                activation,
                bytes: 4 * values.len(),
                alone: [alone(activation)?, alone(Activation::Identity)?],
                packed,
                x: Rng::new(SEED).uniform(batch * inputs),
                z: vec![0.0; batch * outputs],
                weights,
                gemm,
                batch,
            });
        }
        Ok(layers)
    }

    /// Seconds per product Z (batch×out) = X·Wᵀ alone.
    fn product_time(&mut self, sampling: Sampling) -> Result<f64> {
        let DenseLayer { inputs, outputs, packed, weights, x, z, gemm, batch, .. } = self;
        let x = Mat { data: x, rs: *inputs, cs: 1 };
        let mut failed = None;
        let seconds = sampling.per_call(|| {
            let z = MatMut { data: z, rs: *outputs, cs: 1 };
            let done = match packed {
                Some(packed) => gemm.sgemm_packed(*batch, 1.0, x, packed, 0.0, z),
                None => gemm.sgemm(*batch, *outputs, *inputs, 1.0, x, Mat { data: weights, rs: 1, cs: *inputs }, 0.0, z),
            };
            if let Err(e) = done {
                failed = Some(e);
            }
        });
        failed.map_or(Ok(seconds), Err)
    }
}

/// A model and its figures over the rounds.
struct Entry {
    name: &'static str,
    model: Model,
    cache: Cache,
    bytes: usize,
    buffer: Aligned,
    layers: Vec<DenseLayer>,
    /// Per round: seconds per read of the buffer, per forward.
    read: Vec<f64>,
    forward: Vec<f64>,
    /// Per layer, per round: the layer alone, alone with the identity, its product alone.
    layer_times: Vec<[Vec<f64>; 3]>,
}

fn us(seconds: f64) -> String {
    format!("{:.2} µs", seconds * 1e6)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let sampling = if args.quick {
        Sampling { warmup: Duration::from_millis(10), sample: Duration::from_millis(2), samples: 3 }
    } else {
        Sampling { warmup: Duration::from_millis(30), sample: Duration::from_millis(5), samples: 7 }
    };
    let l2 = cache_bytes(2);
    let mut entries = Vec::new();
    for &(name, chain) in &args.models {
        let (model, cache) = ready(chain().build()?.init(Init::HeNormal, SEED), args.batch)?;
        let bytes = 4 * model.parameters()?.len();
        let layers = if args.layers { DenseLayer::of(&model, args.batch)? } else { Vec::new() };
        let layer_times = layers.iter().map(|_| Default::default()).collect();
        entries.push(Entry {
            name,
            model,
            cache,
            bytes,
            buffer: Aligned::new(bytes),
            layers,
            read: Vec::new(),
            forward: Vec::new(),
            layer_times,
        });
    }
    let (_, lanes) = reader();
    let kernels = Gemm::new(1)?.isa();
    println!("machine: {}", measure::machine());
    println!("load average at the start: {}", measure::load());
    let reference: Vec<String> = [256usize << 10, 768 << 10, 4 << 20, 16 << 20, 256 << 20]
        .iter()
        .map(|&b| format!("{} KiB {:.0}", b >> 10, b as f64 / read_time(&Aligned::new(b), sampling) / 1e9))
        .collect();
    println!("one thread's {lanes} read rate, GB/s, by buffer size: {}", reference.join(", "));
    for round in 0..args.rounds {
        for e in &mut entries {
            if round % 2 == 0 {
                e.read.push(read_time(&e.buffer, sampling));
                e.forward.push(forward_time(&e.model, &mut e.cache, sampling)?);
            } else {
                e.forward.push(forward_time(&e.model, &mut e.cache, sampling)?);
                e.read.push(read_time(&e.buffer, sampling));
            }
            for (layer, times) in e.layers.iter_mut().zip(&mut e.layer_times) {
                for (alone, t) in layer.alone.iter_mut().zip(times.iter_mut()) {
                    t.push(forward_time(&alone.0, &mut alone.1, sampling)?);
                }
                let product = layer.product_time(sampling)?;
                times[2].push(product);
            }
            eprintln!("round {round}: {} read {}, forward {}", e.name, us(e.read[round]), us(e.forward[round]));
        }
    }
    println!(
        "\none thread, {kernels} kernels, batch {}; the least of {} rounds' medians of process CPU time per call (read and forward alternating)\n",
        args.batch, args.rounds
    );
    println!("| model | parameters | bytes | held in | read | floor | forward | forward / floor |");
    println!("|---|---|---|---|---|---|---|---|");
    for e in &entries {
        let (read, forward) = (least(&e.read), least(&e.forward));
        let level = match l2 {
            Some(l2) if e.bytes <= l2 => "L2",
            Some(_) => "L3",
            None => "?",
        };
        println!(
            "| {} | {} | {:.1} KB | {level} | {:.0} GB/s | {} | {} | {:.2}× |",
            e.name,
            e.bytes / 4,
            e.bytes as f64 / 1e3,
            e.bytes as f64 / read / 1e9,
            us(read),
            us(forward),
            forward / read
        );
    }
    if args.layers {
        println!("\nby layer: its parameters' floor at the model's read rate; a model of the layer alone (its activation, then the identity); its product alone (GFLOP/s)\n");
        println!("| model | layer | bytes | floor | alone | alone, identity | product | forward − Σ alone |");
        println!("|---|---|---|---|---|---|---|---|");
        for e in &entries {
            let rate = e.bytes as f64 / least(&e.read);
            let sum_alone: f64 = e.layer_times.iter().map(|t| least(&t[0])).sum();
            for (i, (layer, t)) in e.layers.iter().zip(&e.layer_times).enumerate() {
                let rest = if i == 0 { us(least(&e.forward) - sum_alone) } else { String::new() };
                let gflops = 2.0 * (layer.batch * layer.inputs * layer.outputs) as f64 / least(&t[2]) / 1e9;
                println!(
                    "| {} | {}→{} {} | {:.1} KB | {} | {} | {} | {} ({gflops:.0}) | {rest} |",
                    e.name,
                    layer.inputs,
                    layer.outputs,
                    layer.activation.name(),
                    layer.bytes as f64 / 1e3,
                    us(layer.bytes as f64 / rate),
                    us(least(&t[0])),
                    us(least(&t[1])),
                    us(least(&t[2]))
                );
            }
        }
    }
    println!("\nload average at the end: {}", measure::load());
    Ok(())
}
