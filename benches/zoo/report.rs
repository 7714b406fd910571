//! The zoo's tables (one per place and task: flatnn, the best peer, the ratio; and one with every
//! peer) and its CSV.

use crate::figures::{fmt_seconds, Figure, Place, Task, FLATNN};
use std::fmt::Write as _;

/// Everything the tables are made from.
pub struct Results<'a> {
    pub figures: &'a [Figure],
    pub models: &'a [&'a str],
    pub places: &'a [Place],
    pub tasks: &'a [Task],
    /// (place, task, peer, why) for peers that could not run at all.
    pub missing: &'a [(String, String, String, String)],
    /// Why no peer ran at all, if so.
    pub peers_failed: Option<&'a str>,
    pub limit_s: f64,
}

/// One row of a table: a point, flatnn's figure and every peer's.
pub struct Row<'a> {
    pub model: &'a str,
    pub batch: usize,
    pub flatnn: Option<&'a Figure>,
    pub peers: Vec<&'a Figure>,
}

impl Row<'_> {
    /// The fastest peer that measured this point.
    pub fn best(&self) -> Option<&Figure> {
        self.peers.iter().copied().filter(|f| f.seconds.is_some()).min_by(|a, b| a.seconds.partial_cmp(&b.seconds).expect("finite"))
    }

    /// best peer / flatnn where both measured.
    pub fn ratio(&self) -> Option<f64> {
        Some(self.best()?.seconds? / self.flatnn?.seconds?)
    }
}

impl<'a> Results<'a> {
    pub fn rows(&self, place: Place, task: Task) -> Vec<Row<'a>> {
        let mut batches: Vec<usize> = self.figures.iter().filter(|f| f.place == place && f.task == task).map(|f| f.batch).collect();
        batches.sort_unstable();
        batches.dedup();
        let mut rows = Vec::new();
        for &model in self.models {
            for &batch in &batches {
                let here: Vec<&Figure> =
                    self.figures.iter().filter(|f| f.place == place && f.task == task && f.model == model && f.batch == batch).collect();
                if here.is_empty() {
                    continue;
                }
                let flatnn = here.iter().copied().find(|f| f.runner == FLATNN);
                let peers = here.into_iter().filter(|f| f.runner != FLATNN).collect();
                rows.push(Row { model, batch, flatnn, peers });
            }
        }
        rows
    }

    /// Why a place and task has no peer figure, from the peers' report.
    fn missing_reason(&self, place: Place, task: Task) -> String {
        let reasons: Vec<String> =
            self.missing.iter().filter(|m| m.0 == place.label() && m.1 == task.label()).map(|m| format!("{}: {}", m.2, m.3)).collect();
        match (reasons.is_empty(), self.peers_failed) {
            (false, _) => reasons.join("; "),
            (true, Some(why)) => format!("peers: {why}"),
            (true, None) => "no peer measured this point".into(),
        }
    }
}

/// A short reason for a figure's absence, the same for every point it applies to.
fn reason(note: &str, limit_s: f64) -> String {
    if note.starts_with("over the limit at batch") {
        format!("a smaller batch already went over the per-call limit ({limit_s} s)")
    } else if note.starts_with("over the limit") {
        format!("one call took over the per-call limit ({limit_s} s)")
    } else if note.starts_with("predicted over the limit") {
        format!("predicted over the per-call limit ({limit_s} s) from the batch before")
    } else {
        note.to_string()
    }
}

/// Numbered footnotes of one table.
#[derive(Default)]
struct Notes(Vec<String>);

impl Notes {
    fn mark(&mut self, text: String) -> String {
        let i = self.0.iter().position(|n| *n == text).unwrap_or_else(|| {
            self.0.push(text);
            self.0.len() - 1
        });
        format!("–{}", i + 1)
    }

    fn write(&self, out: &mut String) {
        for (i, n) in self.0.iter().enumerate() {
            let _ = writeln!(out, "  –{}: {n}", i + 1);
        }
    }
}

fn over_limit(f: Option<&Figure>) -> bool {
    f.and_then(|f| f.note.as_deref()).is_some_and(|n| n.contains("over the limit"))
}

