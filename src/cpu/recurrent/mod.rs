//! The recurrent layers' time loops over one sample (the fast CPU path of `layers::recurrent`),
//! written once over [`Lanes`](crate::cpu::vmath::lanes::Lanes) and compiled for AVX-512, for
//! AVX2+FMA and portably, chosen at run time as the activations' kernels are. Every product is
//! summed in an order fixed by the layer's sizes alone (fused multiply-adds) and the gates use
//! `vmath`'s gate kernels (`gate_sigmoid`, `gate_tanh`: within 2.45 and 1.55 ulp, in fewer
//! operations than the activation layers' kernels), so the three give the same bits; and one step of a batch of sequences is
//! exactly one step of a stream (a stream's model runs this same code one step at a time), which
//! the tests check.
//!
//! A GRU or LSTM step of one sample runs a vector of hidden units at a time (two panels of 16
//! units at once with AVX-512), reading the packed weights (`layers::recurrent`): for each gate the
//! recurrent product of those units, two chains of fused multiply-adds (h_{t−1}[j]·W_hhᵀ[j, ·] for
//! the even j from b_hh, for the odd j from 0, then added: half the chain a small layer waits on),
//! then the gates in registers, where the products are. An LSTM step of four samples or more
//! computes one gate's vector of units for all of them at once (each weight vector loaded once for
//! them), leaves the pre-activations in the kept gates, then computes the gates: the same sums in
//! the same order, so the same bits. The backward pass likewise takes several samples at once
//! through its product with W_hh.
//!
//! GRU (PyTorch's formula, the reset gate on the recurrent product and its bias):
//!   r = σ(x_r + a_r), z = σ(x_z + a_z), n = tanh(r·a_n + x_n), h_t = n + z·(h_{t−1} − n)
//! LSTM:
//!   i = σ(x_i + a_i), f = σ(x_f + a_f), g = tanh(x_g + a_g), o = σ(x_o + a_o),
//!   c_t = f·c_{t−1} + i·g (one rounding for the sum, fused), h_t = o·tanh(c_t)
//! with x = W_ih·x_t + b_ih (the step's input products) and a = W_hh·h_{t−1} + b_hh.
//!
//! One sample's inference on several threads ([`forward_split`]) splits each step's units among
//! them, two panels a part, every part the same values as the whole step gives those units.
//!
//! The files: `sequence` (a group's forward pass: the input products and the loop over steps; a
//! split step's parts),
//! `cells` (one step of a GRU or an LSTM: the recurrent product and the gates), `backprop` (the
//! backward pass through time: the gate gradients and the product with W_hh), `pack` (the
//! weights' panels), and here the entry points compiled for each instruction set.

#![deny(clippy::undocumented_unsafe_blocks)]

mod backprop;
mod cells;
mod pack;
mod sequence;
#[cfg(test)]
mod tests;

use super::pool::Pool;
#[cfg(target_arch = "x86_64")]
use super::vmath::lanes::{Avx2, Avx512};
use super::vmath::Isa;
use super::SharedMut;
use crate::layers::recurrent::{Cell, Dims, Weights, LANES};
use backprop::backward;
pub(crate) use pack::{pack_panels, transpose};
pub(crate) use sequence::split_threads;
use sequence::{forward, outputs, split_part, split_parts, SharedSample};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};

/// One sample's part of a recurrent step's regions (see `layers::recurrent`): `x` (T × F) is
/// read, the rest written (`state`'s initial values read first).
pub(crate) struct Sample<'a> {
    pub x: &'a [f32],
    pub out: &'a mut [f32],
    pub gates: &'a mut [f32],
    pub hprev: &'a mut [f32],
    pub state: &'a mut [f32],
    /// Empty for a GRU.
    pub cprev: &'a mut [f32],
}

impl Sample<'_> {
    /// A sample of no values, which fills a group's unused places.
    pub fn none() -> Self {
        Sample { x: &[], out: &mut [], gates: &mut [], hprev: &mut [], state: &mut [], cprev: &mut [] }
    }
}

/// One sample's values for the backward pass: what the forward pass kept, the gradient of the
/// output, and the kept regions' twins in the gradient buffer, written.
pub(crate) struct BackSample<'a> {
    pub gates: &'a [f32],
    pub hprev: &'a [f32],
    pub state: &'a [f32],
    pub cprev: &'a [f32],
    pub dy: &'a [f32],
    pub dgates: &'a mut [f32],
    pub dhprev: &'a mut [f32],
    pub dstate: &'a mut [f32],
    pub dcprev: &'a mut [f32],
}

impl BackSample<'_> {
    /// A sample of no values, which fills a group's unused places.
    pub fn none() -> Self {
        BackSample {
            gates: &[],
            hprev: &[],
            state: &[],
            cprev: &[],
            dy: &[],
            dgates: &mut [],
            dhprev: &mut [],
            dstate: &mut [],
            dcprev: &mut [],
        }
    }
}

