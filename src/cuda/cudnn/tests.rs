//! The choice of cuDNN's results flatnn takes ([`super::Perf::usable`]) and how the report
//! names them, on synthetic perf records: no device needed.

use super::{choose, Algo, Dir, Perf};
use crate::cuda::options::GpuOptions;
use cudarc::cudnn::sys;
use sys::cudnnConvolutionBwdDataAlgo_t as D;
use sys::cudnnConvolutionBwdFilterAlgo_t as W;
use sys::cudnnConvolutionFwdAlgo_t as F;
use sys::cudnnMathType_t as M;

const WORKSPACE: usize = 1 << 20;
const DETERMINISTIC: u32 = sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC as u32;
const NON_DETERMINISTIC: u32 = sys::cudnnDeterminism_t::CUDNN_NON_DETERMINISTIC as u32;

/// A successful result of `algo` in `memory` bytes.
fn perf(algo: u32, determinism: u32, math: u32, memory: usize) -> Perf {
    let status = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32;
    Perf { algo, status, time: 0.5, memory, determinism, math_type: math, reserved: [0; 3] }
}

/// Whether `r` is usable with each of (tf32, deterministic) = (off, on), (off, off), (on, on),
/// (on, off).
fn usable(dir: Dir, r: Perf) -> [bool; 4] {
    [(false, true), (false, false), (true, true), (true, false)].map(|(tf32, det)| r.usable(dir, WORKSPACE, tf32, det))
}

#[test]
fn usable_follows_the_deterministic_and_tf32_options() {
    let (fma, default, tensor_op) = (M::CUDNN_FMA_MATH as u32, M::CUDNN_DEFAULT_MATH as u32, M::CUDNN_TENSOR_OP_MATH as u32);
    let conversion = M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION as u32;
    let (wgrad0, wgrad1, wgrad3) = (
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 as u32,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 as u32,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3 as u32,
    );
    let (dgrad0, dgrad1) = (D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 as u32, D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 as u32);
    let gemm = F::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM as u32;
    // usable with (tf32, deterministic) = (off, on), (off, off), (on, on), (on, off)
    let cases: [(Dir, Perf, [bool; 4]); 17] = [
        // deterministic, plain FP32: always
        (Dir::Weight, perf(wgrad1, DETERMINISTIC, fma, 0), [true; 4]),
        (Dir::Input, perf(dgrad1, DETERMINISTIC, fma, WORKSPACE), [true; 4]),
        (Dir::Forward, perf(gemm, DETERMINISTIC, fma, 64), [true; 4]),
        // the atomic algorithms: only with the option off
        (Dir::Weight, perf(wgrad0, NON_DETERMINISTIC, fma, 0), [false, true, false, true]),
        (Dir::Weight, perf(wgrad3, NON_DETERMINISTIC, fma, 0), [false, true, false, true]),
        (Dir::Input, perf(dgrad0, NON_DETERMINISTIC, fma, 0), [false, true, false, true]),
        // the same algorithm reported deterministic (cuDNN's record decides)
        (Dir::Weight, perf(wgrad0, DETERMINISTIC, fma, 0), [true; 4]),
        // TF32 math types: only with TF32, and then as the determinism allows
        (Dir::Weight, perf(wgrad1, DETERMINISTIC, tensor_op, 0), [false, false, true, true]),
        (Dir::Weight, perf(wgrad0, NON_DETERMINISTIC, default, 0), [false, false, false, true]),
        (Dir::Input, perf(dgrad0, NON_DETERMINISTIC, tensor_op, 0), [false, false, false, true]),
        // never: conversions to FP16, an unknown math type, FFT, Winograd, too large, failed
        (Dir::Weight, perf(wgrad0, NON_DETERMINISTIC, conversion, 0), [false; 4]),
        (Dir::Weight, perf(wgrad1, DETERMINISTIC, 99, 0), [false; 4]),
        (Dir::Weight, perf(W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT as u32, DETERMINISTIC, fma, 0), [false; 4]),
        (Dir::Input, perf(D::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED as u32, NON_DETERMINISTIC, fma, 0), [false; 4]),
        (Dir::Forward, perf(F::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD as u32, DETERMINISTIC, fma, 0), [false; 4]),
        (Dir::Weight, perf(wgrad0, NON_DETERMINISTIC, fma, WORKSPACE + 1), [false; 4]),
        (
            Dir::Weight,
            Perf { status: sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED as u32, ..perf(wgrad0, NON_DETERMINISTIC, fma, 0) },
            [false; 4],
        ),
    ];
    for (dir, r, want) in cases {
        assert_eq!(usable(dir, r), want, "{} {r:?}", dir.name());
    }
}

