//! An inference pass, which leaves the pre-activations z of activated steps unwritten
//! (`exec::forward` in `Mode::Infer`), against a training pass's forward over the same
//! buffers and routes.

use super::{check, same_bits};
use crate::cuda::buffer::DevBuf;
use crate::cuda::exec::{self, Forward};
use crate::cuda::test_gpu;
use crate::device::Device;
use crate::init::Init;
use crate::layers::{region, Mode};
use crate::models::{gelu_mlp, lenet5, mlp};
use crate::testutil::{batch, rel_err, Rng};

/// A ReLU MLP, the GELU MLP and LeNet-5 (ReLU convolutions, no batch norm or dropout, so the
/// two modes compute the same thing), at a few samples (flatnn's kernels) and at 2048 (where
/// cuBLAS or the tensor-core tiles run the products, then the bias and activation pass): on the
/// routes `Model::forward` measured, every activation but the inputs poisoned with NaN before
/// each pass, an inference pass gives the training pass's outputs bit for bit, and those of
/// `Model::forward` (a graph) within rounding.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn an_inference_pass_gives_a_training_passs_outputs() {
    let _gpu = test_gpu();
    let mut rng = Rng::new(29);
    for (name, chain) in [("mlp", mlp()), ("gelu_mlp", gelu_mlp()), ("lenet5", lenet5())] {
        let model = chain.build().unwrap().init(Init::HeNormal, 7).to(&Device::Cuda(0)).unwrap();
        let mut cache = model.preallocate(2048).unwrap();
        for n in [7, 2048] {
            let (x, _) = batch(&mut rng, &model, n);
            cache.set_inputs(&x).unwrap();
            // measures the routes for this batch and leaves the inputs on the device
            let want = model.forward(&mut cache).unwrap().to_vec();
            let (plan, capacity) = (model.plan(), cache.capacity());
            let dm = model.dev.as_ref().unwrap();
            let draw = DevBuf::<u32>::zeros(&dm.gpu, &dm.stream, 5).unwrap();
            let (inputs, out) = (region(plan, 0, capacity, n), region(plan, plan.steps.last().unwrap().output_region, capacity, n));
            let mut outputs = Vec::new();
            for mode in [Mode::Train, Mode::Infer] {
                let dev = cache.dev.as_mut().unwrap();
                let mut acts = vec![0.0f32; dev.acts.len()];
                dev.acts.download(&dm.stream, &mut acts).unwrap();
                acts[inputs.end..].fill(f32::NAN);
                dev.acts.upload(&dm.stream, &acts).unwrap();
                let (acts_buf, cols) = (&dev.acts, &dev.cols);
                let (dnn, routes) = (Some(&dev.dnn), Some(&dev.routes));
                let f = Forward { params: &dm.params, acts: acts_buf, cols, capacity, batch: n, dnn, routes, buffers: None, draw: &draw };
                exec::forward(&dm.gpu, &dev.blas, &dm.stream, plan, &f, false, plan.steps.len(), mode).unwrap();
                dev.acts.download(&dm.stream, &mut acts).unwrap();
                outputs.push(acts[out.clone()].to_vec());
            }
            same_bits(&format!("{name} at {n}: inference against training"), &outputs[1], &outputs[0]);
            println!("{name} at {n}: against Model::forward, rel err {:e}", rel_err(&outputs[1], &want));
            check(&format!("{name} at {n}: against Model::forward"), &outputs[1], &want, 1e-5, 1e-5);
        }
    }
}
