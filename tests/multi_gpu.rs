//! Data-parallel training on every GPU of the machine (`DataParallel`, two or more): the same
//! result as one GPU on the whole batch, replicas that stay bit-identical, batch norm's running
//! statistics each replica's own, nothing allocated per step, one process a GPU, and errors
//! instead of hangs. Each test takes every CUDA device there is (n =
//! `flatnn::cuda::device_count()`, at least two, else it fails saying so) and needs NCCL
//! (`libnccl.so.2` on the library path), and is `#[ignore]`d; each name holds `many_gpus`, so
//! that `cargo test --release --test multi_gpu -- --include-ignored --skip many_gpus` runs none
//! of them on a one-GPU machine. Global batches are at least 63 samples (every replica has one
//! for n up to 63), and of each pair of sizes a test trains on (512 and 511, 256 and 255, 512
//! and 63, 64 and 63) at least one leaves shares a sample apart for every n from 2 to 8. Tests
//! that start processes of their own (the same binary, one test each, n of them) pass them the
//! environment as it is (NCCL's variables included). The tests take turns on the GPUs (one reads
//! free device memory), their child processes included.
#![cfg(feature = "cuda")]

use flatnn::models::{lenet5, mlp, resnet_small};
use flatnn::prelude::*;
use flatnn::testutil::{in_child, rel_err, run_alone, Rng};
use std::alloc::{GlobalAlloc, Layout, System};
use std::ops::Range;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Counts the allocations of every thread (a group's replicas but the first run their steps on
/// threads of their own): read only in a child process that runs one test alone.
struct Everywhere;
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator; only counts.
unsafe impl GlobalAlloc for Everywhere {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static EVERYWHERE: Everywhere = Everywhere;

const NEEDS: &str = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)";

/// Held by each test while it runs, its child processes included.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The first line of every test here: the number of CUDA devices, and this test's turn on them
/// (held until the guard drops); with fewer than two, or without NCCL, the test fails saying
/// so. Makes no context on any device (a test's processes each use one device).
fn gpu_count() -> (usize, MutexGuard<'static, ()>) {
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
    let count = flatnn::cuda::device_count();
    assert!(count >= 2, "this test needs two or more CUDA devices and there are {count}");
    if let Err(e) = flatnn::cuda::nccl_version() {
        panic!("this test needs NCCL: {e}");
    }
    (count, turn)
}

/// CUDA devices 0..count.
fn devices(count: usize) -> Vec<Device> {
    (0..count).map(|i| Device::cuda(i).unwrap()).collect()
}

/// As [`gpu_count`], with every device.
fn every_gpu() -> (Vec<Device>, MutexGuard<'static, ()>) {
    let (count, turn) = gpu_count();
    (devices(count), turn)
}

/// The samples of a batch of `batch` that rank `rank` of `world` trains on, as `DataParallel`
/// documents its split: contiguous shares, the first `batch % world` one sample larger.
fn share(batch: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (batch / world, batch % world);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Σ_r (share_r / batch) · gradients_r, as the reduction weighs each rank's gradients (the
/// weight rounded to f32, the sum in f64): the gradients each rank's `Share` computes of its
/// samples of (`x`, `labels`) at `params`; and the loss, weighted alike.
fn weighted(shares: &mut [Share], params: &[f32], x: &[f32], labels: &[u32]) -> (Vec<f32>, f32) {
    let (batch, world) = (labels.len(), shares.len());
    let (mut grads, mut loss) = (Vec::new(), 0f64);
    for (rank, gpu) in shares.iter_mut().enumerate() {
        let range = share(batch, world, rank);
        let weight = range.len() as f64 / batch as f64;
        let (g, l) = gpu.backprop(params, x, labels, range);
        grads.resize(g.len(), 0f64);
        grads.iter_mut().zip(&g).for_each(|(w, g)| *w += f64::from(weight as f32) * f64::from(*g));
        loss += weight * f64::from(l);
    }
    (grads.iter().map(|&v| v as f32).collect(), loss as f32)
}

/// `steps` global batches (inputs, labels) for `model`, of `sizes[i % sizes.len()]` samples.
fn batches(model: &Model, steps: usize, sizes: &[usize], seed: u64) -> Vec<(Vec<f32>, Vec<u32>)> {
    let mut rng = Rng::new(seed);
    (0..steps).map(|i| flatnn::testutil::batch(&mut rng, model, sizes[i % sizes.len()])).collect()
}

/// SGD with momentum and clipping by norm (the norm's kernel runs after the reduction).
fn sgd() -> (Optim, Clip) {
    (Optim::sgd(0.05, 0.9), Clip::Norm(5.0))
}

/// The parameters and the losses of `steps` steps on one GPU, each on a whole batch.
fn one_gpu(model: &Model, optim: (Optim, Clip), data: &[(Vec<f32>, Vec<u32>)], capacity: usize) -> (Vec<f32>, Vec<f32>) {
    let mut model = model.to(&Device::cuda(0).unwrap()).unwrap();
    let (mut fwd, mut bwd) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
    let mut opt = Optimizer::new(&model, optim.0).unwrap();
    opt.set_clip(optim.1).unwrap();
    let mut losses = Vec::new();
    for (x, labels) in data {
        fwd.set_inputs(x).unwrap();
        fwd.set_labels(labels).unwrap();
        opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::LogitCrossEntropy).unwrap();
        losses.push(bwd.last_loss().unwrap());
    }
    (model.parameters().unwrap().into_owned(), losses)
}

/// The same steps through `dp`, each on the global batch.
fn data_parallel(dp: &mut DataParallel, data: &[(Vec<f32>, Vec<u32>)]) -> (Vec<f32>, Vec<f32>) {
    let mut losses = Vec::new();
    for (x, labels) in data {
        dp.set_inputs(x).unwrap();
        dp.set_labels(labels).unwrap();
        dp.train_step(Loss::LogitCrossEntropy).unwrap();
        losses.push(dp.last_loss().unwrap());
    }
    (dp.parameters().unwrap(), losses)
}

/// One GPU's backward pass on one replica's share of a batch: the same device, capacity and
/// batch size as the replica, so the same kernels and convolution algorithms (chosen once per
/// process for a device, shape and batch), on the same parameters. Its model's running
/// statistics move with the samples it is given, as the replica's do.
struct Share {
    model: Model,
    cache: Cache,
    grads: Grads,
}

impl Share {
    fn new(model: &Model, device: Device, capacity: usize) -> Share {
        let model = model.to(&device).unwrap();
        let (cache, grads) = (model.preallocate(capacity).unwrap(), model.preallocate_grads(capacity).unwrap());
        Share { model, cache, grads }
    }

    /// The gradients and the loss of samples `range` of (`x`, `labels`) at `params`.
    fn backprop(&mut self, params: &[f32], x: &[f32], labels: &[u32], range: Range<usize>) -> (Vec<f32>, f32) {
        let per_sample = self.model.input_shape().len();
        self.model.set_parameters(params).unwrap();
        self.cache.set_inputs(&x[range.start * per_sample..range.end * per_sample]).unwrap();
        self.cache.set_labels(&labels[range]).unwrap();
        self.model.backprop(&mut self.grads, &mut self.cache, Loss::LogitCrossEntropy).unwrap();
        (self.grads.gradients().unwrap().into_owned(), self.grads.last_loss().unwrap())
    }
}

/// One Share a replica: on each of `devices`, for its share of global batches of `capacity`.
fn shares(model: &Model, devices: &[Device], capacity: usize) -> Vec<Share> {
    devices.iter().map(|&d| Share::new(model, d, capacity.div_ceil(devices.len()))).collect()
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_twenty_steps_equal_one_gpu_on_the_whole_batch() {
    let (devices, _turn) = every_gpu();
    // One GPU on the whole batch rounds otherwise than n on their shares (other kernels and
    // convolution algorithms for 512 samples than for 512 / n, sums in another order): ~1e-7 a
    // step, which LeNet amplifies under this optimiser. On the CPU (the reference), LeNet's
    // parameters moved by one rounding (× (1 ± 1e-7)) before these 20 steps end 1.0e-3 from
    // the unmoved run's (1.2e-7 for 8 steps, then growing), the MLP's 1.2e-7; and a step's
    // gradients from parameters one rounding apart are at times 1e-4 to 1e-3 apart (a ReLU or
    // a max-pool that flips). So the 1e-5 against the whole batch holds for the MLP
    // and LeNet's free run is held only to 1e-2 (a share lost or not averaged costs more);
    // what a step must compute is checked step by step, for both: its gradients and loss are
    // its shares', each run on one GPU alone (the same kernels as its replica, so the same
    // rounding but for the reduction's), weighted by samples, within 1e-6.
    let world = devices.len();
    for (name, chain, bar) in [("mlp", mlp(), 1e-5), ("lenet", lenet5(), 1e-2)] {
        let model = chain.build().unwrap().init(Init::HeNormal, 3);
        // 512 and 511: equal shares (2, 4 or 8 GPUs) and shares a sample apart, weighted by
        // samples; on 3, 5 or 6 GPUs both are uneven, on 7 only 512
        let data = batches(&model, 20, &[512, 511], 5);
        let (want, want_losses) = one_gpu(&model, sgd(), &data, 512);
        let mut dp = DataParallel::new(&model, &devices, 512, sgd().0).unwrap();
        dp.configure(|opt| opt.set_clip(sgd().1)).unwrap();
        let mut shares = shares(&model, &devices, 512);
        let (mut losses, mut worst) = (Vec::new(), 0f64);
        for (step, (x, labels)) in data.iter().enumerate() {
            let before = dp.parameters().unwrap();
            dp.set_inputs(x).unwrap();
            dp.set_labels(labels).unwrap();
            dp.train_step(Loss::LogitCrossEntropy).unwrap();
            let (grads, loss) = (dp.gradients().unwrap(), dp.last_loss().unwrap());
            let (want_grads, want_loss) = weighted(&mut shares, &before, x, labels);
            let (err, loss_err) = (rel_err(&grads, &want_grads), rel_err(&[loss], &[want_loss]));
            assert!(err <= 1e-6 && loss_err <= 1e-6, "{name}, step {step}: gradients {err:.2e}, loss {loss_err:.2e} from their shares'");
            worst = worst.max(err);
            losses.push(loss);
        }
        let (err, loss_err) = (rel_err(&dp.parameters().unwrap(), &want), rel_err(&losses, &want_losses));
        println!("{name}: every step's gradients within {worst:.2e} of their shares'; after 20 steps on {world} GPUs against 1 GPU on the whole batch: parameters {err:.2e}, losses {loss_err:.2e}");
        assert!(err <= bar && loss_err <= bar, "{name}: parameters differ by {err:.2e}, losses by {loss_err:.2e} (bar {bar:.0e})");
        assert_eq!(dp.optimizer().steps(), 20);
    }
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_replicas_stay_bit_identical_over_1000_steps() {
    let (devices, _turn) = every_gpu();
    for (name, chain) in [("mlp", mlp()), ("lenet", lenet5())] {
        let model = chain.build().unwrap().init(Init::HeNormal, 7);
        let mut dp = DataParallel::new(&model, &devices, 256, Optim::adam(1e-3).with_weight_decay(1e-4)).unwrap();
        dp.configure(|opt| {
            opt.set_clip(Clip::Norm(1.0))?;
            opt.set_schedule(Schedule::cosine(50, 1000))
        })
        .unwrap();
        // 255: shares a sample apart on 2, 4, 6, 7 or 8 GPUs; 256 on 3, 5, 6 or 7
        let data = batches(&model, 16, &[256, 255], 11);
        for step in 0..1000 {
            let (x, labels) = &data[step % data.len()];
            dp.set_inputs(x).unwrap();
            dp.set_labels(labels).unwrap();
            dp.train_step(Loss::LogitCrossEntropy).unwrap();
        }
        let loss = dp.last_loss().unwrap();
        assert!(loss.is_finite() && !dp.diverged().unwrap(), "{name}: loss {loss}");
        let replicas: Vec<Vec<u32>> = dp.models().map(|m| m.parameters().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
        assert_eq!(replicas.len(), devices.len());
        for (rank, replica) in replicas.iter().enumerate().skip(1) {
            let differ = replica.iter().zip(&replicas[0]).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{name}: {differ} of {} parameters of rank {rank} differ from rank 0's after 1,000 steps", replica.len());
        }
        println!("{name}: {} replicas identical after 1,000 steps, loss {loss:.4}", replicas.len());
    }
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_a_step_allocates_nothing_and_device_memory_stays_put() {
    let (count, _turn) = gpu_count();
    // alone in a child process (while this test holds its turn): the counter counts every
    // thread's allocations, and no other test may take device memory while it is read
    if !in_child() {
        run_alone("many_gpus_a_step_allocates_nothing_and_device_memory_stays_put", &[]);
        return;
    }
    let devices = devices(count);
    for (name, chain) in [("mlp", mlp()), ("lenet", lenet5())] {
        let model = chain.build().unwrap().init(Init::HeNormal, 1);
        let mut dp = DataParallel::new(&model, &devices, 512, Optim::adam(1e-3)).unwrap();
        dp.configure(|opt| {
            opt.set_clip(Clip::Norm(1.0))?;
            opt.set_schedule(Schedule::cosine(100, 3000))
        })
        .unwrap();
        // 63: at least 7 samples a GPU, up to 8 GPUs; 512 or 63 uneven on any number of them
        let data = batches(&model, 2, &[512, 63], 2);
        let mut step = |i: usize| {
            let (x, labels) = &data[i % 2];
            dp.set_inputs(x).unwrap();
            dp.set_labels(labels).unwrap();
            dp.train_step(Loss::LogitCrossEntropy).unwrap();
        };
        // warm-up: both batch sizes, both staging buffers of each cache, so every graph is captured
        (0..8).for_each(&mut step);
        let free = || -> Vec<usize> { devices.iter().map(|d| d.memory().unwrap().0).collect() };
        let before = free();
        let counted = ALLOCATIONS.load(Ordering::SeqCst);
        (0..1000).for_each(&mut step);
        dp.synchronize().unwrap();
        let allocations = ALLOCATIONS.load(Ordering::SeqCst) - counted;
        let after = free();
        println!("{name}: {allocations} host allocations in 1,000 steps on {count} GPUs; free device memory {before:?} -> {after:?}");
        assert_eq!(allocations, 0, "{name}: a data-parallel step allocated on the host");
        assert_eq!(before, after, "{name}: device memory changed over 1,000 steps");
        assert!(dp.last_loss().unwrap().is_finite());
    }
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_batch_norm_statistics_are_each_replicas_own() {
    let (devices, _turn) = every_gpu();
    // As under PyTorch's DistributedDataParallel without SyncBatchNorm: a step normalises each
    // share by the share's own statistics, and each replica's running statistics move with its
    // own shares alone. Nothing brings them together: the replicas' parameters stay the same,
    // their running statistics part. Rank 0's (`DataParallel::model`, and what is saved from
    // it) are those of rank 0's shares, as DDP's rank 0 keeps by default (it broadcasts rank 0's
    // buffers before every forward, so rank 0's move with rank 0's shares alone too).
    let world = devices.len();
    let model = resnet_small().build().unwrap().init(Init::HeNormal, 4);
    let data = batches(&model, 6, &[64, 63], 6);
    let mut dp = DataParallel::new(&model, &devices, 64, sgd().0).unwrap();
    let mut shares = shares(&model, &devices, 64);
    for (step, (x, labels)) in data.iter().enumerate() {
        let before = dp.parameters().unwrap();
        dp.set_inputs(x).unwrap();
        dp.set_labels(labels).unwrap();
        dp.train_step(Loss::LogitCrossEntropy).unwrap();
        // each share's backward pass, normalised by that share's statistics, moves that
        // share's running statistics as its replica's step did
        let (want, _) = weighted(&mut shares, &before, x, labels);
        let err = rel_err(&dp.gradients().unwrap(), &want);
        assert!(err <= 1e-6, "step {step}: gradients {err:.2e} from their shares' (each normalised by its own statistics)");
    }
    dp.synchronize().unwrap();
    let params: Vec<Vec<u32>> = dp.models().map(|m| m.parameters().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
    let buffers: Vec<Vec<f32>> = dp.models().map(|m| m.buffers().unwrap().into_owned()).collect();
    for rank in 0..world {
        assert!(params[rank] == params[0], "rank {rank}'s parameters differ from rank 0's");
        let own = rel_err(&buffers[rank], &shares[rank].model.buffers().unwrap());
        let apart = rel_err(&buffers[rank], &buffers[0]);
        println!("rank {rank}: running statistics {own:.2e} from its own shares', {apart:.2e} from rank 0's");
        assert!(own <= 1e-6, "rank {rank}: running statistics {own:.2e} from those of its own shares alone");
        // the shares hold other samples, so their statistics differ far beyond rounding
        assert!(rank == 0 || apart > 1e-5, "rank {rank}'s running statistics are rank 0's ({apart:.2e} apart)");
    }
    let dir = scratch("batch-norm");
    let path = dir.join("model.safetensors");
    dp.model().save(&path).unwrap();
    let saved = Model::load(&path).unwrap();
    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert!(bits(&saved.buffers().unwrap()) == bits(&buffers[0]), "the saved model's running statistics are not rank 0's");
    assert!(bits(&saved.parameters().unwrap()) == params[0], "the saved model's parameters are not the replicas'");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank's process as it ended: its exit status and what it printed.
struct Ended {
    status: ExitStatus,
    stdout: String,
}

impl Ended {
    /// Whether the one test it ran passed.
    fn passed(&self) -> bool {
        self.status.success() && self.stdout.contains("1 passed")
    }
}

/// Starts this test binary once per rank, each running test `test` alone with the group's
/// variables (RANK, WORLD_SIZE = `worlds[rank]`, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
/// `out` as FLATNN_TEST_OUT (their output goes to files there); waits until all have exited,
/// at most `deadline` from their start (then kills those left and fails, saying so, after
/// printing what each printed); returns how they ended, in rank order.
fn ranks(test: &str, worlds: &[usize], out: &Path, deadline: Duration) -> Vec<Ended> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let exe = std::env::current_exe().unwrap();
    let log = |rank: usize, stream: &str| out.join(format!("rank{rank}.{stream}"));
    let start = Instant::now();
    let mut children: Vec<Child> = worlds
        .iter()
        .enumerate()
        .map(|(rank, world)| {
            let file = |stream| Stdio::from(std::fs::File::create(log(rank, stream)).unwrap());
            let rank_var = rank.to_string();
            Command::new(&exe)
                .args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
                .envs([("FLATNN_TEST_CHILD", "1"), ("RANK", &rank_var), ("LOCAL_RANK", &rank_var), ("WORLD_SIZE", &world.to_string())])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port.as_str())])
                .env("FLATNN_TEST_OUT", out)
                .stdout(file("stdout"))
                .stderr(file("stderr"))
                .spawn()
                .unwrap()
        })
        .collect();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    while statuses.iter().any(Option::is_none) && start.elapsed() < deadline {
        for (child, status) in children.iter_mut().zip(&mut statuses) {
            if status.is_none() {
                *status = child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let late: Vec<usize> = (0..children.len()).filter(|&rank| statuses[rank].is_none()).collect();
    for &rank in &late {
        // a process this test started, still running past the deadline
        let _ = children[rank].kill();
        let _ = children[rank].wait();
    }
    let read = |rank: usize, stream: &str| std::fs::read_to_string(log(rank, stream)).unwrap_or_default();
    for (rank, status) in statuses.iter().enumerate() {
        let status = status.map_or_else(|| "still running at the deadline: killed".to_string(), |s| s.to_string());
        println!("--- rank {rank} ({status}):\n{}{}", read(rank, "stdout"), read(rank, "stderr"));
    }
    assert!(late.is_empty(), "ranks {late:?} had not exited {deadline:?} after they started: a hang");
    statuses.into_iter().enumerate().map(|(rank, status)| Ended { status: status.expect("exited"), stdout: read(rank, "stdout") }).collect()
}

/// A folder of its own for one test's files (its processes' output, a saved model).
fn scratch(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("flatnn-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// This process's rank, where it is one of a test's ranks.
fn rank() -> Option<usize> {
    in_child().then(|| std::env::var("RANK").ok()?.parse().ok()).flatten()
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_processes_train_as_one_gpu_on_the_whole_batch() {
    // a process a GPU, n of them
    let (world, _turn) = gpu_count();
    let model = mlp().build().unwrap().init(Init::HeNormal, 3);
    let data = batches(&model, 20, &[512, 511], 5);
    if let Some(rank) = rank() {
        let group = Group { timeout: Duration::from_secs(60), ..Group::from_env().unwrap() };
        let mut dp = DataParallel::join(&model, &group, 512, sgd().0).unwrap();
        dp.configure(|opt| opt.set_clip(sgd().1)).unwrap();
        assert_eq!((dp.world(), dp.ranks()), (world, rank..rank + 1));
        let (params, losses) = data_parallel(&mut dp, &data);
        let bytes: Vec<u8> = params.iter().chain(&losses).flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(Path::new(&std::env::var("FLATNN_TEST_OUT").unwrap()).join(format!("rank{rank}")), bytes).unwrap();
        return;
    }
    let out = scratch("processes");
    let ended = ranks("many_gpus_processes_train_as_one_gpu_on_the_whole_batch", &vec![world; world], &out, Duration::from_secs(300));
    assert!(ended.iter().all(Ended::passed), "a rank failed");
    let read = |rank: usize| -> Vec<f32> {
        let bytes = std::fs::read(out.join(format!("rank{rank}"))).unwrap();
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    let rank0 = read(0);
    for rank in 1..world {
        let theirs = read(rank);
        assert!(
            rank0.len() == theirs.len() && rank0.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits()),
            "process {rank}'s parameters or losses differ from process 0's"
        );
    }
    let (want, want_losses) = one_gpu(&model, sgd(), &data, 512);
    let (params, losses) = rank0.split_at(want.len());
    let (err, loss_err) = (rel_err(params, &want), rel_err(losses, &want_losses));
    println!("{world} processes against 1 GPU: parameters {err:.2e}, losses {loss_err:.2e} relative");
    assert!(err <= 1e-5 && loss_err <= 1e-5, "parameters differ by {err:.2e}, losses by {loss_err:.2e}");
    let _ = std::fs::remove_dir_all(&out);
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_a_mismatched_world_size_is_an_error_within_the_deadline() {
    let (world, _turn) = gpu_count();
    // n processes, the last with WORLD_SIZE = n + 1: rank 0 refuses the group as soon as the
    // last comes, and the ranks that came before it hear why at once; a rank that comes later
    // finds rank 0's port closed (its connection reset, or no rank 0 until its timeout). Each
    // measures from before it builds its replica (a context and the kernels: seconds), which
    // the bounds leave room for.
    const TIMEOUT: Duration = Duration::from_secs(30);
    if let Some(rank) = rank() {
        let model = mlp().build().unwrap().init(Init::HeNormal, 3);
        let group = Group { timeout: TIMEOUT, ..Group::from_env().unwrap() };
        let start = Instant::now();
        let err = DataParallel::join(&model, &group, 512, sgd().0).err().expect("a group of n and a group of n + 1").to_string();
        let elapsed = start.elapsed();
        println!("rank {rank}: {err} after {elapsed:?}");
        let named = err.contains(&format!("WORLD_SIZE={}", world + 1));
        if rank == 0 || rank == world - 1 {
            assert!(named, "{err}");
            assert!(elapsed < TIMEOUT, "rank {rank} heard of the mismatch {elapsed:?} after it started");
        } else {
            let late = err.contains("no rank 0 answered") || err.contains("did not hand out the id");
            assert!(named || late, "{err}");
            assert!(elapsed < 2 * TIMEOUT, "rank {rank} gave up {elapsed:?} after it started");
        }
        return;
    }
    let out = scratch("mismatch");
    let mut worlds = vec![world; world];
    worlds[world - 1] = world + 1;
    let ended = ranks("many_gpus_a_mismatched_world_size_is_an_error_within_the_deadline", &worlds, &out, Duration::from_secs(180));
    assert!(ended.iter().all(Ended::passed), "a rank failed");
    let _ = std::fs::remove_dir_all(&out);
}

#[ignore = "needs two or more CUDA devices and NCCL: run with --include-ignored where there are (--skip many_gpus on one GPU)"]
#[test]
fn many_gpus_a_dead_rank_is_an_error_within_the_timeout() {
    let (world, _turn) = gpu_count();
    // the group's timeout; the error must come within it, NCCL's abort (waited for at most 5 s)
    // and some slack, after the last rank dies
    const TIMEOUT: Duration = Duration::from_secs(10);
    const SLACK: Duration = Duration::from_secs(8);
    let dead = world - 1;
    if let Some(rank) = rank() {
        let model = mlp().build().unwrap().init(Init::HeNormal, 3);
        let group = Group { timeout: TIMEOUT, ..Group::from_env().unwrap() };
        let mut dp = DataParallel::join(&model, &group, 512, sgd().0).unwrap();
        let data = batches(&model, 2, &[512], 5);
        let step = |dp: &mut DataParallel, i: usize| {
            dp.set_inputs(&data[i % 2].0)?;
            dp.set_labels(&data[i % 2].1)?;
            dp.train_step(Loss::LogitCrossEntropy)
        };
        for i in 0..10 {
            step(&mut dp, i).unwrap();
        }
        let _ = dp.last_loss().unwrap();
        if rank == dead {
            println!("rank {rank} dies without a word");
            // SAFETY: ends this process at once, as a crash would: no destructor, no clean-up
            // by NCCL, nothing more said to the others.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            unreachable!("this process was killed");
        }
        // the others go on without it: their step 10 waits for it forever on the GPU, so a
        // wait of the host for it (writing a batch, or queueing a step a few ahead) gives up
        // past the timeout
        let start = Instant::now();
        let err = (10..1_000_000).find_map(|i| step(&mut dp, i).err()).expect("a step fails once a rank is gone");
        let elapsed = start.elapsed();
        let err = dp.last_loss().err().map_or(err.to_string(), |later| format!("{err}; then {later}"));
        println!("rank {rank}, {elapsed:?} after rank {dead} left: {err}");
        assert!(err.contains(&format!("rank {rank}")) && err.contains("unusable"), "{err}");
        assert!(elapsed < TIMEOUT + SLACK, "the error came {elapsed:?} after rank {dead} left");
        return;
    }
    let out = scratch("dead");
    let ended = ranks("many_gpus_a_dead_rank_is_an_error_within_the_timeout", &vec![world; world], &out, Duration::from_secs(120));
    for (rank, ended) in ended[..dead].iter().enumerate() {
        assert!(ended.passed(), "rank {rank} failed");
    }
    assert!(ended[dead].stdout.contains("dies without a word"), "rank {dead} did not die as planned");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn every_test_here_names_many_gpus_and_says_what_it_needs() {
    // `--skip many_gpus` must skip every GPU test of this file on a one-GPU machine
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/multi_gpu.rs")).unwrap();
    let mut lines = text.lines().peekable();
    let mut tests = 0;
    while let Some(line) = lines.next() {
        if line.starts_with("#[ignore = ") {
            assert!(line.contains(NEEDS), "{line}");
            assert_eq!(lines.next(), Some("#[test]"));
            let name = lines.peek().unwrap();
            assert!(name.starts_with("fn many_gpus_"), "{name}");
            tests += 1;
        }
    }
    assert_eq!(tests, 7);
}
