//! `--from FILE.csv`: the figures of a CSV the zoo wrote, read back, so that its tables and plot
//! can be written again without measuring anything.

use crate::figures::{Figure, Place, Task, FLATNN};
use crate::report::{self, Results, CSV_COLUMNS};
use crate::svg;
use ::flatnn::{Error, Result};
use std::path::Path;

/// The line a record starts on, and its fields.
type Record = (usize, Vec<String>);

/// The records of a CSV, each with the line it starts on. Fields are split at commas; a field
/// in double quotes may hold commas, newlines and doubled quotes (as `report::csv` writes them).
/// Blank lines are skipped.
fn records(text: &str) -> std::result::Result<Vec<Record>, (usize, String)> {
    let mut out = Vec::new();
    let (mut line, mut start) = (1, 1);
    let (mut fields, mut field) = (Vec::new(), String::new());
    // `quoted`: inside a quoted field; `closed`: its closing quote seen, so only , or a newline may follow
    let (mut quoted, mut closed) = (false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => (quoted, closed) = (false, true),
            (true, c) => {
                line += usize::from(c == '\n');
                field.push(c);
            }
            (false, ',') => {
                fields.push(std::mem::take(&mut field));
                closed = false;
            }
            (false, '\n') => {
                fields.push(std::mem::take(&mut field));
                let record = std::mem::take(&mut fields);
                if record.len() > 1 || !record[0].is_empty() || closed {
                    out.push((start, record));
                }
                closed = false;
                line += 1;
                start = line;
            }
            (false, '\r') if chars.peek() == Some(&'\n') => {}
            (false, _) if closed => return Err((line, format!("{c:?} after a closing quote"))),
            (false, '"') if field.is_empty() => quoted = true,
            (false, '"') => return Err((line, "a quote inside a field that does not start with one".into())),
            (false, c) => field.push(c),
        }
    }
    if quoted {
        return Err((start, "a quoted field is not closed".into()));
    }
    if !fields.is_empty() || !field.is_empty() || closed {
        fields.push(field);
        out.push((start, fields));
    }
    Ok(out)
}

/// A time in seconds, or none where the field is empty.
fn seconds(name: &str, s: &str) -> std::result::Result<Option<f64>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    match s.parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 => Ok(Some(t)),
        _ => Err(format!("{name} {s:?}: expected a positive number of seconds or nothing")),
    }
}

/// One figure from one record of `CSV_COLUMNS`; `ratio_to_flatnn` and `best_peer` are left
/// out: the tables work them out again from the times.
fn figure(fields: &[String]) -> std::result::Result<Figure, String> {
    let columns = CSV_COLUMNS.split(',').count();
    if fields.len() != columns {
        return Err(format!("{} fields, expected {columns} ({CSV_COLUMNS})", fields.len()));
    }
    let text = |i: usize, name: &str| match fields[i].as_str() {
        "" => Err(format!("{name} is empty")),
        s => Ok(s.to_string()),
    };
    let count = |i: usize, name: &str| fields[i].parse::<usize>().map_err(|_| format!("{name} {:?}: expected a count", fields[i]));
    let place = Place::NAMED.into_iter().find(|p| p.label() == fields[0]).ok_or_else(|| format!("unknown device {:?}", fields[0]))?;
    let task = Task::ALL.into_iter().find(|t| t.label() == fields[1]).ok_or_else(|| format!("unknown task {:?}", fields[1]))?;
    let batch = count(3, "batch").and_then(|b| if b > 0 { Ok(b) } else { Err("batch 0".into()) })?;
    Ok(Figure {
        model: text(2, "model")?,
        place,
        task,
        batch,
        runner: text(4, "runner")?,
        seconds: seconds("seconds", &fields[5])?,
        p99: seconds("p99_seconds", &fields[6])?,
        calls: count(7, "calls")?,
        note: Some(fields[10].clone()).filter(|n| !n.is_empty()),
    })
}

