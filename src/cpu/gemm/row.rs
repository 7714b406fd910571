//! Products with a single row (batch-1 inference) or a single column: no packing, C is one
//! pass of axpys or dot products.

use super::{View, ViewMut};

/// The 1×k·k×n case: no packing. Row-contiguous B sums α·a_p·B[p, :] rows into C (axpy);
/// otherwise each C element is a dot product.
///
/// # Safety
/// `a` covers 1×k, `b` k×n and `c` 1×n elements (checked extents), and no other thread touches
/// C's during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn row_times_matrix(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    // SAFETY: the same contract; the AVX2 copy only where the CPU has AVX2 and FMA.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx2_fma() {
            return row_times_matrix_avx2(n, k, alpha, a, b, beta, c);
        }
        row_times_matrix_body(n, k, alpha, a, b, beta, c)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn row_times_matrix_avx2(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    // SAFETY: `row_times_matrix`'s contract.
    unsafe { row_times_matrix_body(n, k, alpha, a, b, beta, c) }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn row_times_matrix_body(n: usize, k: usize, alpha: f32, a: View, b: View, beta: f32, c: ViewMut) {
    // Every access below is to an element (0, p < k) of A, (p < k, j < n) of B or (0, j < n)
    // of C (`row_times_matrix`'s contract); a slice is made only along a stride of 1.
    // SAFETY: element (0, p) of A, p < k.
    let at = |p: usize| unsafe { *a.ptr.add(p * a.cs) };
    let store = |j: usize, acc: f32| {
        // SAFETY: element (0, j) of C, j < n.
        let p = unsafe { c.ptr.add(j * c.cs) };
        // SAFETY: as above.
        unsafe { *p = if beta == 0.0 { alpha * acc } else { alpha * acc + beta * *p } };
    };
    if b.cs == 1 && c.cs == 1 && k == 1 {
        // One term (a batch-1 dW row): a single pass, C ← α·(a₀·B) + β·C.
        // SAFETY: row 0 of B and of C, n contiguous elements each (cs = 1).
        let (a0, row) = (at(0), unsafe { std::slice::from_raw_parts(b.ptr, n) });
        // SAFETY: as above.
        let out = unsafe { std::slice::from_raw_parts_mut(c.ptr, n) };
        if beta == 0.0 {
            out.iter_mut().zip(row).for_each(|(o, &v)| *o = alpha * (a0 * v));
        } else {
            out.iter_mut().zip(row).for_each(|(o, &v)| *o = alpha * (a0 * v) + beta * *o);
        }
    } else if b.cs == 1 && c.cs == 1 {
        // Accumulate rows of B in a stack tile of up to 256 columns at a time.
        let mut tile = [0.0f32; 256];
        for j0 in (0..n).step_by(256) {
            let w = (n - j0).min(256);
            let acc = &mut tile[..w];
            acc.fill(0.0);
            for p in 0..k {
                // SAFETY: columns j0..j0 + w ≤ n of row p < k of B, contiguous (cs = 1).
                let (ap, row) = (at(p), unsafe { std::slice::from_raw_parts(b.ptr.add(p * b.rs + j0), w) });
                acc.iter_mut().zip(row).for_each(|(s, &v)| *s += ap * v);
            }
            // SAFETY: columns j0..j0 + w ≤ n of C's row, contiguous (cs = 1).
            let out = unsafe { std::slice::from_raw_parts_mut(c.ptr.add(j0), w) };
            if beta == 0.0 {
                out.iter_mut().zip(acc.iter()).for_each(|(o, &s)| *o = alpha * s);
            } else {
                out.iter_mut().zip(acc.iter()).for_each(|(o, &s)| *o = alpha * s + beta * *o);
            }
        }
    } else if b.rs == 1 && a.cs == 1 {
        // SAFETY: A's row, k contiguous elements (cs = 1).
        let arow = unsafe { std::slice::from_raw_parts(a.ptr, k) };
        // SAFETY: column j < n of B, k contiguous elements (rs = 1).
        let col = |j: usize| unsafe { std::slice::from_raw_parts(b.ptr.add(j * b.cs), k) };
        // four columns at a time: independent sums that hide the add latency, each summed
        // as `dot` sums it
        let fours = n / 4 * 4;
        for j in (0..fours).step_by(4) {
            let sums = dot4(arow, [col(j), col(j + 1), col(j + 2), col(j + 3)]);
            sums.iter().enumerate().for_each(|(q, &s)| store(j + q, s));
        }
        for j in fours..n {
            store(j, dot(arow, col(j)));
        }
    } else {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                // SAFETY: element (p < k, j < n) of B.
                acc += at(p) * unsafe { *b.ptr.add(p * b.rs + j * b.cs) };
            }
            store(j, acc);
        }
    }
}

/// Dot product with 16 independent partial sums (vectorises; fixed order): lane l sums the
/// products at l mod 16 of the whole chunks, then the lanes in order, then the tail.
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut part = [0.0f32; 16];
    let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for l in 0..16 {
            part[l] += xs[l] * ys[l];
        }
    }
    let mut sum = part.iter().sum::<f32>();
    for (a, b) in xr.iter().zip(yr) {
        sum += a * b;
    }
    sum
}

/// [`dot`] of `x` with four vectors at once, each summed in `dot`'s order (the same bits).
#[inline(always)]
fn dot4(x: &[f32], [y0, y1, y2, y3]: [&[f32]; 4]) -> [f32; 4] {
    let (mut p0, mut p1, mut p2, mut p3) = ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
    let chunks = x.chunks_exact(16).zip(y0.chunks_exact(16)).zip(y1.chunks_exact(16)).zip(y2.chunks_exact(16)).zip(y3.chunks_exact(16));
    for ((((xs, a), b), c), d) in chunks {
        for l in 0..16 {
            p0[l] += xs[l] * a[l];
            p1[l] += xs[l] * b[l];
            p2[l] += xs[l] * c[l];
            p3[l] += xs[l] * d[l];
        }
    }
    let tail = x.len() / 16 * 16;
    let finish = |part: &[f32; 16], y: &[f32]| {
        let mut sum = part.iter().sum::<f32>();
        for (a, b) in x[tail..].iter().zip(&y[tail..]) {
            sum += a * b;
        }
        sum
    };
    [finish(&p0, y0), finish(&p1, y1), finish(&p2, y2), finish(&p3, y3)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;

    /// Four columns at a time sum each as one column does: the same bits.
    #[test]
    fn four_dots_at_once_have_one_dots_bits() {
        let mut rng = Rng::new(3);
        for k in [0, 1, 15, 16, 17, 100, 784] {
            let x = rng.uniform(k);
            let ys: Vec<Vec<f32>> = (0..4).map(|_| rng.uniform(k)).collect();
            let four = dot4(&x, [&ys[0], &ys[1], &ys[2], &ys[3]]);
            for (q, y) in ys.iter().enumerate() {
                assert_eq!(four[q].to_bits(), dot(&x, y).to_bits(), "k = {k}, column {q}");
            }
        }
    }
}
