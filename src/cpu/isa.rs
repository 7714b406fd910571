//! The instruction sets the CPU kernels are written for, and the one this process uses.
//!
//! Each kernel has a portable version and versions for AVX2 + FMA and for AVX-512; the best
//! one this CPU runs is chosen once per process. `FLATNN_ISA=avx512|avx2|portable` caps it
//! (to compare them on one machine, or to have a run's bits match a machine with less): the
//! GEMM's AVX2 and AVX-512 kernels give the same bits (same k-blocking, each sum a chain of
//! FMAs in k order), the portable ones (no FMA) may differ in the last bits.

use crate::error::{Error, Result};
use std::sync::OnceLock;

/// An instruction set the kernels have a version for, from least to most capable.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Isa {
    Portable,
    /// AVX2 and FMA (x86-64).
    Avx2,
    /// AVX-512F, with AVX2 and FMA (x86-64).
    Avx512,
}

impl Isa {
    /// The most capable set this CPU runs, capped by `FLATNN_ISA` (read once; a value that is
    /// not a set's name prints one warning and is ignored).
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let detected = Isa::detected();
            match std::env::var("FLATNN_ISA") {
                Err(_) => detected,
                Ok(text) => match Isa::from_name(&text) {
                    Some(cap) => cap.min(detected),
                    None => {
                        eprintln!("flatnn: FLATNN_ISA={text:?} is none of avx512, avx2, portable; using {}", detected.name());
                        detected
                    }
                },
            }
        })
    }

    /// Every set this CPU runs, least capable first (tests run each kernel on all of them).
    #[cfg(test)]
    pub fn runnable() -> Vec<Isa> {
        let top = Isa::detected();
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|&isa| isa <= top).collect()
    }

    /// Ok when this CPU runs the set (kernels for it may be called), else `Error::Config`.
    pub fn check(self) -> Result<()> {
        if self <= Isa::detected() {
            Ok(())
        } else {
            Err(Error::Config(format!("{} kernels asked for on a CPU that has only {}", self.name(), Isa::detected().name())))
        }
    }

    /// The set's name, as `FLATNN_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    fn from_name(name: &str) -> Option<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().find(|isa| isa.name() == name.trim().to_ascii_lowercase())
    }

    /// What the CPU has, ignoring `FLATNN_ISA`.
    fn detected() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            if avx2 && is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_cap_never_exceeds_the_cpu() {
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name(" AVX2\n"), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("sse"), None);
        assert!(Isa::best() <= Isa::detected());
        assert_eq!(Isa::runnable().last(), Some(&Isa::detected()));
        assert!(Isa::runnable().iter().all(|isa| isa.check().is_ok()));
        if Isa::detected() < Isa::Avx512 {
            assert!(matches!(Isa::Avx512.check(), Err(Error::Config(_))));
        }
    }
}
