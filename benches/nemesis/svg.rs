//! Throughput over time with the fault windows shaded: an SVG drawn from a
//! history and its faults file.

use std::fmt::Write;
use std::path::Path;

use super::history::{read_faults, Op};

fn colour(kind: &str) -> &'static str {
    match kind {
        k if k.starts_with("partition-db") => "#d62728",
        k if k.starts_with("partition-clients") => "#ff7f0e",
        k if k.starts_with("slow") => "#bcbd22",
        k if k.starts_with("clock") => "#9467bd",
        "pause" => "#17becf",
        "kill" => "#8c564b",
        k if k.starts_with("pg-restart") => "#e377c2",
        _ => "#7f7f7f",
    }
}

const LEGEND: &[(&str, &str)] = &[
    ("partition-db*", "partition-db"),
    ("partition-clients*", "partition-clients"),
    ("slow-db / slow-clients", "slow"),
    ("clock offsets", "clock"),
    ("pause (SIGSTOP)", "pause"),
    ("kill -9", "kill"),
    ("PostgreSQL restart", "pg-restart"),
    ("disk full", "disk-full"),
];

/// Writes `out`: operations per second (all, and acknowledged) from
/// `history`, over the fault windows of `HISTORY.faults`.
pub fn write(history: &Path, out: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(history).map_err(|e| e.to_string())?;
    let ops: Vec<Op> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|o: &Op| o.process != "final")
        .collect();
    let faults = read_faults(&super::history::faults_path(history));
    let Some(t0) = ops.iter().map(|o| o.invoke).reduce(f64::min) else {
        return Err("empty history".into());
    };
    let t1 = ops.iter().map(|o| o.complete).fold(t0, f64::max);
    let secs = (t1 - t0).ceil().max(1.0) as usize;
    let (mut all, mut okc) = (vec![0u32; secs + 1], vec![0u32; secs + 1]);
    for o in &ops {
        let b = ((o.complete - t0) as usize).min(secs);
        all[b] += 1;
        if o.outcome == "ok" {
            okc[b] += 1;
        }
    }
    let peak = *all.iter().max().unwrap_or(&1).max(&1) as f64;
    let (w, h, left, top, bottom) = (1200.0, 420.0, 60.0, 20.0, 90.0);
    let plot_w = w - left - 20.0;
    let plot_h = h - top - bottom;
    let x = |t: f64| left + plot_w * (t / secs as f64);
    let y = |v: f64| top + plot_h * (1.0 - v / peak);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let lanes: Vec<String> = {
        let mut t: Vec<String> = faults.iter().map(|f| f.target.clone()).collect();
        t.sort();
        t.dedup();
        t
    };
    let lane_h = plot_h / lanes.len().max(1) as f64;
    for f in &faults {
        let lane = lanes.iter().position(|l| *l == f.target).unwrap_or(0) as f64;
        let (a, b) = (x(f.start - t0), x(f.end - t0));
        let _ = writeln!(
            s,
            r#"<rect x="{a:.1}" y="{:.1}" width="{:.1}" height="{lane_h:.1}" fill="{}" fill-opacity="0.25"><title>{} {} {}</title></rect>"#,
            top + lane * lane_h,
            (b - a).max(1.0),
            colour(&f.kind),
            f.kind,
            f.target,
            f.detail
        );
    }
    for (i, l) in lanes.iter().enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" fill="#555">{l}</text>"##,
            left + 4.0,
            top + i as f64 * lane_h + 12.0
        );
    }
    for (series, colour) in [(&all, "#1f77b4"), (&okc, "#2ca02c")] {
        let pts: Vec<String> = series
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i as f64), y(f64::from(*v))))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1" points="{}"/>"#,
            pts.join(" ")
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#000"/><line x1="{left}" y1="{top}" x2="{left}" y2="{:.1}" stroke="#000"/>"##,
        top + plot_h,
        left + plot_w,
        top + plot_h,
        top + plot_h
    );
    let _ = writeln!(
        s,
        r#"<text x="4" y="{:.1}">{peak:.0}/s</text><text x="4" y="{:.1}">0</text><text x="{:.1}" y="{:.1}">{secs} s</text>"#,
        top + 10.0,
        top + plot_h,
        left + plot_w - 30.0,
        top + plot_h + 14.0
    );
    let mut lx = left;
    let mut ly = h - bottom + 36.0;
    for (label, kind) in [("operations/s", ""), ("acknowledged (ok)/s", "")]
        .iter()
        .copied()
        .chain(LEGEND.iter().copied())
    {
        let c = match label {
            "operations/s" => "#1f77b4",
            "acknowledged (ok)/s" => "#2ca02c",
            _ => colour(kind),
        };
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{c}" fill-opacity="0.6"/><text x="{:.1}" y="{ly:.1}">{label}</text>"#,
            ly - 9.0,
            lx + 13.0
        );
        lx += 18.0 + 6.5 * label.len() as f64;
        if lx > w - 150.0 {
            lx = left;
            ly += 16.0;
        }
    }
    let _ = writeln!(s, "</svg>");
    std::fs::write(out, s).map_err(|e| e.to_string())
}
