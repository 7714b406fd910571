//! Without the `cuda` feature: the device halves of models, caches and optimisers exist only
//! as types with no values, so the CPU code that dispatches on them compiles unchanged and
//! every request for a GPU is an [`Error::Cuda`].

use crate::cache::{Cache, Grads};
use crate::chain::Plan;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::optim::Update;

// How a model runs on the GPU (no effect in a build without the `cuda` feature): the same
// types as with it.
#[path = "cuda/options.rs"]
mod options;
pub use options::{Convs, GpuOptions, RnnAlgos, Tuning};

pub(crate) enum DevModel {}
pub(crate) enum DevCache {}
pub(crate) enum DevGrads {}
pub(crate) enum DevOptim {}
pub(crate) enum DevServer {}
/// A data-parallel reduction (none without the `cuda` feature).
pub(crate) enum Reduce {}

impl DevServer {
    pub fn poison_for_test(&mut self, _kernel_idle: std::time::Duration) {
        match *self {}
    }
    pub fn inputs_mut(&mut self, _len: usize) -> &mut [f32] {
        match *self {}
    }
    pub fn forward(&mut self, _samples: usize, _fresh: bool) -> Result<&[f32]> {
        match *self {}
    }
}

impl DevModel {
    pub fn on(_ordinal: usize, _params: &[f32], _buffers: &[f32], _draw: crate::layers::Draw, _options: GpuOptions) -> Result<DevModel> {
        Err(no_cuda())
    }
    pub fn set_draw(&mut self, _seed: u64, _passes: u64) -> Result<()> {
        match *self {}
    }
    pub fn device(&self) -> Device {
        match *self {}
    }
    pub fn download(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
    pub fn upload(&mut self, _values: &[f32]) -> Result<()> {
        match *self {}
    }
    pub fn download_buffers(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
    pub fn upload_buffers(&mut self, _values: &[f32]) -> Result<()> {
        match *self {}
    }
    pub fn new_cache(&self, _plan: &Plan, _capacity: usize) -> Result<DevCache> {
        match *self {}
    }
    pub fn new_grads(&self, _plan: &Plan, _capacity: usize) -> Result<DevGrads> {
        match *self {}
    }
    pub fn server(&self, _plan: &Plan, _capacity: usize) -> Result<Option<DevServer>> {
        match *self {}
    }
    pub fn new_optim(&self, _values: &[f32]) -> Result<DevOptim> {
        match *self {}
    }
    pub fn forward<'c>(&self, _plan: &Plan, _cache: &'c mut Cache) -> Result<&'c [f32]> {
        match *self {}
    }
    pub fn backprop(&self, _plan: &Plan, _grads: &mut Grads, _cache: &mut Cache, _loss: Loss) -> Result<()> {
        match *self {}
    }
    pub fn update(&mut self, _update: Update, _step: u64, _opt: &mut DevOptim, _grads: &Grads) -> Result<()> {
        match *self {}
    }
    #[allow(clippy::too_many_arguments)]
    pub fn train_step(
        &mut self,
        _plan: &Plan,
        _grads: &mut Grads,
        _cache: &mut Cache,
        _loss: Loss,
        _update: Update,
        _steps: &mut u64,
        _opt: &mut DevOptim,
        _reduce: Option<&Reduce>,
    ) -> Result<()> {
        match *self {}
    }
}

impl DevCache {
    pub fn on(_ordinal: usize, _plan: &Plan, _capacity: usize) -> Result<DevCache> {
        Err(no_cuda())
    }
    pub fn device(&self) -> Device {
        match *self {}
    }
    pub fn outputs(&self, _len: usize) -> &[f32] {
        match *self {}
    }
    pub fn conv_report(&self) -> String {
        match *self {}
    }
    pub fn routes_report(&self, _plan: &Plan) -> String {
        match *self {}
    }
    pub fn inputs_host_mut(&mut self, _len: usize) -> Result<&mut [f32]> {
        match *self {}
    }
    pub fn inputs_host(&self, _len: usize) -> &[f32] {
        match *self {}
    }
    pub fn download_labels(&self, _out: &mut [u32]) -> Result<()> {
        match *self {}
    }
    pub fn download_targets(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
    pub fn write_acts(&mut self, _at: usize, _values: &[f32]) -> Result<()> {
        match *self {}
    }
    pub fn zero_acts(&mut self, _range: std::ops::Range<usize>) -> Result<()> {
        match *self {}
    }
    pub fn read_acts(&self, _at: usize, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
}

impl DevGrads {
    pub fn on(_ordinal: usize, _plan: &Plan, _capacity: usize) -> Result<DevGrads> {
        Err(no_cuda())
    }
    pub fn device(&self) -> Device {
        match *self {}
    }
    pub fn last_loss(&self) -> Result<f32> {
        match *self {}
    }
    pub fn mean_loss(&mut self) -> Result<f32> {
        match *self {}
    }
    pub fn loss_sum(&self) -> Result<f64> {
        match *self {}
    }
    pub fn download(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
}

impl DevOptim {
    pub fn on(_ordinal: usize, _values: &[f32]) -> Result<DevOptim> {
        Err(no_cuda())
    }
    pub fn device(&self) -> Device {
        match *self {}
    }
    pub fn download(&self, _out: &mut [f32]) -> Result<()> {
        match *self {}
    }
    pub fn upload(&mut self, _values: &[f32]) -> Result<()> {
        match *self {}
    }
    pub fn norm(&self) -> Result<f32> {
        match *self {}
    }
}

fn no_cuda() -> Error {
    Error::Cuda { what: "flatnn was built without its `cuda` feature".into() }
}
