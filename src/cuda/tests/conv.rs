//! A convolution's inference epilogue (`conv_epilogue`, src/cuda/conv.rs) against a plain loop
//! and against the kernels it stands for run one by one, at odd sizes and alignments.

use super::{check, download, same_bits, upload};
use crate::activation::Activation;
use crate::cuda::conv::Norm;
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::batch_norm::{inv_std, Geometry};
use crate::testutil::{poisoned, Rng};

/// One case's operands on the host: z, the bias, the batch norm's running mean and variance,
/// γ and β, and the block's input, for `batch` samples of `channels × pixels`.
struct Operands {
    z: Vec<f32>,
    bias: Vec<f32>,
    norm: [Vec<f32>; 4],
    skip: Vec<f32>,
}

impl Operands {
    fn new(rng: &mut Rng, channels: usize, n: usize) -> Operands {
        let var = rng.uniform(channels).iter().map(|v| 0.5 + v.abs() * 2.0).collect();
        let norm = [rng.uniform(channels), var, rng.uniform(channels), rng.uniform(channels)];
        Operands { z: rng.uniform(n), bias: rng.uniform(channels), norm, skip: rng.uniform(n) }
    }

    /// The plain loop: act(((z + b − μ)·r)·γ + β + skip), r = 1/√(var + ε), each part where
    /// asked for, value by value in f32.
    fn want(&self, pixels: usize, channels: usize, bn: bool, add: bool, act: Activation) -> Vec<f32> {
        let [mean, var, gamma, beta] = &self.norm;
        (0..self.z.len())
            .map(|i| {
                let c = (i / pixels) % channels;
                let mut v = self.z[i] + self.bias[c];
                if bn {
                    v = (v - mean[c]) * inv_std(var[c]) * gamma[c] + beta[c];
                }
                if add {
                    v += self.skip[i];
                }
                act.apply(v)
            })
            .collect()
    }
}

/// The epilogue at pixels 1, 3, 7, 12 and 1024, channels 1 and 5, 3 samples, with and without a
/// batch norm and a residual sum, identity, ReLU and tanh, its operands 16-byte aligned (float4s
/// where the pixels allow) and one value off (single values): against the plain loop within
/// rounding (tanh's), and the same bits as bias_act_forward, batch_norm_apply (by the running
/// statistics) and residual_add run one after the other; y poisoned first, every value written,
/// nothing before or after it.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_epilogue_matches_a_plain_loop_and_the_kernels_one_by_one() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(17);
    let batch = 3;
    for pixels in [1, 3, 7, 12, 1024] {
        for channels in [1, 5] {
            let n = batch * channels * pixels;
            let ops = Operands::new(&mut rng, channels, n);
            // each operand at `offset` values into a buffer with a spare value after it
            let padded = |v: &[f32], offset: usize| [vec![0.5; offset], v.to_vec(), vec![0.5]].concat();
            for offset in [0, 1] {
                let (z, skip) = (upload(&stream, &padded(&ops.z, offset)), upload(&stream, &padded(&ops.skip, offset)));
                let (bias, norm) = (upload(&stream, &ops.bias), ops.norm.clone().map(|v| upload(&stream, &v)));
                let (z_at, skip_at) = (View::of(&z).slice(offset..offset + n), View::of(&skip).slice(offset..offset + n));
                for (bn, add) in [(false, false), (true, false), (false, true), (true, true)] {
                    for act in [Activation::Identity, Activation::Relu, Activation::Tanh] {
                        let what = format!("{batch}x{channels}x{pixels}, offset {offset}, bn {bn}, add {add}, {act:?}");
                        let mut y = upload(&stream, &poisoned(n + offset + 1));
                        let ym = ViewMut::of(&mut y);
                        // SAFETY: values offset..offset + n of `y`, used by this launch alone.
                        let out = unsafe { ViewMut::from_raw(ym.ptr() + 4 * offset as u64, n) };
                        let batch_norm = bn.then(|| {
                            let [mean, var, gamma, beta] = [0, 1, 2, 3].map(|i| View::of(&norm[i]));
                            Norm { mean, var, gamma, beta }
                        });
                        let skip = add.then_some(skip_at);
                        gpu.conv_epilogue(&stream, (channels, pixels, batch), z_at, View::of(&bias), batch_norm, skip, act, out).unwrap();
                        let got = download(&stream, &y);
                        assert!(got[..offset].iter().chain(&got[offset + n..]).all(|v| v.is_nan()), "{what}: written outside y");
                        let got = &got[offset..offset + n];
                        check(&what, got, &ops.want(pixels, channels, bn, add, act), 1e-7, 1e-6);
                        let steps = one_by_one(&gpu, &stream, &ops, (channels, pixels, batch), (bn, add), act);
                        same_bits(&format!("{what}: against the kernels one by one"), got, &steps);
                    }
                }
            }
        }
    }
}

/// The output of the kernels the epilogue stands for, run one after the other as the steps
/// would run them: bias_act_forward (z + b, the activation there where it is the last step),
/// batch_norm_apply by the running statistics, residual_add.
fn one_by_one(
    gpu: &crate::cuda::Gpu,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ops: &Operands,
    (channels, pixels, batch): (usize, usize, usize),
    (bn, add): (bool, bool),
    act: Activation,
) -> Vec<f32> {
    let n = ops.z.len();
    let (mut conv_z, mut conv_y) = (upload(stream, &ops.z), upload(stream, &poisoned(n)));
    let bias = upload(stream, &ops.bias);
    let own_act = !bn && !add;
    let y = own_act.then(|| ViewMut::of(&mut conv_y));
    gpu.bias_act(stream, act, View::of(&bias), channels, pixels, batch, ViewMut::of(&mut conv_z), y, true).unwrap();
    let mut out = if own_act { conv_y } else { conv_z };
    if bn {
        let norm = ops.norm.clone().map(|v| upload(stream, &v));
        let (mut z, mut y) = (upload(stream, &poisoned(n)), upload(stream, &poisoned(n)));
        let g = Geometry { channels, pixels, batch };
        let activated = (!add).then(|| (ViewMut::of(&mut y), act));
        let (stats, affine) = ((View::of(&norm[0]), View::of(&norm[1])), (View::of(&norm[2]), View::of(&norm[3])));
        gpu.batch_norm_apply(stream, &g, View::of(&out), (ViewMut::of(&mut z), activated), stats, affine, true).unwrap();
        out = if add { z } else { y };
    }
    if add {
        let skip = upload(stream, &ops.skip);
        let (mut z, mut y) = (upload(stream, &poisoned(n)), upload(stream, &poisoned(n)));
        gpu.residual_add(stream, act, View::of(&out), View::of(&skip), ViewMut::of(&mut z), Some(ViewMut::of(&mut y))).unwrap();
        out = y;
    }
    download(stream, &out)
}
