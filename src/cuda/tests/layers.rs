//! The kernels of batch norm, layer norm, dropout and residual blocks against the CPU, where a
//! model-level comparison (tests/gpu_layers.rs) would blur what went wrong: dropout's masks,
//! which must be the CPU's bits, and the pass counter that moves them on.

use super::{download, upload};
use crate::cuda::launch::{View, ViewMut};
use crate::cuda::test_gpu;
use crate::layers::dropout::Mask;
use crate::layers::Draw;
use crate::testutil::{poisoned, Rng};

/// The mask the kernel draws is the CPU's, bit for bit, forward and backward (in = dy), for
/// several seeds, passes (past 2³² too), layers and probabilities, on odd lengths; inference
/// copies; nothing past the length is written.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn dropout_draws_the_cpus_bits() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    let mut rng = Rng::new(4);
    for (n, p, region, seed, pass, replica) in [
        (1, 0.5, 1, 0, 0, 0),
        (7, 0.1, 3, 42, 9, 1),
        (4097, 0.5, 2, u64::MAX - 3, (1 << 32) + 5, 0),
        ((1 << 20) + 3, 0.3, 17, 0x1234_5678_9abc_def0, 123_456, 0),
        ((1 << 20) + 3, 0.3, 17, 0x1234_5678_9abc_def0, 123_456, 3),
    ] {
        let x = rng.uniform(n);
        let draw = Draw { seed, pass, replica };
        let draw_dev = upload(&stream, &crate::cuda::state::draw_words(draw));
        let mask = Mask::new(p, region, draw);
        let want: Vec<f32> = (0..n).map(|i| x[i] * mask.factor(i)).chain([f32::NAN]).collect();
        let xd = upload(&stream, &x);
        for train in [true, false] {
            let mut y = upload(&stream, &poisoned(n + 1));
            gpu.dropout(&stream, n, View::of(&xd), ViewMut::of(&mut y), (View::of(&draw_dev), region, p), train).unwrap();
            let got = download(&stream, &y);
            let want: Vec<f32> = if train { want.clone() } else { x.iter().copied().chain([f32::NAN]).collect() };
            let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "dropout n={n} p={p} replica={replica} train={train}: {differ} values differ from the CPU's");
        }
    }
}

/// `dropout_next_pass` adds one to the pass count, carrying into the high word, and leaves the
/// seed and the replica alone.
#[ignore = "needs a CUDA device: run with --include-ignored where there is one"]
#[test]
fn the_pass_count_moves_on_by_one_with_a_carry() {
    let gpu = test_gpu();
    let stream = gpu.new_stream().unwrap();
    for (pass, next) in [(0u64, 1u64), (41, 42), (u32::MAX as u64, 1 << 32), ((7 << 32) + 3, (7 << 32) + 4)] {
        let seed = 0xdead_beef_0bad_f00d_u64;
        let words = |pass: u64| crate::cuda::state::draw_words(Draw { seed, pass, replica: 5 }).to_vec();
        let draw = crate::cuda::buffer::DevBuf::from_host(&gpu, &stream, &words(pass)).unwrap();
        crate::cuda::layers::next_pass(&gpu, &stream, &draw).unwrap();
        let mut got = vec![0u32; 5];
        draw.download(&stream, &mut got).unwrap();
        assert_eq!(got, words(next), "pass {pass}");
    }
}
