//! Helpers for the crate's tests (public so integration tests and benches can share them;
//! not part of the supported API).

/// A seeded generator for test data.
pub struct Rng(crate::init::Rng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(crate::init::Rng::new(seed))
    }

    /// Small integers in −4..=4, so sums and products stay exact in f32.
    pub fn ints(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.0.below(9) as f32 - 4.0).collect()
    }

    /// Uniform values in [−1, 1).
    pub fn uniform(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (2.0 * self.0.uniform() - 1.0) as f32).collect()
    }

    /// Integers in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }
}

/// A directory of a test's own under the system's temporary one, `flatnn-NAME-PID`, created
/// empty (what a killed run left there is removed first) and removed with what it holds when
/// dropped, also when the test fails: a panic unwinds through it.
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("flatnn-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        TempDir(dir)
    }
}

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for TempDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// ‖a − b‖ / ‖b‖ in f64 (NaN where either holds a NaN, so that no comparison with it passes).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (diff / norm.max(1e-30)).sqrt()
}

/// A batch of `n` inputs (uniform in [−1, 1)) and class labels for `model`.
pub fn batch(rng: &mut Rng, model: &crate::Model, n: usize) -> (Vec<f32>, Vec<u32>) {
    let x = rng.uniform(n * model.input_shape().len());
    let classes = model.output_shape().len();
    let labels = (0..n).map(|_| (rng.uniform(1)[0] * classes as f32) as u32 % classes as u32).collect();
    (x, labels)
}

/// `steps` training steps of `model` (on its device) with `optim` and `loss`, alternating a full
/// batch of 32 and a partial one of 17 from `seed`'s data; the losses, and the trained model.
pub fn train_alternating(model: crate::Model, optim: crate::Optim, loss: crate::Loss, steps: usize, seed: u64) -> (Vec<f32>, crate::Model) {
    let mut model = model;
    let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
    let mut opt = crate::Optimizer::new(&model, optim).unwrap();
    let mut rng = Rng::new(seed);
    let mut losses = Vec::new();
    for step in 0..steps {
        let n = if step % 2 == 0 { 32 } else { 17 };
        let (x, labels) = batch(&mut rng, &model, n);
        fwd.set_inputs(&x).unwrap();
        if loss.takes_labels() {
            fwd.set_labels(&labels).unwrap()
        } else {
            fwd.set_targets(&rng.uniform(n * model.output_shape().len())).unwrap()
        }
        model.backprop(&mut bwd, &mut fwd, loss).unwrap();
        losses.push(bwd.last_loss().unwrap());
        opt.update(&mut model, &bwd).unwrap();
    }
    (losses, model)
}

/// Set in the child processes [`run_alone`] starts.
const CHILD: &str = "FLATNN_TEST_CHILD";

/// True in a child process started by [`run_alone`].
pub fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `test` of the running test binary alone in a child process with the variables
/// `env` set (for settings flatnn reads once per process, such as `FLATNN_CUDNN`); prints its
/// output, asserts that it ran and passed, and returns its standard output.
pub fn run_alone(test: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut command = std::process::Command::new(exe);
    command.args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"]).env(CHILD, "1");
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command.output().expect("starting the test binary again");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("--- {test} in a child process with {env:?}:\n{stdout}{stderr}--- end of {test}");
    assert!(out.status.success(), "{test} failed in a child process with {env:?}");
    assert!(stdout.contains("1 passed"), "{test} did not run in the child process");
    stdout.into_owned()
}

/// A buffer of NaN, so unwritten outputs show.
pub fn poisoned(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

/// Asserts |a − b| ≤ atol + rtol·|b| everywhere (NaN never passes); prints the first bad
/// indices.
pub fn assert_close(a: &[f32], b: &[f32], atol: f32, rtol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let bad: Vec<String> = (0..a.len())
        .filter(|&i| (a[i] - b[i]).abs().partial_cmp(&(atol + rtol * b[i].abs())).is_none_or(|o| o.is_gt()))
        .take(5)
        .map(|i| format!("[{i}] {} vs {}", a[i], b[i]))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join(", "));
}

