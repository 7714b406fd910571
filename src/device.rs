//! Where a model runs: [`Device::Cpu`] or [`Device::Cuda`]`(n)`, and the choice a program
//! makes when it does not care ([`device`]).
//!
//! As in Flux, asking for the GPU never fails where a fallback is meant ([`device`], [`gpu`]),
//! and asking for one particular GPU ([`Device::cuda`]) is an error that names what is missing.

use crate::error::{Error, Result};
use std::fmt;

/// A place a model's buffers live and its steps run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host, with the engine's own thread pool.
    Cpu,
    /// CUDA device `n` (as numbered after `CUDA_VISIBLE_DEVICES`).
    Cuda(usize),
}

impl Device {
    /// CUDA device `ordinal`, checked to be usable now: the driver, NVRTC and cuBLAS load, the
    /// device exists, and flatnn's kernels compile for it. Otherwise an [`Error::Cuda`] that
    /// says what is missing.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        usable(ordinal)?;
        Ok(Device::Cuda(ordinal))
    }

    /// True for a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// The device's name as its driver reports it ("cpu" for the CPU).
    pub fn name(self) -> Result<String> {
        match self {
            Device::Cpu => Ok("cpu".into()),
            Device::Cuda(ordinal) => cuda_info(ordinal).map(|(name, ..)| name),
        }
    }

    /// (free, total) bytes of the device's memory; an error for the CPU.
    pub fn memory(self) -> Result<(usize, usize)> {
        match self {
            Device::Cpu => Err(Error::Config("the CPU's memory is not tracked by flatnn".into())),
            Device::Cuda(ordinal) => cuda_info(ordinal).map(|(_, free, total, _)| (free, total)),
        }
    }

    /// A CUDA device's compute capability, (major, minor): (9, 0) for an H100 or H200. Some
    /// routes need a capability (clusters of blocks and programmatic launches sm_90); an error
    /// for the CPU.
    pub fn compute_capability(self) -> Result<(u32, u32)> {
        match self {
            Device::Cpu => Err(Error::Config("the CPU has no compute capability".into())),
            Device::Cuda(ordinal) => cuda_info(ordinal).map(|(.., cc)| cc),
        }
    }

    /// Parses `cpu`, `cuda`, `cuda:N` or `auto` (= [`device`]); a CUDA device is checked as by
    /// [`Device::cuda`].
    pub fn parse(text: &str) -> Result<Device> {
        match text.trim() {
            "cpu" => Ok(Device::Cpu),
            "auto" => Ok(device()),
            "cuda" | "gpu" => Device::cuda(0),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Device::cuda(n),
                _ => Err(Error::Config(format!("unknown device {other:?}: expected cpu, cuda, cuda:N or auto"))),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device a program should use when it has no preference: `FLATNN_DEVICE`
/// (`cpu`, `cuda`, `cuda:N`) if set, else CUDA device 0 when it works here, else the CPU.
/// Never fails: a `FLATNN_DEVICE` that cannot be had prints one warning and gives the CPU.
pub fn device() -> Device {
    match std::env::var("FLATNN_DEVICE") {
        Ok(text) if text.trim() != "auto" => Device::parse(&text).unwrap_or_else(|e| {
            eprintln!("flatnn: FLATNN_DEVICE={text}: {e}; using the CPU");
            Device::Cpu
        }),
        _ if cuda_functional() => Device::Cuda(0),
        _ => Device::Cpu,
    }
}

/// CUDA device 0 if it works here, else the CPU after one warning per process (Flux's `gpu`).
pub fn gpu_or_cpu() -> Device {
    match Device::cuda(0) {
        Ok(device) => device,
        Err(e) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| eprintln!("flatnn: no usable GPU ({e}); running on the CPU"));
            Device::Cpu
        }
    }
}

/// Moves `x` to the GPU ([`gpu_or_cpu`]): falls back to the CPU, with one warning, where no GPU
/// works. Fails only if the GPU works but the copy does (out of device memory, say).
pub fn gpu<T: ToDevice>(x: T) -> Result<T> {
    x.to_device(&gpu_or_cpu())
}

/// Moves `x` to the CPU.
pub fn cpu<T: ToDevice>(x: T) -> Result<T> {
    x.to_device(&Device::Cpu)
}

