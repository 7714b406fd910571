//! Weight operands packed once, in the layout the loop nest reads, for products that reuse
//! them: the owner allocates one at `preallocate` and repacks it only after the weights change.
//!
//! A [`PackedB`] (k×n) is its KC×NC blocks in column-block then row-block order, each block its
//! NR-wide panels (the last zero-padded), each panel kc rows of NR values: what `pack_b` makes
//! of the block in a plain product. A [`PackedA`] (m×k) is its MC×KC blocks likewise, each
//! block the row panels of `row_panels`, as `pack_a` makes them.

use super::pack::{pack_a, pack_b};
use super::{check_extent, tile_shape, Mat, View, KC, MC, NC};
use crate::cpu::isa::Isa;
use crate::error::{zeros, Error, Result};

/// A k×n B operand packed for one kernel.
pub(crate) struct PackedB {
    isa: Isa,
    k: usize,
    n: usize,
    data: Vec<f32>,
}

/// A m×k A operand packed for one kernel.
pub(crate) struct PackedA {
    isa: Isa,
    m: usize,
    k: usize,
    pub(super) data: Vec<f32>,
}

/// Room for `len` packed values, or `Err` (Shape when the count overflows).
fn room(len: Option<usize>, what: &str) -> Result<Vec<f32>> {
    let len = len.ok_or_else(|| Error::Shape(format!("{what}: more values than memory can hold")))?;
    zeros(len, || what.into())
}

impl PackedB {
    /// Room for a k×n B packed for `isa`'s kernel: k·⌈n / NR⌉·NR values; `Err` if this CPU
    /// does not run the kernel or the allocation cannot be had.
    pub fn new(isa: Isa, k: usize, n: usize) -> Result<PackedB> {
        isa.check()?;
        let nr = tile_shape(isa).1;
        let data = room(n.checked_next_multiple_of(nr).and_then(|cols| cols.checked_mul(k)), "packed weights")?;
        Ok(PackedB { isa, k, n, data })
    }

    /// Packs `b` (k×n, any strides) in. Panics if `b` is too short for k×n with its strides.
    pub fn pack(&mut self, b: Mat) {
        let (k, n) = (self.k, self.n);
        check_extent("B", b.data.len(), k, n, b.rs, b.cs).unwrap_or_else(|e| panic!("{e}"));
        let nr = tile_shape(self.isa).1;
        let view = View { ptr: b.data.as_ptr(), rs: b.rs, cs: b.cs };
        let mut offset = 0;
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let len = kc * nc.next_multiple_of(nr);
                // SAFETY: rows pc..pc + kc ≤ k, columns jc..jc + nc ≤ n of B (checked above);
                // the block's slice holds its panels.
                unsafe { pack_b(nr, kc, nc, view.at(pc, jc), &mut self.data[offset..][..len]) };
                offset += len;
            }
        }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn k(&self) -> usize {
        self.k
    }

    pub fn n(&self) -> usize {
        self.n
    }

    /// The raw form the loop nest reads.
    pub(super) fn view(&self) -> BView {
        BView { ptr: self.data.as_ptr(), k: self.k, n: self.n, col0: 0 }
    }
}

impl PackedA {
    /// Room for an m×k A packed for `isa`'s kernel: m·k values; `Err` if this CPU does not run
    /// the kernel or the allocation cannot be had.
    pub fn new(isa: Isa, m: usize, k: usize) -> Result<PackedA> {
        isa.check()?;
        Ok(PackedA { isa, m, k, data: room(m.checked_mul(k), "packed weights")? })
    }

    /// Packs `a` (m×k, any strides) in. Panics if `a` is too short for m×k with its strides.
    pub fn pack(&mut self, a: Mat) {
        check_extent("A", a.data.len(), self.m, self.k, a.rs, a.cs).unwrap_or_else(|e| panic!("{e}"));
        let view = View { ptr: a.data.as_ptr(), rs: a.rs, cs: a.cs };
        let mr = tile_shape(self.isa).0;
        self.each_block(|ic, mc, pc, kc, out| {
            // SAFETY: rows ic..ic + mc ≤ m, columns pc..pc + kc ≤ k of A (checked above); `out`
            // holds the block's mc·kc values.
            unsafe { pack_a(mr, mc, kc, view.at(ic, pc), out) }
        });
    }

