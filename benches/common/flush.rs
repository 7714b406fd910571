//! Flush-to-zero and denormals-are-zero on the calling thread, for the tools that measure with
//! them (`step_time --flush-subnormals on`, the zoo's `--flush-subnormals`): a program that
//! wants them sets them on its own thread, and flatnn's pool threads take the caller's
//! floating-point mode at each run.

/// Sets flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) on this thread; x86-64 only.
pub fn flush_subnormals() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr = 0u32;
        // SAFETY: stmxcsr and ldmxcsr read and write MXCSR through a local; the value set is
        // MXCSR's own with two control bits added.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
            csr |= 0x8040;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags, readonly));
        }
        Ok(())
    }
    #[cfg(not(target_arch = "x86_64"))]
    Err("flush-to-zero: x86-64 only".into())
}