/// The ratio cell: the ratio (starred where flatnn is slower), or a bound where one side went
/// over the per-call limit and the other did not.
fn ratio_cell(row: &Row, limit_s: f64) -> String {
    if let Some(r) = row.ratio() {
        return format!("{r:.2}{}", if r < 1.0 { " *" } else { "" });
    }
    let best = row.best().and_then(|f| f.seconds);
    let flatnn = row.flatnn.and_then(|f| f.seconds);
    match (flatnn, best) {
        (None, Some(p)) if over_limit(row.flatnn) => format!("<{:.2} *", p / limit_s),
        (Some(t), None) if row.peers.iter().any(|f| over_limit(Some(f))) => format!(">{:.2}", limit_s / t),
        _ => "–".into(),
    }
}

/// Geometric mean of the ratios of the rows where both sides measured, and how many were < 1.
pub fn geomean(rows: &[Row]) -> Option<(f64, usize, usize)> {
    let ratios: Vec<f64> = rows.iter().filter_map(Row::ratio).collect();
    if ratios.is_empty() {
        return None;
    }
    let mean = ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64;
    Some((mean.exp(), ratios.len(), ratios.iter().filter(|&&r| r < 1.0).count()))
}

/// Right-aligned columns but the first, separated by two spaces.
fn render(out: &mut String, rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..cols).map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0)).collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str("  ");
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

fn cell(f: Option<&Figure>, notes: &mut Notes, who: &str, limit_s: f64, missing: &dyn Fn() -> String) -> String {
    match f {
        Some(Figure { seconds: Some(s), .. }) => fmt_seconds(*s),
        Some(f) => notes.mark(format!("{who}{}", reason(f.note.as_deref().unwrap_or("not measured"), limit_s))),
        None => notes.mark(missing()),
    }
}

/// The summary table of one place and task.
fn summary(out: &mut String, res: &Results, place: Place, task: Task) {
    let rows = res.rows(place, task);
    if rows.is_empty() {
        return;
    }
    let latency = task == Task::Latency;
    let what = if latency { "p50 and p99 of single calls; ratio of the p50s" } else { "median per call" };
    let _ = writeln!(out, "\n== {} {task}: {what}; ratio = best peer / flatnn (> 1: flatnn faster)", place.title());
    let mut notes = Notes::default();
    let mut table = vec![if latency {
        ["model", "batch", "flatnn p50", "p99", "best peer p50", "p99", "peer", "ratio"].map(String::from).to_vec()
    } else {
        ["model", "batch", "flatnn", "best peer", "peer", "ratio"].map(String::from).to_vec()
    }];
    for row in &rows {
        let missing_flatnn = || "flatnn: not measured".to_string();
        let mut line = vec![row.model.to_string(), row.batch.to_string()];
        line.push(cell(row.flatnn, &mut notes, "flatnn: ", res.limit_s, &missing_flatnn));
        if latency {
            line.push(row.flatnn.and_then(|f| f.p99).map_or_else(String::new, fmt_seconds));
        }
        let best = row.best();
        let peer_missing = || match row.peers.first() {
            Some(f) => format!("peers: {}: {}", f.runner, reason(f.note.as_deref().unwrap_or("not measured"), res.limit_s)),
            None => res.missing_reason(place, task),
        };
        line.push(match best {
            Some(f) => fmt_seconds(f.seconds.expect("best has a time")),
            None => notes.mark(peer_missing()),
        });
        if latency {
            line.push(best.and_then(|f| f.p99).map_or_else(String::new, fmt_seconds));
        }
        line.push(best.map_or_else(String::new, |f| f.runner.clone()));
        line.push(ratio_cell(row, res.limit_s));
        table.push(line);
    }
    render(out, &table);
    match geomean(&rows) {
        Some((g, n, red)) => {
            let _ = writeln!(
                out,
                "geometric mean of the ratios: {g:.2} over {n} point{} ({red} with flatnn slower, marked *)",
                if n == 1 { "" } else { "s" }
            );
        }
        None => {
            let _ = writeln!(out, "geometric mean of the ratios: none (no point measured by both)");
        }
    }
    notes.write(out);
}

