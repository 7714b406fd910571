//! Model files: round trip, PyTorch-layout files, and every corrupt-file case.

use flatnn::prelude::*;
use flatnn::testutil::TempDir;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

fn lenet() -> Chain {
    Chain::new(Input::image(1, 12, 12))
        .conv_with(3, (5, 5), Relu, ConvOptions { stride: (1, 1), padding: (2, 2) })
        .max_pool((2, 2))
        .conv(4, (3, 3), Tanh)
        .max_pool((2, 2))
        .flatten()
        .dense(7, LeakyRelu(0.05))
        .dense(3, Identity)
}

fn outputs(model: &Model, x: &[f32]) -> Vec<f32> {
    let mut fwd = model.preallocate(x.len() / model.input_shape().len()).unwrap();
    fwd.set_inputs(x).unwrap();
    model.forward(&mut fwd).unwrap().to_vec()
}

#[test]
fn save_then_load_gives_the_same_outputs_bit_for_bit() {
    let dir = TempDir::new("io-roundtrip");
    let model = lenet().build().unwrap().init(Init::GlorotNormal, 3);
    let x = flatnn::testutil::Rng::new(1).uniform(2 * 144);
    let path = dir.join("lenet.safetensors");
    model.save(&path).unwrap();
    let loaded = Model::load(&path).unwrap();
    assert_eq!(loaded.plan(), model.plan());
    assert_eq!(loaded.parameters().unwrap(), model.parameters().unwrap());
    let (a, b) = (outputs(&model, &x), outputs(&loaded, &x));
    assert_eq!(a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), b.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    // saving again replaces the file and leaves no temporary behind
    model.save(&path).unwrap();
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["lenet.safetensors"]);
    // load_weights into a fresh chain of the same shape
    let mut fresh = lenet().build().unwrap();
    fresh.load_weights(&path).unwrap();
    assert_eq!(fresh.parameters().unwrap(), model.parameters().unwrap());
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes a safetensors file the way `safetensors.torch.save_file(model.state_dict())` does:
/// no metadata of ours, tensors named by `nn.Sequential` index.
fn write_torch_style(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(&str, TensorView)> = tensors.iter().map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap())).collect();
    let metadata = Some(HashMap::from([("format".to_owned(), "pt".to_owned())]));
    std::fs::write(path, safetensors::serialize(views, &metadata).unwrap()).unwrap();
}

/// Sequential(Linear(2, 2), ReLU(), Linear(2, 1)) with weights chosen so the output is easy
/// to compute by hand.
fn tiny_torch_file(path: &Path) {
    write_torch_style(
        path,
        &[
            ("0.weight", Dtype::F32, vec![2, 2], f32_bytes(&[1.0, 2.0, -1.0, 0.5])),
            ("0.bias", Dtype::F32, vec![2], f32_bytes(&[0.5, -3.0])),
            ("2.weight", Dtype::F32, vec![1, 2], f32_bytes(&[2.0, -4.0])),
            ("2.bias", Dtype::F32, vec![1], f32_bytes(&[0.25])),
        ],
    );
}

#[test]
fn a_pytorch_state_dict_loads_and_computes_what_pytorch_would() {
    let dir = TempDir::new("io-torch");
    let path = dir.join("tiny.safetensors");
    tiny_torch_file(&path);
    let mut model = Chain::new(Input::vector(2)).dense(2, Relu).dense(1, Identity).build().unwrap();
    model.load_weights(&path).unwrap();
    // x = (1, 2): h = relu(1·1 + 2·2 + 0.5, −1 + 1 − 3) = (5.5, 0); y = 2·5.5 − 0 + 0.25
    // x = (−2, 4): h = relu(−2 + 8 + 0.5, 2 + 2 − 3) = (6.5, 1); y = 13 − 4 + 0.25
    assert_eq!(outputs(&model, &[1.0, 2.0, -2.0, 4.0]), [11.25, 9.25]);
    // without our metadata, Model::load cannot know the architecture, and says so
    let err = Model::load(&path).unwrap_err();
    assert!(err.to_string().contains("load_weights"), "{err}");
}

