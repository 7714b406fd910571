//! The CPU convolution routes (im2col + GEMM, the direct GEMM on shifted windows of the padded
//! input, and forward only F(2, 3) Winograd along the rows) on the zoo's convolution layers: time per call and GFLOP/s (2·OC·OH·OW·CKK
//! per sample forward, twice that backward, with the input gradient except on a network's
//! first layer, which needs none), the routes interleaved, the fastest of several calls.
//! `cargo bench --bench conv_routes [-- THREADS]` (default 1 thread).

use flatnn::testutil::conv_route_times;
use flatnn::ConvOptions;

/// (name, (C, H, W), OC, kernel, stride, padding, first layer)
type Layer = (&'static str, (usize, usize, usize), usize, (usize, usize), (usize, usize), (usize, usize), bool);

const LAYERS: [Layer; 9] = [
    ("lenet5 conv1", (1, 28, 28), 6, (5, 5), (1, 1), (2, 2), true),
    ("lenet5 conv2", (6, 14, 14), 16, (5, 5), (1, 1), (0, 0), false),
    ("simplenn conv1", (1, 28, 28), 16, (5, 5), (1, 1), (0, 0), true),
    ("simplenn conv2", (16, 12, 12), 8, (3, 3), (1, 1), (0, 0), false),
    ("vgg_small conv1", (3, 32, 32), 16, (3, 3), (1, 1), (1, 1), true),
    ("vgg_small conv2", (16, 32, 32), 16, (3, 3), (1, 1), (1, 1), false),
    ("vgg_small conv3", (16, 16, 16), 32, (3, 3), (1, 1), (1, 1), false),
    ("vgg_small conv4", (32, 16, 16), 32, (3, 3), (1, 1), (1, 1), false),
    ("1-D k=7 32→32", (32, 1, 256), 32, (1, 7), (1, 1), (0, 3), false),
];

fn main() -> flatnn::Result<()> {
    // `cargo bench` passes `--bench`; a number is the thread count
    let threads = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1);
    println!("{threads} thread(s); µs per call, fastest of 20; GFLOP/s");
    println!("{:16} {:>5}  {:>8} {:>8} {:>6} {:>8} {:>6}", "layer", "batch", "route", "fwd µs", "GF/s", "bwd µs", "GF/s");
    for (name, input, out_channels, kernel, stride, padding, first) in LAYERS {
        let (c, h, w) = input;
        let (oh, ow) = ((h + 2 * padding.0 - kernel.0) / stride.0 + 1, (w + 2 * padding.1 - kernel.1) / stride.1 + 1);
        for batch in [1, 8, 64] {
            let times = conv_route_times(input, out_channels, kernel, ConvOptions { stride, padding }, batch, threads, 20, !first)?;
            let flops = 2.0 * (batch * out_channels * oh * ow * c * kernel.0 * kernel.1) as f64;
            let bwd_flops = if first { flops } else { 2.0 * flops };
            // µs and GFLOP/s, or dashes where the route does not compute the direction
            let cells = |t: Option<std::time::Duration>, flops: f64| match t {
                Some(t) => format!("{:>8.1} {:>6.1}", t.as_secs_f64() * 1e6, flops / t.as_secs_f64() / 1e9),
                None => format!("{:>8} {:>6}", "–", "–"),
            };
            for (route, f, b) in times {
                println!("{name:16} {batch:>5}  {route:>8} {} {}", cells(f, flops), cells(b, bwd_flops));
            }
        }
    }
    Ok(())
}
