//! Products with packed operands, and the bits the kernels give.

use super::*;

/// C ← α·A·B + β·C through a [`PackedB`] against the plain loop, C poisoned where β = 0 and
/// its padding checked untouched.
#[allow(clippy::too_many_arguments)]
fn check_packed_b(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
    kinds: (usize, usize, usize),
    alpha: f32,
    beta: f32,
) {
    let ((ars, acs, alen), (brs, bcs, blen), (crs, ccs, clen)) = (layout(kinds.0, m, k), layout(kinds.1, k, n), layout(kinds.2, m, n));
    let (a, b) = (rng.ints(alen), rng.ints(blen));
    let c0 = if beta == 0.0 { poisoned(clen) } else { rng.ints(clen) };
    let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
    let mut want = c0.clone();
    reference(m, n, k, alpha, am, bm, beta, &mut want, crs, ccs);
    let mut packed = PackedB::new(ws.isa(), k, n).unwrap();
    packed.pack(bm);
    let mut got = c0.clone();
    sgemm_packed_b(pool, ws, m, alpha, am, &packed, beta, MatMut { data: &mut got, rs: crs, cs: ccs });
    let mut inside = vec![false; clen];
    (0..m).for_each(|i| (0..n).for_each(|j| inside[i * crs + j * ccs] = true));
    for idx in 0..clen {
        let what = format!("{:?} {} threads {m}×{n}×{k} layouts {kinds:?} α={alpha} β={beta} at {idx}", ws.isa(), pool.threads());
        if inside[idx] {
            assert_eq!(got[idx], want[idx], "{what}");
        } else {
            assert!(got[idx].to_bits() == c0[idx].to_bits(), "{what}: padding touched");
        }
    }
}

#[test]
fn packed_b_matches_the_plain_loop() {
    let mut rng = Rng::new(21);
    // m of 1 to 4 takes tiles several panels wide, each ending at a partial panel somewhere;
    // n past NC and k past KC cross the packed blocks
    let shapes = [
        (1, 1, 1),
        (1, 10, 64),
        (1, 200, 300),
        (2, 70, 9),
        (3, 97, 5),
        (4, 33, 17),
        (5, 40, 3),
        (13, 31, 20),
        (64, 10, 128),
        (0, 5, 3),
        (3, 5, 0),
    ];
    for (isa, threads) in Isa::runnable().into_iter().flat_map(|isa| [(isa, 1), (isa, 2), (isa, 3)]) {
        let pool = Pool::new(threads).unwrap();
        let mut ws = GemmWorkspace::with_isa(threads, isa).unwrap();
        for shape in shapes {
            for kinds in [(0, 1, 0), (0, 0, 2), (1, 3, 0), (2, 1, 1), (0, 1, 4)] {
                for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (1.0, 1.0), (-1.5, 0.5)] {
                    check_packed_b(&pool, &mut ws, &mut rng, shape, kinds, alpha, beta);
                }
            }
        }
        check_packed_b(&pool, &mut ws, &mut rng, (3, NC + 45, KC + 7), (0, 1, 0), 1.0, 0.0);
        check_packed_b(&pool, &mut ws, &mut rng, (MC + 5, NC + 19, KC + 11), (0, 1, 0), 0.5, 1.0);
    }
}

/// Uniform values, so every sum rounds: bits then show the order of the sums.
fn product(isa: Isa, threads: usize, (m, n, k): (usize, usize, usize), a: &[f32], w: &[f32], packed: bool) -> Vec<u32> {
    let (pool, mut ws) = (Pool::new(threads).unwrap(), GemmWorkspace::with_isa(threads, isa).unwrap());
    // Z (m×n) = X (m×k)·Wᵀ, W (n×k) row-major: a dense layer's forward
    let (am, bm) = (Mat { data: a, rs: k, cs: 1 }, Mat { data: w, rs: 1, cs: k });
    let mut z = poisoned(m * n);
    let c = MatMut { data: &mut z, rs: n, cs: 1 };
    if packed {
        let mut pb = PackedB::new(isa, k, n).unwrap();
        pb.pack(bm);
        sgemm_packed_b(&pool, &mut ws, m, 1.0, am, &pb, 0.0, c);
    } else {
        sgemm(&pool, &mut ws, m, n, k, 1.0, am, bm, 0.0, c);
    }
    bits(&z)
}

