//! The recurrent weights' panels (the packed layout of `layers::recurrent`).

use super::PANEL;

/// `w` (gates·hidden × rows, PyTorch's layout) into `panels` in the packed layout
/// (`layers::recurrent::panel_at`: for each panel of 16 units, each row j and each gate, the 16
/// units' values, 0 past `hidden`). Blocks of 8 units by 8 rows are transposed in registers (AVX)
/// where the CPU has it; the rest one value at a time.
pub(crate) fn pack_panels(gates: usize, hidden: usize, rows: usize, w: &[f32], panels: &mut [f32]) {
    assert!(
        w.len() >= gates * hidden * rows && panels.len() >= hidden.div_ceil(PANEL) * rows * gates * PANEL,
        "pack_panels: short buffers"
    );
    #[cfg(target_arch = "x86_64")]
    let avx = crate::cpu::has_avx2_fma();
    for q in 0..hidden.div_ceil(PANEL) {
        for gate in 0..gates {
            // W[gate·H + 16q + lane, j] goes to panels[((q·rows + j)·gates + gate)·16 + lane]
            let src = (gate * hidden + q * PANEL) * rows;
            let dst = (q * rows * gates + gate) * PANEL;
            for lane0 in (0..PANEL).step_by(8) {
                for j0 in (0..rows).step_by(8) {
                    let whole = q * PANEL + lane0 + 8 <= hidden && j0 + 8 <= rows;
                    #[cfg(target_arch = "x86_64")]
                    if whole && avx {
                        // SAFETY: the CPU has AVX (checked above); the 8×8 block lies inside `w`
                        // (rows gate·H + 16q + lane0 … + 7 < gates·H, columns j0 … j0 + 7 < rows)
                        // and inside `panels` (asserted sizes above).
                        unsafe {
                            transpose8(
                                w.as_ptr().add(src + lane0 * rows + j0),
                                rows,
                                panels.as_mut_ptr().add(dst + j0 * gates * PANEL + lane0),
                                gates * PANEL,
                            )
                        };
                        continue;
                    }
                    for lane in lane0..lane0 + 8 {
                        let unit = q * PANEL + lane;
                        for j in j0..(j0 + 8).min(rows) {
                            panels[dst + j * gates * PANEL + lane] = if unit < hidden { w[src + lane * rows + j] } else { 0.0 };
                        }
                    }
                }
            }
        }
    }
}

/// dst[c·ld_dst + r] = src[r·ld_src + c] for r < `rows`, c < `cols`: a transpose, 8×8 blocks at a
/// time in registers (AVX) where the CPU has it, the rest one value at a time.
pub(crate) fn transpose(rows: usize, cols: usize, src: &[f32], ld_src: usize, dst: &mut [f32], ld_dst: usize) {
    assert!(
        rows == 0 || cols == 0 || (src.len() >= (rows - 1) * ld_src + cols && dst.len() >= (cols - 1) * ld_dst + rows),
        "transpose: short buffers"
    );
    #[cfg(target_arch = "x86_64")]
    let avx = crate::cpu::has_avx2_fma();
    for r0 in (0..rows).step_by(8) {
        for c0 in (0..cols).step_by(8) {
            #[cfg(target_arch = "x86_64")]
            if avx && r0 + 8 <= rows && c0 + 8 <= cols {
                // SAFETY: the CPU has AVX (checked above); rows r0 … r0 + 7 < rows, columns
                // c0 … c0 + 7 < cols lie inside `src`, and their transposes inside `dst` (asserted
                // sizes above); the two are distinct slices.
                unsafe { transpose8(src.as_ptr().add(r0 * ld_src + c0), ld_src, dst.as_mut_ptr().add(c0 * ld_dst + r0), ld_dst) };
                continue;
            }
            for r in r0..(r0 + 8).min(rows) {
                for c in c0..(c0 + 8).min(cols) {
                    dst[c * ld_dst + r] = src[r * ld_src + c];
                }
            }
        }
    }
}

/// dst[c·ld_dst + r] = src[r·ld_src + c] for r, c < 8: an 8×8 block transposed in registers.
///
/// # Safety
/// The CPU has AVX; `src` points to 8 rows of 8 readable values `ld_src` apart, `dst` to 8 rows of
/// 8 writable values `ld_dst` apart, not overlapping them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8(src: *const f32, ld_src: usize, dst: *mut f32, ld_dst: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract: every load reads a row of 8 values of `src`, every store
    // writes a row of 8 of `dst`; this function enables the AVX that transpose8x8 needs.
    unsafe {
        let row = |i: usize| src.add(i * ld_src);
        let r = [
            _mm256_loadu_ps(row(0)),
            _mm256_loadu_ps(row(1)),
            _mm256_loadu_ps(row(2)),
            _mm256_loadu_ps(row(3)),
            _mm256_loadu_ps(row(4)),
            _mm256_loadu_ps(row(5)),
            _mm256_loadu_ps(row(6)),
            _mm256_loadu_ps(row(7)),
        ];
        let c = crate::cpu::gemm::transpose8x8(r);
        for (i, &v) in c.iter().enumerate() {
            _mm256_storeu_ps(dst.add(i * ld_dst), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `transpose` against the plain loop on sizes that leave ragged 8 × 8 blocks (the rest goes
    /// one value at a time), with strides past the rows' lengths: every element of the result
    /// written (from NaN), nothing between or past the rows touched.
    #[test]
    fn transpose_matches_the_plain_loop() {
        for (rows, cols) in [(1, 1), (3, 17), (8, 8), (9, 16), (16, 23), (128, 8)] {
            let (ld_src, ld_dst) = (cols + 3, rows + 5);
            let src: Vec<f32> = (0..rows * ld_src).map(|i| i as f32).collect();
            let mut dst = vec![f32::NAN; cols * ld_dst + 7];
            transpose(rows, cols, &src, ld_src, &mut dst, ld_dst);
            for (i, &v) in dst.iter().enumerate() {
                let (c, r) = (i / ld_dst, i % ld_dst);
                let want = if c < cols && r < rows { src[r * ld_src + c] } else { f32::NAN };
                assert!(v.to_bits() == want.to_bits(), "{rows}×{cols}: dst[{i}] = {v}, want {want}");
            }
        }
    }
}
