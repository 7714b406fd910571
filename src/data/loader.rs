//! Data sets in memory and a loader that writes each shuffled batch straight into a cache's
//! preallocated input and label buffers: no allocation per batch or per epoch.

use super::idx::{read_images, read_labels};
use crate::cache::Cache;
use crate::chain::Shape;
use crate::error::{Error, Result};
use crate::init::Rng;
use std::path::Path;

/// Images (or feature vectors) normalised to f32 once, at load, with integer class labels.
#[derive(Clone, Debug)]
pub struct Dataset {
    samples: Vec<f32>,
    labels: Vec<u32>,
    shape: Shape,
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
    /// A data set from sample-major values and one label per sample.
    pub fn new(samples: Vec<f32>, labels: Vec<u32>, shape: Shape) -> Result<Dataset> {
        if shape.is_empty() || samples.len() != labels.len() * shape.len() {
            return Err(Error::Shape(format!("{} values are not {} samples of {shape}", samples.len(), labels.len())));
        }
        Ok(Dataset { samples, labels, shape })
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
        Dataset::new(samples, labels.into_iter().map(u32::from).collect(), Shape::image(rows, cols, 1))
    }

    /// The first `n` samples (all of them if there are fewer).
    pub fn take(mut self, n: usize) -> Dataset {
        let n = n.min(self.len());
        self.samples.truncate(n * self.shape.len());
        self.labels.truncate(n);
        self
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Shape of one sample.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Sample `i`'s values.
    pub fn sample(&self, i: usize) -> &[f32] {
        &self.samples[i * self.shape.len()..][..self.shape.len()]
    }

    /// All labels.
    pub fn labels(&self) -> &[u32] {
        &self.labels
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

/// Hands out a data set in batches, shuffled per epoch from a seed.
pub struct Loader {
    order: Vec<u32>,
    batch: usize,
    drop_last: bool,
    next: usize,
    rng: Rng,
}

impl Loader {
    /// A loader over `len` samples in batches of `batch`. With `drop_last`, a final partial
    /// batch is skipped; otherwise it runs as a smaller batch in the same buffers.
    pub fn new(len: usize, batch: usize, seed: u64, drop_last: bool) -> Result<Loader> {
        if batch == 0 || len == 0 {
            return Err(Error::Config(format!("a loader needs samples and a batch of at least 1 (got {len} samples, batch {batch})")));
        }
        let len = u32::try_from(len).map_err(|_| Error::Config(format!("{len} samples is more than a loader indexes")))?;
        Ok(Loader { order: (0..len).collect(), batch, drop_last, next: 0, rng: Rng::new(seed) })
    }

    /// Starts an epoch in a new random order (in place: no allocation).
    pub fn shuffle(&mut self) {
        self.rng.shuffle(&mut self.order);
        self.next = 0;
    }

    /// Starts an epoch in the data set's own order.
    pub fn rewind(&mut self) {
        self.order.iter_mut().enumerate().for_each(|(i, o)| *o = i as u32);
        self.next = 0;
    }

    /// Batches per epoch.
    pub fn batches(&self) -> usize {
        if self.drop_last {
            self.order.len() / self.batch
        } else {
            self.order.len().div_ceil(self.batch)
        }
    }

    /// Writes the next batch's samples and labels into `cache` and returns its size, or
    /// `None` at the end of the epoch. The data set must be the one the loader was made for.
    pub fn next_batch(&mut self, data: &Dataset, cache: &mut Cache) -> Result<Option<usize>> {
        if data.len() != self.order.len() {
            return Err(Error::Mismatch(format!("loader made for {} samples, data set has {}", self.order.len(), data.len())));
        }
        let per_sample = data.shape.len();
        if cache.plan.input.len() != per_sample {
            return Err(Error::Shape(format!("data samples are {}, the model takes {}", data.shape, cache.plan.input)));
        }
        let left = self.order.len() - self.next;
        let size = left.min(self.batch);
        if size == 0 || (self.drop_last && size < self.batch) {
            return Ok(None);
        }
        let picked = &self.order[self.next..self.next + size];
        let inputs = cache.inputs_mut(size)?;
        for (dst, &i) in inputs.chunks_exact_mut(per_sample).zip(picked) {
            dst.copy_from_slice(data.sample(i as usize));
        }
        let labels = cache.labels_mut(size)?;
        for (dst, &i) in labels.iter_mut().zip(picked) {
            *dst = data.labels[i as usize];
        }
        self.next += size;
        Ok(Some(size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Chain, Identity};

    #[test]
    fn epochs_cover_every_sample_once_in_a_new_order() {
        let n = 10;
        let data = Dataset::new((0..n * 2).map(|v| v as f32).collect(), (0..n as u32).collect(), Shape::vector(2)).unwrap();
        let model = Chain::new(Shape::vector(2)).dense(10, Identity).build().unwrap();
        let mut cache = model.preallocate(4).unwrap();
        let mut loader = Loader::new(n, 4, 1, false).unwrap();
        let mut orders = Vec::new();
        for _ in 0..2 {
            loader.shuffle();
            let mut seen = Vec::new();
            let mut sizes = Vec::new();
            while let Some(b) = loader.next_batch(&data, &mut cache).unwrap() {
                sizes.push(b);
                for (x, &label) in cache.inputs().chunks(2).zip(&cache.labels[..b]) {
                    assert_eq!(x, [2.0 * label as f32, 2.0 * label as f32 + 1.0], "sample and label travel together");
                    seen.push(label);
                }
            }
            assert_eq!(sizes, [4, 4, 2]);
            orders.push(seen.clone());
            seen.sort();
            assert_eq!(seen, (0..n as u32).collect::<Vec<_>>());
        }
        assert_ne!(orders[0], orders[1]);
        let mut dropping = Loader::new(n, 4, 1, true).unwrap();
        dropping.shuffle();
        let mut count = 0;
        while dropping.next_batch(&data, &mut cache).unwrap().is_some() {
            count += 1;
        }
        assert_eq!((count, dropping.batches(), loader.batches()), (2, 2, 3));
    }

    #[test]
    fn mismatches_are_errors() {
        let data = Dataset::new(vec![0.0; 6], vec![0, 1], Shape::vector(3)).unwrap();
        let model = Chain::new(Shape::vector(2)).dense(2, Identity).build().unwrap();
        let mut cache = model.preallocate(2).unwrap();
        assert!(matches!(Loader::new(2, 2, 0, false).unwrap().next_batch(&data, &mut cache), Err(Error::Shape(_))));
        assert!(matches!(Loader::new(3, 2, 0, false).unwrap().next_batch(&data, &mut cache), Err(Error::Mismatch(_))));
        assert!(Dataset::new(vec![0.0; 5], vec![0, 1], Shape::vector(3)).is_err());
        assert!(Loader::new(0, 1, 0, false).is_err());
    }

    #[test]
    fn real_mnist_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
        let test = Dataset::mnist(&dir, Split::Test).unwrap();
        assert_eq!((test.len(), test.shape()), (10_000, Shape::image(28, 28, 1)));
        assert_eq!(test.labels()[0], 7);
        assert!(test.sample(0).iter().all(|&p| (0.0..=1.0).contains(&p)));
        let err = Dataset::mnist(Path::new("/nonexistent"), Split::Train).unwrap_err();
        assert!(err.to_string().contains("train-images.idx3-ubyte"), "{err}");
    }
}
