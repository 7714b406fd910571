//! [`Server`]: inference calls at the lowest latency a device allows, for a program that makes
//! many small calls on one model.

use crate::cache::{check_finite, Cache};
use crate::dev::DevServer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::model::Model;

/// Inference on one model, from [`Model::serve`]: set a batch with [`Server::set_inputs`], run
/// it with [`Server::forward`] (as often as wanted: without new inputs the same batch runs
/// again). Allocates nothing per call.
///
/// On a GPU, a model of dense layers whose weights fit in a block's shared memory (on an H100,
/// up to about 55,000 parameters) is served by a resident kernel: launched once, it stays on the
/// GPU and answers calls that the host rings on a doorbell in page-locked memory, so no call
/// pays for a launch. Each of its blocks takes a share of the batch through every layer, and
/// holds an SM while the kernel lives (one block an SM, as many as there are samples, up to the
/// SM count): other work on that GPU shares the SMs left, and while other work holds SMs the
/// kernel's blocks may wait for them, and calls with them. The kernel leaves after 1 ms without
/// a call; a call that finds it has run 20 ms ends and relaunches it first (that call pays one
/// launch); so the SMs go back to other work when calls stop, and another thread's call that
/// waits for the whole device (freeing device memory does) is held at most about 1 ms after
/// calls stop, or until the next call past 20 ms while they go on. Any other model, and every
/// model on the CPU, is served by [`Model::forward`] on a cache of the server's capacity:
/// [`Server::is_resident`] tells which.
///
/// The server borrows the model: its parameters cannot change while the server lives.
pub struct Server<'m> {
    model: &'m Model,
    how: How,
    /// Samples in the batch last set (0: none yet).
    batch: usize,
    capacity: usize,
}

// one a server, made once: the variants' sizes do not matter
#[allow(clippy::large_enum_variant)]
enum How {
    Resident { dev: DevServer, fresh: bool },
    Forward(Cache),
}

impl Model {
    /// A [`Server`] for batches of up to `capacity` samples. Allocates every buffer it will
    /// use; on a GPU, waits for the work queued on the model first.
    pub fn serve(&self, capacity: usize) -> Result<Server<'_>> {
        if capacity == 0 {
            return Err(Error::Config("a server needs a capacity of at least one sample".into()));
        }
        // every buffer of the server holds at most the activations of `capacity` samples, so
        // once this fits, no size for the capacity overflows
        self.plan.acts_len(capacity)?;
        let resident = match &self.dev {
            Some(dev) => dev.server(&self.plan, capacity)?,
            None => None,
        };
        let how = match resident {
            Some(dev) => How::Resident { dev, fresh: false },
            None => How::Forward(self.preallocate(capacity)?),
        };
        Ok(Server { model: self, how, batch: 0, capacity })
    }
}

impl Server<'_> {
    /// Sets the next batch: `inputs` holds whole samples (`batch × input length`,
    /// sample-major), at most the capacity, every value finite (else [`Error::NonFinite`]).
    pub fn set_inputs(&mut self, inputs: &[f32]) -> Result<()> {
        let len = self.model.input_shape().len();
        if inputs.is_empty() || !inputs.len().is_multiple_of(len) {
            return Err(Error::Shape(format!("{} input values are not a whole, non-zero number of samples of {len}", inputs.len())));
        }
        let batch = inputs.len() / len;
        if batch > self.capacity {
            return Err(Error::Capacity { batch, capacity: self.capacity });
        }
        match &mut self.how {
            How::Resident { dev, fresh } => {
                check_finite(inputs, "inputs")?;
                dev.inputs_mut(inputs.len()).copy_from_slice(inputs);
                *fresh = true;
            }
            // which checks the values too
            How::Forward(cache) => cache.set_inputs(inputs)?,
        }
        self.batch = batch;
        Ok(())
    }

    /// The model's outputs for the batch last set (`batch × outputs`), once they are back on
    /// the host.
    pub fn forward(&mut self) -> Result<&[f32]> {
        if self.batch == 0 {
            return Err(Error::Shape("no inputs set: call set_inputs first".into()));
        }
        match &mut self.how {
            How::Resident { dev, fresh } => {
                let new = std::mem::take(fresh);
                let outcome = dev.forward(self.batch, new);
                if outcome.is_err() {
                    // the inputs may not have reached the device
                    *fresh = new;
                }
                outcome
            }
            How::Forward(cache) => self.model.forward(cache),
        }
    }

    /// Whether calls are answered by a resident kernel (see [`Server`]); false on the CPU and
    /// for models it cannot run.
    pub fn is_resident(&self) -> bool {
        matches!(self.how, How::Resident { .. })
    }

    /// The device the server runs on (the model's).
    pub fn device(&self) -> Device {
        self.model.device()
    }

    /// For tests of the resident kernel (nothing otherwise): fills its outputs with NaN, so that
    /// a call that writes none is seen, and shortens how long the kernel, from its next launch,
    /// waits for a call before it leaves, so that calls meet a kernel that has left.
    #[doc(hidden)]
    pub fn poison_for_test(&mut self, kernel_idle: std::time::Duration) {
        if let How::Resident { dev, .. } = &mut self.how {
            dev.poison_for_test(kernel_idle);
        }
    }

    /// The largest batch it takes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Samples in the batch last set.
    pub fn batch(&self) -> usize {
        self.batch
    }
}

impl std::fmt::Debug for Server<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("device", &self.device())
            .field("resident", &self.is_resident())
            .field("capacity", &self.capacity)
            .field("batch", &self.batch)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use crate::prelude::*;

    fn model() -> Model {
        Chain::new(Input::vector(5)).dense(7, Relu).dense(3, Identity).build().unwrap().init(Init::GlorotUniform, 3)
    }

    #[test]
    fn on_the_cpu_a_server_runs_forward() {
        let model = model();
        let mut server = model.serve(4).unwrap();
        assert!(!server.is_resident());
        assert!(matches!(server.forward(), Err(Error::Shape(_))));
        let inputs: Vec<f32> = (0..15).map(|i| (i as f32 * 0.37).sin()).collect();
        server.set_inputs(&inputs).unwrap();
        let got = server.forward().unwrap().to_vec();
        let mut cache = model.preallocate(4).unwrap();
        cache.set_inputs(&inputs).unwrap();
        assert_eq!(got, model.forward(&mut cache).unwrap());
        assert_eq!(got.len(), 9);
        assert!(matches!(server.set_inputs(&[0.0; 25]), Err(Error::Capacity { batch: 5, capacity: 4 })));
        assert!(matches!(server.set_inputs(&[0.0; 6]), Err(Error::Shape(_))));
        assert!(matches!(model.serve(0), Err(Error::Config(_))));
    }
}
