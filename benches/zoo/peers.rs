//! The peers (`benches/peers/zoo.py --serve`): one Python process for the whole run, asked for one
//! point at a time right after flatnn measured it, so that both sides of a ratio are taken a few
//! seconds apart (a shared host drifts over a run). It waits on its input between points.
//!
//! Protocol, one JSON object a line: the process first writes `@zoo {"env", "not_importable", "params"}`,
//! then, for each request `{"model", "device", "batch", "tasks", "cpu_clock"}` on its input, one
//! `@zoo {"results", "missing", "onnx_source"}`. Other lines it writes are passed on to stderr.

use crate::figures::{Figure, Place, Task};
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

pub struct Peer {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    /// Versions, GPU name and the like, as the script found them.
    pub env: Vec<(String, String)>,
    /// What the script could not import (and so which peers cannot run), if anything.
    pub not_importable: String,
    /// Parameter count of each model the peers know.
    pub params: Vec<(String, usize)>,
    /// How each model's ONNX file was made.
    pub onnx_source: Vec<(String, String)>,
    /// (place, task, peer, why) for peers that could not run at all.
    pub missing: Vec<(String, String, String, String)>,
    /// Seconds spent waiting for the peers' points.
    pub seconds: f64,
}

fn string(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "none".into(),
        other => other.to_string(),
    }
}

fn pairs(v: &Value) -> Vec<(String, String)> {
    v.as_object().into_iter().flatten().map(|(k, v)| (k.clone(), string(v))).collect()
}

impl Peer {
    /// Starts the script and waits until it has imported what it needs and said hello.
    pub fn start(python: &str, script: &Path, config: &Value, compile: bool) -> Result<Peer, String> {
        let mut command = Command::new(python);
        command.arg(script).arg("--serve").args(["--config", &config.to_string()]);
        if compile {
            command.arg("--compile");
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {python} {}: {e}", script.display()))?;
        let (Some(input), Some(output)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("no pipes to the peer script".into());
        };
        let mut peer = Peer {
            child,
            input,
            output: BufReader::new(output),
            env: Vec::new(),
            not_importable: String::new(),
            params: Vec::new(),
            onnx_source: Vec::new(),
            missing: Vec::new(),
            seconds: 0.0,
        };
        let hello = peer.receive()?;
        peer.env = pairs(&hello["env"]);
        peer.not_importable = hello["not_importable"].as_str().unwrap_or_default().to_owned();
        peer.params =
            hello["params"].as_object().into_iter().flatten().filter_map(|(k, v)| Some((k.clone(), v.as_u64()? as usize))).collect();
        Ok(peer)
    }

    /// The next protocol line, other lines passed on to stderr.
    fn receive(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        loop {
            line.clear();
            match self.output.read_line(&mut line) {
                Ok(0) => {
                    let status = self.child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Err(format!("the peer script ended ({status})"));
                }
                Ok(_) => {}
                Err(e) => return Err(format!("reading from the peer script: {e}")),
            }
            match line.strip_prefix("@zoo ") {
                Some(json) => return serde_json::from_str(json).map_err(|e| format!("the peer script wrote bad JSON: {e}")),
                None => eprint!("{line}"),
            }
        }
    }

    /// The peers' figures for `tasks` of `model` at `batch` on `place` (timed by the process's
    /// CPU time where `cpu_clock`): those of `place.peers()`, recorded as `place`'s.
    pub fn point(&mut self, model: &str, place: Place, batch: usize, tasks: &[Task], cpu_clock: bool) -> Result<Vec<Figure>, String> {
        let start = Instant::now();
        let tasks: Vec<&str> = tasks.iter().map(|t| t.label()).collect();
        let asked = place.peers().label();
        let request = serde_json::json!({ "model": model, "device": asked, "batch": batch, "tasks": tasks, "cpu_clock": cpu_clock });
        writeln!(self.input, "{request}").and_then(|()| self.input.flush()).map_err(|e| format!("writing to the peer script: {e}"))?;
        let reply = self.receive()?;
        self.seconds += start.elapsed().as_secs_f64();
        for m in reply["missing"].as_array().into_iter().flatten() {
            let device = if m["device"].as_str() == Some(asked) { place.label().to_string() } else { string(&m["device"]) };
            let entry = (device, string(&m["task"]), string(&m["peer"]), string(&m["why"]));
            if !self.missing.contains(&entry) {
                self.missing.push(entry);
            }
        }
        self.onnx_source = pairs(&reply["onnx_source"]);
        let figures = reply["results"].as_array().into_iter().flatten().filter_map(figure);
        Ok(figures.map(|f| if f.place == place.peers() { Figure { place, ..f } } else { f }).collect())
    }

    /// Closes the script's input (it exits) and waits for it.
    pub fn finish(self) {
        let Peer { mut child, input, .. } = self;
        drop(input);
        let _ = child.wait();
    }
}

fn figure(r: &Value) -> Option<Figure> {
    let place = Place::ALL.into_iter().find(|p| Some(p.label()) == r["device"].as_str())?;
    let task = Task::ALL.into_iter().find(|t| Some(t.label()) == r["task"].as_str())?;
    let seconds = r["seconds"].as_f64();
    let mut note = r["note"].as_str().map(str::to_owned);
    if let (Some(build), Some(_)) = (r["build_s"].as_f64(), seconds) {
        let cached = r["cached"].as_str().map_or_else(String::new, |c| format!(", {c}"));
        note = Some(format!("compile and capture took {build:.1} s{cached}"));
    }
    Some(Figure {
        model: string(&r["model"]),
        place,
        task,
        batch: r["batch"].as_u64()? as usize,
        runner: string(&r["peer"]),
        seconds,
        p99: r["p99"].as_f64(),
        calls: r["calls"].as_u64().unwrap_or(0) as usize,
        note,
    })
}
