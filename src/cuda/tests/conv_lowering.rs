//! A convolution's lowering on the GPU (im2col, the products, col2im) against the spec, and the
//! geometries the convolution tests share.

use super::{check, download, upload};
use crate::chain::Shape;
use crate::cuda::blas::{DevMat, DevMatMut};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::conv;
use crate::testutil::{poisoned, Rng};

/// The CPU's im2col for one sample, written out from the geometry.
fn im2col_reference(g: &conv::Geometry, x: &[f32]) -> Vec<f32> {
    let (kh, kw, ohw) = (g.kernel.0, g.kernel.1, g.ohw());
    let mut col = vec![0.0; g.lowered_len()];
    for c in 0..g.in_channels {
        for i in 0..kh {
            for j in 0..kw {
                for oy in 0..g.out_height {
                    for ox in 0..g.out_width {
                        let (iy, ix) = (
                            (oy * g.stride.0 + i * g.dilation.0) as isize - g.padding.0 as isize,
                            (ox * g.stride.1 + j * g.dilation.1) as isize - g.padding.1 as isize,
                        );
                        if iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width {
                            col[((c * kh + i) * kw + j) * ohw + oy * g.out_width + ox] =
                                x[(c * g.height + iy as usize) * g.width + ix as usize];
                        }
                    }
                }
            }
        }
    }
    col
}

/// The seven geometries the convolution kernels are checked at: no padding, stride (2, 1) with a
/// 3×2 kernel, 5×5 stride 2 pad 2, a 1×1 input, LeNet's first layer, and two 1-D dilated ones.
pub(super) fn conv_geometries() -> Vec<conv::Geometry> {
    let cases = [
        (Shape::image(1, 5, 5), 2, (3, 3), (1, 1), (0, 0), (1, 1)),
        (Shape::image(3, 7, 6), 4, (3, 2), (2, 1), (1, 1), (1, 1)),
        (Shape::image(2, 9, 9), 3, (5, 5), (2, 2), (2, 2), (1, 1)),
        (Shape::image(2, 1, 1), 5, (1, 1), (1, 1), (0, 0), (1, 1)),
        (Shape::image(1, 28, 28), 6, (5, 5), (1, 1), (2, 2), (1, 1)),
        (Shape::image(2, 1, 19), 3, (1, 3), (1, 2), (0, 2), (1, 3)),
        (Shape::image(3, 1, 40), 4, (1, 5), (1, 1), (0, 4), (1, 2)),
    ];
    cases
        .into_iter()
        .map(|(input, oc, kernel, stride, padding, dilation)| conv_geometry(input, oc, kernel, stride, padding, dilation))
        .collect()
}

/// A convolution's geometry from its input, output channels, kernel, stride, padding and
/// dilation; its output size by the layers' own rule ([`conv::output_size`]).
pub(super) fn conv_geometry(
    input: Shape,
    oc: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: (usize, usize),
    dilation: (usize, usize),
) -> conv::Geometry {
    let Shape::Image { channels: _, height, width } = input else { unreachable!() };
    let (oh, ow) = conv::output_size((height, width), kernel, stride, padding, dilation).expect("the kernel fits the padded input");
    conv::Geometry::new(input, Shape::image(oc, oh, ow), kernel, stride, padding, dilation)
}