#[test]
fn corrupt_and_mismatched_files_are_refused_by_name() {
    let dir = TempDir::new("io-corrupt");
    let good = dir.join("good.safetensors");
    tiny_torch_file(&good);
    let bytes = std::fs::read(&good).unwrap();
    let chain = || Chain::new(Input::vector(2)).dense(2, Relu).dense(1, Identity);
    let w = |n: &'static str, shape: Vec<usize>| (n, Dtype::F32, shape.clone(), f32_bytes(&vec![0.0; shape.iter().product()]));
    type Writer = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Writer, &str)> = vec![
        ("empty", Box::new(|p: &Path| std::fs::write(p, b"").unwrap()), "not a valid safetensors"),
        ("truncated", Box::new(move |p: &Path| std::fs::write(p, &bytes[..bytes.len() - 3]).unwrap()), "not a valid safetensors"),
        ("garbage", Box::new(|p: &Path| std::fs::write(p, [0xffu8; 64]).unwrap()), "not a valid safetensors"),
        (
            "missing",
            Box::new(move |p: &Path| write_torch_style(p, &[w("0.weight", vec![2, 2]), w("0.bias", vec![2]), w("2.weight", vec![1, 2])])),
            "2.bias [1] is missing",
        ),
        (
            "extra",
            Box::new(move |p: &Path| {
                write_torch_style(
                    p,
                    &[
                        w("0.weight", vec![2, 2]),
                        w("0.bias", vec![2]),
                        w("2.weight", vec![1, 2]),
                        w("2.bias", vec![1]),
                        w("4.weight", vec![1]),
                    ],
                )
            }),
            "\"4.weight\"",
        ),
        (
            "misshaped",
            Box::new(move |p: &Path| {
                write_torch_style(p, &[w("0.weight", vec![2, 3]), w("0.bias", vec![2]), w("2.weight", vec![1, 2]), w("2.bias", vec![1])])
            }),
            "0.weight has shape [2, 3], expected [2, 2]",
        ),
        (
            "f64",
            Box::new(move |p: &Path| {
                let f64_weight = ("0.weight", Dtype::F64, vec![2, 2], vec![0u8; 32]);
                write_torch_style(p, &[f64_weight, w("0.bias", vec![2]), w("2.weight", vec![1, 2]), w("2.bias", vec![1])])
            }),
            "0.weight is F64",
        ),
        (
            "nan",
            Box::new(move |p: &Path| {
                let nan_bias = ("2.bias", Dtype::F32, vec![1], f32_bytes(&[f32::NAN]));
                write_torch_style(p, &[w("0.weight", vec![2, 2]), w("0.bias", vec![2]), w("2.weight", vec![1, 2]), nan_bias])
            }),
            "tensor 2.bias holds NaN or an infinity (value 0 of [1])",
        ),
        (
            "infinite",
            Box::new(move |p: &Path| {
                let inf_weight = ("0.weight", Dtype::F32, vec![2, 2], f32_bytes(&[0.0, 0.0, f32::NEG_INFINITY, 0.0]));
                write_torch_style(p, &[inf_weight, w("0.bias", vec![2]), w("2.weight", vec![1, 2]), w("2.bias", vec![1])])
            }),
            "tensor 0.weight holds NaN or an infinity (value 2 of [2, 2])",
        ),
    ];
    for (name, write, needle) in cases {
        let path = dir.join(format!("{name}.safetensors"));
        write(&path);
        let mut model = chain().build().unwrap().init(Init::GlorotNormal, 1);
        let before = model.parameters().unwrap().to_vec();
        let err = model.load_weights(&path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Format { .. }), "{name}: {msg}");
        assert!(msg.contains(needle) && msg.contains(&format!("{name}.safetensors")), "{name}: {msg:?} lacks {needle:?}");
        assert_eq!(&*model.parameters().unwrap(), &before[..], "{name}: a refused file changed the parameters");
    }
    assert!(matches!(Model::load(dir.join("absent.safetensors")), Err(Error::Io { .. })));
    // a model file (our metadata) with an infinite weight: refused by Model::load too
    let mut model = chain().build().unwrap();
    model.parameters_mut().unwrap()[1] = f32::INFINITY;
    let infinite = dir.join("infinite-weight.safetensors");
    model.save(&infinite).unwrap();
    let err = Model::load(&infinite).unwrap_err();
    assert!(err.to_string().contains("tensor 0.weight holds NaN or an infinity (value 1 of [2, 2])"), "{err}");
    // a failed save names the file asked for (not the temporary) and the step that failed
    let target = dir.join("no/such/dir/m.safetensors");
    match model.save(&target) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, target);
            assert!(source.to_string().starts_with("creating a temporary file beside it: "), "{source}");
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

#[test]
fn saves_from_many_threads_to_one_path_all_succeed() {
    let dir = TempDir::new("io-threads");
    let path = dir.join("lenet.safetensors");
    let model = lenet().build().unwrap().init(Init::GlorotNormal, 3);
    let failures: Vec<String> = std::thread::scope(|s| {
        let savers: Vec<_> = (0..8).map(|_| s.spawn(|| (0..50).filter_map(|_| model.save(&path).err()).collect::<Vec<_>>())).collect();
        savers.into_iter().flat_map(|saver| saver.join().unwrap()).map(|e| e.to_string()).collect()
    });
    assert!(failures.is_empty(), "{} of 400 saves failed, the first: {}", failures.len(), failures[0]);
    assert_eq!(Model::load(&path).unwrap().parameters().unwrap(), model.parameters().unwrap());
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["lenet.safetensors"], "temporary files were left behind");
}

#[cfg(unix)]
#[test]
fn a_save_keeps_the_permissions_of_the_file_it_replaces() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("io-permissions");
    let path = dir.join("m.safetensors");
    let model = lenet().build().unwrap();
    model.save(&path).unwrap();
    for mode in [0o600, 0o644, 0o444] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        model.save(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, mode);
    }
}

#[test]
fn bad_architecture_metadata_is_a_format_error() {
    let dir = TempDir::new("io-arch");
    let path = dir.join("m.safetensors");
    let views: Vec<(&str, TensorView)> = vec![];
    for arch in ["vector 0; dense 3 relu", "vector 2; dense 3 swish", "image 2 2 1; dense 3 relu", "nonsense"] {
        let metadata = Some(HashMap::from([("flatnn.architecture".to_owned(), arch.to_owned())]));
        std::fs::write(&path, safetensors::serialize(views.clone(), &metadata).unwrap()).unwrap();
        let err = Model::load(&path).unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{arch}: {err}");
    }
}
