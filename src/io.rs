//! Model files: standard safetensors, readable by PyTorch and friends.
//!
//! Tensors are named as PyTorch names an `nn.Sequential` of the same layers, counting every
//! module, activations, pools and flatten included: an MLP 784-128(relu)-10 is
//! `Sequential(Linear, ReLU, Linear)`, so its tensors are `0.weight`, `0.bias`, `2.weight`,
//! `2.bias`. Layouts are PyTorch's (Linear (out, in); Conv2d (out, in, kh, kw)), f32,
//! little-endian. The architecture is stored in the metadata under `flatnn.architecture`, so
//! [`Model::load`] rebuilds the chain with no code.

use crate::activation::Activation;
use crate::chain::{Layer, Plan, Shape};
use crate::error::{Error, Result};
use crate::model::Model;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

const ARCHITECTURE_KEY: &str = "flatnn.architecture";

/// One parameter tensor of the model, as PyTorch would name and shape it.
struct Tensor {
    name: String,
    shape: Vec<usize>,
    range: std::ops::Range<usize>,
}

/// Every parameter tensor in PyTorch's `nn.Sequential` naming.
fn tensors(plan: &Plan) -> Vec<Tensor> {
    let mut out = Vec::new();
    let mut module = 0usize;
    for step in &plan.steps {
        let (w, b) = step.weight_and_bias();
        let weight_shape = match (step.layer, step.input) {
            (Layer::Dense { out_features, .. }, input) => Some(vec![out_features, input.len()]),
            (Layer::Conv { out_channels, kernel, .. }, Shape::Image { channels, .. }) => {
                Some(vec![out_channels, channels, kernel.0, kernel.1])
            }
            _ => None,
        };
        if let Some(shape) = weight_shape {
            out.push(Tensor { name: format!("{module}.bias"), shape: vec![shape[0]], range: b });
            out.push(Tensor { name: format!("{module}.weight"), shape, range: w });
        }
        module += 1 + usize::from(step.layer.activation() != Activation::Identity);
    }
    out
}

/// The architecture as one line of text (see `parse_architecture`).
fn describe(plan: &Plan) -> String {
    let mut parts = vec![match plan.input {
        Shape::Vector(n) => format!("vector {n}"),
        Shape::Image { channels, height, width } => format!("image {height} {width} {channels}"),
    }];
    for step in &plan.steps {
        parts.push(match step.layer {
            Layer::Dense { out_features, activation } => format!("dense {out_features} {}", activation.name()),
            Layer::Conv { out_channels, kernel, stride, padding, activation } => format!(
                "conv {out_channels} {} {} {} {} {} {} {}",
                kernel.0,
                kernel.1,
                stride.0,
                stride.1,
                padding.0,
                padding.1,
                activation.name()
            ),
            Layer::MaxPool { window, stride } => format!("maxpool {} {} {} {}", window.0, window.1, stride.0, stride.1),
            Layer::Flatten => "flatten".into(),
        });
    }
    parts.join("; ")
}

/// Parses what `describe` writes.
fn parse_architecture(text: &str, path: &Path) -> Result<(Shape, Vec<Layer>)> {
    let bad = |what: String| Error::Format { path: path.to_path_buf(), what };
    let mut parts = text.split(';').map(str::trim);
    let words = |part: &str| part.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let numbers = |w: &[String], n: usize, part: &str| -> Result<Vec<usize>> {
        if w.len() < n {
            return Err(bad(format!("architecture entry {part:?} has too few fields")));
        }
        w[..n].iter().map(|v| v.parse::<usize>().map_err(|_| bad(format!("{v:?} in {part:?} is not a whole number")))).collect()
    };
    let activation = |w: &[String], part: &str| -> Result<Activation> {
        match w {
            [name] => Activation::from_name(name).ok_or_else(|| bad(format!("unknown activation {name:?} in {part:?}"))),
            _ => Err(bad(format!("architecture entry {part:?} has the wrong number of fields"))),
        }
    };
    let first = parts.next().unwrap_or("");
    let w = words(first);
    let input = match w.first().map(String::as_str) {
        Some("vector") if w.len() == 2 => Shape::Vector(numbers(&w[1..], 1, first)?[0]),
        Some("image") if w.len() == 4 => {
            let n = numbers(&w[1..], 3, first)?;
            Shape::image(n[0], n[1], n[2])
        }
        _ => return Err(bad(format!("the architecture must start with the input shape, not {first:?}"))),
    };
    let mut layers = Vec::new();
    for part in parts {
        let w = words(part);
        let layer = match w.first().map(String::as_str) {
            Some("dense") => Layer::Dense { out_features: numbers(&w[1..], 1, part)?[0], activation: activation(&w[2..], part)? },
            Some("conv") => {
                let n = numbers(&w[1..], 7, part)?;
                Layer::Conv {
                    out_channels: n[0],
                    kernel: (n[1], n[2]),
                    stride: (n[3], n[4]),
                    padding: (n[5], n[6]),
                    activation: activation(&w[8..], part)?,
                }
            }
            Some("maxpool") if w.len() == 5 => {
                let n = numbers(&w[1..], 4, part)?;
                Layer::MaxPool { window: (n[0], n[1]), stride: (n[2], n[3]) }
            }
            Some("flatten") if w.len() == 1 => Layer::Flatten,
            _ => return Err(bad(format!("unknown architecture entry {part:?}"))),
        };
        layers.push(layer);
    }
    Ok((input, layers))
}