/// Most samples [`forward_group`] and [`backward_group`] take: a multiple of the 8 an LSTM step
/// takes at once with AVX-512 (and of a GRU's 4), so that a batch of 16 or more leaves no
/// smaller tile.
pub(crate) const GROUP: usize = 16;

/// The forward pass over a group of up to [`GROUP`] samples (independent sequences), with the
/// weights in the packed layout: the outputs (and, with `keep`, every step's gates) and the final
/// states. A step takes several samples at once where the registers allow (with AVX-512, four of
/// a GRU's, three of an LSTM's), each weight vector loaded once for all of them; each sample's
/// values are summed in the same order whatever the group.
pub(crate) fn forward_group(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    // SAFETY: `Isa::best` is an instruction set this CPU has.
    unsafe { forward_group_on(Isa::best(), d, w, group, keep) }
}

/// [`forward_group`] on the kernels of `isa`.
///
/// # Safety
/// This CPU has `isa` ([`Isa::available`]).
pub(super) unsafe fn forward_group_on(isa: Isa, d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
    debug_assert!(group.len() <= GROUP && isa.available());
    match isa {
        Isa::Portable => portable::forward(d, w, group, keep),
        // SAFETY: this CPU has the instruction set (the caller's contract).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::forward(d, w, group, keep) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::forward(d, w, group, keep) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// The inference forward pass of one sample with each step's units split among
/// [`split_threads`] of the pool's threads, in [`split_parts`] parts a step (a part: two panels
/// of the packed weights): the outputs and final states [`forward_group`] gives it, bit for bit
/// (each unit's values are computed as the whole step computes them), and the gates not kept.
/// The input products of every step come first, on the calling thread; then each thread takes
/// the next part of the steps in order and, before it runs a part of step t, waits until every
/// part of step t − 1 is done. A thread that never comes costs nothing: the calling thread then
/// takes every part itself.
pub(crate) fn forward_split(d: &Dims, w: &Weights, s: &mut Sample, pool: &Pool) {
    let isa = Isa::best();
    // SAFETY: `Isa::best` is an instruction set this CPU has.
    unsafe { inputs_on(isa, d, w, s) };
    let shared = SharedSample {
        gates: SharedMut::new(&mut *s.gates),
        hprev: SharedMut::new(&mut *s.hprev),
        state: SharedMut::new(&mut *s.state),
        cprev: SharedMut::new(&mut *s.cprev),
    };
    let parts = split_parts(d);
    let total = d.steps * parts;
    let (next, done, failed) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicBool::new(false));
    pool.run(split_threads(d, pool.threads()), &|_, _| {
        let _unwinding = Unwinding(&failed);
        loop {
            let claim = next.fetch_add(1, Relaxed);
            if claim >= total {
                return;
            }
            let (t, part) = (claim / parts, claim % parts);
            let mut spins = 0u32;
            // every part of step t − 1 done (parts are taken in order, and a part of step t
            // starts only once t·parts are done: those are the parts before it)
            while done.load(Acquire) < t * parts {
                if failed.load(Relaxed) {
                    return;
                }
                spins += 1;
                if spins.is_multiple_of(1 << 12) {
                    std::thread::yield_now();
                }
                std::hint::spin_loop();
            }
            // SAFETY: step t − 1 is done (above), no part of step t + 1 starts before this one
            // is done (the same wait), and this thread alone took (t, part); `isa` is this CPU's.
            unsafe { part_on(isa, d, w, &shared, t, part) };
            done.fetch_add(1, Release);
        }
    });
    outputs::<f32>(d, s);
}

/// Marks a split pass failed when a thread unwinds out of a part, so that the others stop waiting
/// for a step that will not be done (the pool then raises the panic in the caller).
struct Unwinding<'a>(&'a AtomicBool);

impl Drop for Unwinding<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Relaxed);
        }
    }
}

/// [`sequence::inputs`] on the kernels of `isa`.
///
/// # Safety
/// This CPU has `isa` ([`Isa::available`]).
unsafe fn inputs_on(isa: Isa, d: &Dims, w: &Weights, s: &mut Sample) {
    match isa {
        Isa::Portable => sequence::inputs::<f32, 16>(d, w, s),
        // SAFETY: this CPU has the instruction set (the caller's contract).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::inputs(d, w, s) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::inputs(d, w, s) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

/// [`split_part`] on the kernels of `isa`.
///
/// # Safety
/// This CPU has `isa`, and [`split_part`]'s contract holds.
unsafe fn part_on(isa: Isa, d: &Dims, w: &Weights, s: &SharedSample, t: usize, part: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        match (isa, d.cell) {
            (Isa::Portable, Cell::Lstm) => split_part::<f32, 16, true>(d, w, s, t, part),
            (Isa::Portable, Cell::Gru) => split_part::<f32, 16, false>(d, w, s, t, part),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, _) => avx2::part(d, w, s, t, part),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, _) => avx512::part(d, w, s, t, part),
            #[cfg(not(target_arch = "x86_64"))]
            (Isa::Avx2 | Isa::Avx512, _) => unreachable!("available only on x86_64"),
        }
    }
}

