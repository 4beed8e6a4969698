//! The tools and prompt that the official MCP conformance suite's MRTR
//! server scenarios (`input-required-result-*`, spec 2026-07-28) call, on
//! rmcp with stateseal in front exactly as the crate README shows.
//!
//!     cargo run --example conformance_server -- PORT STATESEAL_ADDR
//!
//! Streamable HTTP at http://127.0.0.1:PORT/mcp. The audience is
//! `STATESEAL_AUDIENCE` (default `conformance`).

use std::sync::Arc;

use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Value};
use stateseal_rmcp::{RequestStateClient, StatesealBoundary};

const TOOLS: [&str; 8] = [
    "test_input_required_result_elicitation",
    "test_input_required_result_sampling",
    "test_input_required_result_list_roots",
    "test_input_required_result_request_state",
    "test_input_required_result_multiple_inputs",
    "test_input_required_result_multi_round",
    "test_input_required_result_tampered_state",
    "test_input_required_result_capabilities",
];
const PROMPT: &str = "test_input_required_result_prompt";

#[derive(Clone)]
struct Conformance;

fn answer<'a>(answers: &'a Option<InputResponses>, key: &str) -> Option<&'a Value> {
    answers.as_ref()?.get(key)
}

/// The accepted content of an elicitation answer.
fn accepted<'a>(
    answers: &'a Option<InputResponses>,
    key: &str,
) -> Option<&'a serde_json::Map<String, Value>> {
    let a = answer(answers, key)?;
    (a.get("action")? == "accept").then_some(())?;
    a.get("content")?.as_object()
}

/// The text of a sampling answer.
fn sampled<'a>(answers: &'a Option<InputResponses>, key: &str) -> Option<&'a str> {
    let a = answer(answers, key)?;
    a.get("role")?.as_str()?;
    a.get("content")?.get("text")?.as_str()
}

fn roots<'a>(answers: &'a Option<InputResponses>, key: &str) -> Option<&'a Vec<Value>> {
    answer(answers, key)?.get("roots")?.as_array()
}

fn form(message: &str, props: &[(&str, &str)]) -> Value {
    let properties: serde_json::Map<String, Value> = props
        .iter()
        .map(|(k, t)| ((*k).to_owned(), json!({ "type": t })))
        .collect();
    let required: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    json!({
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": message,
            "requestedSchema": { "type": "object", "properties": properties, "required": required }
        }
    })
}

fn sampling(text: &str, max_tokens: u32) -> Value {
    json!({
        "method": "sampling/createMessage",
        "params": { "messages": [{ "role": "user", "content": { "type": "text", "text": text } }], "maxTokens": max_tokens }
    })
}

fn list_roots() -> Value {
    json!({ "method": "roots/list", "params": {} })
}

/// An input_required result: these questions, and this plaintext state
/// (stateseal seals it).
fn ask(questions: Value, state: Option<Value>) -> Result<InputRequiredResult, ErrorData> {
    let requests: InputRequests = serde_json::from_value(questions)
        .map_err(|e| ErrorData::internal_error(format!("bad question: {e}"), None))?;
    Ok(InputRequiredResult::new(
        Some(requests),
        state.map(|s| s.to_string()),
    ))
}

fn round_of(state: &Option<String>) -> Value {
    state
        .as_deref()
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or(Value::Null)
}

fn text(t: impl Into<String>) -> CallToolResponse {
    CallToolResult::success(vec![ContentBlock::text(t.into())]).into()
}

