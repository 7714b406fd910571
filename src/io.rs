//! Model files: standard safetensors, readable by PyTorch and friends.
//!
//! Tensors are named as PyTorch names an `nn.Sequential` of the same layers, counting every
//! module, activations, pools and flatten included: an MLP 784-128(relu)-10 is
//! `Sequential(Linear, ReLU, Linear)`, so its tensors are `0.weight`, `0.bias`, `2.weight`,
//! `2.bias` (each layer's module path is its plan step's, `Step::module`; a residual block's
//! body is `{i}.body.{j}`, see `layers/residual.rs`). Buffers (running statistics and the like)
//! are saved beside the parameters under their PyTorch names too (`1.running_mean`). Layouts
//! are PyTorch's (Linear (out, in); Conv2d (out, in, kh, kw)), f32, little-endian, but for
//! counts (batch norm's `num_batches_tracked`), which PyTorch keeps as 64-bit integers: I64.
//! The architecture is stored in the metadata under `flatnn.architecture`, so
//! [`Model::load`] rebuilds the chain with no code.

use crate::activation::Activation;
use crate::cache::first_non_finite;
use crate::chain::{Fill, Layer, Plan, Shape, Step};
use crate::error::{Error, Result};
use crate::layers::conv;
use crate::model::Model;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) const ARCHITECTURE_KEY: &str = "flatnn.architecture";

/// The prefix of a checkpoint's optimiser tensors (src/checkpoint.rs), which model loading
/// passes over.
pub(crate) const OPTIMIZER_PREFIX: &str = "optimizer.";

/// The most values one sample of a loaded model may need, in its activations (all layers
/// together) and in any convolution's lowered input: 2³⁰ (4 GiB of f32), as for an IDX file.
pub const MAX_SAMPLE_VALUES: usize = 1 << 30;

/// A tensor as a file holds it: name, type, little-endian bytes, shape.
pub(crate) type FileTensor = (String, Dtype, Vec<u8>, Vec<usize>);

/// One parameter or buffer tensor of the model, as PyTorch would name and shape it, and its
/// range in the model's flat parameters or buffers.
pub(crate) struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: std::ops::Range<usize>,
    /// A count, which files hold as a 64-bit integer ([`Fill::Count`]).
    pub count: bool,
}

/// Every parameter tensor in PyTorch's naming (`{module}.{name}`), a layer's in the order of
/// their names (as a file lists them).
pub(crate) fn tensors(plan: &Plan) -> Vec<Tensor> {
    named(plan, |step| &step.tensors)
}

/// Every buffer tensor, as [`tensors`].
pub(crate) fn buffer_tensors(plan: &Plan) -> Vec<Tensor> {
    named(plan, |step| &step.buffers)
}

fn named(plan: &Plan, of: impl Fn(&Step) -> &[crate::chain::Tensor]) -> Vec<Tensor> {
    let mut out = Vec::new();
    for step in &plan.steps {
        let mut own: Vec<Tensor> = of(step)
            .iter()
            .map(|t| Tensor {
                name: format!("{}.{}", step.module, t.name),
                shape: t.shape.clone(),
                range: t.range.clone(),
                count: t.fill == Fill::Count,
            })
            .collect();
        own.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(own);
    }
    out
}

/// The architecture as one line of text (see `parse_architecture`).
pub(crate) fn describe(plan: &Plan) -> String {
    let mut parts = vec![match plan.input {
        Shape::Vector(n) => format!("vector {n}"),
        Shape::Image { channels, height, width } => format!("image {height} {width} {channels}"),
        Shape::Sequence { steps, features } => format!("sequence {steps} {features}"),
        Shape::Signal { channels, length } => format!("signal {channels} {length}"),
    }];
    parts.extend(plan.steps.iter().map(|step| step.layer.describe()));
    parts.join("; ")
}

/// The words of one entry of an architecture, for the layer kind it names to read its numbers
/// from, and to say what is wrong with them.
pub(crate) struct Words<'a> {
    part: &'a str,
    words: Vec<&'a str>,
    path: &'a Path,
}

