//! Data sets in memory: samples normalised to f32 once, each with a class label or with
//! real-valued targets, and their copies in the memory of a GPU.

use super::idx::{read_images, read_labels};
use super::DevDataset;
use crate::cache::{check_finite, check_labels};
use crate::chain::Shape;
use crate::device::Device;
use crate::error::{Error, Result};
use std::path::Path;

/// Samples (images or feature vectors) normalised to f32 once, at load, each with an integer
/// class label (for [`crate::Loss::LogitCrossEntropy`]) or with real-valued targets (a
/// regression, [`crate::Loss::Mse`]).
///
/// ```
/// use flatnn::data::{Dataset, Loader};
/// use flatnn::prelude::*;
///
/// // y = 2x − 1 from 64 points: a regression from plain vectors
/// let xs: Vec<f32> = (0..64).map(|i| i as f32 / 32.0 - 1.0).collect();
/// let ys: Vec<f32> = xs.iter().map(|x| 2.0 * x - 1.0).collect();
/// let data = Dataset::from_targets(&xs, &ys, Shape::vector(1), 1)?;
/// let model = Chain::new(Input::vector(1)).dense(8, Tanh).dense(1, Identity).build()?;
/// let mut model = model.init(Init::GlorotUniform, 1).with_threads(1)?;
/// let (mut fwd, mut bwd) = (model.preallocate(16)?, model.preallocate_grads(16)?);
/// let mut opt = Optimizer::new(&model, Optim::adam(2e-2))?;
/// let mut loader = Loader::new(data.len(), 16, 7, false)?;
/// let mut epoch_loss = f32::NAN;
/// for _ in 0..100 {
///     loader.shuffle();
///     while loader.next_batch(&data, &mut fwd)?.is_some() {
///         opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::Mse)?;
///     }
///     epoch_loss = bwd.mean_loss()?;
/// }
/// // the mean squared error over the last epoch, for targets of variance 4/3
/// assert!(epoch_loss < 0.01, "{epoch_loss}");
/// # Ok::<(), flatnn::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Dataset {
    pub(super) samples: Vec<f32>,
    pub(super) targets: Targets,
    pub(super) shape: Shape,
}

/// What a data set's samples are labelled with.
#[derive(Clone, Debug)]
pub(crate) enum Targets {
    /// One class label per sample.
    Labels(Vec<u32>),
    /// `outputs` finite values per sample, sample-major.
    Values { values: Vec<f32>, outputs: usize },
}

impl Targets {
    fn len(&self) -> usize {
        match self {
            Targets::Labels(labels) => labels.len(),
            Targets::Values { values, outputs } => values.len() / outputs,
        }
    }

    /// Real values per sample; None for class labels.
    pub(crate) fn outputs(&self) -> Option<usize> {
        match self {
            Targets::Labels(_) => None,
            Targets::Values { outputs, .. } => Some(*outputs),
        }
    }
}

/// Which MNIST file pair to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// 60,000 training images.
    Train,
    /// 10,000 test images.
    Test,
}

impl Dataset {
    /// A data set from sample-major values and one class label per sample (each must be below
    /// the outputs of the model it feeds: checked per batch, or once by [`Dataset::to_device`]).
    /// A NaN or infinite value is an [`Error::NonFinite`] naming the first (checked here, once,
    /// for every constructor: one read of the values), so the batches a loader writes from it
    /// need no check of their own.
    pub fn new(samples: Vec<f32>, labels: Vec<u32>, shape: Shape) -> Result<Dataset> {
        Dataset::with(samples, Targets::Labels(labels), shape)
    }

    /// A regression data set: sample-major values and `outputs` real-valued targets per
    /// sample (`targets.len() / outputs` samples), each finite (an [`Error::NonFinite`]
    /// naming the first that is not).
    pub fn regression(samples: Vec<f32>, targets: Vec<f32>, shape: Shape, outputs: usize) -> Result<Dataset> {
        if outputs == 0 || !targets.len().is_multiple_of(outputs) {
            return Err(Error::Shape(format!("{} target values are not a whole number of samples of {outputs}", targets.len())));
        }
        check_finite(&targets, "targets")?;
        Dataset::with(samples, Targets::Values { values: targets, outputs }, shape)
    }

    /// [`Dataset::new`] from borrowed slices (copied once).
    pub fn from_labels(samples: &[f32], labels: &[u32], shape: Shape) -> Result<Dataset> {
        Dataset::new(samples.to_vec(), labels.to_vec(), shape)
    }

    /// [`Dataset::regression`] from borrowed slices (copied once).
    pub fn from_targets(samples: &[f32], targets: &[f32], shape: Shape, outputs: usize) -> Result<Dataset> {
        Dataset::regression(samples.to_vec(), targets.to_vec(), shape, outputs)
    }

    fn with(samples: Vec<f32>, targets: Targets, shape: Shape) -> Result<Dataset> {
        let count = targets.len();
        if shape.is_empty() || count.checked_mul(shape.len()) != Some(samples.len()) {
            return Err(Error::Shape(format!("{} values are not {count} samples of {shape}", samples.len())));
        }
        check_finite(&samples, "samples")?;
        Ok(Dataset { samples, targets, shape })
    }