#[test]
fn a_sample_has_the_same_bits_in_a_batch_of_one_and_of_many_and_on_avx2_and_avx512() {
    let mut rng = Rng::new(22);
    for (n, k) in [(128, 784), (10, 64), (1024, 512), (37, 300)] {
        let (x, w) = (rng.uniform(64 * k), rng.uniform(n * k));
        let mut fma_kernels: Vec<Vec<u32>> = Vec::new();
        for isa in Isa::runnable() {
            let batch = product(isa, 2, (64, n, k), &x, &w, true);
            assert_eq!(batch, product(isa, 1, (64, n, k), &x, &w, false), "{isa:?} {n}×{k}: packed and plain differ");
            for rows in [1, 2, 3, 4, 5] {
                let few = product(isa, 1, (rows, n, k), &x[..rows * k], &w, true);
                assert_eq!(few, batch[..rows * n], "{isa:?} {n}×{k}: a batch of {rows} differs from the same rows in a batch of 64");
            }
            if isa >= Isa::Avx2 {
                fma_kernels.push(batch);
            }
        }
        assert!(fma_kernels.windows(2).all(|w| w[0] == w[1]), "{n}×{k}: AVX2 and AVX-512 differ");
    }
}

#[test]
fn packed_products_have_the_same_bits_on_any_thread_count() {
    let mut rng = Rng::new(25);
    // (1, 1000, 300) splits columns, (200, 40, 300) rows, (3, 1100, 260) crosses NC and KC
    for (m, n, k) in [(1, 1000, 300), (200, 40, 300), (3, 1100, 260), (64, 128, 784)] {
        let (x, w) = (rng.uniform(m * k), rng.uniform(n * k));
        for isa in Isa::runnable() {
            let one = product(isa, 1, (m, n, k), &x, &w, true);
            for threads in 2..=4 {
                assert!(product(isa, threads, (m, n, k), &x, &w, true) == one, "{isa:?} {m}×{n}×{k}: bits differ on {threads} threads");
            }
        }
    }
}

