//! Dense: z = W·x + b per sample, W (out_features, in_features) row-major, then b (out_features),
//! the layout of PyTorch's `nn.Linear`. The activation is applied by the shared pass in
//! `layers/mod.rs`; the fast path here computes the matrix products.
//!
//! Batched, with X (batch, in) and Z (batch, out) row-major:
//!   forward  Z  = X·Wᵀ + b
//!   backward dW = dZᵀ·X (out, in),  db = Σ_batch dZ,  dX = dZ·W (batch, in)

use crate::cpu::gemm::{sgemm, GemmWorkspace, Mat, MatMut};
use crate::cpu::pool::Pool;
#[cfg(test)]
use crate::float::Float;

#[cfg(test)]
/// Plain-loop forward (the spec): z[s,o] = b[o] + Σ_i w[o,i]·x[s,i].
pub fn forward_spec<F: Float>(batch: usize, in_f: usize, out_f: usize, w: &[F], b: &[F], x: &[F], z: &mut [F]) {
    for s in 0..batch {
        for o in 0..out_f {
            let mut acc = b[o];
            for i in 0..in_f {
                acc += w[o * in_f + i] * x[s * in_f + i];
            }
            z[s * out_f + o] = acc;
        }
    }
}

#[cfg(test)]
/// Plain-loop backward (the spec): dW, db overwritten; dX overwritten when given.
#[allow(clippy::too_many_arguments)]
pub fn backward_spec<F: Float>(
    batch: usize,
    in_f: usize,
    out_f: usize,
    w: &[F],
    x: &[F],
    dz: &[F],
    dw: &mut [F],
    db: &mut [F],
    dx: Option<&mut [F]>,
) {
    for o in 0..out_f {
        let mut acc_b = F::ZERO;
        for s in 0..batch {
            acc_b += dz[s * out_f + o];
        }
        db[o] = acc_b;
        for i in 0..in_f {
            let mut acc = F::ZERO;
            for s in 0..batch {
                acc += dz[s * out_f + o] * x[s * in_f + i];
            }
            dw[o * in_f + i] = acc;
        }
    }
    if let Some(dx) = dx {
        for s in 0..batch {
            for i in 0..in_f {
                let mut acc = F::ZERO;
                for o in 0..out_f {
                    acc += dz[s * out_f + o] * w[o * in_f + i];
                }
                dx[s * in_f + i] = acc;
            }
        }
    }
}

/// Fast forward without the bias: Z (batch, out) ← X·Wᵀ.
#[allow(clippy::too_many_arguments)]
pub fn forward(pool: &Pool, ws: &mut GemmWorkspace, batch: usize, in_f: usize, out_f: usize, w: &[f32], x: &[f32], z: &mut [f32]) {
    let a = Mat { data: x, rs: in_f, cs: 1 };
    let b = Mat { data: w, rs: 1, cs: in_f };
    sgemm(pool, ws, batch, out_f, in_f, 1.0, a, b, 0.0, MatMut { data: z, rs: out_f, cs: 1 });
}

/// Fast backward without the bias: dW ← dZᵀ·X; dX ← dZ·W when given.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    pool: &Pool,
    ws: &mut GemmWorkspace,
    batch: usize,
    in_f: usize,
    out_f: usize,
    w: &[f32],
    x: &[f32],
    dz: &[f32],
    dw: &mut [f32],
    dx: Option<&mut [f32]>,
) {
    let dz_t = Mat { data: dz, rs: 1, cs: out_f };
    sgemm(pool, ws, out_f, in_f, batch, 1.0, dz_t, Mat { data: x, rs: in_f, cs: 1 }, 0.0, MatMut { data: dw, rs: in_f, cs: 1 });
    if let Some(dx) = dx {
        let dz = Mat { data: dz, rs: out_f, cs: 1 };
        sgemm(pool, ws, batch, in_f, out_f, 1.0, dz, Mat { data: w, rs: in_f, cs: 1 }, 0.0, MatMut { data: dx, rs: in_f, cs: 1 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, poisoned, Rng};

    #[test]
    fn fast_matches_spec_on_odd_shapes() {
        let mut rng = Rng::new(7);
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap();
            let mut ws = GemmWorkspace::new(threads).unwrap();
            for (batch, in_f, out_f) in [(1, 1, 1), (3, 5, 7), (17, 33, 9), (64, 130, 65), (2, 784, 10)] {
                let w = rng.ints(out_f * in_f);
                let b = vec![0.0; out_f];
                let x = rng.ints(batch * in_f);
                let dz = rng.ints(batch * out_f);
                let mut z_spec = vec![0.0; batch * out_f];
                forward_spec(batch, in_f, out_f, &w, &b, &x, &mut z_spec);
                let mut z = poisoned(batch * out_f);
                forward(&pool, &mut ws, batch, in_f, out_f, &w, &x, &mut z);
                assert_eq!(z, z_spec, "forward {batch}×{in_f}×{out_f}");

                let (mut dw_s, mut db_s, mut dx_s) = (vec![0.0; out_f * in_f], vec![0.0; out_f], vec![0.0; batch * in_f]);
                backward_spec(batch, in_f, out_f, &w, &x, &dz, &mut dw_s, &mut db_s, Some(&mut dx_s));
                let (mut dw, mut dx) = (poisoned(out_f * in_f), poisoned(batch * in_f));
                backward(&pool, &mut ws, batch, in_f, out_f, &w, &x, &dz, &mut dw, Some(&mut dx));
                assert_close(&dw, &dw_s, 0.0, 0.0, "dW");
                assert_close(&dx, &dx_s, 0.0, 0.0, "dX");
            }
        }
    }
}
