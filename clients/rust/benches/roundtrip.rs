//! Added latency of one MRTR round (input_required, then the retry that
//! completes) through stateseal, against rmcp's own boundary
//! (`RequestStateCodec`, HMAC-SHA256 with the params as associated data),
//! measured in one run with the real rmcp server and client over
//! Streamable HTTP on 127.0.0.1.
//!
//!     cargo build --release --bin stateseal            # at the repository root
//!     cd clients/rust && cargo bench --bench roundtrip -- [rounds, default 300]
//!
//! `STATESEAL_BIN` overrides the stateseal binary (default: the root's
//! target/release/stateseal). The two variants run interleaved in blocks of
//! 20, so machine noise hits both alike.
//!
//! It then prints where the stateseal variant's time goes, per round trip
//! (mean over the measured round trips), each step timed where it runs
//! (`stateseal_rmcp::steps`):
//! - the boundary's own work: its time on the response path minus the
//!   steps below (and minus the handler);
//! - binding v2 (the params digest) and the subject;
//! - the manifest: the questions' JSON when sealing, the answers' JSON sent
//!   and the filtered answers parsed back;
//! - each RPC as the boundary awaits it: Seal and Open RESERVE on the
//!   response path, and how many Commits the next Open carried and how many
//!   went on their own;
//! - the server's handling of each RPC (its
//!   stateseal_request_duration_seconds histogram, scraped before and
//!   after) and its durable rounds (stateseal_ledger_consume_duration_seconds);
//! - the gRPC client and loopback: the RPCs as awaited minus the server's
//!   handling of them.

#[path = "../tests/common/mod.rs"]
mod common;

use common::transfer;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Value};
use stateseal_rmcp::steps::{Step, Steps};
use stateseal_rmcp::{RequestStateClient, StatesealBoundary};

/// The same bank tool, its state sealed by rmcp's own codec, bound to the
/// tool name and arguments as associated data.
#[derive(Clone)]
struct CodecBank {
    codec: RequestStateCodec,
}

impl ServerHandler for CodecBank {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_protocol_version(ProtocolVersion::V_2026_07_28)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let amount = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("amount"))
            .cloned()
            .unwrap_or(Value::Null);
        let ad = serde_json::to_vec(&json!([request.name, request.arguments]))
            .map_err(|_| ErrorData::internal_error("ad", None))?;
        let confirmed = request
            .input_responses
            .as_ref()
            .and_then(|a| a.get("confirm"))
            .and_then(|a| a.get("content")?.get("confirm")?.as_bool());
        if let (Some(sealed), Some(true)) = (&request.request_state, confirmed) {
            let state = self
                .codec
                .open_with(sealed, &ad)
                .map_err(|_| ErrorData::invalid_params("Invalid or expired requestState", None))?;
            let state: Value = serde_json::from_slice(&state)
                .map_err(|_| ErrorData::invalid_params("state", None))?;
            if state.get("amount") != Some(&amount) {
                return Err(ErrorData::invalid_params("state does not match", None));
            }
            return Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                "transferred {amount}"
            ))])
            .into());
        }
        let state = json!({ "step": "confirm", "amount": amount }).to_string();
        let sealed = self.codec.seal_with(
            state.as_bytes(),
            &SealOptions::new()
                .associated_data(&ad)
                .ttl(Duration::from_secs(600)),
        );
        let questions = transfer::confirm_question(&amount)?;
        Ok(InputRequiredResult::new(Some(questions), Some(sealed)).into())
    }
}

