//! Classes from scores: [`Model::predict`] (each sample's arg-max) and [`Model::accuracy`].

use crate::cache::Cache;
use crate::chain::Shape;
use crate::error::{Error, Result};
use crate::loss::Loss;
use crate::model::Model;

impl Model {
    /// Runs the model on the cache's batch in inference mode (as [`Model::forward`]) and writes
    /// each sample's class into `classes[..batch]`: the index of its largest output, the first
    /// of equal ones, a NaN counting as the largest (as `torch.argmax`). The model must output a
    /// vector of at least 2 scores (for one logit of a yes/no question, compare it with 0), and
    /// `classes` must hold the batch; the rest of it is left alone. Allocates nothing.
    pub fn predict(&self, cache: &mut Cache, classes: &mut [u32]) -> Result<()> {
        let outputs = self.class_scores()?;
        let batch = cache.batch();
        if classes.len() < batch {
            return Err(Error::Shape(format!("{} places for the classes of a batch of {batch}", classes.len())));
        }
        let scores = self.forward(cache)?;
        for (class, row) in classes.iter_mut().zip(scores.chunks_exact(outputs)) {
            // at most u32::MAX (checked above)
            *class = argmax(row) as u32;
        }
        Ok(())
    }

    /// The fraction of the cache's batch whose predicted class ([`Model::predict`]) is its
    /// label (set as for cross-entropy: [`Cache::set_labels`], or by a loader), from a forward
    /// pass in inference mode. For a whole data set, weigh each batch's by its size. Allocates
    /// nothing.
    pub fn accuracy(&self, cache: &mut Cache) -> Result<f32> {
        let outputs = self.class_scores()?;
        self.check_targets(cache, Loss::LogitCrossEntropy)?;
        self.forward(cache)?;
        cache.targets_to_host(Loss::LogitCrossEntropy)?;
        let batch = cache.batch();
        let rows = cache.outputs().chunks_exact(outputs).zip(&cache.labels[..batch]);
        let correct = rows.filter(|(row, &label)| argmax(row) == label as usize).count();
        Ok(correct as f32 / batch as f32)
    }

    /// The model's scores a sample, where it outputs a vector of 2 to u32::MAX + 1 of them.
    fn class_scores(&self) -> Result<usize> {
        match self.output_shape() {
            Shape::Vector(classes) if (2..=u32::MAX as usize + 1).contains(&classes) => Ok(classes),
            shape => {
                Err(Error::Shape(format!("classes are predicted from a vector of 2 or more scores per sample; the model outputs {shape}")))
            }
        }
    }
}

/// The index of the largest value of `row` (not empty): the first of equal ones, and the first
/// NaN over any number.
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate().skip(1) {
        if !row[best].is_nan() && (v > row[best] || v.is_nan()) {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::Chain;
    use crate::Identity;

    #[test]
    fn the_first_largest_wins_and_nan_counts_as_largest() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 9.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, 9.0]), 0);
    }

    #[test]
    fn predictions_and_accuracy_of_a_batch() {
        // the identity on 3 scores: the classes are the inputs' arg-maxes
        let mut model = Chain::new(Shape::vector(3)).dense(3, Identity).build().unwrap().with_threads(1).unwrap();
        let eye = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        model.set_parameters(&eye).unwrap();
        let mut cache = model.preallocate(4).unwrap();
        cache.set_inputs(&[0.1, 0.5, 0.2, 3.0, -1.0, 0.0, -2.0, -3.0, -1.0]).unwrap();
        let mut classes = [7u32; 4];
        model.predict(&mut cache, &mut classes).unwrap();
        assert_eq!(classes, [1, 0, 2, 7]);
        cache.set_labels(&[1, 2, 2]).unwrap();
        assert_eq!(model.accuracy(&mut cache).unwrap(), 2.0 / 3.0);
        let err = model.predict(&mut cache, &mut [0; 2]).unwrap_err();
        assert!(err.to_string().contains("2 places for the classes of a batch of 3"), "{err}");
        cache.set_labels(&[1, 2]).unwrap();
        assert!(model.accuracy(&mut cache).unwrap_err().to_string().contains("2 labels set for a batch of 3"));
        let single = Chain::new(Shape::vector(3)).dense(1, Identity).build().unwrap();
        let mut cache = single.preallocate(1).unwrap();
        cache.set_inputs(&[1.0, 2.0, 3.0]).unwrap();
        let err = single.predict(&mut cache, &mut [0]).unwrap_err();
        assert!(err.to_string().contains("the model outputs vector(1)"), "{err}");
    }
}