thread_local! {
    static ALLOCATIONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A global allocator that counts the calling thread's allocations, reallocations and frees,
/// so that a test sees its own calls even while other tests run beside it. Install it in a test
/// binary with `#[global_allocator] static A: flatnn::testutil::Counting = flatnn::testutil::Counting;`.
pub struct Counting;

// SAFETY: forwards every call to the system allocator; only counts.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

/// Allocations, reallocations and frees this thread made during `f` (under [`Counting`]).
pub fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(|n| n.get());
    f();
    ALLOCATIONS.with(|n| n.get()) - before
}

/// The first line of every GPU test: CUDA device 0. GPU tests are `#[ignore]`d, so the test
/// runner reports them as ignored where they are not asked for; run with `--include-ignored`
/// where there is a GPU. Asked to run without one, a GPU test fails here, saying why.
pub fn cuda_device() -> crate::Device {
    match crate::Device::cuda(0) {
        Ok(device) => device,
        Err(e) => panic!("this test needs a CUDA device, and there is none usable: {e}"),
    }
}

/// Whether CUDA device 0 runs flatnn's tensor-core kernels (sm_80 and later: the `own-mma`
/// convolution routes and the dense `dense_mma` tiles are candidates there alone); false where
/// there is no usable device or the crate is built without CUDA.
pub fn cuda_tensor_cores() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::device_info(0).is_ok_and(|info| info.compute_capability >= (8, 0))
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Time per call of each CPU convolution route (`Lowered`: im2col and GEMM; `Direct`: the GEMM
/// on shifted windows of the padded input) on one layer: (route, forward, backward with the
/// input gradient when `input_grad`), the fastest of `runs` calls on `threads` threads (None
/// where the route does not compute the convolution), for `benches/conv_routes.rs`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn conv_route_times(
    (in_channels, height, width): (usize, usize, usize),
    out_channels: usize,
    kernel: (usize, usize),
    options: crate::ConvOptions,
    batch: usize,
    threads: usize,
    runs: usize,
    input_grad: bool,
) -> crate::Result<Vec<(String, Option<std::time::Duration>, Option<std::time::Duration>)>> {
    let shape =
        crate::cpu::conv::ConvShape { in_channels, height, width, out_channels, kernel, stride: options.stride, padding: options.padding };
    let times = crate::cpu::conv::route_times(&shape, batch, threads, runs, input_grad)?;
    Ok(times.into_iter().map(|(route, f, b)| (format!("{route:?}"), f, b)).collect())
}

/// A net on 1×28×28 images (784 values, as MNIST) through average pooling (window and strided),
/// global average pooling, the activations SiLU, ELU and Softplus, and softmax as its last layer:
/// 10 probabilities.
pub fn pooling_net() -> crate::Chain {
    use crate::{ConvOptions, Elu, Identity, Input, Silu, Softplus};
    crate::Chain::new(Input::image(1, 28, 28))
        .conv_with(4, (3, 3), Silu, ConvOptions { stride: (1, 1), padding: (1, 1) })
        .avg_pool((2, 2))
        .conv(6, (3, 3), Elu(0.5))
        .avg_pool_with((3, 3), (2, 2))
        .global_avg_pool()
        .dense(16, Softplus)
        .dense(10, Identity)
        .softmax()
}

/// A net on signals of 1×784 values through 1-D convolutions (one strided, padded and dilated),
/// 1-D max-pools (one padded and dilated) and the flatten of a signal: 10 scores.
pub fn signal_net() -> crate::Chain {
    use crate::{Conv1dOptions, Elu, Identity, Input, Pool1dOptions, Silu, Softplus};
    crate::Chain::new(Input::signal(1, 784))
        .conv1d_with(4, 5, Silu, Conv1dOptions { stride: 2, padding: 2, dilation: 2 })
        .max_pool1d_with(3, Pool1dOptions { stride: 2, padding: 1, dilation: 2 })
        .conv1d(8, 3, Elu(1.0))
        .max_pool1d(4)
        .conv1d(6, 3, Softplus)
        .flatten()
        .dense(10, Identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_temp_dir_starts_empty_and_goes_with_its_files() {
        let path = {
            let dir = TempDir::new("testutil-temp-dir");
            std::fs::write(dir.join("left"), b"x").unwrap();
            dir.to_path_buf()
        };
        assert!(!path.exists(), "{} outlived its TempDir", path.display());
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("left"), b"x").unwrap();
        let dir = TempDir::new("testutil-temp-dir");
        assert_eq!(std::fs::read_dir(&*dir).unwrap().count(), 0, "what a killed run left was kept");
    }
}