#[test]
fn avx2_and_avx512_give_the_same_bits_on_every_layout() {
    if !Isa::runnable().contains(&Isa::Avx512) {
        return;
    }
    let mut rng = Rng::new(23);
    for (m, n, k) in [(7, 8, 2000), (13, 17, 600), (100, 33, 300), (6, 1000, 50), (266, 265, 257)] {
        for kinds in [(0, 1, 0), (1, 0, 2), (0, 0, 1), (0, 1, 4)] {
            let ((ars, acs, alen), (brs, bcs, blen), (crs, ccs, clen)) =
                (layout(kinds.0, m, k), layout(kinds.1, k, n), layout(kinds.2, m, n));
            let (a, b, c0) = (rng.uniform(alen), rng.uniform(blen), rng.uniform(clen));
            let (am, bm) = (Mat { data: &a, rs: ars, cs: acs }, Mat { data: &b, rs: brs, cs: bcs });
            for (alpha, beta) in [(1.0, 0.0), (1.0, 1.0), (0.7, 1.3)] {
                let run = |isa| {
                    let (pool, mut ws) = (Pool::new(2).unwrap(), GemmWorkspace::with_isa(2, isa).unwrap());
                    let mut c = c0.clone();
                    sgemm(&pool, &mut ws, m, n, k, alpha, am, bm, beta, MatMut { data: &mut c, rs: crs, cs: ccs });
                    c.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                assert!(run(Isa::Avx2) == run(Isa::Avx512), "{m}×{n}×{k} layouts {kinds:?} α={alpha} β={beta}");
            }
        }
    }
}

#[test]
fn a_read_in_place_has_the_bits_of_a_packed_a() {
    // The same A row-major (its rows read in place), column-major (packed as the call goes)
    // and packed once, against B plain (its panels perhaps read in place) and packed once, C
    // by rows and by columns (tiles through the stack tile); uniform values, so that the bits
    // show the order of the sums. m not a multiple of either MR and past MC, m ≤ 4 (tiles
    // several panels wide), k past KC and below 4, n past NC.
    let mut rng = Rng::new(26);
    let shapes = [(13, 70, 300), (7, 40, 3), (1, 33, 2), (3, 100, 257), (25, 17, 1), (MC + 5, NC + 19, KC + 11), (150, 64, 2 * KC + 1)];
    for isa in Isa::runnable() {
        let (pool, mut ws) = (Pool::new(1).unwrap(), GemmWorkspace::with_isa(1, isa).unwrap());
        for (m, n, k) in shapes {
            assert!(
                nest::column_fits_l1(tile_shape(isa).0, k, tile_shape(isa).1 * k.min(KC)),
                "{isa:?} {m}×{n}×{k}: A is packed, not read in place"
            );
            let (x, b) = (rng.uniform(m * k), rng.uniform(k * n));
            // column-major: (i, p) at p·m + i
            let x_t: Vec<f32> = (0..m * k).map(|idx| x[(idx % m) * k + idx / m]).collect();
            let (rows, cols, bm) = (Mat { data: &x, rs: k, cs: 1 }, Mat { data: &x_t, rs: 1, cs: m }, Mat { data: &b, rs: n, cs: 1 });
            let (mut pa, mut pb) = (PackedA::new(isa, m, k).unwrap(), PackedB::new(isa, k, n).unwrap());
            pa.pack(rows);
            pb.pack(bm);
            for (crs, ccs) in [(n, 1), (1, m)] {
                let what = format!("{isa:?} {m}×{n}×{k} C strides ({crs}, {ccs})");
                let run = |f: &mut dyn FnMut(MatMut)| {
                    let mut c = poisoned(m * n);
                    f(MatMut { data: &mut c, rs: crs, cs: ccs });
                    assert!(c.iter().all(|v| v.is_finite()), "{what}: not every element written");
                    bits(&c)
                };
                let in_place = run(&mut |c| sgemm_blocked(&pool, &mut ws, m, n, k, 1.0, rows, bm, 0.0, c));
                assert!(in_place == run(&mut |c| sgemm_blocked(&pool, &mut ws, m, n, k, 1.0, cols, bm, 0.0, c)), "{what}: packed here");
                let mut scratch = GemmWorkspace::with_isa(1, isa).unwrap();
                let once = run(&mut |c| sgemm_packed_a_on(&mut scratch.workers()[0], n, 1.0, &pa, bm, 0.0, c));
                assert!(in_place == once, "{what}: A packed once");
                let in_place = run(&mut |c| sgemm_packed_b(&pool, &mut ws, m, 1.0, rows, &pb, 0.0, c));
                assert!(in_place == once, "{what}: B packed once");
                assert!(
                    in_place == run(&mut |c| sgemm_packed_b(&pool, &mut ws, m, 1.0, cols, &pb, 0.0, c)),
                    "{what}: B packed once, A packed here"
                );
            }
        }
    }
}

/// Bits, so that NaN left in the padding compares equal to itself.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn packed_a_and_shifted_rows_match_the_plain_loop() {
    let mut rng = Rng::new(24);
    for isa in Isa::runnable() {
        let mut ws = GemmWorkspace::with_isa(1, isa).unwrap();
        let slack = shifted_slack(isa);
        for (m, n, k) in [(1, 1, 1), (6, 100, 25), (16, 70, 150), (32, 37, 300), (5, 33, 7), (MC + 3, 40, KC + 5), (3, 0, 4)] {
            let (a, b) = (rng.ints(m * k), rng.ints(k * n));
            // A given column-major, then element by element: both packings must agree
            let a_t: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
            let mut packed = PackedA::new(isa, m, k).unwrap();
            let mut by_element = PackedA::new(isa, m, k).unwrap();
            packed.pack(Mat { data: &a_t, rs: 1, cs: m });
            by_element.pack_with(|i, p| a[i * k + p]);
            assert_eq!(packed.data, by_element.data, "{isa:?} {m}×{k}: pack and pack_with differ");
            let (am, bm) = (Mat { data: &a, rs: k, cs: 1 }, Mat { data: &b, rs: n, cs: 1 });
            for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0)] {
                let c0 = if beta == 0.0 { poisoned(m * n + 3) } else { rng.ints(m * n + 3) };
                let mut want = c0.clone();
                reference(m, n, k, alpha, am, bm, beta, &mut want, n, 1);
                let mut got = c0.clone();
                sgemm_packed_a_on(&mut ws.workers()[0], n, alpha, &packed, bm, beta, MatMut { data: &mut got[..m * n], rs: n, cs: 1 });
                assert_eq!(bits(&got), bits(&want), "{isa:?} packed A {m}×{n}×{k} α={alpha} β={beta}");
                // B's rows scattered through a larger buffer, at offsets in no order, some
                // overlapping; the buffer has the slack whole panels need
                let rows_len = 3 * k * n + n + slack;
                let mut rows = poisoned(rows_len);
                let offsets: Vec<usize> = (0..k).map(|_| rng.below(3 * k * n + 1)).collect();
                let mut b_rows = vec![0.0; k * n];
                for (p, &o) in offsets.iter().enumerate() {
                    rows[o..][..n].copy_from_slice(&b[p * n..][..n]);
                }
                for (p, &o) in offsets.iter().enumerate() {
                    b_rows[p * n..][..n].copy_from_slice(&rows[o..][..n]);
                }
                rows.iter_mut().filter(|v| v.is_nan()).for_each(|v| *v = 1.0);
                let mut want = c0.clone();
                reference(m, n, k, alpha, am, Mat { data: &b_rows, rs: n, cs: 1 }, beta, &mut want, n, 1);
                let mut got = c0.clone();
                sgemm_shifted_on(
                    &mut ws.workers()[0],
                    n,
                    alpha,
                    &packed,
                    &rows,
                    &offsets,
                    (n.max(1), n.max(1)),
                    beta,
                    MatMut { data: &mut got[..m * n], rs: n, cs: 1 },
                );
                assert_eq!(bits(&got), bits(&want), "{isa:?} shifted B {m}×{n}×{k} α={alpha} β={beta}");
            }
        }
    }
}

