//! The packed GEMM, on every kernel this CPU runs, against the plain triple loop and against
//! matrixmultiply.

use super::*;
use crate::testutil::{poisoned, Rng};

mod packed;

#[allow(clippy::too_many_arguments)]
fn reference(m: usize, n: usize, k: usize, alpha: f32, a: Mat, b: Mat, beta: f32, c: &mut [f32], rsc: usize, csc: usize) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc += a.data[i * a.rs + p * a.cs] * b.data[p * b.rs + j * b.cs];
            }
            let v = &mut c[i * rsc + j * csc];
            *v = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *v };
        }
    }
}

/// (rs, cs, len) of an r×c matrix in one of five layouts: row-major, column-major, each with
/// padded leading dimension, and every other column of a row-major 2c-wide matrix (neither
/// stride 1: C tiles then go through the edge tile).
fn layout(kind: usize, r: usize, c: usize) -> (usize, usize, usize) {
    let pad = 3;
    match kind {
        0 => (c, 1, r * c),
        1 => (1, r, r * c),
        2 => (c + pad, 1, r * (c + pad)),
        3 => (1, r + pad, c * (r + pad)),
        _ => (2 * c, 2, 2 * r * c),
    }
}

fn check(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
    kinds: (usize, usize, usize),
    alpha: f32,
    beta: f32,
) {
    let (ars, acs, alen) = layout(kinds.0, m, k);
    let (brs, bcs, blen) = layout(kinds.1, k, n);
    let (crs, ccs, clen) = layout(kinds.2, m, n);
    let (a, b) = (rng.ints(alen), rng.ints(blen));
    let c0 = if beta == 0.0 { vec![f32::NAN; clen] } else { rng.ints(clen) };
    let mut want = c0.clone();
    let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
    reference(m, n, k, alpha, am, bm, beta, &mut want, crs, ccs);
    let mut got = c0.clone();
    sgemm(pool, ws, m, n, k, alpha, am, bm, beta, MatMut { data: &mut got, rs: crs, cs: ccs });
    let mut inside = vec![false; clen];
    (0..m).for_each(|i| (0..n).for_each(|j| inside[i * crs + j * ccs] = true));
    for idx in 0..clen {
        if inside[idx] {
            assert_eq!(got[idx], want[idx], "{:?} {m}×{n}×{k} layouts {kinds:?} α={alpha} β={beta} at {idx}", ws.isa());
        } else {
            assert!(got[idx].to_bits() == c0[idx].to_bits(), "{m}×{n}×{k}: padding at {idx} touched");
        }
    }
}

#[test]
fn matches_the_plain_loop_on_odd_shapes_and_layouts() {
    let mut rng = Rng::new(1);
    let shapes = [
        (0, 3, 2),
        (3, 0, 2),
        (2, 3, 0),
        (1, 1, 1),
        (1, 17, 5),
        (5, 1, 9),
        (2, 5, 17),
        (7, 33, 65),
        (17, 16, 6),
        (65, 127, 18),
        (6, 16, 300),
        (64, 40, 33),
        (32, 20, 7),
        (10, 48, 9),
        (9, 37, 1),
        (130, 300, 1),
        (25, 70, 40),
        (4, 100, 30),
        (3, 130, 11),
        (2, 97, 7),
    ];
    for (isa, threads) in Isa::runnable().into_iter().flat_map(|isa| [(isa, 1), (isa, 2), (isa, 3)]) {
        let pool = Pool::new(threads).unwrap();
        let mut ws = GemmWorkspace::with_isa(threads, isa).unwrap();
        for &shape in &shapes {
            for kinds in [(0, 0, 0), (1, 1, 1), (0, 1, 0), (1, 0, 2), (2, 2, 3), (3, 3, 0), (0, 1, 4), (4, 4, 4)] {
                for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-1.5, 0.5), (1.0, -1.5)] {
                    check(&pool, &mut ws, &mut rng, shape, kinds, alpha, beta);
                }
            }
        }
    }
}

