//! Products that end in a dense layer's bias and activation: each column of tiles of C (a
//! block's rows, a B panel's columns), once its last block of k is summed, goes through the
//! epilogue while it is in L1 (`vmath::epilogue`), instead of a pass of its own over the whole
//! of C after the product, which reads it back from L2 or memory.

use super::nest::{AOp, BOp};
use super::{check_c, check_extent, GemmWorkspace, Mat, MatMut, PackedB, Product, View, ViewMut};
use crate::activation::Activation;
use crate::cpu::pool::Pool;
use crate::cpu::vmath::{self, epilogue::Tile};

/// What follows the product on each element (i, j) of C: c = c + bias[j], then y = act(c) into
/// `y` (C's shape and strides) where given, else c = act(c) in place.
pub(crate) struct BiasAct<'a> {
    pub bias: &'a [f32],
    pub act: Activation,
    pub y: Option<&'a mut [f32]>,
}

/// The B (k×n) of a product with an epilogue: packed once, or strided, packed as the product
/// goes (with the bits of the packed one).
#[derive(Clone, Copy)]
pub(crate) enum Weights<'a> {
    Packed(&'a PackedB),
    Plain { b: Mat<'a>, k: usize, n: usize },
}

/// C (m×n) ← A (m×k)·B (k×n), then each element through `post` ([`BiasAct`]), split over the
/// pool's threads through the blocked nest (never transposed): each element of C and y has the
/// bits of [`super::sgemm_packed_b`] (or [`super::sgemm_blocked`]) with α = 1, β = 0, then the
/// bias added and the activation applied by `Activation::apply_slice`. C need not be
/// initialised, nor y. Panics, before writing anything, if an operand is too short for its
/// shape and strides, C's elements overlap or are not contiguous along its rows, the bias
/// holds fewer than n values, or a packed B was packed for another kernel than `ws`'s.
pub(crate) fn sgemm_bias_act(pool: &Pool, ws: &mut GemmWorkspace, m: usize, a: Mat, b: Weights, c: MatMut, post: BiasAct) {
    let (k, n, bop) = match b {
        Weights::Packed(b) => {
            assert_eq!(b.isa(), ws.isa(), "B packed for another kernel than the workspace's");
            (b.k(), b.n(), BOp::Packed(b.view()))
        }
        Weights::Plain { b, k, n } => {
            check_extent("B", b.data.len(), k, n, b.rs, b.cs).unwrap_or_else(|e| panic!("{e}"));
            (k, n, BOp::View(View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs }))
        }
    };
    check_extent("A", a.data.len(), m, k, a.rs, a.cs).and_then(|_| check_c(m, n, &c)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.cs, 1, "gemm: an epilogue needs C's rows contiguous");
    assert!(post.bias.len() >= n, "gemm: a bias of {} values for {n} columns", post.bias.len());
    let y = post.y.map(|y| {
        check_extent("Y", y.len(), m, n, c.rs, c.cs).unwrap_or_else(|e| panic!("{e}"));
        ViewMut { ptr: y.as_mut_ptr(), rs: c.rs, cs: c.cs }
    });
    let post = Post { bias: post.bias.as_ptr(), act: post.act, y, isa: vmath::Isa::best() };
    let a = AOp::View(View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs });
    let p = Product { post: Some(post), ..Product::packed(ws.isa(), m, n, k, 1.0, a, bop, 0.0, c.out()) };
    // SAFETY: checked above (a packed B by its construction); C and y are borrowed exclusively
    // for this call and apart (two `&mut`); the workspace's kernel was one this CPU runs.
    unsafe { p.run_on(pool, ws) }
}

/// [`BiasAct`] as the loop nest reads it, from some element (i, j) of C on: the bias from
/// column j, y from (i, j).
#[derive(Clone, Copy)]
pub(super) struct Post {
    bias: *const f32,
    act: Activation,
    y: Option<ViewMut>,
    isa: vmath::Isa,
}

// SAFETY: the bias is borrowed for the whole product and only read; y, like C, is borrowed
// exclusively and each task writes only its own elements of it (those of its elements of C).
unsafe impl Send for Post {}
// SAFETY: as above.
unsafe impl Sync for Post {}

impl Post {
    /// The same from element (i, j) on.
    ///
    /// # Safety
    /// (i, j) lies inside the checked extent of C.
    pub(super) unsafe fn at(self, i: usize, j: usize) -> Post {
        // SAFETY: column j < n of the bias; (i, j) of y, whose extent is C's.
        unsafe { Post { bias: self.bias.add(j), y: self.y.map(|y| y.at(i, j)), ..self } }
    }

    /// Through the epilogue: `rows` × `cols` of C from `c`, this post's element.
    ///
    /// # Safety
    /// The tile lies inside C (C's rows contiguous: cs = 1), and no other thread touches it or its
    /// elements of y during the call.
    pub(super) unsafe fn apply(self, rows: usize, cols: usize, c: ViewMut) {
        debug_assert!(c.cs == 1);
        let tile = Tile { rows, cols, z: c.ptr, z_rs: c.rs, y: self.y.map(|y| (y.ptr, y.rs)) };
        // SAFETY: the contract: the bias holds the tile's columns, y the tile's elements.
        unsafe { vmath::epilogue::bias_act_tile(self.isa, self.act, self.bias, tile) }
    }
}
