//! Soaks: `--samples` writes, every `--sample-every` seconds, the server's
//! RSS, its data directory's size on disk, the ops done, and the ledger's
//! size (`--sample-database-url`: the PostgreSQL table's live rows and
//! size; otherwise sled's record count from /metrics); `--samples-plot`
//! draws them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::runner::OPS_DONE;
use crate::support;

/// One row of --samples.
#[derive(Clone, Debug)]
pub struct Sample {
    secs: f64,
    rss_kib: u64,
    dir_kib: u64,
    ops: u64,
    /// PostgreSQL ledger: live rows and table size (with indexes, TOAST).
    pg_rows: Option<i64>,
    pg_kib: Option<i64>,
    /// The sled ledger's record count (`stateseal_ledger_records`).
    records: Option<i64>,
}

const SAMPLE_HEADER: &str =
    "seconds,rss_kib,data_dir_kib,ops,ops_per_s,pg_live_rows,pg_table_kib,ledger_records";

/// One gauge from the server's /metrics (Prometheus text), if it has it.
async fn scrape_gauge(addr: &str, name: &str) -> Option<i64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await.ok()?;
    String::from_utf8_lossy(&body)
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Samples the server every `every` until `stop`, appending CSV rows to
/// `out` as they come (a long soak keeps its data if cut short).
pub async fn sampler(
    pid: u32,
    dir: PathBuf,
    db_url: Option<String>,
    metrics_addr: Option<String>,
    every: Duration,
    out: PathBuf,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    use std::io::Write;
    let db = match db_url {
        Some(u) => match tokio_postgres::connect(&u, tokio_postgres::NoTls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                Some(c)
            }
            Err(e) => {
                eprintln!("sampler: cannot connect to PostgreSQL ({e}); not sampling the table");
                None
            }
        },
        None => None,
    };
    let mut f = std::fs::File::create(&out).expect("create --samples file");
    writeln!(f, "{SAMPLE_HEADER}").expect("write samples");
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut last: Option<(f64, u64)> = None;
    let mut tick = tokio::time::interval(every);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let rss_kib = support::status_kib(&pid.to_string(), "VmRSS:").unwrap_or(0);
        let (pg_rows, pg_kib) = match &db {
            Some(c) => match c
                .query_one(
                    "SELECT count(*), pg_total_relation_size('stateseal_consumed_v1') / 1024 \
                     FROM stateseal_consumed_v1",
                    &[],
                )
                .await
            {
                Ok(r) => (Some(r.get::<_, i64>(0)), Some(r.get::<_, i64>(1))),
                Err(_) => (None, None),
            },
            None => (None, None),
        };
        let records = match &metrics_addr {
            Some(a) => scrape_gauge(a, "stateseal_ledger_records").await,
            None => None,
        };
        let s = Sample {
            records,
            secs: started.elapsed().as_secs_f64(),
            rss_kib,
            dir_kib: support::disk_usage(&dir) / 1024,
            ops: OPS_DONE.load(Ordering::Relaxed),
            pg_rows,
            pg_kib,
        };
        let rate = last
            .map(|(t, o)| (s.ops - o) as f64 / (s.secs - t).max(1e-9))
            .unwrap_or(0.0);
        last = Some((s.secs, s.ops));
        let opt = |v: Option<i64>| v.map(|v| v.to_string()).unwrap_or_default();
        writeln!(
            f,
            "{:.0},{},{},{},{:.0},{},{},{}",
            s.secs,
            s.rss_kib,
            s.dir_kib,
            s.ops,
            rate,
            opt(s.pg_rows),
            opt(s.pg_kib),
            opt(s.records)
        )
        .expect("write samples");
        let _ = f.flush();
        eprintln!(
            "sample {:>6.0}s: rss {:>7} KiB, data dir {:>7} KiB, {:>8.0} ops/s{}",
            s.secs,
            s.rss_kib,
            s.dir_kib,
            rate,
            s.pg_rows
                .map(|r| format!(", pg {r} rows, {} KiB", s.pg_kib.unwrap_or(0)))
                .or_else(|| s.records.map(|r| format!(", ledger {r} records")))
                .unwrap_or_default()
        );
        rows.push(s);
    }
    rows
}

/// The samples as curves over time, one panel per quantity.
pub fn samples_svg(rows: &[Sample]) -> String {
    use std::fmt::Write as _;
    let mut panels: Vec<(&str, Vec<(f64, f64)>)> = vec![
        (
            "server RSS (MiB)",
            rows.iter()
                .map(|r| (r.secs, r.rss_kib as f64 / 1024.0))
                .collect(),
        ),
        (
            "data directory on disk (MiB)",
            rows.iter()
                .map(|r| (r.secs, r.dir_kib as f64 / 1024.0))
                .collect(),
        ),
        (
            "ops/s (since the previous sample)",
            rows.windows(2)
                .map(|w| {
                    (
                        w[1].secs,
                        (w[1].ops - w[0].ops) as f64 / (w[1].secs - w[0].secs),
                    )
                })
                .collect(),
        ),
    ];
    // Panels for the quantities a run sampled (sled's record count, or the
    // PostgreSQL table), skipped when it did not.
    type Series = fn(&Sample) -> Option<f64>;
    let optional: [(&str, Series); 3] = [
        ("ledger records (live and not yet collected)", |r| {
            r.records.map(|v| v as f64)
        }),
        ("PostgreSQL ledger live rows", |r| {
            r.pg_rows.map(|v| v as f64)
        }),
        ("PostgreSQL ledger table size (MiB)", |r| {
            r.pg_kib.map(|v| v as f64 / 1024.0)
        }),
    ];
    for (title, value) in optional {
        let pts: Vec<(f64, f64)> = rows
            .iter()
            .filter_map(|r| Some((r.secs, value(r)?)))
            .collect();
        if !pts.is_empty() {
            panels.push((title, pts));
        }
    }
    let (w, ph, left, top) = (720.0, 150.0, 70.0, 30.0);
    let h = top + panels.len() as f64 * (ph + 40.0);
    let tmax = rows.last().map(|r| r.secs).unwrap_or(1.0).max(1.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, (title, pts)) in panels.iter().enumerate() {
        let y0 = top + i as f64 * (ph + 40.0);
        let vmax = pts.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
        let _ = writeln!(
            out,
            "<text x=\"{left}\" y=\"{}\" font-weight=\"bold\">{title}</text>",
            y0 - 8.0
        );
        let _ = writeln!(out, "<rect x=\"{left}\" y=\"{y0}\" width=\"{}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>", w - left - 20.0);
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.1}</text>",
            left - 4.0,
            y0 + 10.0,
            vmax
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">0</text>",
            left - 4.0,
            y0 + ph
        );
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.0} min</text>",
            w - 20.0,
            y0 + ph + 14.0,
            tmax / 60.0
        );
        let path: Vec<String> = pts
            .iter()
            .map(|(t, v)| {
                format!(
                    "{:.1},{:.1}",
                    left + t / tmax * (w - left - 20.0),
                    y0 + ph - v / vmax * ph
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"#1f6fb2\" stroke-width=\"1.5\" points=\"{}\"/>",
            path.join(" ")
        );
    }
    out.push_str("</svg>\n");
    out
}
