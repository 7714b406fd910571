//! The ratio plot: one panel per place and task, ratio (best peer / flatnn) against batch, both
//! axes logarithmic, one line per model, a line at 1 (above it flatnn is faster).

use crate::figures::{Place, Task};
use crate::report::{geomean, Results};
use std::fmt::Write as _;

const COLOURS: [&str; 10] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const PANEL_W: f64 = 320.0;
const PANEL_H: f64 = 220.0;
const MARGIN: f64 = 60.0;

pub fn plot(res: &Results, title: &str) -> String {
    let panels: Vec<(Place, Task)> = res
        .places
        .iter()
        .flat_map(|&p| res.tasks.iter().map(move |&t| (p, t)))
        .filter(|&(p, t)| res.rows(p, t).iter().any(|r| r.ratio().is_some()))
        .collect();
    let ratios: Vec<f64> = panels.iter().flat_map(|&(p, t)| res.rows(p, t).iter().filter_map(|r| r.ratio()).collect::<Vec<_>>()).collect();
    let batches: Vec<usize> = res.figures.iter().map(|f| f.batch).collect();
    let (b_lo, b_hi) = (batches.iter().copied().min().unwrap_or(1).max(1) as f64, batches.iter().copied().max().unwrap_or(2).max(2) as f64);
    // y from the decade below the smallest ratio (at most 0.1) to the one above the largest (at least 10)
    let lo = ratios.iter().copied().fold(0.1f64, f64::min).log10().floor();
    let hi = ratios.iter().copied().fold(10.0f64, f64::max).log10().ceil();
    // one row per place, one column per task, for the places and tasks that have a panel
    let mut rows_of: Vec<Place> = panels.iter().map(|p| p.0).collect();
    rows_of.dedup();
    let mut cols_of: Vec<Task> = panels.iter().map(|p| p.1).collect();
    cols_of.sort_unstable();
    cols_of.dedup();
    let (cols, grid_rows) = (cols_of.len().max(1), rows_of.len().max(1));
    let width = cols as f64 * (PANEL_W + MARGIN) + MARGIN;
    let height = grid_rows as f64 * (PANEL_H + 2.0 * MARGIN) + 50.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{MARGIN}\" y=\"20\" font-size=\"13\">{}</text>\n",
        escape(title)
    );
    if panels.is_empty() {
        let _ = writeln!(out, "<text x=\"{MARGIN}\" y=\"60\">no point was measured by flatnn and a peer</text>");
    }
    for &(place, task) in &panels {
        let col = cols_of.iter().position(|&t| t == task).unwrap_or(0);
        let row = rows_of.iter().position(|&p| p == place).unwrap_or(0);
        let x0 = MARGIN + col as f64 * (PANEL_W + MARGIN);
        let y0 = MARGIN + row as f64 * (PANEL_H + 2.0 * MARGIN);
        let sx = |b: f64| x0 + (b.log2() - b_lo.log2()) / (b_hi.log2() - b_lo.log2()).max(1e-9) * PANEL_W;
        let sy = |r: f64| y0 + (hi - r.log10()) / (hi - lo) * PANEL_H;
        let rows = res.rows(place, task);
        let mean = geomean(&rows).map_or(String::new(), |(g, _, _)| format!(" (geometric mean {g:.2})"));
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"12\">{place} {task}{mean}</text>",
            x0 + PANEL_W / 2.0,
            y0 - 8.0
        );
        let _ = writeln!(out, "<rect x=\"{x0}\" y=\"{y0}\" width=\"{PANEL_W}\" height=\"{PANEL_H}\" fill=\"none\" stroke=\"#444\"/>");
        let mut e = lo;
        while e <= hi {
            let y = sy(10f64.powf(e));
            let _ = writeln!(out, "<line x1=\"{x0}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>", x0 + PANEL_W);
            let _ = writeln!(out, "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>", x0 - 4.0, y + 4.0, 10f64.powf(e));
            e += 1.0;
        }
        let one = sy(1.0);
        let _ = writeln!(
            out,
            "<line x1=\"{x0}\" x2=\"{}\" y1=\"{one:.1}\" y2=\"{one:.1}\" stroke=\"#000\" stroke-width=\"1.2\"/>",
            x0 + PANEL_W
        );
        let mut ticks: Vec<usize> = rows.iter().map(|r| r.batch).collect();
        ticks.sort_unstable();
        ticks.dedup();
        for b in ticks {
            let _ = writeln!(out, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{b}</text>", sx(b as f64), y0 + PANEL_H + 14.0);
        }
        let _ = writeln!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">batch</text>", x0 + PANEL_W / 2.0, y0 + PANEL_H + 28.0);
        for (m, model) in res.models.iter().enumerate() {
            let colour = COLOURS[m % COLOURS.len()];
            let points: Vec<(f64, f64)> =
                rows.iter().filter(|r| r.model == *model).filter_map(|r| Some((sx(r.batch as f64), sy(r.ratio()?)))).collect();
            let path: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(out, "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.8\" points=\"{}\"/>", path.join(" "));
            for (x, y) in points {
                let _ = writeln!(out, "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.5\" fill=\"{colour}\"/>");
            }
        }
    }
    let ly = height - 16.0;
    let _ = writeln!(
        out,
        "<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">best peer / flatnn (above 1: flatnn faster)</text>",
        MARGIN + PANEL_H / 2.0,
        MARGIN + PANEL_H / 2.0
    );
    let mut lx = MARGIN;
    for (m, model) in res.models.iter().enumerate() {
        let colour = COLOURS[m % COLOURS.len()];
        let _ = writeln!(
            out,
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{colour}\" stroke-width=\"2\"/><text x=\"{}\" y=\"{}\">{}</text>",
            lx + 18.0,
            lx + 22.0,
            ly + 4.0,
            escape(model)
        );
        lx += 110.0;
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}
