//! A thread's floating-point mode: on x86-64 the control bits of MXCSR (flush-to-zero,
//! denormals-are-zero, rounding, exception masks; not its sticky status flags), elsewhere
//! nothing. The pool's workers take on the mode of the thread that opens each run, which is the
//! default one unless the program changed its own: flatnn itself never changes it. Subnormal
//! values (below 2⁻¹²⁶ ≈ 1.2e-38) cost a microcode assist per operation on Intel cores: a
//! training step of a model that fits its batch, whose gradients shrink to them, ran 4.7–10×
//! slower there in the default mode than with flush-to-zero and denormals-are-zero set.

/// MXCSR's control bits: denormals-are-zero (6), the exception masks (7–12), rounding
/// (13–14), flush-to-zero (15).
#[cfg(target_arch = "x86_64")]
const CONTROL: u32 = 0xffc0;

/// The whole MXCSR.
#[cfg(target_arch = "x86_64")]
fn mxcsr() -> u32 {
    let mut csr = 0u32;
    // SAFETY: stmxcsr writes the 32-bit MXCSR to the address given, a local of ours.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags)) };
    csr
}

/// The calling thread's mode.
pub fn current() -> u32 {
    #[cfg(target_arch = "x86_64")]
    return mxcsr() & CONTROL;
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Makes `mode` (a value of [`current`]) the calling thread's, its status flags kept.
pub fn set(mode: u32) {
    #[cfg(target_arch = "x86_64")]
    {
        let csr = (mxcsr() & !CONTROL) | (mode & CONTROL);
        // SAFETY: ldmxcsr reads 32 bits from the address given, a local of ours; the
        // value is MXCSR's own with control bits that a thread of this process had (no
        // reserved bit set).
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags, readonly)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = mode;
}
