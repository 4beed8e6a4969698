//! Test support: a real stateseal process, the example bank behind a real
//! rmcp server on 127.0.0.1, and a real rmcp client over Streamable HTTP.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rmcp::model::*;
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ClientHandler;
use serde_json::{json, Value};

#[path = "../../examples/transfer_server.rs"]
pub mod transfer;

/// The stateseal binary: `STATESEAL_BIN`, else the repository's debug build.
pub fn stateseal_bin() -> PathBuf {
    std::env::var_os("STATESEAL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/stateseal")
        })
}

/// A stateseal process on 127.0.0.1 (killed on drop).
pub struct Stateseal {
    child: Child,
    pub addr: String,
    bin: PathBuf,
    args: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Stateseal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Stateseal {
    pub fn start(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, extra)
    }

    pub fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Self {
        Self::start_from(&stateseal_bin(), dir, extra)
    }

    /// `bin` (for the bench: a release build).
    pub fn start_with(bin: &std::path::Path, extra: &[&str]) -> Self {
        Self::start_from(bin, tempfile::tempdir().expect("tempdir"), extra)
    }

    /// Listening on `port`, so that [`Stateseal::restart`] listens there
    /// again.
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::spawn_from(&stateseal_bin(), dir, &format!("127.0.0.1:{port}"), extra)
    }

    fn start_from(bin: &std::path::Path, dir: tempfile::TempDir, extra: &[&str]) -> Self {
        Self::spawn_from(bin, dir, "127.0.0.1:0", extra)
    }

    fn spawn_from(
        bin: &std::path::Path,
        dir: tempfile::TempDir,
        listen: &str,
        extra: &[&str],
    ) -> Self {
        assert!(bin.exists(), "no stateseal binary at {} (cargo build --bin stateseal at the root, or set STATESEAL_BIN)", bin.display());
        let data = dir.path().join("data");
        let mut args: Vec<String> = vec!["serve".into(), "--listen".into(), listen.into()];
        args.extend([
            "--data-dir".into(),
            data.to_str().expect("utf-8").to_owned(),
        ]);
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let (child, addr) = Self::spawn(bin, &args);
        Stateseal {
            child,
            addr,
            bin: bin.to_owned(),
            args,
            _dir: dir,
        }
    }

    /// Kills the process (SIGKILL) and waits for it: stateseal is down.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again, with the same arguments and data directory (and,
    /// started with [`Stateseal::start_on`], the same address).
    pub fn restart(&mut self) {
        self.kill();
        let (child, addr) = Self::spawn(&self.bin, &self.args);
        self.child = child;
        self.addr = addr;
    }

    fn spawn(bin: &std::path::Path, args: &[String]) -> (Child, String) {
        let mut child = Command::new(bin)
            .args(args)
            .env_remove("STATESEAL_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start stateseal");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let mut addr = None;
        for line in lines.by_ref() {
            let line = line.expect("stderr line");
            if line.contains("listening") {
                if let Some(a) = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("addr="))
                {
                    addr = Some(a.trim_matches('"').to_owned());
                    break;
                }
            }
        }
        let addr = addr.expect("stateseal did not start");
        // Keep draining stderr so the process never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        (child, addr)
    }
}

/// The MCP test client: answers nothing by itself (the tests drive each
/// round), declares elicitation, sampling and roots, speaks 2026-07-28.
#[derive(Clone)]
pub struct TestClient;

impl ClientHandler for TestClient {
    #[allow(deprecated)] // sampling and roots: deprecated by SEP-2577, still in the MRTR scenarios
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder()
                .enable_elicitation()
                .enable_sampling()
                .enable_roots()
                .build(),
            Implementation::new("stateseal-rmcp-tests", "1"),
        )
        .with_protocol_version(ProtocolVersion::V_2026_07_28)
    }
}

pub type Client = RunningService<RoleClient, TestClient>;

pub async fn connect(url: &str) -> Client {
    start(StreamableHttpClientTransport::from_uri(url.to_owned())).await
}

/// The 2026-07-28 lifecycle (`server/discover`, per-request metadata).
async fn start(transport: StreamableHttpClientTransport<reqwest::Client>) -> Client {
    use rmcp::service::{ClientLifecycleMode, ClientServiceExt};
    let mode = ClientLifecycleMode::Discover {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
    };
    TestClient
        .serve_with_lifecycle(transport, mode)
        .await
        .expect("connect")
}

/// The bank behind `boundary` on 127.0.0.1; returns its /mcp URL.
pub async fn serve_bank(
    boundary: stateseal_rmcp::StatesealBoundary,
    bank: transfer::Bank,
) -> String {
    serve_handler(boundary.wrap(bank)).await
}

/// Any handler over Streamable HTTP (stateless, JSON answers) at /mcp on
/// 127.0.0.1; returns the URL.
pub async fn serve_handler<H: rmcp::ServerHandler + Clone>(handler: H) -> String {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
    let service = StreamableHttpService::new(
        move || Ok(handler.clone()),
        std::sync::Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        axum::serve(listener, axum::Router::new().nest_service("/mcp", service)).await
    });
    url
}