/// Every runner's figure for one place and task.
fn full(out: &mut String, res: &Results, place: Place, task: Task) {
    let rows = res.rows(place, task);
    let mut runners: Vec<&str> = rows.iter().flat_map(|r| r.peers.iter().map(|f| f.runner.as_str())).collect();
    runners.sort_unstable();
    runners.dedup();
    if rows.is_empty() || runners.is_empty() {
        return;
    }
    let what = if task == Task::Latency { "p50 of single calls" } else { "median per call" };
    let _ = writeln!(out, "\n== {} {task}, every runner ({what})", place.title());
    let mut notes = Notes::default();
    let mut header = vec!["model".to_string(), "batch".into(), FLATNN.into()];
    header.extend(runners.iter().map(|r| r.to_string()));
    let mut table = vec![header];
    for row in &rows {
        let mut line = vec![row.model.to_string(), row.batch.to_string()];
        line.push(cell(row.flatnn, &mut notes, "", res.limit_s, &|| "not measured".into()));
        for runner in &runners {
            let f = row.peers.iter().copied().find(|f| f.runner == *runner);
            line.push(cell(f, &mut notes, "", res.limit_s, &|| "not run at this point".into()));
        }
        table.push(line);
    }
    render(out, &table);
    notes.write(out);
}

/// Every table of `zoo.txt` after its header: the summaries, then every runner's figures, then
/// the compiles.
pub fn tables(res: &Results) -> String {
    let mut out = String::new();
    for &place in res.places {
        for &task in res.tasks {
            summary(&mut out, res, place, task);
        }
    }
    for &place in res.places {
        for &task in res.tasks {
            full(&mut out, res, place, task);
        }
    }
    compile_times(&mut out, res);
    out
}

/// The compiled peers' notes (how long each compile and capture took, and how many of its
/// graphs inductor's cache held), one line per point they measured.
fn compile_times(out: &mut String, res: &Results) {
    let lines: Vec<String> = res
        .figures
        .iter()
        .filter(|f| f.runner.starts_with("pt-compile") && f.seconds.is_some())
        .filter_map(|f| Some(format!("  {} {} {} {} {}: {}", f.place, f.task, f.model, f.batch, f.runner, f.note.as_deref()?)))
        .collect();
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n== torch.compile, per point");
    for line in lines {
        let _ = writeln!(out, "{line}");
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The CSV's columns, its first line.
pub const CSV_COLUMNS: &str = "device,task,model,batch,runner,seconds,p99_seconds,calls,ratio_to_flatnn,best_peer,note";

/// One line per figure: every runner, every point; the ratio to flatnn's figure and which peer
/// was the best at the point.
pub fn csv(res: &Results) -> String {
    let mut out = format!("{CSV_COLUMNS}\n");
    for &place in res.places {
        for &task in res.tasks {
            for row in res.rows(place, task) {
                let best = row.best().map(|f| f.runner.clone());
                let flatnn = row.flatnn.and_then(|f| f.seconds);
                for f in row.flatnn.into_iter().chain(row.peers.iter().copied()) {
                    let ratio = match (f.seconds, flatnn) {
                        (Some(s), Some(t)) => format!("{:.4}", s / t),
                        _ => String::new(),
                    };
                    // the shortest decimal that reads back as the same f64: a table rebuilt from
                    // the CSV rounds its cells as the run did
                    let opt = |v: Option<f64>| v.map_or_else(String::new, |v| v.to_string());
                    let _ = writeln!(
                        out,
                        "{place},{task},{},{},{},{},{},{},{ratio},{},{}",
                        row.model,
                        row.batch,
                        csv_field(&f.runner),
                        opt(f.seconds),
                        opt(f.p99),
                        f.calls,
                        if best.as_deref() == Some(f.runner.as_str()) { "yes" } else { "" },
                        csv_field(f.note.as_deref().unwrap_or(""))
                    );
                }
            }
        }
    }
    out
}