impl Model {
    /// Writes the model as a safetensors file (atomically: a temporary file beside `path`,
    /// then a rename, so a crash never leaves a half-written model).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let params = self.parameters()?;
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors(&self.plan)
            .into_iter()
            .map(|t| (t.name, params[t.range].iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape))
            .collect();
        let views = bytes
            .iter()
            .map(|(name, data, shape)| {
                Ok((name.as_str(), TensorView::new(Dtype::F32, shape.clone(), data).map_err(|e| format_err(path, e))?))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = Some(HashMap::from([(ARCHITECTURE_KEY.to_owned(), describe(&self.plan))]));
        let file = safetensors::serialize(views, &metadata).map_err(|e| format_err(path, e))?;
        write_atomically(path, &file)
    }

    /// Reads a model written by [`Model::save`]: rebuilds its chain from the file's metadata
    /// and fills its parameters.
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
        let plan =
            Plan::new(input, &layers).map_err(|e| Error::Format { path: path.to_owned(), what: format!("bad architecture: {e}") })?;
        let mut model = Model::from_plan(plan)?;
        model.fill_from(bytes, path)?;
        Ok(model)
    }

    /// Fills this model's parameters from a safetensors file written elsewhere (for example
    /// a PyTorch `state_dict` of the matching `nn.Sequential`). Missing, extra, mis-shaped or
    /// non-f32 tensors are refused, by name, before any parameter changes.
    pub fn load_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
        self.fill_from(&bytes, path)
    }

    fn fill_from(&mut self, bytes: &[u8], path: &Path) -> Result<()> {
        let file = SafeTensors::deserialize(bytes).map_err(|e| format_err(path, e))?;
        let wanted = tensors(&self.plan);
        let bad = |what: String| Err(Error::Format { path: path.to_owned(), what });
        let mut extra: Vec<&String> = file.names().into_iter().filter(|n| !wanted.iter().any(|t| &t.name == *n)).collect();
        extra.sort();
        if !extra.is_empty() {
            return bad(format!("tensors this model does not have: {extra:?}"));
        }
        let mut views = Vec::with_capacity(wanted.len());
        for t in &wanted {
            let Ok(view) = file.tensor(&t.name) else {
                return bad(format!("tensor {} {:?} is missing", t.name, t.shape));
            };
            if view.dtype() != Dtype::F32 {
                return bad(format!("tensor {} is {:?}, expected F32", t.name, view.dtype()));
            }
            if view.shape() != t.shape.as_slice() {
                return bad(format!("tensor {} has shape {:?}, expected {:?}", t.name, view.shape(), t.shape));
            }
            views.push(view);
        }
        let mut params = self.parameters()?.into_owned();
        for (t, view) in wanted.iter().zip(views) {
            for (p, b) in params[t.range.clone()].iter_mut().zip(view.data().chunks_exact(4)) {
                *p = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        self.set_parameters(&params)
    }
}

fn format_err(path: &Path, e: safetensors::SafeTensorError) -> Error {
    Error::Format { path: path.to_owned(), what: format!("not a valid safetensors file: {e}") }
}

/// Writes `bytes` to a temporary file in `path`'s folder, syncs it, and renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Config(format!("{} is not a file name", path.display())))?;
    let tmp: PathBuf = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(bytes).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConvOptions, Relu};

    #[test]
    fn architecture_round_trips_and_names_follow_sequential() {
        let model = crate::Chain::new(Shape::image(28, 28, 1))
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
}