/// The backward pass through a group of up to [`GROUP`] samples' steps, from the last to the
/// first: every step's gate gradients, and ∂L/∂h_{t−1} (∂L/∂c_{t−1}) for each. `rows`: W_hh with
/// rows padded (G·H × padded). Each sample's values are summed in the same order whatever the
/// group.
pub(crate) fn backward_group(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
    // SAFETY: `Isa::best` is an instruction set this CPU has.
    unsafe { backward_group_on(Isa::best(), d, rows, group) }
}

/// [`backward_group`] on the kernels of `isa`.
///
/// # Safety
/// This CPU has `isa` ([`Isa::available`]).
pub(super) unsafe fn backward_group_on(isa: Isa, d: &Dims, rows: &[f32], group: &mut [BackSample]) {
    debug_assert!(group.len() <= GROUP && isa.available());
    match isa {
        Isa::Portable => backward::<f32, 16>(d, rows, group),
        // SAFETY: this CPU has the instruction set (the caller's contract).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::backward(d, rows, group) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::backward(d, rows, group) },
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Avx2 | Isa::Avx512 => unreachable!("available only on x86_64"),
    }
}

// Everything in `sequence`, `cells` and `backprop` is `#[inline(always)]` down to the lanes'
// intrinsics and uses no closures, so that it is compiled inside the `#[target_feature]` entry
// points below (see `vmath`).

/// Units a panel of the packed weights holds.
const PANEL: usize = LANES;

/// The loops compiled for one instruction set.
macro_rules! instantiate {
    ($name:ident, $lanes:ty, $vpp:literal, $features:literal) => {
        mod $name {
            use super::*;

            #[target_feature(enable = $features)]
            pub(super) fn forward(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                if d.cell == Cell::Lstm {
                    lstm(d, w, group, keep)
                } else {
                    gru(d, w, group, keep)
                }
            }

            // (each cell's loops a function of their own, so that the LSTM's tiles do not shape
            // the code of the GRU's loops, which was slower when compiled beside them)
            #[target_feature(enable = $features)]
            #[inline(never)]
            fn lstm(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                super::forward::<$lanes, $vpp, true>(d, w, group, keep)
            }

            #[target_feature(enable = $features)]
            #[inline(never)]
            fn gru(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
                super::forward::<$lanes, $vpp, false>(d, w, group, keep)
            }

            #[target_feature(enable = $features)]
            pub(super) fn backward(d: &Dims, rows: &[f32], group: &mut [BackSample]) {
                super::backward::<$lanes, $vpp>(d, rows, group)
            }

            #[target_feature(enable = $features)]
            pub(super) fn inputs(d: &Dims, w: &Weights, s: &mut Sample) {
                super::sequence::inputs::<$lanes, $vpp>(d, w, s)
            }

            /// # Safety
            /// [`split_part`]'s contract.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn part(d: &Dims, w: &Weights, s: &SharedSample, t: usize, part: usize) {
                // SAFETY: the caller's contract.
                unsafe {
                    if d.cell == Cell::Lstm {
                        lstm_part(d, w, s, t, part)
                    } else {
                        gru_part(d, w, s, t, part)
                    }
                }
            }

            /// # Safety
            /// [`split_part`]'s contract.
            #[target_feature(enable = $features)]
            #[inline(never)]
            unsafe fn lstm_part(d: &Dims, w: &Weights, s: &SharedSample, t: usize, part: usize) {
                // SAFETY: the caller's contract.
                unsafe { super::split_part::<$lanes, $vpp, true>(d, w, s, t, part) }
            }

            /// # Safety
            /// [`split_part`]'s contract.
            #[target_feature(enable = $features)]
            #[inline(never)]
            unsafe fn gru_part(d: &Dims, w: &Weights, s: &SharedSample, t: usize, part: usize) {
                // SAFETY: the caller's contract.
                unsafe { super::split_part::<$lanes, $vpp, false>(d, w, s, t, part) }
            }
        }
    };
}

/// The loops compiled portably.
mod portable {
    use super::*;

    pub(super) fn forward(d: &Dims, w: &Weights, group: &mut [Sample], keep: bool) {
        if d.cell == Cell::Lstm {
            super::forward::<f32, 16, true>(d, w, group, keep)
        } else {
            super::forward::<f32, 16, false>(d, w, group, keep)
        }
    }
}

#[cfg(target_arch = "x86_64")]
instantiate!(avx2, Avx2, 2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
instantiate!(avx512, Avx512, 1, "avx512f");