    /// MNIST from `dir` (the four IDX files, raw or gzipped, as `data/mnist/` ships them);
    /// pixels scaled to [0, 1].
    pub fn mnist(dir: &Path, split: Split) -> Result<Dataset> {
        let prefix = match split {
            Split::Train => "train",
            Split::Test => "t10k",
        };
        let images_path = find(dir, &format!("{prefix}-images.idx3-ubyte"))?;
        let labels_path = find(dir, &format!("{prefix}-labels.idx1-ubyte"))?;
        let (pixels, count, rows, cols) = read_images(&images_path)?;
        let labels = read_labels(&labels_path)?;
        if labels.len() != count {
            return Err(Error::Format { path: labels_path, what: format!("{} labels for {count} images", labels.len()) });
        }
        let samples = pixels.iter().map(|&p| p as f32 / 255.0).collect();
        Dataset::new(samples, labels.into_iter().map(u32::from).collect(), Shape::image(1, rows, cols))
    }

    /// The first `n` samples (all of them if there are fewer).
    pub fn take(mut self, n: usize) -> Dataset {
        let n = n.min(self.len());
        self.samples.truncate(n * self.shape.len());
        match &mut self.targets {
            Targets::Labels(labels) => labels.truncate(n),
            Targets::Values { values, outputs } => values.truncate(n * *outputs),
        }
        self
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Shape of one sample.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Sample `i`'s values; `None` past the last sample.
    pub fn sample(&self, i: usize) -> Option<&[f32]> {
        self.samples.chunks_exact(self.shape.len()).nth(i)
    }

    /// All class labels (empty for a regression data set).
    pub fn labels(&self) -> &[u32] {
        match &self.targets {
            Targets::Labels(labels) => labels,
            Targets::Values { .. } => &[],
        }
    }

    /// All real-valued targets, `outputs` a sample (empty for a data set of class labels).
    pub fn targets(&self) -> &[f32] {
        match &self.targets {
            Targets::Labels(_) => &[],
            Targets::Values { values, .. } => values,
        }
    }

    /// This data set copied to `device` (a CUDA device), for [`Loader::next_device_batch`](crate::data::Loader::next_device_batch);
    /// the host waits for the copy. `outputs` is the number of outputs of the models it will
    /// feed: class labels must be below it (an [`Error::Label`] naming the first that is not;
    /// a model fed must then have at least `outputs`), real-valued targets must be `outputs` a
    /// sample (an [`Error::Shape`]). On the CPU, or without the `cuda` feature, an error: there
    /// the loader reads the `Dataset` itself.
    pub fn to_device(&self, device: &Device, outputs: usize) -> Result<DeviceDataset> {
        if self.is_empty() {
            return Err(Error::Config("an empty data set cannot be put on a device".into()));
        }
        match &self.targets {
            Targets::Labels(labels) => check_labels(labels, outputs)?,
            Targets::Values { outputs: per_sample, .. } => check_outputs(*per_sample, outputs)?,
        }
        let dev = match *device {
            Device::Cpu => {
                return Err(Error::Config("a device data set needs a CUDA device; on the CPU the loader reads the Dataset".into()))
            }
            Device::Cuda(ordinal) => DevDataset::on(ordinal, &self.samples, &self.targets)?,
        };
        let targets = self.targets.outputs();
        Ok(DeviceDataset { dev, shape: self.shape, len: self.len(), outputs, targets, order_of: None })
    }
}

/// Real-valued targets of `per_sample` values a sample for a model of `outputs` outputs.
pub(super) fn check_outputs(per_sample: usize, outputs: usize) -> Result<()> {
    if per_sample != outputs {
        return Err(Error::Shape(format!("the data's targets are {per_sample} values a sample, the model has {outputs} outputs")));
    }
    Ok(())
}

/// A [`Dataset`] in the memory of one GPU (from [`Dataset::to_device`]): its samples as f32,
/// its labels (checked below `outputs` at upload) or real-valued targets (`outputs` a
/// sample), and room for a loader's order.
pub struct DeviceDataset {
    pub(super) dev: DevDataset,
    pub(super) shape: Shape,
    pub(super) len: usize,
    pub(super) outputs: usize,
    /// Real values per sample; None for class labels.
    pub(super) targets: Option<usize>,
    /// The loader (its id) and epoch whose order the device holds.
    pub(super) order_of: Option<(u64, u64)>,
}

impl DeviceDataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty data set is not uploaded.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Shape of one sample.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The outputs of the models it feeds: every label is below this, or every sample has
    /// this many targets.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// The device holding the data.
    pub fn device(&self) -> Device {
        self.dev.device()
    }
}

/// `dir/name`, or `dir/name.gz` when only the gzipped file is there.
fn find(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    let (raw, gz) = (dir.join(name), dir.join(format!("{name}.gz")));
    if raw.is_file() {
        Ok(raw)
    } else if gz.is_file() {
        Ok(gz)
    } else {
        Err(Error::Io {
            path: gz,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, format!("neither {name} nor {name}.gz found")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_mnist_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
        let test = Dataset::mnist(&dir, Split::Test).unwrap();
        assert_eq!((test.len(), test.shape()), (10_000, Shape::image(1, 28, 28)));
        assert_eq!(test.labels()[0], 7);
        assert!(test.sample(0).unwrap().iter().all(|&p| (0.0..=1.0).contains(&p)));
        assert_eq!((test.sample(9_999).map(<[f32]>::len), test.sample(10_000)), (Some(784), None));
        let err = Dataset::mnist(Path::new("/nonexistent"), Split::Train).unwrap_err();
        assert!(err.to_string().contains("train-images.idx3-ubyte"), "{err}");
    }
}