/// im2col, then W·col (strided-batched SGEMM), equals the conv spec; Wᵀ·dZ then col2im equals
/// its dX, and Σ dZ_s·col_sᵀ its dW. Small integers: everything is exact. Dilated 1-D
/// convolutions (height 1) too, as `Conv1d` runs them.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn conv_lowering_with_sgemm_matches_the_spec() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let blas = gpu.blas(&stream, false).unwrap();
    let mut rng = Rng::new(7);
    for g in conv_geometries() {
        let input = Shape::image(g.in_channels, g.height, g.width);
        let (oc, ckk, ohw, out_len) = (g.out_channels, g.ckk(), g.ohw(), g.out_len());
        for batch in [1, 2, 5] {
            let (w, x, dz) = (rng.ints(oc * ckk), rng.ints(batch * input.len()), rng.ints(batch * out_len));
            let (mut z_want, mut dw_want, mut db_want, mut dx_want) =
                (vec![0.0; batch * out_len], vec![0.0; w.len()], vec![0.0; oc], vec![0.0; x.len()]);
            conv::forward_spec(&g, batch, &w, &vec![0.0; oc], &x, &mut z_want);
            conv::backward_spec(&g, batch, &w, &x, &dz, &mut dw_want, &mut db_want, Some(&mut dx_want));
            let col_want: Vec<f32> = x.chunks(input.len()).flat_map(|xs| im2col_reference(&g, xs)).collect();

            let (wd, xd, dzd) = (upload(&stream, &w), upload(&stream, &x), upload(&stream, &dz));
            let (mut col, mut z, mut dcol, mut dx, mut dw) = (
                upload(&stream, &poisoned(batch * g.lowered_len())),
                upload(&stream, &poisoned(batch * out_len)),
                upload(&stream, &poisoned(batch * g.lowered_len())),
                upload(&stream, &poisoned(x.len())),
                upload(&stream, &poisoned(w.len())),
            );
            gpu.im2col(&stream, &g, batch, View::of(&xd), ViewMut::of(&mut col)).unwrap();
            // Z_s (OC × OHW) = W (OC × CKK) · col_s (CKK × OHW)
            let w_mat = DevMat { data: View::of(&wd), rs: ckk, cs: 1 };
            let col_mat = DevMat { data: View::of(&col), rs: ohw, cs: 1 };
            let z_mat = DevMatMut { data: ViewMut::of(&mut z), rs: ohw, cs: 1 };
            blas.sgemm_batched(batch, oc, ohw, ckk, 1.0, (w_mat, 0), (col_mat, ckk * ohw), 0.0, (z_mat, out_len)).unwrap();
            // dcol_s (CKK × OHW) = Wᵀ (CKK × OC) · dZ_s (OC × OHW)
            let w_t = DevMat { data: View::of(&wd), rs: 1, cs: ckk };
            let dz_mat = DevMat { data: View::of(&dzd), rs: ohw, cs: 1 };
            let dcol_mat = DevMatMut { data: ViewMut::of(&mut dcol), rs: ohw, cs: 1 };
            blas.sgemm_batched(batch, ckk, ohw, oc, 1.0, (w_t, 0), (dz_mat, out_len), 0.0, (dcol_mat, ckk * ohw)).unwrap();
            gpu.col2im(&stream, &g, batch, View::of(&dcol), ViewMut::of(&mut dx)).unwrap();
            // dW (OC × CKK) = Σ_s dZ_s (OC × OHW) · col_sᵀ (OHW × CKK)
            for s in 0..batch {
                let dz_s = DevMat { data: View::of(&dzd).slice(s * out_len..(s + 1) * out_len), rs: ohw, cs: 1 };
                let col_t = DevMat { data: View::of(&col).slice(s * g.lowered_len()..(s + 1) * g.lowered_len()), rs: 1, cs: ohw };
                let beta = if s == 0 { 0.0 } else { 1.0 };
                blas.sgemm(oc, ckk, ohw, 1.0, dz_s, col_t, beta, DevMatMut { data: ViewMut::of(&mut dw), rs: ckk, cs: 1 }).unwrap();
            }
            let what = format!("{g:?} batch {batch}");
            check(&format!("im2col {what}"), &download(&stream, &col), &col_want, 0.0, 0.0);
            check(&format!("conv z {what}"), &download(&stream, &z), &z_want, 0.0, 0.0);
            check(&format!("col2im dx {what}"), &download(&stream, &dx), &dx_want, 0.0, 0.0);
            check(&format!("conv dw {what}"), &download(&stream, &dw), &dw_want, 0.0, 0.0);
        }
    }
}
