//! A complete rmcp server (Streamable HTTP, stateless) whose `requestState`
//! goes through stateseal: the same `transfer-service` as the TypeScript
//! example and the Python replica of the cross-language test (the same
//! tools, state and question).
//!
//!     cargo run --example transfer_server -- STATESEAL_ADDR PORT
//!
//! The crate's tests use [`Bank`] in process (`tests/common`).
#![allow(dead_code)] // the tests include this file for `Bank`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Value};
use stateseal_rmcp::{RequestStateClient, StatesealBoundary};
use tokio::sync::Semaphore;

/// The bank: `transfer` and `slow_transfer` ask to confirm an amount, then
/// run; `flaky` reports an error on its first confirmed run.
#[derive(Clone, Default)]
pub struct Bank {
    /// Confirmed runs started and finished, per tool name.
    pub runs: Arc<Runs>,
    /// When set, a confirmed `slow_transfer` waits for a permit.
    pub gate: Option<Arc<Semaphore>>,
    /// The `inputResponses` each handler call saw (JSON), in order.
    pub seen: Arc<std::sync::Mutex<Vec<Value>>>,
}

#[derive(Default)]
pub struct Runs {
    pub transfer: AtomicUsize,
    pub slow_started: AtomicUsize,
    pub slow_finished: AtomicUsize,
    pub flaky: AtomicUsize,
}

pub fn confirm_question(amount: &Value) -> Result<InputRequests, ErrorData> {
    serde_json::from_value(json!({
        "confirm": {
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": format!("Transfer {amount}?"),
                "requestedSchema": {
                    "type": "object",
                    "properties": { "confirm": { "type": "boolean" } },
                    "required": ["confirm"]
                }
            }
        }
    }))
    .map_err(|e| ErrorData::internal_error(format!("bad question: {e}"), None))
}

fn text(t: impl Into<String>) -> CallToolResponse {
    CallToolResult::success(vec![ContentBlock::text(t.into())]).into()
}

impl ServerHandler for Bank {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_protocol_version(ProtocolVersion::V_2026_07_28)
            .with_server_info(Implementation::new(
                "transfer-service",
                env!("CARGO_PKG_VERSION"),
            ))
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema: JsonObject = serde_json::from_value(json!({
            "type": "object", "properties": { "amount": { "type": "number" } }, "required": ["amount"]
        }))
        .unwrap_or_default();
        let schema = Arc::new(schema);
        Ok(ListToolsResult::with_all_items(
            ["transfer", "slow_transfer", "flaky"]
                .iter()
                .map(|n| Tool::new(*n, "Move money", schema.clone()))
                .collect(),
        ))
    }

    async fn on_custom_request(
        &self,
        request: CustomRequest,
        _: RequestContext<RoleServer>,
    ) -> Result<CustomResult, ErrorData> {
        Ok(Bank::echo(&request))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if let Some(a) = &request.input_responses {
            if let Ok(mut seen) = self.seen.lock() {
                seen.push(json!(a));
            }
        }
        let amount = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("amount"))
            .cloned()
            .unwrap_or(Value::Null);
        let confirmed = request
            .input_responses
            .as_ref()
            .and_then(|a| a.get("confirm"))
            .filter(|a| a.get("action").and_then(Value::as_str) == Some("accept"))
            .and_then(|a| a.get("content")?.get("confirm")?.as_bool());
        let (Some(state), Some(confirmed)) = (&request.request_state, confirmed) else {
            // The state is this server's plaintext: stateseal seals it.
            let state = json!({ "step": "confirm", "amount": amount }).to_string();
            return Ok(
                InputRequiredResult::new(Some(confirm_question(&amount)?), Some(state)).into(),
            );
        };
        let state: Value = serde_json::from_str(state)
            .map_err(|_| ErrorData::invalid_params("bad state", None))?;
        if state.get("amount") != Some(&amount) {
            return Err(ErrorData::invalid_params("state does not match", None));
        }
        if !confirmed {
            return Ok(text("cancelled"));
        }
        match request.name.as_ref() {
            "transfer" => {
                self.runs.transfer.fetch_add(1, Ordering::SeqCst);
                Ok(text(format!("transferred {amount} (rust)")))
            }
            "slow_transfer" => {
                self.runs.slow_started.fetch_add(1, Ordering::SeqCst);
                if let Some(gate) = &self.gate {
                    let _permit = gate
                        .acquire()
                        .await
                        .map_err(|_| ErrorData::internal_error("gate closed", None))?;
                }
                self.runs.slow_finished.fetch_add(1, Ordering::SeqCst);
                Ok(text(format!("slow {amount} done (rust)")))
            }
            "flaky" => {
                if self.runs.flaky.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Ok(
                        CallToolResult::error(vec![ContentBlock::text("backend hiccup")]).into(),
                    );
                }
                Ok(text(format!("flaky {amount} done (rust)")))
            }
            _ => Err(ErrorData::invalid_params("no such tool", None)),
        }
    }
}

impl Bank {
    /// What an app's catch-all for methods rmcp does not know looks like:
    /// it echoes the params it got. A `tools/call` whose params rmcp cannot
    /// parse would land here, unopened, without the boundary's guard.
    pub fn echo(request: &CustomRequest) -> CustomResult {
        CustomResult::new(json!({ "method": request.method, "params": request.params }))
    }
}

/// Serves `boundary.wrap(bank)` over Streamable HTTP (stateless, JSON
/// answers) at /mcp on `listener`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    boundary: StatesealBoundary,
    bank: Bank,
) -> std::io::Result<()> {
    let service = StreamableHttpService::new(
        move || Ok(boundary.wrap(bank.clone())),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    axum::serve(listener, axum::Router::new().nest_service("/mcp", service)).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:50051".to_owned());
    let port: u16 = args.next().as_deref().unwrap_or("3000").parse()?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let boundary = StatesealBoundary::new(RequestStateClient::new(&addr)?, "transfer-service");
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("ready");
    serve(listener, boundary, Bank::default()).await?;
    Ok(())
}
