//! `--check`: proves the peers run the same networks. For each model, flatnn (CPU, one thread)
//! saves its weights (safetensors, PyTorch's names), a batch of inputs, its outputs and its loss;
//! `zoo.py --check` then recomputes outputs and loss with ONNX Runtime on a graph built from those
//! weights, and with the PyTorch twin and its ONNX export where torch imports.

use crate::engine::{build, data, ZooModel};
use crate::figures::Place;
use crate::Result;
use ::flatnn::prelude::*;
use std::path::Path;
use std::process::Command;

/// An odd batch, so that nothing lines up by accident.
const BATCH: usize = 5;

fn write_f32(path: &Path, values: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).map_err(|source| Error::Io { path: path.to_owned(), source })
}

/// Writes one model's files into `dir`; returns its manifest entry.
fn save(zoo: &ZooModel, dir: &Path) -> Result<serde_json::Value> {
    let model = build(zoo, Place::Cpu1, None)?;
    let (inputs, labels, targets) = data(&model, zoo.loss, BATCH, 5);
    let mut cache = model.preallocate(BATCH)?;
    cache.set_inputs(&inputs)?;
    let outputs = model.forward(&mut cache)?.to_vec();
    if zoo.loss.takes_labels() {
        cache.set_labels(&labels)?
    } else {
        cache.set_targets(&targets)?
    }
    // in inference mode, as the peers compute theirs: a training pass would normalise by the
    // batch's statistics and move the running ones the file holds
    let loss = model.loss(&mut cache, zoo.loss)?;
    let name = zoo.name;
    model.save(dir.join(format!("{name}.safetensors")))?;
    write_f32(&dir.join(format!("{name}.inputs.f32")), &inputs)?;
    write_f32(&dir.join(format!("{name}.outputs.f32")), &outputs)?;
    let mut entry = serde_json::json!({
        "name": name, "batch": BATCH, "weights": format!("{name}.safetensors"),
        "inputs": format!("{name}.inputs.f32"), "outputs": format!("{name}.outputs.f32"),
        "loss": loss,
    });
    if zoo.loss.takes_labels() {
        entry["labels"] = serde_json::json!(labels);
    } else {
        write_f32(&dir.join(format!("{name}.targets.f32")), &targets)?;
        entry["targets"] = serde_json::json!(format!("{name}.targets.f32"));
    }
    Ok(entry)
}

/// Saves every model in `models` under `dir` and runs the peer script's check on them; Ok(true)
/// if every output and loss agreed.
pub fn run(models: &[&ZooModel], dir: &Path, python: &str, script: &Path) -> Result<bool> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_owned(), source })?;
    let entries = models.iter().map(|m| save(m, dir)).collect::<Result<Vec<_>>>()?;
    let manifest = dir.join("manifest.json");
    let text = serde_json::json!({ "models": entries }).to_string();
    std::fs::write(&manifest, text).map_err(|source| Error::Io { path: manifest.clone(), source })?;
    println!("check: flatnn's weights, inputs, outputs and losses in {}", dir.display());
    let status = Command::new(python)
        .arg(script)
        .arg("--check")
        .arg(dir)
        .status()
        .map_err(|e| Error::Config(format!("cannot start {python} {}: {e}", script.display())))?;
    Ok(status.success())
}
