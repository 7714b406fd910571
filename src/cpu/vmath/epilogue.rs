//! A dense layer's bias and activation on a tile of its product, run by the GEMM on each column
//! of tiles of C once its sums are done, while it is in L1 (`cpu::gemm::sgemm_bias_act`): the
//! pass over the whole of z that would follow the product otherwise reads it back from L2 or
//! memory. The activations run on pairs of vectors ([`Pair`]): sigmoid's chain of operations
//! is long enough that one vector at a time leaves the core waiting on it.

use super::kernels::{expm1, Gelu, Sigmoid, Silu, Softplus, Tanh, Unary};
#[cfg(target_arch = "x86_64")]
use super::lanes::{Avx2, Avx512};
use super::lanes::{Lanes, Pair};
use super::Isa;
use crate::activation::Activation;
use std::marker::PhantomData;

/// A tile of `rows` × `cols` values: row i of z at `z + i·z_rs`, of y (where given) at
/// `y + i·y_rs`.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    pub rows: usize,
    pub cols: usize,
    pub z: *mut f32,
    pub z_rs: usize,
    pub y: Option<(*mut f32, usize)>,
}

/// For each row i and column j of the tile: z[i, j] += bias[j], then y[i, j] = act(z[i, j]) where
/// the tile has a y, else z[i, j] = act(z[i, j]) in place; each value with the bits of the bias
/// pass (`*z += b`) then [`Activation::apply_slice`], on any instruction set.
///
/// # Safety
/// `bias` holds `cols` readable values; the tile's rows of z (and of y) hold `cols` values each,
/// valid to read and write, which no other thread touches during the call, and z and y do not
/// overlap; `isa` is available.
pub(crate) unsafe fn bias_act_tile(isa: Isa, act: Activation, bias: *const f32, tile: Tile) {
    debug_assert!(isa.available());
    // SAFETY: the contract; the entry points' instruction sets are available.
    unsafe {
        match isa {
            Isa::Portable => by_kind::<Pair<f32>, f32>(act, bias, tile),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2(act, bias, tile),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512(act, bias, tile),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
        }
    }
}

/// # Safety
/// As [`bias_act_tile`], with AVX2 and FMA present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(act: Activation, bias: *const f32, tile: Tile) {
    // SAFETY: the contract.
    unsafe { by_kind::<Pair<Avx2>, Avx2>(act, bias, tile) }
}

/// # Safety
/// As [`bias_act_tile`], with AVX-512F present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(act: Activation, bias: *const f32, tile: Tile) {
    // SAFETY: the contract.
    unsafe { by_kind::<Pair<Avx512>, Avx512>(act, bias, tile) }
}

/// The tile's loops for the activation's kind, over lanes `W` and then `V` (narrower).
///
/// # Safety
/// As [`bias_act_tile`], on lanes the CPU runs.
#[inline(always)]
unsafe fn by_kind<W: Lanes, V: Lanes>(act: Activation, bias: *const f32, tile: Tile) {
    // SAFETY: the contract.
    unsafe {
        match act {
            Activation::Identity => rows::<W, V, Same>(0.0, bias, tile),
            Activation::Relu => rows::<W, V, Relu>(0.0, bias, tile),
            Activation::LeakyRelu(slope) => rows::<W, V, Leaky>(slope, bias, tile),
            Activation::Tanh => rows::<W, V, Of<Tanh>>(0.0, bias, tile),
            Activation::Sigmoid => rows::<W, V, Of<Sigmoid>>(0.0, bias, tile),
            Activation::Gelu => rows::<W, V, Of<Gelu>>(0.0, bias, tile),
            Activation::Silu => rows::<W, V, Of<Silu>>(0.0, bias, tile),
            Activation::Elu(alpha) => rows::<W, V, Elu>(alpha, bias, tile),
            Activation::Softplus => rows::<W, V, Of<Softplus>>(0.0, bias, tile),
        }
    }
}

/// An activation over lanes, with its parameter (0 where it takes none): the per-value rule of
/// [`Activation::apply_slice`].
trait Act {
    fn at<V: Lanes>(z: V, param: f32) -> V;
}

/// The identity.
struct Same;

impl Act for Same {
    #[inline(always)]
    fn at<V: Lanes>(z: V, _: f32) -> V {
        z
    }
}

/// max(z, 0), 0 for NaN (as `f32::max`).
struct Relu;

impl Act for Relu {
    #[inline(always)]
    fn at<V: Lanes>(z: V, _: f32) -> V {
        z.max(V::splat(0.0))
    }
}

/// z for z > 0, else slope·z.
struct Leaky;

impl Act for Leaky {
    #[inline(always)]
    fn at<V: Lanes>(z: V, slope: f32) -> V {
        V::select(V::splat(0.0).lt(z), z, V::splat(slope) * z)
    }
}

/// z for z > 0, else alpha·(e^z − 1).
struct Elu;

impl Act for Elu {
    #[inline(always)]
    fn at<V: Lanes>(z: V, alpha: f32) -> V {
        V::select(V::splat(0.0).lt(z), z, V::splat(alpha) * expm1(z))
    }
}

/// One of the vectorised kernels.
struct Of<K>(PhantomData<K>);

impl<K: Unary> Act for Of<K> {
    #[inline(always)]
    fn at<V: Lanes>(z: V, _: f32) -> V {
        K::at(z)
    }
}

