//! The zoo bench's CSV read back (`cargo bench --bench zoo -- --from FILE.csv`): figures survive
//! a write and a read, a malformed line is an error naming it, and the committed CSVs rebuild
//! their committed tables' ratios.

// The bench's own files; what only its measuring uses is dead here.
#[allow(dead_code)]
#[path = "../benches/zoo/figures.rs"]
mod figures;
#[allow(dead_code)]
#[path = "../benches/zoo/replot.rs"]
mod replot;
#[allow(dead_code)]
#[path = "../benches/zoo/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../benches/zoo/svg.rs"]
mod svg;

use figures::{Figure, Place, Task};
use replot::{Replot, Selection};
use report::Results;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn docs(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join(name)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn figure(model: &str, place: Place, task: Task, batch: usize, runner: &str, seconds: Option<f64>, note: Option<&str>) -> Figure {
    Figure {
        model: model.into(),
        place,
        task,
        batch,
        runner: runner.into(),
        seconds,
        // latency points carry a p99, a little above the p50
        p99: seconds.filter(|_| task == Task::Latency).map(|s| s * 1.37),
        calls: 1 + batch * 7,
        note: note.map(String::from),
    }
}

/// Figures in the order a run records them (model, device, batch, a point's tasks; flatnn's
/// figures of a point before the peers'), with times that are not short decimals, skipped
/// points, and notes a CSV has to quote.
fn measured() -> Vec<Figure> {
    let mut out = Vec::new();
    for (m, model) in ["lenet5", "mlp"].into_iter().enumerate() {
        for place in [Place::Cpu, Place::Gpu] {
            for batch in [1, 8, 4096] {
                let t = (m + 1) as f64 * batch as f64 / 3.0e5 + 1.0 / 7.0e6;
                let tasks: &[Task] = if batch <= 8 { &[Task::Train, Task::Latency] } else { &[Task::Train] };
                for &task in tasks {
                    let (seconds, note) =
                        if batch == 4096 { (None, Some("over the limit: one call took 1.59 s")) } else { (Some(t), None) };
                    out.push(figure(model, place, task, batch, "flatnn", seconds, note));
                }
                for &task in tasks {
                    out.push(figure(model, place, task, batch, "pt-eager", Some(t * 1.618), None));
                    let note = "compile and capture took 0.4 s, 2 of 2 graphs from \"inductor's\" cache,\nthen one call";
                    out.push(figure(model, place, task, batch, "pt-compile:fp32", Some(t * 0.9), Some(note)));
                }
            }
        }
    }
    out
}

fn results<'a>(figures: &'a [Figure], models: &'a [&'a str], places: &'a [Place], tasks: &'a [Task]) -> Results<'a> {
    Results { figures, models, places, tasks, missing: &[], peers_failed: None, limit_s: 1.0 }
}

#[test]
fn figures_written_to_csv_read_back_the_same() {
    let figures = measured();
    let (models, places, tasks) = (["lenet5", "mlp"], [Place::Cpu, Place::Gpu], [Task::Train, Task::Latency]);
    let written = report::csv(&results(&figures, &models, &places, &tasks));
    let path = Path::new("zoo.csv");
    let back = Replot::new(replot::parse(&written, path).expect("the CSV just written"), &Selection::default());
    assert_eq!(back.models, models);
    assert_eq!(back.places, places);
    assert_eq!(back.tasks, tasks);
    assert_eq!(back.figures.len(), figures.len());
    for (i, (got, want)) in back.figures.iter().zip(&figures).enumerate() {
        assert_eq!(got, want, "figure {i}");
    }
    // and its tables are those of the figures it was written from
    let names: Vec<&str> = back.models.iter().map(String::as_str).collect();
    let rebuilt = report::tables(&results(&back.figures, &names, &back.places, &back.tasks));
    assert_eq!(rebuilt, report::tables(&results(&figures, &models, &places, &tasks)));
    assert_eq!(report::csv(&results(&back.figures, &names, &back.places, &back.tasks)), written);
}