/// One MRTR round trip: the call that asks, and the retry that completes.
async fn round(client: &common::Client, amount: u64) -> Duration {
    let args: JsonObject = serde_json::from_value(json!({ "amount": amount })).expect("args");
    let start = Instant::now();
    let first = client
        .call_tool_once(CallToolRequestParams::new("transfer").with_arguments(args.clone()))
        .await
        .expect("first call");
    let CallToolResponse::InputRequired(asked) = first else {
        panic!("expected input_required, got {first:?}")
    };
    let answers: InputResponses = serde_json::from_value(
        json!({ "confirm": { "action": "accept", "content": { "confirm": true } } }),
    )
    .expect("answers");
    let mut retry = CallToolRequestParams::new("transfer")
        .with_arguments(args)
        .with_input_responses(answers);
    if let Some(s) = asked.request_state {
        retry = retry.with_request_state(s);
    }
    match client.call_tool_once(retry).await.expect("retry") {
        CallToolResponse::Complete(r) if r.is_error != Some(true) => {}
        other => panic!("expected a complete result, got {other:?}"),
    }
    start.elapsed()
}

/// The server's request and ledger histograms: sum and count by name.
fn scrape(addr: &str) -> HashMap<String, f64> {
    let mut s = std::net::TcpStream::connect(addr).expect("metrics");
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("metrics body");
    let mut out = HashMap::new();
    for line in text.lines() {
        for prefix in [
            "stateseal_request_duration_seconds_",
            "stateseal_ledger_consume_duration_seconds_",
        ] {
            if line.starts_with(&format!("{prefix}sum"))
                || line.starts_with(&format!("{prefix}count"))
            {
                if let Some((name, value)) = line.rsplit_once(' ') {
                    out.insert(name.to_owned(), value.parse().unwrap_or(0.0));
                }
            }
        }
    }
    out
}