/// The figures of a CSV the zoo wrote, in its order; a malformed line is an error naming it.
pub fn parse(text: &str, path: &Path) -> Result<Vec<Figure>> {
    let bad = |line: usize, what: String| Error::Format { path: path.to_owned(), what: format!("line {line}: {what}") };
    let records = records(text).map_err(|(line, what)| bad(line, what))?;
    let mut records = records.into_iter();
    match records.next() {
        Some((_, header)) if header.join(",") == CSV_COLUMNS => {}
        Some((line, header)) => return Err(bad(line, format!("header {:?}, expected {CSV_COLUMNS:?}", header.join(",")))),
        None => return Err(bad(1, "empty: no header".into())),
    }
    records.map(|(line, fields)| figure(&fields).map_err(|what| bad(line, what))).collect()
}

/// What a run's `--models`, `--devices`, `--tasks` and `--batches` chose, where given.
#[derive(Default)]
pub struct Selection<'a> {
    pub models: Option<&'a [&'a str]>,
    pub places: Option<&'a [Place]>,
    pub tasks: Option<&'a [Task]>,
    pub batches: Option<&'a [usize]>,
}

/// The values the figures have, in the order of `chosen` where given (as a run orders them),
/// else in the order they first appear (the order of the run that wrote the CSV).
fn order<T: PartialEq + Copy>(seen: impl Iterator<Item = T>, chosen: Option<&[T]>) -> Vec<T> {
    let mut first: Vec<T> = Vec::new();
    for v in seen {
        if !first.contains(&v) {
            first.push(v);
        }
    }
    match chosen {
        Some(chosen) => chosen.iter().copied().filter(|v| first.contains(v)).collect(),
        None => first,
    }
}

/// Where `v` is in `list` (every figure's values are, once selected).
fn at<T: PartialEq>(list: &[T], v: &T) -> usize {
    list.iter().position(|x| x == v).unwrap_or(usize::MAX)
}

/// A CSV's figures, selected as a run's flags select what it measures.
pub struct Replot {
    pub figures: Vec<Figure>,
    pub models: Vec<String>,
    pub places: Vec<Place>,
    pub tasks: Vec<Task>,
}

impl Replot {
    pub fn new(figures: Vec<Figure>, chosen: &Selection) -> Replot {
        let keep = |f: &Figure| {
            chosen.models.is_none_or(|m| m.contains(&f.model.as_str()))
                && chosen.places.is_none_or(|p| p.contains(&f.place))
                && chosen.tasks.is_none_or(|t| t.contains(&f.task))
                && chosen.batches.is_none_or(|b| b.contains(&f.batch))
        };
        let mut figures: Vec<Figure> = figures.into_iter().filter(keep).collect();
        let models: Vec<String> = order(figures.iter().map(|f| f.model.as_str()), chosen.models).into_iter().map(String::from).collect();
        let places = order(figures.iter().map(|f| f.place), chosen.places);
        let tasks = order(figures.iter().map(|f| f.task), chosen.tasks);
        // A run records model by model, device by device, batch by batch: at each batch flatnn's
        // figures of its tasks, then the peers'. The CSV groups by device and task. Back to the
        // run's order (the compile notes follow it); the sort is stable, so the peers of a task
        // keep their order.
        figures.sort_by_key(|f| (at(&models, &f.model), at(&places, &f.place), f.batch, f.runner != FLATNN, at(&tasks, &f.task)));
        Replot { figures, models, places, tasks }
    }

    /// `zoo.txt` and `zoo.svg` as a run would write them for these figures, with `title` (one
    /// line) in place of the run's header. `limit_s` is the run's per-call limit, which the CSV
    /// does not hold; the peers' reasons for points they did not run are not in it either.
    pub fn files(&self, title: &str, limit_s: f64) -> (String, String) {
        let models: Vec<&str> = self.models.iter().map(String::as_str).collect();
        let results = Results {
            figures: &self.figures,
            models: &models,
            places: &self.places,
            tasks: &self.tasks,
            missing: &[],
            peers_failed: None,
            limit_s,
        };
        (format!("{title}\n{}", report::tables(&results)), svg::plot(&results, title))
    }
}