/// `--nondeterministic`'s devices: written as `gpu-nd` and `gpu-tf32-nd`, read back as such, and
/// every table of theirs says what flatnn gave up.
#[test]
fn nondeterministic_devices_are_named_in_the_csv_and_every_title() {
    let figures: Vec<Figure> = measured()
        .into_iter()
        .filter(|f| f.place == Place::Gpu)
        .flat_map(|f| [Figure { place: Place::GpuNd, ..f.clone() }, Figure { place: Place::GpuTf32Nd, ..f }])
        .collect();
    let (models, places, tasks) = (["lenet5", "mlp"], [Place::GpuNd, Place::GpuTf32Nd], [Task::Train, Task::Latency]);
    let written = report::csv(&results(&figures, &models, &places, &tasks));
    assert!(written.contains("\ngpu-nd,train,") && written.contains("\ngpu-tf32-nd,latency,"), "{written}");
    assert!(!written.contains("\ngpu,"), "{written}");
    let back = Replot::new(replot::parse(&written, Path::new("zoo.csv")).expect("the CSV just written"), &Selection::default());
    assert_eq!(back.places, places);
    assert_eq!(back.figures.len(), figures.len());
    assert!(back.figures.iter().all(|f| f.place.nondeterministic()));
    let tables = report::tables(&results(&figures, &models, &places, &tasks));
    let titles: Vec<&str> = tables.lines().filter(|l| l.starts_with("== ") && !l.starts_with("== torch.compile")).collect();
    // a summary and an every-runner table per device and task (and the compile notes)
    assert_eq!(titles.len(), 2 * 2 * 2, "{tables}");
    for title in titles {
        assert!(title.contains("-nd ") && title.contains("GpuOptions::deterministic off"), "{title}");
    }
    // the deterministic devices' titles are as before
    let plain = report::tables(&results(&measured(), &models, &[Place::Gpu], &tasks));
    assert!(
        plain
            .lines()
            .filter(|l| l.starts_with("== ") && !l.starts_with("== torch.compile"))
            .all(|l| l.starts_with("== gpu ") && !l.contains("deterministic")),
        "{plain}"
    );
}

#[test]
fn selection_keeps_the_chosen_points_in_the_chosen_order() {
    let written = report::csv(&results(&measured(), &["lenet5", "mlp"], &[Place::Cpu, Place::Gpu], &[Task::Train, Task::Latency]));
    let figures = replot::parse(&written, Path::new("zoo.csv")).expect("the CSV just written");
    let chosen =
        Selection { models: Some(&["mlp", "lenet5", "resnet_small"]), places: Some(&[Place::Gpu]), tasks: None, batches: Some(&[8, 4096]) };
    let back = Replot::new(figures, &chosen);
    assert_eq!(back.models, ["mlp", "lenet5"]);
    assert_eq!(back.places, [Place::Gpu]);
    assert_eq!(back.tasks, [Task::Train, Task::Latency]);
    assert!(!back.figures.is_empty());
    assert!(back.figures.iter().all(|f| f.place == Place::Gpu && (f.batch == 8 || f.batch == 4096)));
    // 8: train and latency, 4096: train; three runners each; two models
    assert_eq!(back.figures.len(), 2 * 3 * 3);
}

