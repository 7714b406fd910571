//! Our CPU GEMM against matrixmultiply at the shapes the models use.
//!
//! Throughput is in "elements" that are FLOPs (2·m·n·k per call), so criterion's `elem/s`
//! reads as FLOP/s. Rows are named by the kernel's instruction set (`flatnn_avx512_1t`: the
//! best this CPU has; `FLATNN_ISA=avx2 cargo bench --bench gemm` gives the AVX2 rows), and a
//! forward product (B = Wᵀ) has a `_packed` row with the weights packed once, as a layer's
//! inference keeps them. `fma_peak` measures the machine's FMA peak with 8-lane and, where the
//! CPU has them, 16-lane FMAs (about 118 GFLOP/s on one thread of the EPYC VM either way: Zen 4
//! splits a 16-lane FMA in two): run it before and after to know whether timings are clean.
//! `read_bandwidth` measures what one thread reads from L2, L3 and memory: a batch-1 row
//! (`fwd_*/…/1x…`) reads each weight once, so its floor is the weights' bytes over that rate.
//! `cargo bench --bench gemm [-- FILTER]`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flatnn::gemm::{Gemm, Mat, MatMut};
use flatnn::testutil::Rng;
use std::time::{Duration, Instant};

/// A product C (m×n) = A (m×k)·B (k×n) with the operand layouts a model step uses.
struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    /// A stored transposed (k×m row-major), as dZᵀ in dW = dZᵀ·X.
    a_t: bool,
    /// B stored transposed (n×k row-major), as Wᵀ in the forward Y = X·Wᵀ.
    b_t: bool,
}

fn shapes() -> Vec<Shape> {
    let mut out = Vec::new();
    for batch in [1, 32, 128, 1024, 4096] {
        out.push(Shape { name: "fwd_784x128", m: batch, n: 128, k: 784, a_t: false, b_t: true });
        out.push(Shape { name: "fwd_1024x1024", m: batch, n: 1024, k: 1024, a_t: false, b_t: true });
        out.push(Shape { name: "fwd_128x64", m: batch, n: 64, k: 128, a_t: false, b_t: true });
        out.push(Shape { name: "dw_128x784", m: 128, n: 784, k: batch, a_t: true, b_t: false });
        out.push(Shape { name: "dx_64x128", m: batch, n: 128, k: 64, a_t: false, b_t: false });
    }
    out.push(Shape { name: "square", m: 1024, n: 1024, k: 1024, a_t: false, b_t: false });
    out
}

fn gemm(c: &mut Criterion) {
    let mut rng = Rng::new(1);
    let mut gemms = [Gemm::new(1).unwrap(), Gemm::new(2).unwrap()];
    for s in shapes() {
        let mut group = c.benchmark_group(format!("gemm/{}", s.name));
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_millis(1500));
        let (a, b) = (rng.uniform(s.m * s.k), rng.uniform(s.k * s.n));
        let mut out = vec![0.0f32; s.m * s.n];
        let (ars, acs) = if s.a_t { (1, s.m) } else { (s.k, 1) };
        let (brs, bcs) = if s.b_t { (1, s.k) } else { (s.n, 1) };
        group.throughput(Throughput::Elements(2 * (s.m * s.n * s.k) as u64));
        let id = format!("{}x{}x{}", s.m, s.n, s.k);
        let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
        for gemm in &mut gemms {
            group.bench_function(BenchmarkId::new(format!("flatnn_{}_{}t", gemm.isa(), gemm.threads()), &id), |bench| {
                bench.iter(|| gemm.sgemm(s.m, s.n, s.k, 1.0, am, bm, 0.0, MatMut { data: &mut out, rs: s.n, cs: 1 }).unwrap())
            });
        }
        if s.b_t {
            let gemm = &mut gemms[0];
            let packed = gemm.pack(s.k, s.n, bm).unwrap();
            group.bench_function(BenchmarkId::new(format!("flatnn_{}_packed_1t", gemm.isa()), &id), |bench| {
                bench.iter(|| gemm.sgemm_packed(s.m, 1.0, am, &packed, 0.0, MatMut { data: &mut out, rs: s.n, cs: 1 }).unwrap())
            });
        }
        group.bench_function(BenchmarkId::new("matrixmultiply_1t", &id), |bench| {
            bench.iter(|| {
                // SAFETY: the buffers hold the matrices at the given strides.
                unsafe {
                    let (ars, acs, brs, bcs) = (ars as isize, acs as isize, brs as isize, bcs as isize);
                    matrixmultiply::sgemm(
                        s.m,
                        s.k,
                        s.n,
                        1.0,
                        a.as_ptr(),
                        ars,
                        acs,
                        b.as_ptr(),
                        brs,
                        bcs,
                        0.0,
                        out.as_mut_ptr(),
                        s.n as isize,
                        1,
                    );
                }
            })
        });
        group.finish();
    }
}

