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
        for j in 0..n {
            // SAFETY: column j < n of B, k contiguous elements (rs = 1).
            let col = unsafe { std::slice::from_raw_parts(b.ptr.add(j * b.cs), k) };
            store(j, dot(arow, col));
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

/// Dot product with 8 independent partial sums (vectorises; fixed order).
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