#[test]
fn large_shapes_cross_every_block_boundary() {
    let mut rng = Rng::new(2);
    for (isa, threads) in Isa::runnable().into_iter().flat_map(|isa| [(isa, 1), (isa, 2)]) {
        let pool = Pool::new(threads).unwrap();
        let mut ws = GemmWorkspace::with_isa(threads, isa).unwrap();
        // m > MC, n > NC, k > KC, none a multiple of the tiles; small ints keep sums exact
        check(&pool, &mut ws, &mut rng, (MC + 7, NC + 19, KC + 11), (0, 1, 0), 1.0, 0.0);
        check(&pool, &mut ws, &mut rng, (266, 265, 257), (1, 0, 2), 1.0, 1.0);
        check(&pool, &mut ws, &mut rng, (266, 265, 257), (0, 0, 4), 0.5, 1.0);
    }
}

#[test]
fn matches_matrixmultiply_on_real_values() {
    let mut rng = Rng::new(4);
    let pool = Pool::new(2).unwrap();
    for (isa, (m, n, k)) in
        Isa::runnable().into_iter().flat_map(|isa| [(128, 784, 128), (1, 128, 784), (64, 10, 128), (300, 200, 100)].map(|s| (isa, s)))
    {
        let mut ws = GemmWorkspace::with_isa(2, isa).unwrap();
        let (a, b) = (rng.uniform(m * k), rng.uniform(k * n));
        let mut want = vec![0.0; m * n];
        // SAFETY: row-major buffers of the stated sizes.
        unsafe {
            matrixmultiply::sgemm(m, k, n, 1.0, a.as_ptr(), k as isize, 1, b.as_ptr(), n as isize, 1, 0.0, want.as_mut_ptr(), n as isize, 1)
        };
        let mut got = vec![f32::NAN; m * n];
        sgemm(
            &pool,
            &mut ws,
            m,
            n,
            k,
            1.0,
            Mat { data: &a, rs: k, cs: 1 },
            Mat { data: &b, rs: n, cs: 1 },
            0.0,
            MatMut { data: &mut got, rs: n, cs: 1 },
        );
        crate::testutil::assert_close(&got, &want, 1e-5, 1e-5, &format!("{isa:?} vs matrixmultiply"));
    }
}

#[test]
#[should_panic(expected = "gemm: B")]
fn short_operands_are_caught() {
    let mut ws = GemmWorkspace::new(1).unwrap();
    let (a, b, mut c) = (vec![0.0; 6], vec![0.0; 5], vec![0.0; 4]);
    let (am, bm) = (Mat { data: &a, rs: 3, cs: 1 }, Mat { data: &b, rs: 2, cs: 1 });
    sgemm_on(&mut ws.workers()[0], 2, 2, 3, 1.0, am, bm, 0.0, MatMut { data: &mut c, rs: 2, cs: 1 });
}

/// (rows, cols, rs, cs) of operands whose last element's offset, (rows − 1)·rs + (cols − 1)·cs,
/// wraps around usize to a small number: an unchecked extent test passes them.
const WRAPPING: [(usize, usize, usize, usize); 3] = [(2, 2, usize::MAX, 1), (3, 2, 1 << 63, 1), (2, 2, 1 << 63, 1 << 63)];