#[test]
fn a_malformed_line_is_an_error_naming_it() {
    let header = report::CSV_COLUMNS;
    let good = "gpu,train,mlp,1,flatnn,0.000014727,,3586,1.0000,,";
    let cases = [
        (format!("{header}\n{good}\ngpu,train,mlp,1,flatnn,0.000014727,,3586\n"), "line 3: 8 fields"),
        (format!("{header}\n{good}\n{good}\ntpu,train,mlp,1,flatnn,0.1,,3,1.0,,\n"), "line 4: unknown device \"tpu\""),
        (format!("{header}\ngpu,fly,mlp,1,flatnn,0.1,,3,1.0,,\n"), "line 2: unknown task"),
        (format!("{header}\ngpu,train,mlp,0,flatnn,0.1,,3,1.0,,\n"), "line 2: batch 0"),
        (format!("{header}\ngpu,train,mlp,x,flatnn,0.1,,3,1.0,,\n"), "line 2: batch \"x\""),
        (format!("{header}\ngpu,train,,1,flatnn,0.1,,3,1.0,,\n"), "line 2: model is empty"),
        (format!("{header}\ngpu,train,mlp,1,flatnn,fast,,3,1.0,,\n"), "line 2: seconds \"fast\""),
        (format!("{header}\ngpu,train,mlp,1,flatnn,-0.1,,3,1.0,,\n"), "line 2: seconds \"-0.1\""),
        (format!("{header}\ngpu,train,mlp,1,flatnn,0.1,NaN,3,1.0,,\n"), "line 2: p99_seconds \"NaN\""),
        (format!("{header}\ngpu,train,mlp,1,flatnn,0.1,,-3,1.0,,\n"), "line 2: calls \"-3\""),
        (format!("{header}\n{good}\ngpu,train,mlp,1,flatnn,0.1,,3,1.0,,\"a, b\nc\n"), "line 3: a quoted field is not closed"),
        (format!("{header}\ngpu,train,mlp,1,flatnn,0.1,,3,1.0,,\"a\"b\n"), "line 2: 'b' after a closing quote"),
        (format!("{header}\ngpu,train,mlp,1,flatnn,0.1,,3,1.0,,a\"b\n"), "line 2: a quote inside a field"),
        (format!("device,task\n{good}\n"), "line 1: header"),
        (String::new(), "line 1: empty"),
    ];
    for (text, want) in cases {
        match replot::parse(&text, Path::new("zoo.csv")) {
            Ok(_) => panic!("{text:?} parsed; expected {want:?}"),
            Err(e) => assert!(e.to_string().contains(want), "{text:?}: {e}; expected {want:?}"),
        }
    }
    // a quoted note over two lines: the next record's line counts both
    let text = format!("{header}\ngpu,train,mlp,1,flatnn,0.1,,3,1.0,,\"two\nlines\"\ngpu,train,mlp,8,flatnn,x,,3,1.0,,\n");
    let e = replot::parse(&text, Path::new("zoo.csv")).expect_err("bad seconds");
    assert!(e.to_string().contains("line 4: seconds"), "{e}");
}

/// Each summary table's ratio cells, by (table, model, batch), and its geometric-mean line.
fn ratios(txt: &str) -> BTreeMap<(String, String, String), String> {
    let mut out = BTreeMap::new();
    let mut table: Option<String> = None;
    for line in txt.lines() {
        if line.starts_with("== ") {
            table = line.contains("ratio = best peer").then(|| line.to_string());
            continue;
        }
        let Some(name) = &table else { continue };
        if line.starts_with("geometric mean") {
            out.insert((name.clone(), "mean".into(), String::new()), line.to_string());
            continue;
        }
        let cells: Vec<&str> = line.split_whitespace().collect();
        if cells.len() < 3 || cells[0] == "model" || cells[0].starts_with('–') {
            continue;
        }
        // the last cell, with its " *" where flatnn is slower
        let ratio = match cells[..] {
            [.., r, "*"] => format!("{r} *"),
            [.., r] => r.to_string(),
            [] => unreachable!("three cells or more"),
        };
        out.insert((name.clone(), cells[0].to_string(), cells[1].to_string()), ratio);
    }
    out
}

#[test]
fn committed_csvs_rebuild_their_tables_ratios() {
    let mut names: Vec<String> = std::fs::read_dir(docs(""))
        .expect("docs/")
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|file| Some(file.strip_prefix("zoo-")?.strip_suffix(".csv")?.to_string()))
        .map(|name| format!("zoo-{name}"))
        .filter(|name| docs(&format!("{name}.txt")).exists())
        .collect();
    names.sort();
    assert!(names.len() >= 2, "committed zoo runs: {names:?}");
    for name in names {
        let csv = docs(&format!("{name}.csv"));
        let figures = replot::parse(&read(&csv), &csv).unwrap_or_else(|e| panic!("{e}"));
        let (txt, svg) = Replot::new(figures, &Selection::default()).files("rebuilt", 1.0);
        let (want, got) = (ratios(&read(&docs(&format!("{name}.txt")))), ratios(&txt));
        assert!(want.len() >= 8, "{name}: only {} ratio cells found in the committed tables", want.len());
        assert_eq!(got.len(), want.len(), "{name}: cells");
        for (key, cell) in &want {
            assert_eq!(got.get(key), Some(cell), "{name}: {key:?}");
        }
        assert!(svg.contains("<polyline"), "{name}: no line in the plot");
    }
}