impl Words<'_> {
    fn bad(&self, what: String) -> Error {
        Error::Format { path: self.path.to_path_buf(), what }
    }

    /// The first word (the kind's).
    pub fn first(&self) -> &str {
        self.words.first().copied().unwrap_or("")
    }

    /// How many words, the first included.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// The `N` whole numbers after the first word.
    pub fn numbers<const N: usize>(&self) -> Result<[usize; N]> {
        let part = self.part;
        if self.words.len() < N + 1 {
            return Err(self.bad(format!("architecture entry {part:?} has too few fields")));
        }
        let mut out = [0; N];
        for (n, v) in out.iter_mut().zip(&self.words[1..]) {
            *n = v.parse::<usize>().map_err(|_| self.bad(format!("{v:?} in {part:?} is not a whole number")))?;
        }
        Ok(out)
    }

    /// Word `at` as a real number (a dropout's probability).
    pub fn real(&self, at: usize) -> Result<f32> {
        let part = self.part;
        let word = self.words.get(at).ok_or_else(|| self.bad(format!("architecture entry {part:?} has too few fields")))?;
        word.parse::<f32>().map_err(|_| self.bad(format!("{word:?} in {part:?} is not a number")))
    }

    /// The activation named by word `at`, which must be the last.
    pub fn activation(&self, at: usize) -> Result<Activation> {
        let part = self.part;
        match self.words.get(at..) {
            Some([name]) => Activation::from_name(name).ok_or_else(|| self.bad(format!("unknown activation {name:?} in {part:?}"))),
            _ => Err(self.bad(format!("architecture entry {part:?} has the wrong number of fields"))),
        }
    }

    /// Word `at`, which must be the last.
    pub fn last_word(&self, at: usize) -> Result<&str> {
        match self.words.get(at..) {
            Some([word]) => Ok(word),
            _ => Err(self.bad(format!("architecture entry {:?} has the wrong number of fields", self.part))),
        }
    }

    /// The error for an entry no layer kind reads.
    pub fn unknown(&self) -> Error {
        self.bad(format!("unknown architecture entry {:?}", self.part))
    }
}

/// Parses what `describe` writes.
fn parse_architecture(text: &str, path: &Path) -> Result<(Shape, Vec<Layer>)> {
    let bad = |what: String| Error::Format { path: path.to_path_buf(), what };
    let mut parts = text.split(';').map(str::trim);
    let words = |part| Words { part, words: part.split_whitespace().collect(), path };
    let first = parts.next().unwrap_or("");
    let w = words(first);
    let input = match (w.first(), w.len()) {
        ("vector", 2) => Shape::Vector(w.numbers::<1>()?[0]),
        ("image", 4) => {
            // the file keeps its order, height width channels
            let [height, width, channels] = w.numbers()?;
            Shape::image(channels, height, width)
        }
        ("sequence", 3) => {
            let [steps, features] = w.numbers()?;
            Shape::sequence(steps, features)
        }
        ("signal", 3) => {
            let [channels, length] = w.numbers()?;
            Shape::signal(channels, length)
        }
        _ => return Err(bad(format!("the architecture must start with the input shape, not {first:?}"))),
    };
    let mut layers = Vec::new();
    for part in parts {
        let w = words(part);
        layers.push(Layer::parse(&w).unwrap_or_else(|| Err(w.unknown()))?);
    }
    Ok((input, layers))
}

/// Checks the sizes a plan read from a file implies, before [`Model`] allocates its parameters
/// and anyone a cache for it: the parameters fit in the file's `file_len` bytes (4 each, so the
/// file bounds their buffer); one sample's activations, and each convolution's lowered input,
/// stay within [`MAX_SAMPLE_VALUES`]. ([`Plan::new`] has checked that no size overflows.)
fn check_sizes(plan: &Plan, file_len: usize, path: &Path) -> Result<()> {
    let bad = |what: String| Err(Error::Format { path: path.to_owned(), what });
    let over = |n: usize| n > MAX_SAMPLE_VALUES;
    let more = format!("more than {MAX_SAMPLE_VALUES} values per sample");
    for (index, step) in plan.steps.iter().enumerate() {
        let layer = step.layer;
        if conv::is_conv(&layer) && over(conv::geometry(step).col_len()) {
            return bad(format!("layer {index} ({layer:?}) lowers its input to {more}"));
        }
        if over(step.output.len()) {
            return bad(format!("layer {index} ({layer:?}) outputs {}: {more}", step.output));
        }
        // regions are laid out in step order: those up to this step's output are its activations
        if over(plan.regions[..=step.output_region].iter().sum()) {
            return bad(format!("layers 0..={index} (to {layer:?}) give activations of {more}"));
        }
        // at most plan::MAX_VALUES parameters: four times that does not overflow
        if step.params.end * 4 > file_len {
            return bad(format!(
                "layers 0..={index} (to {layer:?}) have more parameters than the file's {file_len} bytes can hold (4 bytes each)"
            ));
        }
    }
    if (plan.param_len + plan.buffer_len) * 4 > file_len {
        return bad(format!("the model's parameters and buffers need more than the file's {file_len} bytes (4 bytes each)"));
    }
    Ok(())
}