    /// Packs the m×k matrix whose element (i, p) is `at(i, p)` in: for layouts no pair of
    /// strides describes (a convolution's weights read for its input gradient).
    pub fn pack_with(&mut self, at: impl Fn(usize, usize) -> f32) {
        let mr = tile_shape(self.isa).0;
        self.each_block(|ic, mc, pc, kc, out| {
            for (i0, h) in super::pack::row_panels(mr, mc) {
                for (p, run) in out[i0 * kc..][..h * kc].chunks_exact_mut(h).enumerate() {
                    run.iter_mut().enumerate().for_each(|(i, v)| *v = at(ic + i0 + i, pc + p));
                }
            }
        });
    }

    /// `f(ic, mc, pc, kc, block)` for each MC×KC block, with the block's packed values.
    fn each_block(&mut self, mut f: impl FnMut(usize, usize, usize, usize, &mut [f32])) {
        let (m, k) = (self.m, self.k);
        let mut offset = 0;
        for ic in (0..m).step_by(MC) {
            let mc = MC.min(m - ic);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                f(ic, mc, pc, kc, &mut self.data[offset..][..mc * kc]);
                offset += mc * kc;
            }
        }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn m(&self) -> usize {
        self.m
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// The raw form the loop nest reads.
    pub(super) fn view(&self) -> AView {
        AView { ptr: self.data.as_ptr(), m: self.m, k: self.k }
    }
}

/// A [`PackedB`] as the loop nest reads it, from column `col0` on (a thread's part).
#[derive(Clone, Copy)]
pub(super) struct BView {
    ptr: *const f32,
    k: usize,
    n: usize,
    pub col0: usize,
}

impl BView {
    /// The same operand from column `col0 + cols` on (a multiple of NR).
    pub fn at_column(self, cols: usize) -> BView {
        BView { col0: self.col0 + cols, ..self }
    }

    /// The first panel of the packed block that holds rows pc.. and column col0 + jc (a
    /// multiple of NR; pc a multiple of KC).
    ///
    /// # Safety
    /// pc < k and col0 + jc < n.
    pub unsafe fn block(self, nr: usize, jc: usize, pc: usize) -> *const f32 {
        let col = self.col0 + jc;
        debug_assert!(col.is_multiple_of(nr) && pc.is_multiple_of(KC) && pc < self.k && col < self.n);
        let (jb, within) = (col / NC, col % NC);
        let block_cols = NC.min(self.n - jb * NC).next_multiple_of(nr);
        let kc = KC.min(self.k - pc);
        // Blocks before: jb full column blocks of k·NC values, then pc rows of this one.
        // SAFETY: inside the packed data (the layout above; the caller's ranges).
        unsafe { self.ptr.add(jb * NC * self.k + pc * block_cols + within / nr * kc * nr) }
    }
}

// SAFETY: a view reads a packed operand borrowed for the whole product, which no one writes
// meanwhile; so for the four impls here.
unsafe impl Send for BView {}
// SAFETY: as above.
unsafe impl Sync for BView {}
// SAFETY: as above.
unsafe impl Send for AView {}
// SAFETY: as above.
unsafe impl Sync for AView {}

/// A [`PackedA`] as the loop nest reads it (never split by rows).
#[derive(Clone, Copy)]
pub(super) struct AView {
    ptr: *const f32,
    m: usize,
    k: usize,
}

impl AView {
    /// The packed block of rows ic.. (a multiple of MC) and columns pc.. (of KC).
    ///
    /// # Safety
    /// ic < m and pc < k.
    pub unsafe fn block(self, ic: usize, pc: usize) -> *const f32 {
        debug_assert!(ic.is_multiple_of(MC) && pc.is_multiple_of(KC) && ic < self.m && pc < self.k);
        let mc = MC.min(self.m - ic);
        // SAFETY: inside the packed data: ic/MC full row blocks of MC·k, then pc columns of mc.
        unsafe { self.ptr.add(ic * self.k + pc * mc) }
    }
}