#[test]
fn extents_that_wrap_are_errors_before_any_write() {
    for threads in [1, 2] {
        let mut gemm = crate::gemm::Gemm::new(threads).unwrap();
        let (a, b) = (vec![1.0; 64], vec![1.0; 64]);
        let row_major = |data, cols| Mat { data, rs: cols, cs: 1 };
        for (rows, cols, rs, cs) in WRAPPING {
            // C wraps: the old kernel wrote at offset usize::MAX or 2^63 (SIGSEGV)
            let mut c = poisoned(64);
            let (am, bm) = (row_major(&a[..], 4), row_major(&b[..], cols));
            let r = gemm.sgemm(rows, cols, 4, 1.0, am, bm, 0.0, MatMut { data: &mut c, rs, cs });
            assert!(matches!(&r, Err(Error::Shape(msg)) if msg.contains("gemm: C")), "C {rows}×{cols} ({rs}, {cs}): {r:?}");
            assert!(c.iter().all(|v| v.is_nan()), "C written before the error");
            // A, then B, wraps: the old kernel read there
            let r =
                gemm.sgemm(rows, 2, cols, 1.0, Mat { data: &a, rs, cs }, row_major(&b[..], 2), 0.0, MatMut { data: &mut c, rs: 2, cs: 1 });
            assert!(matches!(&r, Err(Error::Shape(msg)) if msg.contains("gemm: A")), "A {rows}×{cols} ({rs}, {cs}): {r:?}");
            let r = gemm.sgemm(
                2,
                cols,
                rows,
                1.0,
                row_major(&a[..], rows),
                Mat { data: &b, rs, cs },
                0.0,
                MatMut { data: &mut c, rs: cols, cs: 1 },
            );
            assert!(matches!(&r, Err(Error::Shape(msg)) if msg.contains("gemm: B")), "B {rows}×{cols} ({rs}, {cs}): {r:?}");
            assert!(c.iter().all(|v| v.is_nan()), "C written before the error");
        }
    }
}

#[test]
#[should_panic(expected = "gemm: C of 2×2 with strides (18446744073709551615, 1) reaches past usize::MAX")]
fn the_internal_entry_panics_on_a_wrapping_extent_before_any_write() {
    let (pool, mut ws) = (Pool::new(1).unwrap(), GemmWorkspace::new(1).unwrap());
    let (a, b, mut c) = (vec![1.0; 4], vec![1.0; 4], vec![0.0; 4]);
    let (am, bm) = (Mat { data: &a, rs: 2, cs: 1 }, Mat { data: &b, rs: 2, cs: 1 });
    sgemm(&pool, &mut ws, 2, 2, 2, 1.0, am, bm, 0.0, MatMut { data: &mut c, rs: usize::MAX, cs: 1 });
}

#[test]
fn outputs_whose_elements_share_memory_are_errors() {
    let mut gemm = crate::gemm::Gemm::new(2).unwrap();
    let mut rng = Rng::new(5);
    // big enough to be split over both threads, where shared elements would be a data race
    let (m, n, k) = (64, 64, 64);
    let (a, b) = (rng.ints(m * k), rng.ints(k * n));
    let (am, bm) = (Mat { data: &a, rs: k, cs: 1 }, Mat { data: &b, rs: n, cs: 1 });
    for (rs, cs) in [(0, 1), (1, 0), (0, 0), (1, 1), (n - 1, 1), (1, m - 1), (2, 3)] {
        let mut c = poisoned(m * n * 3);
        let r = gemm.sgemm(m, n, k, 1.0, am, bm, 0.0, MatMut { data: &mut c, rs, cs });
        assert!(matches!(&r, Err(Error::Shape(msg)) if msg.contains("share memory")), "strides ({rs}, {cs}): {r:?}");
        assert!(c.iter().all(|v| v.is_nan()), "C written before the error");
    }
    // stride 0 in A or B broadcasts, and a single row or column of C may have any stride there
    let mut want = vec![0.0; m * n];
    let a0 = Mat { data: &a, rs: 0, cs: 1 };
    reference(m, n, k, 1.0, a0, bm, 0.0, &mut want, n, 1);
    let mut got = poisoned(m * n);
    gemm.sgemm(m, n, k, 1.0, a0, bm, 0.0, MatMut { data: &mut got, rs: n, cs: 1 }).unwrap();
    assert_eq!(got, want);
    gemm.sgemm(1, n, k, 1.0, am, bm, 0.0, MatMut { data: &mut got, rs: 0, cs: 1 }).unwrap();
    gemm.sgemm(m, 1, k, 1.0, am, bm, 0.0, MatMut { data: &mut got, rs: 1, cs: 0 }).unwrap();
}