impl ServerHandler for Conformance {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_prompts()
                .build(),
        )
        .with_protocol_version(ProtocolVersion::V_2026_07_28)
        .with_server_info(Implementation::new(
            "stateseal-rmcp-conformance",
            env!("CARGO_PKG_VERSION"),
        ))
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let schema: Arc<JsonObject> =
            Arc::new(serde_json::from_value(json!({ "type": "object" })).unwrap_or_default());
        Ok(ListToolsResult::with_all_items(
            TOOLS
                .iter()
                .map(|name| Tool::new(*name, "An MRTR conformance tool", schema.clone()))
                .collect(),
        ))
    }

    async fn list_prompts(
        &self,
        _: Option<PaginatedRequestParams>,
        _: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        Ok(ListPromptsResult::with_all_items(vec![Prompt::new(
            PROMPT,
            Some("An MRTR conformance prompt"),
            None,
        )]))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        if request.name != PROMPT {
            return Err(ErrorData::invalid_params("no such prompt", None));
        }
        let a = &request.input_responses;
        match accepted(a, "user_context").and_then(|c| c.get("context")?.as_str()) {
            Some(context) => Ok(GetPromptResult::new(vec![PromptMessage::new_text(
                Role::User,
                format!("Context: {context}"),
            )])
            .into()),
            None => Ok(ask(json!({ "user_context": form("What context should the prompt use?", &[("context", "string")]) }), None)?.into()),
        }
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let a = &request.input_responses;
        let state = round_of(&request.request_state);
        let round = state.get("round").and_then(Value::as_str);
        match request.name.as_ref() {
            "test_input_required_result_elicitation" => {
                match accepted(a, "user_name").and_then(|c| c.get("name")?.as_str()) {
                    Some(name) => Ok(text(format!("Hello, {name}!"))),
                    None => Ok(ask(
                        json!({ "user_name": form("What is your name?", &[("name", "string")]) }),
                        None,
                    )?
                    .into()),
                }
            }
            "test_input_required_result_sampling" => match sampled(a, "capital_question") {
                Some(t) => Ok(text(format!("The model said: {t}"))),
                None => Ok(ask(
                    json!({ "capital_question": sampling("What is the capital of France?", 100) }),
                    None,
                )?
                .into()),
            },
            "test_input_required_result_list_roots" => match roots(a, "client_roots") {
                Some(r) => {
                    let uris: Vec<&str> = r.iter().filter_map(|x| x.get("uri")?.as_str()).collect();
                    Ok(text(format!("Roots: {}", uris.join(", "))))
                }
                None => Ok(ask(json!({ "client_roots": list_roots() }), None)?.into()),
            },
            name @ ("test_input_required_result_request_state"
            | "test_input_required_result_tampered_state") => {
                let ok = accepted(a, "confirm").and_then(|c| c.get("ok")?.as_bool());
                match (round, ok) {
                    (Some("confirm"), Some(ok)) if name.ends_with("request_state") => {
                        Ok(text(format!("state-ok: confirmed={ok}")))
                    }
                    (Some("confirm"), Some(_)) => Ok(text("state verified")),
                    _ => Ok(ask(
                        json!({ "confirm": form("Please confirm", &[("ok", "boolean")]) }),
                        Some(json!({ "round": "confirm" })),
                    )?
                    .into()),
                }
            }
            "test_input_required_result_multiple_inputs" => {
                let name = accepted(a, "user_name").and_then(|c| c.get("name")?.as_str());
                let greeting = sampled(a, "greeting");
                let r = roots(a, "client_roots");
                match (round, name, greeting, r) {
                    (Some("all"), Some(name), Some(greeting), Some(r)) => {
                        Ok(text(format!("{greeting} {name} ({} roots)", r.len())))
                    }
                    _ => Ok(ask(
                        json!({
                            "user_name": form("What is your name?", &[("name", "string")]),
                            "greeting": sampling("Generate a greeting", 50),
                            "client_roots": list_roots(),
                        }),
                        Some(json!({ "round": "all" })),
                    )?
                    .into()),
                }
            }
            "test_input_required_result_multi_round" => {
                let name = accepted(a, "step1").and_then(|c| c.get("name")?.as_str());
                let color = accepted(a, "step2").and_then(|c| c.get("color")?.as_str());
                match (round, name, color) {
                    (Some("step1"), Some(name), _) => Ok(ask(
                        json!({ "step2": form("Step 2: What is your favorite color?", &[("color", "string")]) }),
                        Some(json!({ "round": "step2", "name": name })),
                    )?
                    .into()),
                    (Some("step2"), _, Some(color)) => {
                        let who = state.get("name").and_then(Value::as_str).unwrap_or_default();
                        Ok(text(format!("{who} likes {color}")))
                    }
                    _ => Ok(ask(
                        json!({ "step1": form("Step 1: What is your name?", &[("name", "string")]) }),
                        Some(json!({ "round": "step1" })),
                    )?
                    .into()),
                }
            }
            "test_input_required_result_capabilities" => {
                if sampled(a, "summary").is_some() || accepted(a, "confirm").is_some() {
                    return Ok(text("done"));
                }
                let caps = context.client_capabilities();
                let mut questions = serde_json::Map::new();
                if caps.as_ref().is_some_and(|c| c.sampling.is_some()) {
                    questions.insert("summary".into(), sampling("Summarize the request", 50));
                }
                if caps.as_ref().is_some_and(|c| c.elicitation.is_some()) {
                    questions.insert("confirm".into(), form("Proceed?", &[("ok", "boolean")]));
                }
                if questions.is_empty() {
                    Ok(text("no input capability declared"))
                } else {
                    Ok(ask(Value::Object(questions), None)?.into())
                }
            }
            _ => Err(ErrorData::invalid_params("no such tool", None)),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().as_deref().unwrap_or("3000").parse()?;
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:50051".to_owned());
    let audience = std::env::var("STATESEAL_AUDIENCE").unwrap_or_else(|_| "conformance".to_owned());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();

    // The whole integration: a client, a boundary, and the handler wrapped.
    let boundary = StatesealBoundary::new(RequestStateClient::new(&addr)?, audience);
    let service = StreamableHttpService::new(
        move || Ok(boundary.wrap(Conformance)),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    axum::serve(listener, app).await?;
    Ok(())
}