impl Model {
    /// Writes the model as a safetensors file (atomically: a temporary file beside `path`,
    /// then a rename, so a crash never leaves a half-written model).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.file_tensors()?;
        let views = views(&bytes, path)?;
        let metadata = Some(HashMap::from([(ARCHITECTURE_KEY.to_owned(), describe(&self.plan))]));
        let file = safetensors::serialize(views, &metadata).map_err(|e| format_err(path, e))?;
        write_atomically(path, &file)
    }

    /// Reads a model written by [`Model::save`] (or a checkpoint, [`Model::save_checkpoint`],
    /// whose optimiser state it passes over): rebuilds its chain from the file's metadata and
    /// fills its parameters.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        Model::from_bytes(&bytes, path)
    }

    /// [`Model::load`] from bytes in memory; `path` only names the source in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Model> {
        let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| format_err(path, e))?;
        let architecture = metadata.metadata().as_ref().and_then(|m| m.get(ARCHITECTURE_KEY)).ok_or_else(|| Error::Format {
            path: path.to_owned(),
            what: format!("no {ARCHITECTURE_KEY} metadata: use load_weights on a chain"),
        })?;
        let (input, layers) = parse_architecture(architecture, path)?;
        if input.len() > MAX_SAMPLE_VALUES {
            let what = format!("the input {input} has more than {MAX_SAMPLE_VALUES} values per sample");
            return Err(Error::Format { path: path.to_owned(), what });
        }
        let plan =
            Plan::new(input, &layers).map_err(|e| Error::Format { path: path.to_owned(), what: format!("bad architecture: {e}") })?;
        check_sizes(&plan, bytes.len(), path)?;
        let mut model = Model::from_plan(plan)?;
        model.fill_from(bytes, path)?;
        Ok(model)
    }

    /// Fills this model's parameters and buffers from a safetensors file written elsewhere (for
    /// example a PyTorch `state_dict` of the matching `nn.Sequential`). Missing, extra,
    /// mis-shaped or non-f32 tensors, and tensors holding NaN or infinities, are refused, by
    /// name, before any parameter changes.
    pub fn load_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        self.fill_from(&bytes, path)
    }

    fn fill_from(&mut self, bytes: &[u8], path: &Path) -> Result<()> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| format_err(path, e))?;
        let (params, buffers) = self.read_tensors(&file, path)?;
        self.set_parameters(&params)?;
        self.set_buffers(&buffers)
    }

    /// Every parameter and buffer tensor of the model as a file holds it.
    pub(crate) fn file_tensors(&self) -> Result<Vec<FileTensor>> {
        let (params, buffers) = (self.parameters()?, self.buffers()?);
        let bytes = |values: &[f32]| values.iter().flat_map(|v| v.to_le_bytes()).collect();
        // a count is a whole number in f32 (it goes up by one a pass)
        let counts = |values: &[f32]| values.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        let params = tensors(&self.plan).into_iter().map(|t| (t.name, Dtype::F32, bytes(&params[t.range]), t.shape));
        let buffers = buffer_tensors(&self.plan).into_iter().map(|t| match t.count {
            true => (t.name, Dtype::I64, counts(&buffers[t.range]), t.shape),
            false => (t.name, Dtype::F32, bytes(&buffers[t.range]), t.shape),
        });
        Ok(params.chain(buffers).collect())
    }

    /// This model's parameters and buffers as `file` holds them (its optimiser tensors passed
    /// over), every tensor checked; the model is not changed.
    pub(crate) fn read_tensors(&self, file: &SafeTensors, path: &Path) -> Result<(Vec<f32>, Vec<f32>)> {
        let (wanted, wanted_buffers) = (tensors(&self.plan), buffer_tensors(&self.plan));
        let known = |n: &str| n.starts_with(OPTIMIZER_PREFIX) || wanted.iter().chain(&wanted_buffers).any(|t| t.name == n);
        let mut extra: Vec<&String> = file.names().into_iter().filter(|n| !known(n)).collect();
        extra.sort();
        if !extra.is_empty() {
            return Err(Error::Format { path: path.to_owned(), what: format!("tensors this model does not have: {extra:?}") });
        }
        let (mut params, mut buffers) = (self.parameters()?.into_owned(), self.buffers()?.into_owned());
        for t in &wanted {
            read_f32(file, &t.name, &t.shape, &mut params[t.range.clone()], path)?;
        }
        for t in &wanted_buffers {
            match t.count {
                true => read_count(file, &t.name, &t.shape, &mut buffers[t.range.clone()], path)?,
                false => read_f32(file, &t.name, &t.shape, &mut buffers[t.range.clone()], path)?,
            }
        }
        Ok((params, buffers))
    }
}