#[test]
fn same_bits_on_any_thread_count() {
    let mut rng = Rng::new(6);
    // (7, 8, 2000) splits into a 6-row and a 1-row part on 2 threads, which once took the
    // single-row path (other rounding); the others cut rows or columns unevenly
    let shapes = [(7, 8, 2000), (13, 17, 600), (100, 33, 300), (6, 1000, 50), (65, 127, 40), (200, 3, 400)];
    let pools: Vec<Pool> = (1..=4).map(|t| Pool::new(t).unwrap()).collect();
    for (isa, (m, n, k)) in Isa::runnable().into_iter().flat_map(|isa| shapes.map(|s| (isa, s))) {
        let mut ws = GemmWorkspace::with_isa(4, isa).unwrap();
        for kinds in [(0, 1, 0), (1, 0, 2), (0, 0, 1), (0, 1, 4)] {
            let ((ars, acs, alen), (brs, bcs, blen), (crs, ccs, clen)) =
                (layout(kinds.0, m, k), layout(kinds.1, k, n), layout(kinds.2, m, n));
            let (a, b, c0) = (rng.uniform(alen), rng.uniform(blen), rng.uniform(clen));
            let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
            for (alpha, beta) in [(1.0, 0.0), (1.0, 1.0), (0.7, 1.3), (-0.5, 0.0)] {
                let mut first: Option<Vec<f32>> = None;
                for pool in &pools {
                    let mut c = c0.clone();
                    sgemm(pool, &mut ws, m, n, k, alpha, am, bm, beta, MatMut { data: &mut c, rs: crs, cs: ccs });
                    let bits: Vec<u32> = c.iter().map(|v| v.to_bits()).collect();
                    let want = first.get_or_insert_with(|| c.clone());
                    let differ = want.iter().zip(&bits).filter(|(w, g)| w.to_bits() != **g).count();
                    assert_eq!(
                        differ,
                        0,
                        "{isa:?} {m}×{n}×{k} layouts {kinds:?} α={alpha} β={beta}: {differ} values differ on {} threads",
                        pool.threads()
                    );
                }
            }
        }
    }
}

#[test]
fn products_on_one_pool_from_two_threads_each_with_its_workspace_are_exact() {
    // Two models copied from one share its pool; each cache has its own workspace. A run that
    // finds the pool busy runs on its caller, and must not meet the other run's buffers.
    let pool = Pool::new(2).unwrap();
    let (m, n, k) = (64, 70, 66);
    std::thread::scope(|scope| {
        for seed in [7, 8] {
            let pool = &pool;
            scope.spawn(move || {
                let mut rng = Rng::new(seed);
                let mut ws = GemmWorkspace::new(2).unwrap();
                let (a, b) = (rng.ints(m * k), rng.ints(k * n));
                let (am, bm) = (Mat { data: &a, rs: k, cs: 1 }, Mat { data: &b, rs: n, cs: 1 });
                let mut want = vec![0.0; m * n];
                reference(m, n, k, 1.0, am, bm, 0.0, &mut want, n, 1);
                for _ in 0..300 {
                    let mut got = poisoned(m * n);
                    sgemm(pool, &mut ws, m, n, k, 1.0, am, bm, 0.0, MatMut { data: &mut got, rs: n, cs: 1 });
                    assert_eq!(got, want);
                }
            });
        }
    });
}

