//! What a run prints and writes: the table, the lines under it, the smoke
//! run's checks, `--plot` (SVG) and `--json`.

use std::collections::BTreeMap;

use super::args::Args;
use super::measure::Totals;
use super::scenarios::Scenario;

/// Prints the table of every scenario against the no-op, the server's CPU
/// by thread group, the block device's requests, the durable scenarios
/// against echo_fsync, and the server's peak RSS; checks a smoke run; then
/// writes `--plot` and `--json`.
pub fn print(
    results: &BTreeMap<Scenario, Totals>,
    args: &Args,
    addr: &str,
    rss: Option<u64>,
    started_server: bool,
) {
    let noop_rate = results
        .get(&Scenario::Noop)
        .map(Totals::rate)
        .unwrap_or(0.0);
    println!();
    println!(
        "{:<10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10} {:>12}  errors",
        "scenario",
        "ops/s",
        "calls/s",
        "p50 µs",
        "p90 µs",
        "p99 µs",
        "p99.9 µs",
        "× noop",
        "srv µs/call"
    );
    let mut json_rows = Vec::new();
    let mut thread_lines = Vec::new();
    let mut disk_lines = Vec::new();
    for (sc, t) in results {
        let h = t.hist.as_ref().expect("at least one run");
        let calls = t.call_rate(*sc);
        let ratio = t.calls_against(*sc, noop_rate);
        let errs: Vec<String> = t.errors.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let cpu = t
            .server_us_per_call(sc.calls_per_op())
            .filter(|_| sc.on_stateseal());
        let by_thread = if sc.on_stateseal() {
            t.server_threads_us_per_call(sc.calls_per_op())
        } else {
            Vec::new()
        };
        let shown: Vec<String> = by_thread
            .iter()
            .filter(|(_, _, us)| *us >= 0.05)
            .map(|(name, n, us)| format!("{name} ×{n} {us:.1}"))
            .collect();
        if !shown.is_empty() {
            thread_lines.push(format!("{:<10} {}", sc.name(), shown.join(", ")));
        }
        let disk = t
            .disk_per_call(sc.calls_per_op())
            .filter(|_| sc.on_stateseal() || sc.durable());
        if let Some((writes, flushes, kib)) = disk {
            disk_lines.push(format!(
                "{:<10} writes {writes:.3}, flushes {flushes:.3}, KiB written {kib:.2}",
                sc.name()
            ));
        }
        println!(
            "{:<10} {:>10.0} {:>10.0} {:>9} {:>9} {:>9} {:>9} {:>10.2} {:>12}  {}",
            sc.name(),
            t.rate(),
            calls,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.9),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            ratio,
            cpu.map_or("-".into(), |c| format!("{c:.1}")),
            if errs.is_empty() {
                "-".into()
            } else {
                errs.join(" ")
            }
        );
        json_rows.push(serde_json::json!({
            "scenario": sc.name(),
            "ops_per_sec": t.rate(),
            "calls_per_sec": calls,
            "ops": t.ops,
            "seconds": t.secs,
            "p50_us": h.value_at_quantile(0.5),
            "p90_us": h.value_at_quantile(0.9),
            "p99_us": h.value_at_quantile(0.99),
            "p999_us": h.value_at_quantile(0.999),
            "ratio_to_noop": ratio,
            "server_cpu_us_per_call": cpu,
            "disk_per_call": disk.map(|(writes, flushes, kib)| serde_json::json!({
                "writes": writes, "flushes": flushes, "kib_written": kib,
            })),
            "server_threads_cpu_us_per_call": by_thread
                .iter()
                .map(|(name, n, us)| (name.clone(), serde_json::json!({ "threads": n, "us_per_call": us })))
                .collect::<serde_json::Map<_, _>>(),
            "errors": t.errors,
        }));
    }
    if !thread_lines.is_empty() {
        println!("server CPU µs per call, by thread (× threads in the group):");
        for l in &thread_lines {
            println!("  {l}");
        }
    }
    if !disk_lines.is_empty() {
        println!(
            "requests per call to the block device of the store (the data directory; Redis's for redis, the echo journal's for echo_fsync; every process's):"
        );
        for l in &disk_lines {
            println!("  {l}");
        }
    }
    // Each durable scenario of stateseal against the durable round alone,
    // per call: what the ledger keeps of what this machine's disk allows.
    let floor = results
        .get(&Scenario::EchoFsync)
        .map(|t| t.call_rate(Scenario::EchoFsync))
        .filter(|f| *f > 0.0);
    let of_floor: Vec<(&str, f64)> = results
        .iter()
        .filter(|(sc, _)| sc.durable() && sc.on_stateseal())
        .filter_map(|(sc, t)| floor.map(|f| (sc.name(), t.calls_against(*sc, f))))
        .collect();
    if !of_floor.is_empty() {
        let shown: Vec<String> = of_floor
            .iter()
            .map(|(name, r)| format!("{name} {r:.2}"))
            .collect();
        println!(
            "calls/s against echo_fsync's (the durable round alone): {}",
            shown.join(", ")
        );
    }
    if let Some(kib) = rss {
        println!("server peak RSS (VmHWM): {:.1} MiB", kib as f64 / 1024.0);
    }
    if !args.bench {
        smoke_check(results, noop_rate, started_server);
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, svg(results, noop_rate)).expect("write --plot");
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "addr": addr,
            "concurrency": args.concurrency,
            "connections": args.connections,
            "state_size": args.state_size,
            "rounds": args.rounds,
            "duration_per_round": args.duration,
            "echo_fsync_delay_us": args.echo_fsync_delay_us,
            "server_peak_rss_kib": rss,
            "ratio_to_echo_fsync": of_floor
                .iter()
                .map(|(name, r)| ((*name).to_owned(), serde_json::json!(r)))
                .collect::<serde_json::Map<_, _>>(),
            "scenarios": json_rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).expect("json"))
            .expect("write --json");
        eprintln!("wrote {}", path.display());
    }
}