/// B's rows read in runs of `width` values, `pitch` apart (a convolution's output rows in its
/// padded planes), against the plain loop on the gathered B: every run width a multiple of
/// half a panel, pitches with and without gaps, a last run cut short or a half panel past n;
/// C poisoned and the values past it checked untouched; NaN between the runs, which the
/// kernels read only to drop.
#[test]
fn shifted_rows_in_runs_match_the_plain_loop() {
    let mut rng = Rng::new(25);
    for isa in Isa::runnable() {
        let mut ws = GemmWorkspace::with_isa(1, isa).unwrap();
        let (half, slack) = (tile_shape(isa).1 / 2, shifted_slack(isa));
        for (m, k) in [(16, 144), (5, 7), (32, 9)] {
            let a = rng.ints(m * k);
            let mut packed = PackedA::new(isa, m, k).unwrap();
            packed.pack_with(|i, p| a[i * k + p]);
            for (width, gap, runs, tail) in
                [(half, 2, 3, 0), (2 * half, 2, 5, 0), (2 * half, 0, 2, 3), (3 * half, 37, 4, half), (half, 6, 1, 5)]
            {
                let (pitch, n) = (width + gap, runs * width + tail);
                assert!(shifted_runs_fit(isa, n, width, pitch), "{isa:?} runs of {width} every {pitch} over {n}");
                let b = rng.ints(k * n);
                let at = |j: usize| (j / width) * pitch + j % width;
                let span = at(n - 1) + 1;
                let offsets: Vec<usize> = (0..k).map(|_| rng.below(2 * span + 1)).collect();
                // later rows overwrite earlier ones where they overlap: gather B back
                let mut rows = poisoned(3 * span + 1 + slack);
                for (p, &o) in offsets.iter().enumerate() {
                    (0..n).for_each(|j| rows[o + at(j)] = b[p * n + j]);
                }
                let b_rows: Vec<f32> = (0..k * n).map(|idx| rows[offsets[idx / n] + at(idx % n)]).collect();
                let mut want = poisoned(m * n + 3);
                want[m * n..].fill(7.0);
                let mut got = want.clone();
                let (am, bm) = (Mat { data: &a, rs: k, cs: 1 }, Mat { data: &b_rows, rs: n, cs: 1 });
                reference(m, n, k, 1.0, am, bm, 0.0, &mut want, n, 1);
                let c = MatMut { data: &mut got[..m * n], rs: n, cs: 1 };
                sgemm_shifted_on(&mut ws.workers()[0], n, 1.0, &packed, &rows, &offsets, (width, pitch), 0.0, c);
                assert_eq!(bits(&got), bits(&want), "{isa:?} {m}×{n}×{k} in runs of {width} every {pitch}");
            }
        }
    }
}