/// The views safetensors writes of `entries`.
pub(crate) fn views<'a>(entries: &'a [FileTensor], path: &Path) -> Result<Vec<(&'a str, TensorView<'a>)>> {
    entries
        .iter()
        .map(|(name, dtype, data, shape)| {
            Ok((name.as_str(), TensorView::new(*dtype, shape.clone(), data).map_err(|e| format_err(path, e))?))
        })
        .collect()
}

/// Copies the count `name` of `file`, which must be I64 of `shape` (as PyTorch writes
/// `num_batches_tracked`), into `out` as f32 (exact up to 2²⁴; a negative count is refused).
fn read_count(file: &SafeTensors, name: &str, shape: &[usize], out: &mut [f32], path: &Path) -> Result<()> {
    let bad = |what: String| Err(Error::Format { path: path.to_owned(), what });
    let Ok(view) = file.tensor(name) else {
        return bad(format!("tensor {name} {shape:?} is missing"));
    };
    if view.dtype() != Dtype::I64 {
        return bad(format!("tensor {name} is {:?}, expected I64 (a count)", view.dtype()));
    }
    if view.shape() != shape {
        return bad(format!("tensor {name} has shape {:?}, expected {shape:?}", view.shape()));
    }
    for (v, b) in out.iter_mut().zip(view.data().chunks_exact(8)) {
        let count = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        if count < 0 {
            return bad(format!("tensor {name} holds a negative count, {count}"));
        }
        *v = count as f32;
    }
    Ok(())
}