pub fn args(v: Value) -> JsonObject {
    v.as_object().cloned().expect("an object")
}

/// `tools/call` once: the raw response (a JSON-RPC error as Err).
pub async fn call(
    client: &Client,
    name: &str,
    arguments: Value,
    retry: Option<(&InputRequiredResult, Value)>,
) -> Result<CallToolResponse, ErrorData> {
    let mut p = CallToolRequestParams::new(name.to_owned()).with_arguments(args(arguments));
    if let Some((asked, answers)) = retry {
        if let Some(state) = &asked.request_state {
            p = p.with_request_state(state.clone());
        }
        p = p.with_input_responses(serde_json::from_value(answers).expect("answers"));
    }
    match client.call_tool_once(p).await {
        Ok(r) => Ok(r),
        Err(ServiceError::McpError(e)) => Err(e),
        Err(e) => panic!("transport failure: {e}"),
    }
}

/// A tool call's outcome, for a failure message: never its `requestState`
/// (a test never prints a token).
pub fn describe(r: &Result<CallToolResponse, ErrorData>) -> String {
    match r {
        Ok(CallToolResponse::Complete(c)) => format!("the result {c:?}"),
        Ok(CallToolResponse::InputRequired(a)) => format!(
            "input_required asking {:?} (its requestState not shown)",
            a.input_requests
                .as_ref()
                .map(|q| q.keys().cloned().collect::<Vec<_>>())
        ),
        Ok(_) => "another kind of result".to_owned(),
        Err(e) => format!("the error {e:?}"),
    }
}

pub fn asked(r: Result<CallToolResponse, ErrorData>) -> InputRequiredResult {
    match r {
        Ok(CallToolResponse::InputRequired(a)) => a,
        other => panic!("expected input_required, got {other:?}"),
    }
}

/// The text of a complete tool result.
pub fn done(r: Result<CallToolResponse, ErrorData>) -> String {
    match r {
        Ok(CallToolResponse::Complete(c)) => c
            .content
            .iter()
            .filter_map(|b| b.as_text().map(|t| t.text.clone()))
            .collect::<Vec<_>>()
            .join(""),
        other => panic!("expected a complete result, got {}", describe(&other)),
    }
}

pub fn yes() -> Value {
    json!({ "confirm": { "action": "accept", "content": { "confirm": true } } })
}

/// Asserts a JSON-RPC error of this code, message and `data.reason`.
pub fn refused(
    r: Result<CallToolResponse, ErrorData>,
    code: i32,
    message: &str,
    reason: Option<&str>,
) {
    match r {
        Err(e) => {
            assert_eq!((e.code.0, e.message.as_ref()), (code, message), "{e:?}");
            let got = e
                .data
                .as_ref()
                .and_then(|d| d.get("reason"))
                .and_then(Value::as_str);
            assert_eq!(got, reason, "{e:?}");
        }
        Ok(r) => panic!("expected error {code} {message}, got {}", describe(&Ok(r))),
    }
}

/// Polls `f` every 20 ms until it holds, at most `within`.
pub async fn until(what: &str, within: Duration, f: impl Fn() -> bool) {
    let end = tokio::time::Instant::now() + within;
    while !f() {
        assert!(
            tokio::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A client whose every request carries `x-user: user` (the test server's
/// stand-in for a verified principal).
pub async fn connect_as(url: &str, user: &str) -> Client {
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    let mut headers = std::collections::HashMap::new();
    headers.insert(
        http::HeaderName::from_static("x-user"),
        http::HeaderValue::from_str(user).expect("header value"),
    );
    let config =
        StreamableHttpClientTransportConfig::with_uri(url.to_owned()).custom_headers(headers);
    start(StreamableHttpClientTransport::from_config(config)).await
}

/// The bank behind `boundary`, with an authentication layer that takes
/// the `x-user` header as the verified principal (a real server verifies
/// an access token here) and puts it where the boundary looks.
pub async fn serve_bank_with_users(
    boundary: stateseal_rmcp::StatesealBoundary,
    bank: transfer::Bank,
) -> String {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
    use std::sync::Arc;
    let service = StreamableHttpService::new(
        move || Ok(boundary.wrap(bank.clone())),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    async fn authenticate(
        mut req: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        if let Some(user) = req
            .headers()
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
        {
            req.extensions_mut().insert(stateseal_rmcp::Principal(user));
        }
        next.run(req).await
    }
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

// The root crate's free-port helper, shared.
#[path = "../../../../tests/it/common/ports.rs"]
mod ports;
#[allow(unused_imports)] // not every test binary starts a server of its own
pub use ports::free_port;

// The root crate's loud skips, shared: under STATESEAL_FAIL_ON_SKIP=1 (CI)
// a test that cannot check its property fails instead.
#[path = "../../../../tests/it/common/skip.rs"]
pub mod skip;