#[test]
#[should_panic(expected = "split a vector")]
fn runs_that_split_a_vector_are_refused() {
    let isa = Isa::best();
    let mut ws = GemmWorkspace::with_isa(1, isa).unwrap();
    let mut a = PackedA::new(isa, 2, 1).unwrap();
    a.pack(Mat { data: &[1.0, 2.0], rs: 1, cs: 1 });
    // runs of 12 (no kernel's half panel divides it) over 30 columns
    let (rows, mut c) = (vec![1.0; 200], vec![0.0; 60]);
    sgemm_shifted_on(&mut ws.workers()[0], 30, 1.0, &a, &rows, &[0], (12, 14), 0.0, MatMut { data: &mut c, rs: 30, cs: 1 });
}

#[test]
#[should_panic(expected = "reaches past")]
fn a_shifted_row_without_its_slack_is_caught() {
    let isa = Isa::best();
    let mut ws = GemmWorkspace::with_isa(1, isa).unwrap();
    let mut a = PackedA::new(isa, 2, 1).unwrap();
    a.pack(Mat { data: &[1.0, 2.0], rs: 1, cs: 1 });
    // row 0 holds its 3 values but not the rest of its panel
    let (rows, mut c) = (vec![1.0; 3], vec![0.0; 6]);
    sgemm_shifted_on(&mut ws.workers()[0], 3, 1.0, &a, &rows, &[0], (3, 3), 0.0, MatMut { data: &mut c, rs: 3, cs: 1 });
}

#[test]
#[should_panic(expected = "gemm: A")]
fn a_short_operand_of_a_packed_product_is_caught() {
    let (pool, mut ws) = (Pool::new(1).unwrap(), GemmWorkspace::new(1).unwrap());
    let mut b = PackedB::new(ws.isa(), 3, 2).unwrap();
    b.pack(Mat { data: &[1.0; 6], rs: 2, cs: 1 });
    let (a, mut c) = (vec![1.0; 5], vec![0.0; 4]);
    sgemm_packed_b(&pool, &mut ws, 2, 1.0, Mat { data: &a, rs: 3, cs: 1 }, &b, 0.0, MatMut { data: &mut c, rs: 2, cs: 1 });
}