/// [`bias_act_tile`] with `A`, a column of vectors at a time (its bias loaded once, its rows
/// independent): whole `W` vectors, then whole `V` vectors, then the last columns of each row
/// through a zero-padded `V` vector.
///
/// # Safety
/// As [`bias_act_tile`], on lanes the CPU runs; V::LANES is at most 16.
#[inline(always)]
unsafe fn rows<W: Lanes, V: Lanes, A: Act>(param: f32, bias: *const f32, tile: Tile) {
    let mut j = 0;
    // SAFETY: columns j..j + LANES ≤ cols of the tile (the contract).
    unsafe {
        while j + W::LANES <= tile.cols {
            column::<W, A>(param, bias, tile, j);
            j += W::LANES;
        }
        while j + V::LANES <= tile.cols {
            column::<V, A>(param, bias, tile, j);
            j += V::LANES;
        }
    }
    if j == tile.cols {
        return;
    }
    let n = tile.cols - j;
    let (mut buf, mut b) = ([0.0f32; 16], [0.0f32; 16]);
    // SAFETY: columns j..cols of the bias and of each row of z and y (the contract).
    unsafe {
        b[..n].copy_from_slice(std::slice::from_raw_parts(bias.add(j), n));
        for i in 0..tile.rows {
            let z = std::slice::from_raw_parts_mut(tile.z.add(i * tile.z_rs + j), n);
            buf[..n].copy_from_slice(z);
            let v = V::load(&buf) + V::load(&b);
            let out = match tile.y {
                Some((y, rs)) => {
                    v.store(&mut buf);
                    z.copy_from_slice(&buf[..n]);
                    std::slice::from_raw_parts_mut(y.add(i * rs + j), n)
                }
                None => z,
            };
            A::at(v, param).store(&mut buf);
            out.copy_from_slice(&buf[..n]);
        }
    }
}

/// Columns j..j + V::LANES of every row of the tile.
///
/// # Safety
/// As [`bias_act_tile`], on lanes the CPU runs, with those columns inside the tile.
#[inline(always)]
unsafe fn column<V: Lanes, A: Act>(param: f32, bias: *const f32, tile: Tile, j: usize) {
    let Tile { rows, z, z_rs, y, .. } = tile;
    // SAFETY: columns j..j + LANES of the bias, and of row i of z and of y (the contract).
    unsafe {
        let b = V::load(std::slice::from_raw_parts(bias.add(j), V::LANES));
        for i in 0..rows {
            let z = std::slice::from_raw_parts_mut(z.add(i * z_rs + j), V::LANES);
            let v = V::load(z) + b;
            match y {
                Some((y, rs)) => {
                    v.store(z);
                    A::at(v, param).store(std::slice::from_raw_parts_mut(y.add(i * rs + j), V::LANES));
                }
                None => A::at(v, param).store(z),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{Elu, Gelu, Identity, LeakyRelu, Relu, Sigmoid, Silu, Softplus, Tanh};
    use crate::testutil::Rng;

    /// On every instruction set this CPU runs: tiles of 1 to 3 rows and of 1 to 70 columns
    /// (whole pairs of vectors, a whole vector, a tail, or a mix), their rows further apart
    /// than they are wide, give z + b then [`Activation::apply_slice`] bit for bit, into y and
    /// in place; the values between the rows are left as they were (y's poisoned).
    #[test]
    fn tiles_give_the_bias_pass_then_apply_slice_on_every_instruction_set() {
        let acts = [Identity, Relu, LeakyRelu(0.1), Tanh, Sigmoid, Gelu, Silu, Elu(0.7), Softplus];
        let mut rng = Rng::new(4);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()) {
            for act in acts {
                for (rows, cols) in
                    [(1, 1), (3, 7), (2, 8), (3, 15), (1, 16), (2, 17), (3, 31), (2, 32), (3, 33), (2, 48), (1, 64), (3, 70)]
                {
                    let rs = cols + 5;
                    let z: Vec<f32> = rng.uniform(rows * rs).iter().map(|v| 6.0 * v).collect();
                    let bias = rng.uniform(cols);
                    let (mut z_want, mut y_want) = (z.clone(), vec![f32::NAN; rows * rs]);
                    for i in 0..rows {
                        let row = &mut z_want[i * rs..][..cols];
                        row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                        act.apply_slice(row, &mut y_want[i * rs..][..cols]);
                    }
                    let what = format!("{isa:?}, {act:?}, {rows}×{cols}");
                    let (mut got_z, mut got_y) = (z.clone(), vec![f32::NAN; rows * rs]);
                    let tile = Tile { rows, cols, z: got_z.as_mut_ptr(), z_rs: rs, y: Some((got_y.as_mut_ptr(), rs)) };
                    // SAFETY: rows × cols at stride rs inside both vectors; the bias holds cols.
                    unsafe { bias_act_tile(isa, act, bias.as_ptr(), tile) };
                    assert_eq!(bits(&got_z), bits(&z_want), "{what}: z");
                    assert_eq!(bits(&got_y), bits(&y_want), "{what}: y");
                    let mut in_place = z.clone();
                    let tile = Tile { rows, cols, z: in_place.as_mut_ptr(), z_rs: rs, y: None };
                    // SAFETY: as above.
                    unsafe { bias_act_tile(isa, act, bias.as_ptr(), tile) };
                    let want: Vec<f32> = (0..rows * rs).map(|k| if k % rs < cols { y_want[k] } else { z[k] }).collect();
                    assert_eq!(bits(&in_place), bits(&want), "{what}: in place");
                }
            }
        }
    }
}
