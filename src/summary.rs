//! A model's summary, `println!("{model}")`: one row per layer (what it is, its output shape,
//! its parameters, its activation), the totals and where the model lives, as PyTorch's
//! `print(model)` with torchinfo's shapes and counts.

use crate::chain::Step;
use crate::device::Device;
use crate::model::Model;
use std::fmt;

/// `a` where both sides are equal, else `a×b`.
pub(crate) fn pair((a, b): (usize, usize)) -> String {
    if a == b {
        a.to_string()
    } else {
        format!("{a}×{b}")
    }
}

/// `n` with its thousands apart: 109,386.
fn grouped(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The activation's name where the layer takes one (dense, conv), else empty.
fn activation(step: &Step) -> String {
    step.layer.takes_activation().map(|act| act.name()).unwrap_or_default()
}

impl fmt::Display for Model {
    /// The summary: a table of the layers, then the totals and the device, as
    ///
    /// ```text
    ///  #  layer              output       parameters  activation
    ///     input              vector(784)
    ///  0  Dense(784 → 128)   vector(128)     100,480  relu
    ///  …
    /// 109,386 parameters (427.3 KiB), on cpu (2 threads)
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = &self.plan;
        let mut rows = vec![[String::new(), "input".into(), plan.input.to_string(), String::new(), String::new()]];
        for (i, step) in plan.steps.iter().enumerate() {
            // a residual block's body indented under it
            let depth = step.module.matches(".body.").count();
            rows.push([
                i.to_string(),
                format!("{}{}", "  ".repeat(depth), step.layer.summary(step.input)),
                step.output.to_string(),
                grouped(step.params.len()),
                activation(step),
            ]);
        }
        let header = ["#", "layer", "output", "parameters", "activation"].map(String::from);
        let mut widths = [0usize; 5];
        for row in std::iter::once(&header).chain(&rows) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        for row in std::iter::once(&header).chain(&rows) {
            // numbers right-aligned, words left
            let line = format!(
                "{:>w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {}",
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3]
            );
            writeln!(f, "{}", line.trim_end())?;
        }
        let kib = (plan.param_len * size_of::<f32>()) as f64 / 1024.0;
        let place = match self.device() {
            Device::Cpu if self.threads() == 1 => "cpu (1 thread)".into(),
            Device::Cpu => format!("cpu ({} threads)", self.threads()),
            device => device.to_string(),
        };
        write!(f, "{} parameters ({kib:.1} KiB), on {place}", grouped(plan.param_len))
    }
}

impl Clone for Model {
    /// A copy with parameters of its own and the same plan and threads (the thread pool is
    /// shared, as [`Model::to`] shares it: two models used at once from two threads then take
    /// turns on it; [`Model::with_threads`] gives the copy its own). The caches, gradients and
    /// optimisers of one serve the other.
    ///
    /// # Panics
    ///
    /// On a model on a GPU, whose copy could fail: use `model.to(&model.device())?`, which
    /// reports it.
    fn clone(&self) -> Model {
        assert!(self.dev.is_none(), "Model::clone copies a model on the CPU, and this one is on {}: use Model::to", self.device());
        Model {
            plan: std::sync::Arc::clone(&self.plan),
            params: self.params.clone(),
            buffers: std::sync::RwLock::new(self.buffers().expect("a model on the CPU").into_owned()),
            seed: self.seed,
            passes: std::sync::atomic::AtomicU64::new(self.train_passes()),
            pool: std::sync::Arc::clone(&self.pool),
            dev: None,
            gpu_options: self.gpu_options,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_pairs() {
        let cases = [(0, "0"), (999, "999"), (1000, "1,000"), (109_386, "109,386"), (1_234_567, "1,234,567")];
        for (n, want) in cases {
            assert_eq!(grouped(n), want);
        }
        assert_eq!((pair((2, 2)), pair((1, 3))), ("2".into(), "1×3".into()));
    }
}