#[test]
fn turning_determinism_off_adds_exactly_the_non_deterministic_results() {
    let maths = [M::CUDNN_FMA_MATH, M::CUDNN_DEFAULT_MATH, M::CUDNN_TENSOR_OP_MATH, M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION];
    let mut added = 0;
    for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
        for algo in 0..dir.count() {
            for determinism in [DETERMINISTIC, NON_DETERMINISTIC] {
                for math in maths.map(|m| m as u32) {
                    for tf32 in [false, true] {
                        let r = perf(algo, determinism, math, 0);
                        let (on, off) = (r.usable(dir, WORKSPACE, tf32, true), r.usable(dir, WORKSPACE, tf32, false));
                        assert!(!on || off, "{} {r:?}: usable deterministic only", dir.name());
                        assert_eq!(on, off && determinism == DETERMINISTIC, "{} {r:?} tf32 {tf32}", dir.name());
                        added += usize::from(off && !on);
                    }
                }
            }
        }
    }
    // the exact algorithms (4 forward, 3 weight, 2 input), FMA without TF32, FMA, DEFAULT and
    // TENSOR_OP with it
    assert_eq!(added, (4 + 3 + 2) * (1 + 3));
}

#[test]
fn a_non_deterministic_algorithm_says_so_in_its_name() {
    let algo = Algo { id: W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 as u32, math: M::CUDNN_FMA_MATH, deterministic: false };
    assert_eq!(algo.name(Dir::Weight), "BWD_FILTER_ALGO_0 (non-deterministic)");
    assert_eq!(Algo { deterministic: true, ..algo }.name(Dir::Weight), "BWD_FILTER_ALGO_0");
    let tf32 = Algo { math: M::CUDNN_TENSOR_OP_MATH, ..algo };
    assert_eq!(tf32.name(Dir::Weight), "BWD_FILTER_ALGO_0 (TENSOR_OP_MATH) (non-deterministic)");
}

/// Of two searches' results (TF32 on: the DEFAULT and the FMA search), the usable ones are
/// taken fastest first, one algorithm under one math type once, at most `count`; the report
/// names the fastest result cuDNN timed faster than every one taken, with why it was not
/// taken; and where none is usable, everything cuDNN offered.
#[test]
fn the_searches_results_are_merged_fastest_first_and_the_faster_refused_named() {
    let (fma, default) = (M::CUDNN_FMA_MATH as u32, M::CUDNN_DEFAULT_MATH as u32);
    let (wgrad0, wgrad1, wgrad3) = (
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 as u32,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 as u32,
        W::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3 as u32,
    );
    let timed = |algo, det, math, memory, ms| Perf { time: ms, ..perf(algo, det, math, memory) };
    let found = vec![
        timed(wgrad1, DETERMINISTIC, fma, 0, 0.9),
        timed(wgrad0, NON_DETERMINISTIC, fma, 0, 0.3),
        timed(wgrad1, DETERMINISTIC, default, 0, 0.7),
        timed(wgrad3, DETERMINISTIC, fma, 2 * WORKSPACE, 0.5),
        timed(wgrad1, DETERMINISTIC, fma, 0, 0.8),
    ];
    let tf32 = GpuOptions { tf32: true, ..GpuOptions::default() };
    let (algos, refused) = choose(found.clone(), Dir::Weight, WORKSPACE, &tf32, 3);
    let ids: Vec<(u32, u32)> = algos.iter().map(|a| (a.id, a.math as u32)).collect();
    assert_eq!(ids, [(wgrad1, default), (wgrad1, fma)], "fastest first, (algorithm, math) once");
    assert!(refused.starts_with("BWD_FILTER_ALGO_0 atomic 300.0 µs"), "{refused}");
    assert!(refused.ends_with("the fastest taken 700.0"), "{refused}");
    let (algos, _) = choose(found.clone(), Dir::Weight, WORKSPACE, &tf32, 1);
    assert_eq!(algos.len(), 1);

    // FP32, non-deterministic allowed: the atomic one is taken first, and the only faster
    // result refused is none (ALGO_3 needs more workspace but is slower than ALGO_0)
    let any_order = GpuOptions { deterministic: false, ..GpuOptions::default() };
    let (algos, refused) = choose(found.clone(), Dir::Weight, WORKSPACE, &any_order, 3);
    assert_eq!(algos.iter().map(|a| a.id).collect::<Vec<_>>(), [wgrad0, wgrad1]);
    assert!(refused.is_empty(), "{refused}");

    // nothing usable: all that cuDNN offered, each with why
    let (algos, offered) = choose(vec![found[1], found[3]], Dir::Weight, WORKSPACE, &GpuOptions::default(), 3);
    assert!(algos.is_empty());
    assert_eq!(offered, "BWD_FILTER_ALGO_0 atomic, BWD_FILTER_ALGO_3 2048 KiB");
}