/// Copies the tensor `name` of `file`, which must be F32 of `shape`, into `out` (as many values).
pub(crate) fn read_f32(file: &SafeTensors, name: &str, shape: &[usize], out: &mut [f32], path: &Path) -> Result<()> {
    let bad = |what: String| Err(Error::Format { path: path.to_owned(), what });
    let Ok(view) = file.tensor(name) else {
        return bad(format!("tensor {name} {shape:?} is missing"));
    };
    if view.dtype() != Dtype::F32 {
        return bad(format!("tensor {name} is {:?}, expected F32", view.dtype()));
    }
    if view.shape() != shape {
        return bad(format!("tensor {name} has shape {:?}, expected {shape:?}", view.shape()));
    }
    debug_assert_eq!(out.len(), shape.iter().product::<usize>());
    for (v, b) in out.iter_mut().zip(view.data().chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    if let Some(index) = first_non_finite(out) {
        return bad(format!("tensor {name} holds NaN or an infinity (value {index} of {shape:?})"));
    }
    Ok(())
}

pub(crate) fn format_err(path: &Path, e: safetensors::SafeTensorError) -> Error {
    Error::Format { path: path.to_owned(), what: format!("not a valid safetensors file: {e}") }
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, gives it the permissions of the
/// file it replaces (if any), renames it over `path`, and syncs the folder, so that the rename
/// too is on disk. The temporary file's name is new to each call (this process's id, a count
/// of its saves, and the clock's nanoseconds, in case a crashed process with the same id left
/// one behind), so saves to one path from several threads or processes never share one: the
/// last rename wins, whole. Errors name `path` and the step that failed; after a failure the
/// temporary file is removed.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let failed = |step: &'static str| {
        move |e: io::Error| Error::Io { path: path.to_owned(), source: io::Error::new(e.kind(), format!("{step}: {e}")) }
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Config(format!("{} is not a file name", path.display())))?;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |t| t.subsec_nanos());
    let count = SAVES.fetch_add(1, Ordering::Relaxed);
    let tmp: PathBuf = dir.join(format!(".{}.tmp-{}-{count}-{nanos}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut file = File::create_new(&tmp).map_err(failed("creating a temporary file beside it"))?;
        if let Ok(old) = std::fs::metadata(path) {
            file.set_permissions(old.permissions()).map_err(failed("giving the temporary file its permissions"))?;
        }
        file.write_all(bytes).map_err(failed("writing a temporary file beside it"))?;
        file.sync_all().map_err(failed("syncing a temporary file beside it"))?;
        std::fs::rename(&tmp, path).map_err(failed("renaming a temporary file over it"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    match sync_folder(dir) {
        // some file systems cannot sync a folder (EINVAL); there the rename is as durable as
        // they make it
        Err(e) if !matches!(e.kind(), io::ErrorKind::InvalidInput | io::ErrorKind::Unsupported) => Err(failed("syncing its folder")(e)),
        _ => Ok(()),
    }
}

/// Flushes a folder's entries (a rename in it) to disk.
#[cfg(unix)]
fn sync_folder(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Elsewhere a folder cannot be opened as a file; NTFS logs a rename in its journal.
#[cfg(not(unix))]
fn sync_folder(_dir: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConvOptions, Identity, Relu};

    #[test]
    fn architecture_round_trips_and_names_follow_sequential() {
        let model = crate::Chain::new(Shape::image(1, 28, 28))
            .conv_with(6, (5, 5), Relu, ConvOptions { stride: (1, 1), padding: (2, 2) })
            .max_pool((2, 2))
            .flatten()
            .dense(10, Activation::LeakyRelu(0.25))
            .dense(3, Activation::Identity)
            .build()
            .unwrap();
        let text = describe(&model.plan);
        let (input, layers) = parse_architecture(&text, Path::new("x")).unwrap();
        assert_eq!(Plan::new(input, &layers).unwrap(), *model.plan);
        let names: Vec<String> = tensors(&model.plan).into_iter().map(|t| t.name).collect();
        // Conv2d(0) ReLU(1) MaxPool2d(2) Flatten(3) Linear(4) LeakyReLU(5) Linear(6)
        assert_eq!(names, ["0.bias", "0.weight", "4.bias", "4.weight", "6.bias", "6.weight"]);
        for bad in
            ["", "vector", "vector x", "image 1 2; dense 3 relu", "vector 3; dense 3 swish", "vector 3; pool 2 2 2 2", "vector 3; dense 3"]
        {
            assert!(matches!(parse_architecture(bad, Path::new("x")), Err(Error::Format { .. })), "{bad:?}");
        }
    }

    #[test]
    fn a_sequence_input_round_trips() {
        let model = crate::Chain::new(Shape::sequence(8, 3)).flatten().dense(2, Relu).build().unwrap();
        let text = describe(&model.plan);
        assert_eq!(text, "sequence 8 3; flatten; dense 2 relu");
        let (input, layers) = parse_architecture(&text, Path::new("x")).unwrap();
        assert_eq!(Plan::new(input, &layers).unwrap(), *model.plan);
        for bad in ["sequence 8", "sequence 8 x", "sequence 8 3 1"] {
            assert!(matches!(parse_architecture(bad, Path::new("x")), Err(Error::Format { .. })), "{bad:?}");
        }
    }

    #[test]
    fn buffers_are_written_and_read_under_their_modules_names() {
        // No layer kind declares a buffer yet: give the second dense layer one by hand, as batch
        // norm declares `running_mean`.
        let layers =
            [crate::Dense { out_features: 4, activation: Relu }.into(), crate::Dense { out_features: 2, activation: Identity }.into()];
        let mut plan = Plan::new(Shape::vector(3), &layers).unwrap();
        let mean = crate::chain::Tensor { name: "running_mean", shape: vec![2], range: 0..2, fill: crate::chain::Fill::Constant(0.5) };
        plan.steps[1].buffers.push(mean);
        plan.buffer_len = 2;
        let mut model = Model::from_plan(plan.clone()).unwrap().init(crate::Init::HeNormal, 1);
        assert_eq!(*model.buffers().unwrap(), [0.5, 0.5], "buffers start at their constants");
        model.set_buffers(&[1.5, -2.0]).unwrap();
        assert!(matches!(model.set_buffers(&[f32::NAN, 0.0]), Err(Error::NonFinite { .. })));
        // Linear(0) ReLU(1) Linear(2)
        let names: Vec<String> = model.file_tensors().unwrap().into_iter().map(|(name, ..)| name).collect();
        assert_eq!(names, ["0.bias", "0.weight", "2.bias", "2.weight", "2.running_mean"]);
        let path = std::env::temp_dir().join(format!("flatnn-io-buffers-{}.safetensors", std::process::id()));
        model.save(&path).unwrap();
        let mut copy = Model::from_plan(plan).unwrap();
        copy.load_weights(&path).unwrap();
        assert_eq!(*copy.buffers().unwrap(), [1.5, -2.0]);
        assert_eq!(copy.parameters().unwrap(), model.parameters().unwrap());
        // a model of the same architecture without the buffer does not take the file
        let err = Model::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("tensors this model does not have: [\"2.running_mean\"]"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    /// A safetensors file with no tensors, only the architecture in its metadata.
    fn header_only(architecture: &str) -> Vec<u8> {
        let metadata = Some(HashMap::from([(ARCHITECTURE_KEY.to_owned(), architecture.to_owned())]));
        safetensors::serialize(Vec::<(&str, TensorView)>::new(), &metadata).unwrap()
    }

    fn load_error(bytes: &[u8]) -> String {
        match Model::from_bytes(bytes, Path::new("fuzz.safetensors")) {
            Err(e @ Error::Format { .. }) => e.to_string(),
            Err(e) => panic!("expected a format error, got {e}"),
            Ok(_) => panic!("expected a format error, the model loaded"),
        }
    }

    #[test]
    fn a_leaky_slope_that_is_not_a_number_is_refused() {
        for slope in ["NaN", "inf", "-inf"] {
            let msg = load_error(&header_only(&format!("vector 3; dense 2 leaky_relu:{slope}")));
            assert!(msg.contains("not a finite number"), "{slope}: {msg}");
        }
    }

    #[test]
    fn sizes_from_the_architecture_are_checked_before_anything_is_allocated() {
        // Found by `cargo fuzz run model_file` (crash-2d0088d6…, 223 bytes): a header-only file
        // whose last layer has 30 370 005 002 outputs; loading it tried to allocate 486 GB of
        // zeroed parameters before reading a tensor. Now refused for its sizes, before Plan::new.
        let found = [
            b"\xd7\0\0\0\0\0\0\0".as_slice(),
            br#"{"__metadata__":{"flatnn.architecture":"image 5 5 1; conv 2 3 3 1 1 1 1 leaky_relu:0.1; maxpool 3 3 2 2; flatten;"#,
            b"                                                           ",
            br#"dense 3 gelu; dense 30370005002 identity"}}"#,
        ]
        .concat();
        assert_eq!(found.len(), 223);
        let err = load_error(&found);
        assert!(err.starts_with("fuzz.safetensors: layer 4 (Dense") && err.contains("more than 1073741824 values per sample"), "{err}");
        // The same defect by other routes, and sizes whose arithmetic overflowed in Plan::new
        // (a panic with debug assertions, a wrong plan without).
        let cases = [
            ("vector 1000000000; dense 1 identity", "more parameters"),
            ("vector 4611686018427387904; dense 4 relu", "the input vector(4611686018427387904) has more than"),
            ("vector 100000000; dense 100 relu", "layers 0..=0 (to Dense { out_features: 100, activation: Relu }) have more parameters"),
            ("image 4 4 11073741825; conv 2 3 3 1 1 1 1 relu", "the input image(11073741825×4×4) has more than"),
            ("image 4 4 1000000; conv 2 3 3 1 1 1 1 relu", "have more parameters than the file's"),
            ("image 4294967296 4294967296 4294967296; maxpool 1 1 1 1", "the input image(4294967296×4294967296×4294967296)"),
            ("image 2 2 1; conv 1 1 1 1 1 9223372036854775807 0 relu", "padded input's size overflows"),
            // These loaded, but a cache for one sample would have needed 7 GB.
            ("image 30000 30000 1; maxpool 1 1 1 1", "give activations of more than 1073741824 values per sample"),
            ("image 30000 30000 1; conv 1 1 1 1 1 0 0 relu", "give activations of more than"),
            ("image 1000 1000 1; conv 1 999 999 1 1 998 998 identity", "lowers its input to more than"),
        ];
        for (architecture, needle) in cases {
            let err = load_error(&header_only(architecture));
            assert!(err.contains(needle), "{architecture:?}: {err:?} lacks {needle:?}");
        }
        // Within the limits, a header-only file fails only for its missing tensors; a layer that
        // does not fit its input is still named by Plan::new.
        assert!(load_error(&header_only("vector 4; dense 2 relu")).contains("tensor 0.bias [2] is missing"));
        assert!(load_error(&header_only("vector 4; maxpool 2 2 2 2")).contains("needs an image input"));
    }
}