/// Something that can be moved to a device: a model, an optimiser, a cache, or a collection or
/// struct of them. Moving copies the state (parameters, optimiser moments) and reallocates the
/// buffers that hold no state across steps (a cache's activations) on the target device.
///
/// For a struct of your own, [`to_device!`](crate::to_device) writes the impl.
pub trait ToDevice: Sized {
    /// `self` on `device` (the same value when it is there already).
    fn to_device(self, device: &Device) -> Result<Self>;
}

impl<T: ToDevice> ToDevice for Option<T> {
    fn to_device(self, device: &Device) -> Result<Self> {
        self.map(|x| x.to_device(device)).transpose()
    }
}

impl<T: ToDevice> ToDevice for Vec<T> {
    fn to_device(self, device: &Device) -> Result<Self> {
        self.into_iter().map(|x| x.to_device(device)).collect()
    }
}

macro_rules! tuple_to_device {
    ($($name:ident),+) => {
        impl<$($name: ToDevice),+> ToDevice for ($($name,)+) {
            #[allow(non_snake_case)]
            fn to_device(self, device: &Device) -> Result<Self> {
                let ($($name,)+) = self;
                Ok(($($name.to_device(device)?,)+))
            }
        }
    };
}
tuple_to_device!(A);
tuple_to_device!(A, B);
tuple_to_device!(A, B, C);
tuple_to_device!(A, B, C, D);
tuple_to_device!(A, B, C, D, E);

/// Implements [`ToDevice`] for a struct by moving each named field (the others are kept):
///
/// ```
/// use flatnn::prelude::*;
/// struct Trainer { model: Model, opt: Optimizer, epochs: usize }
/// flatnn::to_device!(Trainer { model, opt });
/// # let model = Chain::new(Input::vector(2)).dense(1, Identity).build()?;
/// # let opt = Optimizer::new(&model, Optim::adam(1e-3))?;
/// let trainer = Trainer { model, opt, epochs: 3 }.to_device(&Device::Cpu)?;
/// # Ok::<(), flatnn::Error>(())
/// ```
#[macro_export]
macro_rules! to_device {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        impl $crate::ToDevice for $ty {
            fn to_device(mut self, device: &$crate::Device) -> $crate::Result<Self> {
                $(self.$field = $crate::ToDevice::to_device(self.$field, device)?;)*
                Ok(self)
            }
        }
    };
}

#[cfg(feature = "cuda")]
fn usable(ordinal: usize) -> Result<()> {
    crate::cuda::gpu(ordinal).map(|_| ())
}

#[cfg(not(feature = "cuda"))]
fn usable(_ordinal: usize) -> Result<()> {
    Err(Error::Cuda { what: "flatnn was built without its `cuda` feature".into() })
}

#[cfg(feature = "cuda")]
fn cuda_info(ordinal: usize) -> Result<(String, usize, usize, (u32, u32))> {
    crate::cuda::device_info(ordinal).map(|info| (info.name, info.free_memory, info.total_memory, info.compute_capability))
}

#[cfg(not(feature = "cuda"))]
fn cuda_info(_ordinal: usize) -> Result<(String, usize, usize, (u32, u32))> {
    Err(Error::Cuda { what: "flatnn was built without its `cuda` feature".into() })
}

#[cfg(feature = "cuda")]
fn cuda_functional() -> bool {
    crate::cuda::is_functional() && crate::cuda::gpu(0).is_ok()
}

#[cfg(not(feature = "cuda"))]
fn cuda_functional() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::Cpu.to_string(), "cpu");
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert!(matches!(Device::parse("tpu"), Err(Error::Config(_))));
        assert!(matches!(Device::parse("cuda:x"), Err(Error::Config(_))));
        // a device that cannot exist is an error naming it, on any machine
        match Device::parse("cuda:97") {
            Err(Error::Cuda { what }) => assert!(what.contains("97") || what.contains("not found") || what.contains("feature"), "{what}"),
            other => panic!("cuda:97 gave {other:?}"),
        }
    }

    /// The CPU has a name but no tracked memory or compute capability; a device that cannot
    /// exist has neither, on any machine.
    #[test]
    fn what_a_device_reports() {
        assert_eq!(Device::Cpu.name().unwrap(), "cpu");
        assert!(matches!(Device::Cpu.memory(), Err(Error::Config(_))));
        assert!(matches!(Device::Cpu.compute_capability(), Err(Error::Config(_))));
        assert!(matches!(Device::Cuda(97).compute_capability(), Err(Error::Cuda { .. })));
    }
}
