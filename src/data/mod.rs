//! Data: IDX files, data sets of class labels or real-valued targets, a zero-allocation loader,
//! and batches fed to a GPU from device memory ([`DeviceDataset`]) or streamed from page-locked
//! host memory ([`StreamingLoader`]).

pub(crate) mod dataset;
pub mod idx;
pub mod loader;

pub use dataset::{Dataset, DeviceDataset, Split};
pub use loader::{Loader, StreamingLoader};

#[cfg(feature = "cuda")]
use crate::cuda::data::{DevDataset, DevStaging};
#[cfg(not(feature = "cuda"))]
use off::{DevDataset, DevStaging};

/// Without the `cuda` feature: the device halves of the loaders exist only as types with no
/// values, and asking for one is an [`crate::Error::Cuda`].
#[cfg(not(feature = "cuda"))]
mod off {
    use super::dataset::Targets;
    use crate::dev::DevCache;
    use crate::device::Device;
    use crate::error::{Error, Result};

    pub(crate) enum DevDataset {}
    pub(crate) enum DevStaging {}

    fn no_cuda() -> Error {
        Error::Cuda { what: "flatnn was built without its `cuda` feature".into() }
    }

    impl DevDataset {
        pub fn on(_ordinal: usize, _samples: &[f32], _targets: &Targets) -> Result<DevDataset> {
            Err(no_cuda())
        }
        pub fn device(&self) -> Device {
            match *self {}
        }
    }

    impl DevStaging {
        pub fn on(_ordinal: usize, _capacity: usize, _sample_len: usize, _outputs: usize) -> Result<DevStaging> {
            Err(no_cuda())
        }
        pub fn device(&self) -> Device {
            match *self {}
        }
        #[allow(clippy::type_complexity)]
        pub fn host_slot(&mut self, _slot: usize) -> Result<(&mut [f32], &mut [u32], &mut [f32])> {
            match *self {}
        }
        pub fn send(&mut self, _slot: usize, _batch: usize, _values: bool) -> Result<()> {
            match *self {}
        }
    }

    impl DevCache {
        pub(crate) fn upload_order(&mut self, data: &mut DevDataset, _order: &[u32]) -> Result<()> {
            match *data {}
        }
        pub(crate) fn gather(&mut self, data: &mut DevDataset, _start: usize, _batch: usize) -> Result<()> {
            match *data {}
        }
        pub(crate) fn receive(&mut self, staging: &mut DevStaging, _slot: usize, _batch: usize, _values: bool) -> Result<()> {
            match *staging {}
        }
    }
}