#[test]
fn b_panels_read_in_place_have_the_bits_of_packed_ones() {
    // dW = dZᵀ·X of a layer 784 → 128 over 32 and 300 samples (k = 300 crosses KC: a block
    // of 256 rows packed, one of 44 read in place), and a narrow last panel, on uniform
    // values so that the bits show the order of the sums
    let mut rng = Rng::new(31);
    for (m, n, k) in [(128, 784, 32), (128, 784, 300), (37, 100, 9)] {
        let (dz, x) = (rng.uniform(k * m), rng.uniform(k * n));
        let (a, b) = (Mat { data: &dz, rs: 1, cs: m }, Mat { data: &x, rs: n, cs: 1 });
        for isa in Isa::runnable() {
            let (pool, mut ws) = (Pool::new(1).unwrap(), GemmWorkspace::with_isa(1, isa).unwrap());
            let last = (k - 1) / KC * KC;
            let fits = nest::in_place_fits_l1(x[last * n..].as_ptr() as usize, k - last, tile_shape(isa).1, n);
            assert!(fits, "{isa:?} {m}×{n}×{k}: the last block of B is packed, not read in place");
            let (mut in_place, mut packed) = (poisoned(m * n), poisoned(m * n));
            sgemm(&pool, &mut ws, m, n, k, 1.0, a, b, 0.0, MatMut { data: &mut in_place, rs: n, cs: 1 });
            let mut pb = PackedB::new(isa, k, n).unwrap();
            pb.pack(b);
            sgemm_packed_b(&pool, &mut ws, m, 1.0, a, &pb, 0.0, MatMut { data: &mut packed, rs: n, cs: 1 });
            assert!(in_place.iter().all(|v| v.is_finite()), "{isa:?} {m}×{n}×{k}: not every element written");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&in_place) == bits(&packed), "{isa:?} {m}×{n}×{k}: in place and packed differ");
        }
    }
}

#[test]
fn b_panels_are_read_in_place_where_their_rows_spread_over_l1() {
    // X of 784 columns (rows 49 lines apart: each in the next sets), 32 rows of 32 values
    assert!(nest::in_place_fits_l1(0, 32, 32, 784));
    // W of 128 columns (rows 8 lines apart share 8 sets), 64 rows of 16
    assert!(!nest::in_place_fits_l1(0, 64, 16, 128));
    // rows 4 KiB apart: the same two sets; 7 rows leave a way, 8 fill them
    assert!(nest::in_place_fits_l1(0, 7, 32, 1024));
    assert!(!nest::in_place_fits_l1(0, 8, 32, 1024));
    // 256 rows of 32 values fill every set, however spread
    assert!(!nest::in_place_fits_l1(0, 256, 32, 784));
}

#[test]
fn a_rows_are_read_in_place_where_a_column_spreads_over_l1() {
    // AVX-512 (12 rows, a panel of 256·32 values that fills L1): X of 784 columns (rows 49
    // lines apart), 512 (two sets of 6), 128; 1024 (rows 4 KiB apart: one set of 12) packed
    let panel = 256 * 32;
    assert!(nest::column_fits_l1(12, 784, panel));
    assert!(nest::column_fits_l1(12, 512, panel));
    assert!(nest::column_fits_l1(12, 128, panel));
    assert!(!nest::column_fits_l1(12, 1024, panel));
    assert!(nest::column_fits_l1(7, 1024, panel));
    // 1025: rows 4 bytes further each, in one set until the 16th; 1028: four rows a line,
    // twelve over three or four sets whatever the column
    assert!(!nest::column_fits_l1(12, 1025, panel));
    assert!(nest::column_fits_l1(12, 1028, panel));
    // AVX2 (6 rows, a panel of 256·16 values: 4 lines of every set): 6 rows 4 KiB apart
    // evict it, 3 in a set (2 KiB apart) leave a way
    let panel = 256 * 16;
    assert!(!nest::column_fits_l1(6, 1024, panel));
    assert!(nest::column_fits_l1(6, 512, panel));
    assert!(nest::column_fits_l1(6, 784, panel));
    // a panel of 64 rows: 1 line a set
    assert!(nest::column_fits_l1(6, 1024, 64 * 16));
    // rows of 3 values (k = 3), 5 rows a line, and one row broadcast to all (stride 0)
    assert!(nest::column_fits_l1(12, 3, 3 * 32));
    assert!(nest::column_fits_l1(12, 0, 256 * 32));
}