/// The smoke run is a test: every scenario must have worked.
fn smoke_check(results: &BTreeMap<Scenario, Totals>, noop_rate: f64, started_server: bool) {
    for (sc, t) in results {
        assert!(
            t.ops > 0 && t.errors.is_empty(),
            "smoke run: {} had {} ops and errors {:?}",
            sc.name(),
            t.ops,
            t.errors
        );
    }
    // The server's threads were read for every scenario on it: the
    // request workers and, once a consumption has run, the ledger's
    // writer.
    if started_server {
        for (sc, t) in results.iter().filter(|(sc, _)| sc.on_stateseal()) {
            let groups = t.server_threads.as_ref();
            assert!(
                groups.is_some_and(|g| g.get("tokio-rt-worker").is_some_and(|w| w.threads >= 1)),
                "smoke run: no request worker among the server's threads for {}",
                sc.name()
            );
            if sc.durable() {
                assert!(
                    groups.is_some_and(|g| g.contains_key("stateseal-ledge")),
                    "smoke run: no ledger writer among the server's threads for {}",
                    sc.name()
                );
            }
        }
    }
    // A durable answer reaches the disk: where the device of the
    // scenario's store is known, it served writes.
    for (sc, t) in results.iter().filter(|(sc, _)| sc.durable()) {
        if let Some(d) = t.disk {
            assert!(
                d.writes > 0 && d.write_sectors > 0,
                "smoke run: {} wrote nothing to its store's device: {d:?}",
                sc.name()
            );
        }
    }
    // And the picture draws a row per scenario.
    let picture = svg(results, noop_rate);
    for sc in results.keys() {
        assert!(
            picture.contains(&format!(">{}</text>", sc.name())),
            "plot lacks {}",
            sc.name()
        );
    }
    println!("load smoke: {} scenarios ran without errors", results.len());
}

/// Two panels: calls/s relative to the no-op, and latency percentiles (µs,
/// log scale), one row per scenario.
fn svg(results: &BTreeMap<Scenario, Totals>, noop_rate: f64) -> String {
    let rows: Vec<(&str, f64, [u64; 3])> = results
        .iter()
        .map(|(sc, t)| {
            let h = t.hist.as_ref().expect("at least one run");
            (
                sc.name(),
                t.calls_against(*sc, noop_rate),
                [
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.9),
                    h.value_at_quantile(0.99),
                ],
            )
        })
        .collect();
    let (row_h, top, left, panel_w) = (26.0, 40.0, 80.0, 380.0);
    let height = top + row_h * rows.len() as f64 + 40.0;
    let width = left + panel_w * 2.0 + 120.0;
    let max_ratio = rows.iter().map(|r| r.1).fold(1.0f64, f64::max);
    let max_us = rows.iter().map(|r| r.2[2]).max().unwrap_or(1).max(10) as f64;
    let log = |us: u64| (us.max(1) as f64).log10() / max_us.log10();
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"20\" font-weight=\"bold\">calls/s × no-op (line at 1.0)</text>\n\
         <text x=\"{}\" y=\"20\" font-weight=\"bold\">latency µs, log scale: p50 ▮ p90 ▮ p99 ▮</text>\n",
        left + panel_w + 40.0
    );
    let one = left + panel_w * (1.0 / max_ratio);
    out.push_str(&format!(
        "<line x1=\"{one:.1}\" y1=\"{top}\" x2=\"{one:.1}\" y2=\"{:.1}\" stroke=\"#888\" stroke-dasharray=\"4 3\"/>\n",
        top + row_h * rows.len() as f64
    ));
    for (i, (name, ratio, p)) in rows.iter().enumerate() {
        let y = top + row_h * i as f64;
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{name}</text>\n",
            left - 8.0,
            y + 16.0
        ));
        let w = panel_w * ratio / max_ratio;
        out.push_str(&format!(
            "<rect x=\"{left}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"18\" fill=\"#4477aa\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{ratio:.2}</text>\n",
            y + 3.0,
            left + w + 4.0,
            y + 16.0
        ));
        let x0 = left + panel_w + 40.0;
        for (j, (us, color)) in p.iter().zip(["#66ccee", "#228833", "#ee6677"]).enumerate() {
            let w = panel_w * log(*us);
            out.push_str(&format!(
                "<rect x=\"{x0}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"5\" fill=\"{color}\"/>\n",
                y + 3.0 + 6.0 * j as f64
            ));
        }
        out.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\">{} / {} / {}</text>\n",
            x0 + panel_w + 6.0,
            y + 16.0,
            p[0],
            p[1],
            p[2]
        ));
    }
    out.push_str("</svg>\n");
    out
}