/// Waits until the server has handled every RPC sent so far (the count of
/// its request histogram stops moving): a Commit beside the answer may
/// still be running.
async fn settle(addr: &str) {
    let mut last = -1.0;
    for _ in 0..50 {
        let now: f64 = scrape(addr)
            .iter()
            .filter(|(k, _)| k.starts_with("stateseal_request_duration_seconds_count"))
            .map(|(_, v)| v)
            .sum();
        if now == last {
            return;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn quantile(xs: &[Duration], p: f64) -> f64 {
    let mut s: Vec<f64> = xs.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    s.sort_by(f64::total_cmp);
    s[((p * s.len() as f64) as usize).min(s.len() - 1)]
}

#[tokio::main]
async fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(300);
    let bin = std::env::var_os("STATESEAL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/stateseal")
        });
    assert!(
        bin.exists(),
        "no stateseal binary at {} (cargo build --release --bin stateseal at the root)",
        bin.display()
    );
    let metrics = format!("127.0.0.1:{}", common::free_port());
    let ss = common::Stateseal::start_with(&bin, &["--metrics-listen", &metrics]);
    let addr = ss.addr.clone();

    let steps = Arc::new(Steps::default());
    let boundary = StatesealBoundary::builder(
        RequestStateClient::new(&addr).expect("client"),
        "transfer-service",
    )
    .steps(steps.clone())
    .build();
    let sealed_url = common::serve_handler(boundary.wrap(transfer::Bank::default())).await;
    let key: [u8; 32] = rand::random();
    let codec_url = common::serve_handler(CodecBank {
        codec: RequestStateCodec::try_new(key.to_vec()).expect("a 32-byte key"),
    })
    .await;
    let (codec, sealed) = (
        common::connect(&codec_url).await,
        common::connect(&sealed_url).await,
    );

    let mut amount = 0u64;
    // Warm-up: connections, caches, the ledger's first writes.
    for _ in 0..20 {
        amount += 1;
        round(&codec, amount).await;
        round(&sealed, amount).await;
    }
    settle(&metrics).await;
    steps.reset();
    let before = scrape(&metrics);
    let (mut base, mut ours) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    while base.len() < rounds {
        let block = 20.min(rounds - base.len());
        for _ in 0..block {
            amount += 1;
            base.push(round(&codec, amount).await);
        }
        for _ in 0..block {
            amount += 1;
            ours.push(round(&sealed, amount).await);
        }
    }
    assert!(
        boundary.drain(Duration::from_secs(10)).await,
        "commits still running"
    );
    settle(&metrics).await;
    let after = scrape(&metrics);

    println!("round trips per variant: {rounds} (2 MCP requests each), rmcp 3.11, blocks of 20 interleaved");
    println!("variant | p50 ms | p90 ms | p99 ms | p50 vs rmcp's codec");
    let b50 = quantile(&base, 0.5);
    for (name, t) in [
        (
            "rmcp RequestStateCodec (HMAC, params as associated data)",
            &base,
        ),
        ("stateseal (reserve + commit, manifest)", &ours),
    ] {
        let p50 = quantile(t, 0.5);
        println!(
            "{name} | {p50:.2} | {:.2} | {:.2} | {:+.2} ms (x{:.2})",
            quantile(t, 0.9),
            quantile(t, 0.99),
            p50 - b50,
            p50 / b50
        );
    }

    let per = |secs: f64| secs * 1000.0 / rounds as f64;
    let ms = |step: Step| per(steps.total(step).as_secs_f64());
    let server = |rpc: &str| {
        let key = format!("{{rpc=\"{rpc}\"}}");
        let get = |m: &HashMap<String, f64>, what: &str| {
            m.get(&format!("stateseal_request_duration_seconds_{what}{key}"))
                .copied()
                .unwrap_or(0.0)
        };
        (
            get(&after, "sum") - get(&before, "sum"),
            get(&after, "count") - get(&before, "count"),
        )
    };
    let durable: f64 = after
        .iter()
        .filter(|(k, _)| k.starts_with("stateseal_ledger_consume_duration_seconds_sum"))
        .map(|(k, v)| v - before.get(k).copied().unwrap_or(0.0))
        .sum();
    let on_path = [("Seal", Step::RpcSeal), ("Open", Step::RpcOpen)];
    let awaited: f64 = on_path.iter().map(|(_, s)| ms(*s)).sum();
    let handled: f64 = on_path.iter().map(|(r, _)| per(server(r).0)).sum();
    let own = ms(Step::Boundary) - ms(Step::Binding) - ms(Step::Manifest) - awaited;
    println!("where the stateseal variant's time goes, ms per round trip (mean of {rounds}):");
    println!("step | ms");
    println!(
        "boundary on the response path, in all | {:.3}",
        ms(Step::Boundary)
    );
    println!("  its own work (not the steps below) | {own:.3}");
    println!("  binding v2 and subject | {:.3}", ms(Step::Binding));
    println!(
        "  manifest: questions and answers JSON | {:.3}",
        ms(Step::Manifest)
    );
    for (rpc, step) in on_path {
        let (s, n) = server(rpc);
        println!(
            "  {rpc} as awaited ({:.2} per round trip) | {:.3}",
            n / rounds as f64,
            ms(step)
        );
        println!("    the server's handling of it | {:.3}", per(s));
    }
    println!(
        "  gRPC client and loopback (awaited minus handled) | {:.3}",
        awaited - handled
    );
    let carried = steps.count(Step::CommitCarried) as f64;
    println!(
        "Commits carried by the next Open, per round trip | {:.2}",
        carried / rounds as f64
    );
    for (rpc, step) in [("Commit", Step::RpcCommit), ("Renew", Step::RpcRenew)] {
        let (s, n) = server(rpc);
        if rpc == "Commit" {
            // The server counts a carried commit as a Commit (handled beside
            // the Open that carried it); the rest were sent alone.
            println!(
                "Commits sent alone, per round trip | {:.2}",
                steps.count(step) as f64 / rounds as f64
            );
            println!(
                "  the server's handling of every commit, carried or not | {:.3}",
                per(s)
            );
            println!(
                "  a Commit sent alone, as awaited, per round trip | {:.3}",
                ms(step)
            );
        } else if n > 0.0 {
            println!(
                "off the response path: {rpc} as awaited ({:.2} per round trip) | {:.3}",
                n / rounds as f64,
                ms(step)
            );
            println!("  the server's handling of it | {:.3}", per(s));
        }
    }
    println!(
        "the server's durable rounds (Open RESERVE and Commit, within their handling) | {:.3}",
        per(durable)
    );
    drop(ss);
}