/// Rounds of 12 independent 8-lane FMAs in [`fma_chains`].
const PEAK_ROUNDS: u64 = 100_000;

/// 12 independent accumulator chains (more than FMA latency × ports), so this measures the
/// core's FMA throughput: the "peak" that the GEMM rates are shares of.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_chains(x: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(x), _mm256_set1_ps(0.999));
    let mut acc = [_mm256_set1_ps(1.0); 12];
    for _ in 0..PEAK_ROUNDS {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, b, a);
        }
    }
    let mut out = [0.0f32; 8];
    let sum = acc.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v));
    _mm256_storeu_ps(out.as_mut_ptr(), sum);
    out.iter().sum()
}

/// As [`fma_chains`] with 16-lane FMAs: 16 chains fit the 32 registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains_512(x: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(x), _mm512_set1_ps(0.999));
    let mut acc = [_mm512_set1_ps(1.0); 16];
    for _ in 0..PEAK_ROUNDS {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, b, a);
        }
    }
    _mm512_reduce_add_ps(acc.iter().fold(_mm512_setzero_ps(), |s, &v| _mm512_add_ps(s, v)))
}

fn fma_peak(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        let mut group = c.benchmark_group("fma_peak");
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        group.throughput(Throughput::Elements(PEAK_ROUNDS * 12 * 8 * 2));
        // SAFETY: AVX2 and FMA were detected above.
        group.bench_function("1t", |b| b.iter(|| unsafe { fma_chains(std::hint::black_box(1e-3)) }));
        if is_x86_feature_detected!("avx512f") {
            group.throughput(Throughput::Elements(PEAK_ROUNDS * 16 * 16 * 2));
            // SAFETY: AVX-512F was detected.
            group.bench_function("avx512_1t", |b| b.iter(|| unsafe { fma_chains_512(std::hint::black_box(1e-3)) }));
        }
        // both threads at once: what the machine's two cores deliver together (each thread
        // runs all of a sample's iterations, so starting the threads is spread over them)
        group.throughput(Throughput::Elements(2 * PEAK_ROUNDS * 12 * 8 * 2));
        group.bench_function("2t", |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                std::thread::scope(|scope| {
                    for _ in 0..2 {
                        scope.spawn(|| {
                            for _ in 0..iters {
                                // SAFETY: as above.
                                std::hint::black_box(unsafe { fma_chains(std::hint::black_box(1e-3)) });
                            }
                        });
                    }
                });
                start.elapsed()
            })
        });
        group.finish();
    }
}

/// Sum of a buffer's values, 8 lanes × 8 independent chains (enough loads in flight to
/// measure what the caches deliver, not the latency of one add chain).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    for block in x.chunks_exact(64) {
        for (v, a) in acc.iter_mut().enumerate() {
            // SAFETY: lanes 8·v..8·v + 8 of a block of 64.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(block.as_ptr().add(8 * v)) });
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: 8 values.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v))) };
    out.iter().sum()
}

/// Read bandwidth of one thread from buffers that fit L2 (256 KiB, 1 MiB), L3 (4, 16 MiB) or
/// neither (256 MiB), read again and again (criterion's `elem/s` is bytes/s): the floor of a
/// batch-1 forward, which reads each weight once, is its weights' bytes over this rate.
fn read_bandwidth(c: &mut Criterion) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        let mut group = c.benchmark_group("read_bandwidth");
        group.sample_size(20).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for kib in [256, 1024, 4096, 16384, 262144] {
            let x = vec![1.0f32; kib * 256];
            group.throughput(Throughput::Bytes((kib * 1024) as u64));
            // SAFETY: AVX2 was detected above.
            group.bench_function(format!("{kib}KiB"), |b| b.iter(|| unsafe { sum_avx2(std::hint::black_box(&x)) }));
        }
        group.finish();
    }
}

criterion_group!(benches, fma_peak, read_bandwidth, gemm);
criterion_main!(benches);
