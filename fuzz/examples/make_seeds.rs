//! Writes the seed corpora in fuzz/seeds/ (run from the crate root:
//! `cargo run --manifest-path fuzz/Cargo.toml --example make_seeds`). Seeds are small valid
//! files the fuzzer mutates from: tiny IDX files of every element type, raw and gzipped, the
//! first MNIST test image and label cut out of data/mnist, the first bytes of a shipped MNIST
//! file, and tiny models written by `Model::save`, two of them again with padded headers.

use flate2::{read::MultiGzDecoder, write::GzEncoder, Compression};
use flatnn::prelude::*;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;

fn idx(code: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, code, dims.len() as u8];
    dims.iter().for_each(|d| out.extend(d.to_be_bytes()));
    out.extend(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::best());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// The first `n` decompressed bytes of a shipped MNIST file.
fn mnist_prefix(name: &str, n: usize) -> Vec<u8> {
    let file = fs::File::open(Path::new("data/mnist").join(name)).unwrap();
    let mut out = Vec::new();
    MultiGzDecoder::new(file).take(n as u64).read_to_end(&mut out).unwrap();
    out
}

/// The same safetensors file with `extra` more spaces closing its JSON header (the format pads
/// headers with spaces): a mutation that lengthens or shortens the architecture text then still
/// leaves a header of the declared length that parses.
fn padded(bytes: &[u8], extra: usize) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut out = ((n + extra) as u64).to_le_bytes().to_vec();
    out.extend(&bytes[8..8 + n]);
    out.extend(std::iter::repeat_n(b' ', extra));
    out.extend(&bytes[8 + n..]);
    out
}

fn main() -> flatnn::Result<()> {
    let dir = Path::new("fuzz/seeds");
    let idx_dir = dir.join("idx");
    fs::create_dir_all(&idx_dir).unwrap();
    let f32s: Vec<u8> = [0.5f32, -1.0, 3.25, f32::MIN_POSITIVE].iter().flat_map(|v| v.to_be_bytes()).collect();
    let f64s: Vec<u8> = [0.25f64, -2.0].iter().flat_map(|v| v.to_be_bytes()).collect();
    let tiny = [
        ("u8-labels", idx(0x08, &[3], &[7, 2, 1])),
        ("u8-images", idx(0x08, &[2, 2, 3], &[0, 1, 2, 3, 4, 5, 250, 251, 252, 253, 254, 255])),
        ("i8", idx(0x09, &[2, 1], &[0x80, 0x7f])),
        ("i16", idx(0x0B, &[2], &[0x01, 0x02, 0xff, 0xfe])),
        ("i32", idx(0x0C, &[1, 1, 1, 1], &[0, 0, 1, 0])),
        ("f32", idx(0x0D, &[2, 2], &f32s)),
        ("f64", idx(0x0E, &[2], &f64s)),
    ];
    for (name, bytes) in &tiny {
        fs::write(idx_dir.join(format!("{name}.idx")), bytes).unwrap();
    }
    for (name, bytes) in &tiny[..2] {
        fs::write(idx_dir.join(format!("{name}.idx.gz")), gzip(bytes)).unwrap();
    }
    // The first MNIST test image and its label, as one-sample files.
    let image = mnist_prefix("t10k-images.idx3-ubyte.gz", 16 + 784);
    let image = idx(0x08, &[1, 28, 28], &image[16..]);
    let label = mnist_prefix("t10k-labels.idx1-ubyte.gz", 9);
    let label = idx(0x08, &[1], &label[8..]);
    fs::write(idx_dir.join("mnist-t10k-image0.idx"), &image).unwrap();
    fs::write(idx_dir.join("mnist-t10k-image0.idx.gz"), gzip(&image)).unwrap();
    fs::write(idx_dir.join("mnist-t10k-label0.idx"), &label).unwrap();
    // The first bytes of shipped files as they are: a truncated gzip stream, a header and a few
    // pixels of the real training set (truncated: the header promises 60 000 images).
    let gz = fs::read("data/mnist/t10k-labels.idx1-ubyte.gz").unwrap();
    fs::write(idx_dir.join("mnist-t10k-labels-first-512.gz"), &gz[..512]).unwrap();
    fs::write(idx_dir.join("mnist-train-images-first-64.idx"), mnist_prefix("train-images.idx3-ubyte.gz", 64)).unwrap();

    let model_dir = dir.join("model_file");
    fs::create_dir_all(&model_dir).unwrap();
    let mlp = Chain::new(Input::vector(4)).dense(3, Relu).dense(2, Identity).build()?.init(Init::GlorotNormal, 1);
    mlp.save(model_dir.join("mlp.safetensors"))?;
    let cnn = Chain::new(Input::image(1, 5, 5))
        .conv_with(2, (3, 3), LeakyRelu(0.1), ConvOptions { stride: (1, 1), padding: (1, 1) })
        .max_pool((2, 2))
        .flatten()
        .dense(3, Gelu)
        .dense(2, Identity)
        .build()?
        .init(Init::GlorotNormal, 2);
    cnn.save(model_dir.join("cnn.safetensors"))?;
    let other = Chain::new(Input::vector(2)).dense(2, Tanh).dense(2, Sigmoid).build()?.init(Init::GlorotNormal, 3);
    other.save(model_dir.join("tanh-sigmoid.safetensors"))?;
    for name in ["mlp", "cnn"] {
        let bytes = fs::read(model_dir.join(format!("{name}.safetensors"))).unwrap();
        fs::write(model_dir.join(format!("{name}-padded.safetensors")), padded(&bytes, 64)).unwrap();
    }
    Ok(())
}
