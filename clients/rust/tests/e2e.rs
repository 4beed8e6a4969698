//! The boundary end to end: a real stateseal process, the example bank on a
//! real rmcp server behind the boundary, and a real rmcp client over
//! Streamable HTTP on 127.0.0.1.
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::transfer::Bank;
use common::*;
use serde_json::json;
use stateseal_rmcp::steps::{Step, Steps};
use stateseal_rmcp::{Binding, Credentials, OpenMode, RequestStateClient, StatesealBoundary};

fn boundary(ss: &Stateseal) -> StatesealBoundary {
    StatesealBoundary::new(
        RequestStateClient::new(&ss.addr).expect("client"),
        "transfer-service",
    )
}

#[tokio::test]
async fn a_round_trip_completes_once_and_a_replay_is_refused() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let client = connect(&serve_bank(boundary(&ss), bank.clone()).await).await;
    let a = asked(call(&client, "transfer", json!({"amount": 42}), None).await);
    let token = a.request_state.clone().expect("a sealed requestState");
    assert!(
        !token.contains("confirm") && !token.starts_with('{'),
        "the state went out unsealed"
    );
    let r = call(
        &client,
        "transfer",
        json!({"amount": 42}),
        Some((&a, yes())),
    )
    .await;
    assert_eq!(done(r), "transferred 42 (rust)");
    let replay = call(
        &client,
        "transfer",
        json!({"amount": 42}),
        Some((&a, yes())),
    )
    .await;
    refused(
        replay,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    assert_eq!(bank.runs.transfer.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn changed_arguments_are_refused_without_burning_the_token() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let client = connect(&serve_bank(boundary(&ss), bank.clone()).await).await;
    let a = asked(call(&client, "transfer", json!({"amount": 8}), None).await);
    let forged = call(
        &client,
        "transfer",
        json!({"amount": 800}),
        Some((&a, yes())),
    )
    .await;
    refused(
        forged,
        -32602,
        "Invalid or expired requestState",
        Some("invalid_request_state"),
    );
    // 2^53 + 1 against 2^53: serde_json holds both exactly, so they differ.
    let big = asked(
        call(
            &client,
            "transfer",
            json!({"amount": 9007199254740993u64}),
            None,
        )
        .await,
    );
    let near = call(
        &client,
        "transfer",
        json!({"amount": 9007199254740992u64}),
        Some((&big, yes())),
    )
    .await;
    refused(
        near,
        -32602,
        "Invalid or expired requestState",
        Some("invalid_request_state"),
    );
    assert_eq!(bank.runs.transfer.load(Ordering::SeqCst), 0);
    let genuine = call(&client, "transfer", json!({"amount": 8}), Some((&a, yes()))).await;
    assert_eq!(done(genuine), "transferred 8 (rust)");
    let genuine = call(
        &client,
        "transfer",
        json!({"amount": 9007199254740993u64}),
        Some((&big, yes())),
    )
    .await;
    assert_eq!(done(genuine), "transferred 9007199254740993 (rust)");
}

#[tokio::test]
async fn answers_without_a_token_never_reach_the_handler_and_unasked_ones_are_dropped() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let client = connect(&serve_bank(boundary(&ss), bank.clone()).await).await;
    let mut p = rmcp::model::CallToolRequestParams::new("transfer")
        .with_arguments(args(json!({"amount": 1})));
    p = p.with_input_responses(serde_json::from_value(yes()).expect("answers"));
    let r = client.call_tool_once(p).await.expect("an answer");
    assert!(
        matches!(r, rmcp::model::CallToolResponse::InputRequired(_)),
        "answers without a token were used: {r:?}"
    );
    assert!(
        bank.seen.lock().expect("seen").is_empty(),
        "the handler saw answers without a token"
    );

    let a = asked(call(&client, "transfer", json!({"amount": 2}), None).await);
    let mut answers = yes();
    answers["unasked"] = json!({"action": "accept", "content": {"x": 1}});
    assert_eq!(
        done(
            call(
                &client,
                "transfer",
                json!({"amount": 2}),
                Some((&a, answers))
            )
            .await
        ),
        "transferred 2 (rust)"
    );
    let seen = bank.seen.lock().expect("seen").clone();
    assert_eq!(
        seen,
        vec![yes()],
        "the handler saw an answer to a question it never asked"
    );
}

/// A tool whose first round answers "still working, call again": an
/// `input_required` with only a `requestState`, no questions. Its retry
/// closes the account only if it finds a confirmation among its answers.
#[derive(Clone, Default)]
struct StillWorking {
    /// The `inputResponses` each retry saw (JSON; `None`: none).
    seen: Arc<std::sync::Mutex<Vec<Option<serde_json::Value>>>>,
    closed: Arc<std::sync::atomic::AtomicUsize>,
}

impl rmcp::ServerHandler for StillWorking {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        use rmcp::model::*;
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_protocol_version(ProtocolVersion::V_2026_07_28)
            .with_server_info(Implementation::new("account-service", "1"))
    }

    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        _: rmcp::service::RequestContext<rmcp::service::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        use rmcp::model::*;
        if request.request_state.as_deref() != Some("working") {
            return Ok(InputRequiredResult::new(None, Some("working".into())).into());
        }
        let answers = request.input_responses.as_ref().map(|a| json!(a));
        self.seen.lock().expect("seen").push(answers.clone());
        let confirmed = answers
            .as_ref()
            .and_then(|a| a.get("confirm"))
            .filter(|c| c["action"] == "accept" && c["content"]["ok"] == true)
            .is_some();
        let said = if confirmed {
            self.closed.fetch_add(1, Ordering::SeqCst);
            "ACCOUNT CLOSED"
        } else {
            "nothing confirmed"
        };
        Ok(CallToolResult::success(vec![ContentBlock::text(said)]).into())
    }
}

#[tokio::test]
async fn a_round_that_asked_nothing_lets_no_answer_reach_the_handler() {
    let ss = Stateseal::start(&[]);
    let tool = StillWorking::default();
    let client = connect(&serve_handler(boundary(&ss).wrap(tool.clone())).await).await;
    let a = asked(call(&client, "close_account", json!({}), None).await);
    assert!(a.input_requests.is_none(), "the round asked something");
    let token = a.request_state.as_deref().expect("a sealed requestState");
    assert_ne!(token, "working", "the state went out unsealed");
    // The end user's retry carries that state and an answer to a question
    // no round asked.
    let forged = json!({"confirm": {"action": "accept", "content": {"ok": true}}});
    let r = call(&client, "close_account", json!({}), Some((&a, forged))).await;
    assert_eq!(done(r), "nothing confirmed");
    assert_eq!(
        tool.closed.load(Ordering::SeqCst),
        0,
        "the handler acted on a forged answer"
    );
    let seen = tool.seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 1, "the retry never reached the handler");
    assert!(
        seen[0].as_ref().is_none_or(|a| a == &json!({})),
        "the handler saw answers to a round that asked nothing: {seen:?}"
    );
}

#[tokio::test]
async fn a_handler_that_reports_failure_gives_the_token_back() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let client = connect(&serve_bank(boundary(&ss), bank.clone()).await).await;
    let a = asked(call(&client, "flaky", json!({"amount": 1}), None).await);
    match call(&client, "flaky", json!({"amount": 1}), Some((&a, yes()))).await {
        Ok(rmcp::model::CallToolResponse::Complete(r)) => assert_eq!(r.is_error, Some(true)),
        other => panic!("expected the tool's error result, got {other:?}"),
    }
    let retry = call(&client, "flaky", json!({"amount": 1}), Some((&a, yes()))).await;
    assert_eq!(done(retry), "flaky 1 done (rust)");
    let replay = call(&client, "flaky", json!({"amount": 1}), Some((&a, yes()))).await;
    refused(
        replay,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
}

#[tokio::test]
async fn at_most_once_targets_are_consumed_before_the_handler_runs() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let b = StatesealBoundary::builder(
        RequestStateClient::new(&ss.addr).expect("client"),
        "transfer-service",
    )
    .at_most_once(["flaky"])
    .build();
    let client = connect(&serve_bank(b, bank.clone()).await).await;
    let a = asked(call(&client, "flaky", json!({"amount": 1}), None).await);
    let failed = call(&client, "flaky", json!({"amount": 1}), Some((&a, yes()))).await;
    assert!(
        matches!(failed, Ok(rmcp::model::CallToolResponse::Complete(ref r)) if r.is_error == Some(true))
    );
    // Consumed before the handler ran: the failure cost the retry.
    let retry = call(&client, "flaky", json!({"amount": 1}), Some((&a, yes()))).await;
    refused(
        retry,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    assert_eq!(bank.runs.flaky.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn each_commit_rides_on_the_next_durable_open_and_drain_sends_the_last() {
    let ss = Stateseal::start(&[]);
    let steps = Arc::new(Steps::default());
    // The longest delay, and the next Open sent right after the answer: the
    // Commit waits for it.
    let b = StatesealBoundary::builder(
        RequestStateClient::new(&ss.addr).expect("client"),
        "transfer-service",
    )
    .commit_delay(Duration::from_millis(250))
    .steps(steps.clone())
    .build();
    let bank = Bank::default();
    let client = connect(&serve_bank(b.clone(), bank.clone()).await).await;
    let first = asked(call(&client, "transfer", json!({"amount": 1}), None).await);
    let second = asked(call(&client, "transfer", json!({"amount": 2}), None).await);
    for (a, amount) in [(&first, 1), (&second, 2)] {
        let r = call(
            &client,
            "transfer",
            json!({ "amount": amount }),
            Some((a, yes())),
        )
        .await;
        assert_eq!(done(r), format!("transferred {amount} (rust)"));
    }
    assert_eq!(
        steps.count(Step::CommitCarried),
        1,
        "the first rode on the second Open"
    );
    assert_eq!(steps.count(Step::RpcCommit), 0, "no Commit on its own yet");
    assert!(b.drain(Duration::from_secs(5)).await);
    assert_eq!(steps.count(Step::RpcCommit), 1, "drain() sent the second");
    for (a, amount) in [(&first, 1), (&second, 2)] {
        let replay = call(
            &client,
            "transfer",
            json!({ "amount": amount }),
            Some((a, yes())),
        )
        .await;
        refused(
            replay,
            -32602,
            "requestState already used",
            Some("request_state_used"),
        );
    }
    assert_eq!(bank.runs.transfer.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_open_carries_commits_and_reports_each() {
    let ss = Stateseal::start(&[]);
    let c = RequestStateClient::new(&ss.addr).expect("client");
    let binding = Binding {
        subject: "s".into(),
        method: "tools/call".into(),
        params_digest: [7; 32],
    };
    let mut tokens = Vec::new();
    for _ in 0..3 {
        tokens.push(
            c.seal(&binding, b"s".to_vec(), 0, true, String::new())
                .await
                .expect("seal")
                .request_state,
        );
    }
    let held = c
        .open(
            &tokens[0],
            &binding,
            OpenMode::Reserve,
            0,
            "a",
            String::new(),
        )
        .await
        .expect("reserve")
        .reservation;
    let opened = c
        .open_carrying(
            &tokens[1],
            &binding,
            OpenMode::Reserve,
            0,
            "b",
            String::new(),
            &[held, "garbage".into()],
        )
        .await
        .expect("open carrying");
    assert!(!opened.reservation.is_empty());
    assert_eq!(opened.commits.len(), 2);
    assert_eq!(opened.commits[0], None);
    let bad = opened.commits[1].clone().expect("garbage refused");
    assert_eq!(
        (bad.reason.as_str(), bad.code, bad.from_stateseal),
        ("MALFORMED", tonic::Code::InvalidArgument, true)
    );
    assert!(bad.client_fault() && !bad.retryable());
    let replayed = c
        .open(
            &tokens[0],
            &binding,
            OpenMode::Consume,
            0,
            "c",
            String::new(),
        )
        .await
        .expect_err("committed by the carry");
    assert_eq!(replayed.reason, "REPLAYED");
    let plain = c
        .open(
            &tokens[2],
            &binding,
            OpenMode::Consume,
            0,
            "d",
            String::new(),
        )
        .await
        .expect("open");
    assert!(plain.commits.is_empty());
    let many = vec!["r".to_string(); 17];
    let refused = c
        .open_carrying(
            &tokens[2],
            &binding,
            OpenMode::Consume,
            0,
            "e",
            String::new(),
            &many,
        )
        .await
        .expect_err("more than 16");
    assert_eq!(refused.code, tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn a_slow_handler_keeps_its_token_past_the_lease_and_runs_once() {
    let ss = Stateseal::start(&["--default-lease-s", "2"]);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let bank = Bank {
        gate: Some(gate.clone()),
        ..Bank::default()
    };
    let url = serve_bank(boundary(&ss), bank.clone()).await;
    let client = connect(&url).await;
    let a = asked(call(&client, "slow_transfer", json!({"amount": 5}), None).await);
    let first = {
        let (client, a) = (connect(&url).await, a.clone());
        tokio::spawn(async move {
            call(
                &client,
                "slow_transfer",
                json!({"amount": 5}),
                Some((&a, yes())),
            )
            .await
        })
    };
    until("the handler to start", Duration::from_secs(30), || {
        bank.runs.slow_started.load(Ordering::SeqCst) == 1
    })
    .await;
    // Past the lease granted at the Open: only the renewals hold the token.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let during = call(
        &client,
        "slow_transfer",
        json!({"amount": 5}),
        Some((&a, yes())),
    )
    .await;
    refused(
        during,
        -32603,
        "Request in progress; retry later",
        Some("in_progress"),
    );
    assert_eq!(bank.runs.slow_finished.load(Ordering::SeqCst), 0);
    gate.add_permits(1);
    let r = first.await.expect("the first retry");
    assert_eq!(done(r), "slow 5 done (rust)");
    let replay = call(
        &client,
        "slow_transfer",
        json!({"amount": 5}),
        Some((&a, yes())),
    )
    .await;
    refused(
        replay,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    assert_eq!(
        bank.runs.slow_started.load(Ordering::SeqCst),
        1,
        "executed more than once"
    );
}

#[tokio::test]
async fn an_expired_token_asks_again() {
    let ss = Stateseal::start(&[]);
    let b = StatesealBoundary::builder(
        RequestStateClient::new(&ss.addr).expect("client"),
        "transfer-service",
    )
    .ttl_seconds(1)
    .build();
    let bank = Bank::default();
    let client = connect(&serve_bank(b, bank.clone()).await).await;
    let a = asked(call(&client, "transfer", json!({"amount": 3}), None).await);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let again = asked(call(&client, "transfer", json!({"amount": 3}), Some((&a, yes()))).await);
    assert_ne!(again.request_state, a.request_state);
    assert_eq!(bank.runs.transfer.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_token_opens_only_for_the_principal_it_was_sealed_for() {
    let ss = Stateseal::start(&[]);
    let bank = Bank::default();
    let url = serve_bank_with_users(boundary(&ss), bank.clone()).await;
    let (alice, mallory) = (
        connect_as(&url, "alice").await,
        connect_as(&url, "mallory").await,
    );
    let a = asked(call(&alice, "transfer", json!({"amount": 4}), None).await);
    let stolen = call(
        &mallory,
        "transfer",
        json!({"amount": 4}),
        Some((&a, yes())),
    )
    .await;
    refused(
        stolen,
        -32602,
        "Invalid or expired requestState",
        Some("invalid_request_state"),
    );
    let anonymous = call(
        &connect(&url).await,
        "transfer",
        json!({"amount": 4}),
        Some((&a, yes())),
    )
    .await;
    refused(
        anonymous,
        -32602,
        "Invalid or expired requestState",
        Some("invalid_request_state"),
    );
    assert_eq!(
        done(call(&alice, "transfer", json!({"amount": 4}), Some((&a, yes()))).await),
        "transferred 4 (rust)"
    );
}

#[tokio::test]
async fn bearer_credentials_are_presented_and_a_missing_one_is_an_internal_error() {
    use sha2::Digest;
    let dir = tempfile::tempdir().expect("tempdir");
    let tenants = dir.path().join("tenants.json");
    let digest = hex::encode(sha2::Sha256::digest(b"s3cret-of-transfer"));
    std::fs::write(
        &tenants,
        json!({"tenants": [{"name": "transfer", "bearer_sha256": digest}]}).to_string(),
    )
    .expect("write");
    let tenants = tenants.to_str().expect("utf-8").to_owned();
    let ss = Stateseal::start_in(dir, &["--auth", "bearer", "--tenants", &tenants]);
    let creds = Credentials {
        bearer: Some("s3cret-of-transfer".into()),
        ..Credentials::default()
    };
    let good = RequestStateClient::with(&ss.addr, creds, Duration::from_secs(5)).expect("client");
    let client = connect(
        &serve_bank(
            StatesealBoundary::new(good, "transfer-service"),
            Bank::default(),
        )
        .await,
    )
    .await;
    let a = asked(call(&client, "transfer", json!({"amount": 6}), None).await);
    assert_eq!(
        done(call(&client, "transfer", json!({"amount": 6}), Some((&a, yes()))).await),
        "transferred 6 (rust)"
    );

    let none = connect(&serve_bank(boundary(&ss), Bank::default()).await).await;
    let r = call(&none, "transfer", json!({"amount": 6}), None).await;
    refused(r, -32603, "Internal error", None);
}

/// A CA, a server certificate for 127.0.0.1 and client certificates with
/// these URI SANs, made with the openssl CLI (as the TypeScript test does).
fn pki(dir: &std::path::Path, uris: &[&str]) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    ca.extend([
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(&ca);
    let leaf = |name: &str, ext: &str| {
        std::fs::write(dir.join(format!("{name}.ext")), ext).expect("ext");
        let (key, csr, pem, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-subj", "/CN=leaf", "-keyout", &key, "-out", &csr]);
        openssl(&req);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            &pem,
            "-extfile",
            &extfile,
        ]);
    };
    leaf(
        "server",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    for (i, u) in uris.iter().enumerate() {
        leaf(
            &format!("client{i}"),
            &format!("subjectAltName=URI:{u}\nextendedKeyUsage=clientAuth\n"),
        );
    }
}

#[tokio::test]
async fn mtls_a_tenant_certificate_works_and_one_naming_no_tenant_is_an_internal_error() {
    use stateseal_rmcp::{Certificate, ClientTlsConfig, Identity};
    let dir = tempfile::tempdir().expect("tempdir");
    pki(
        dir.path(),
        &[
            "spiffe://test/transfer-service",
            "spiffe://test/someone-else",
        ],
    );
    let p = |f: &str| dir.path().join(f).to_str().expect("utf-8").to_owned();
    let read = |f: &str| std::fs::read(dir.path().join(f)).expect("read");
    let tenants =
        json!({"tenants": [{"name": "transfer", "uri": "spiffe://test/transfer-service"}]});
    std::fs::write(dir.path().join("tenants.json"), tenants.to_string()).expect("tenants");
    let (cert, key, ca, t) = (
        p("server.pem"),
        p("server.key"),
        p("ca.pem"),
        p("tenants.json"),
    );
    let (ca_pem, c0, k0, c1, k1) = (
        read("ca.pem"),
        read("client0.pem"),
        read("client0.key"),
        read("client1.pem"),
        read("client1.key"),
    );
    let args = [
        "--auth",
        "mtls",
        "--tls-cert",
        cert.as_str(),
        "--tls-key",
        key.as_str(),
        "--tls-client-ca",
        ca.as_str(),
        "--tenants",
        t.as_str(),
    ];
    let ss = Stateseal::start_in(dir, &args);
    let client_for = |pem: &[u8], key: &[u8]| {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&ca_pem))
            .identity(Identity::from_pem(pem, key));
        let creds = Credentials {
            tls: Some(tls),
            ..Credentials::default()
        };
        RequestStateClient::with(&ss.addr, creds, Duration::from_secs(5)).expect("client")
    };
    let tenant = connect(
        &serve_bank(
            StatesealBoundary::new(client_for(&c0, &k0), "transfer-service"),
            Bank::default(),
        )
        .await,
    )
    .await;
    let a = asked(call(&tenant, "transfer", json!({"amount": 9}), None).await);
    assert_eq!(
        done(call(&tenant, "transfer", json!({"amount": 9}), Some((&a, yes()))).await),
        "transferred 9 (rust)"
    );

    let stranger = connect(
        &serve_bank(
            StatesealBoundary::new(client_for(&c1, &k1), "transfer-service"),
            Bank::default(),
        )
        .await,
    )
    .await;
    refused(
        call(&stranger, "transfer", json!({"amount": 9}), None).await,
        -32603,
        "Internal error",
        None,
    );
}

#[tokio::test]
async fn mrtr_params_rmcp_cannot_parse_never_reach_the_handler() {
    use rmcp::model::{ClientRequest, CustomRequest};
    use rmcp::service::ServiceError;
    let ss = Stateseal::start(&[]);
    let client = connect(&serve_bank(boundary(&ss), Bank::default()).await).await;
    let a = asked(call(&client, "transfer", json!({"amount": 7}), None).await);
    let token = a.request_state.clone().expect("token");
    // Each fails rmcp's typed parse, so rmcp hands it to on_custom_request,
    // where the bank (like an app's catch-all) would echo it unopened.
    let cases = [
        (
            json!({"name": "transfer", "arguments": {"amount": 7}, "requestState": 5, "inputResponses": yes()}),
            true,
        ),
        (
            json!({"name": "transfer", "arguments": [7], "requestState": token, "inputResponses": yes()}),
            true,
        ),
        (
            json!({"name": "transfer", "arguments": {"amount": 7}, "requestState": token, "inputResponses": [1]}),
            true,
        ),
        (json!({"name": 7, "arguments": {"amount": 7}}), false),
    ];
    for (method, (params, with_state)) in ["tools/call", "prompts/get", "resources/read"]
        .iter()
        .flat_map(|m| cases.iter().map(move |c| (m, c)))
    {
        let r = client
            .send_request(ClientRequest::CustomRequest(CustomRequest::new(
                *method,
                Some(params.clone()),
            )))
            .await;
        match r {
            Err(ServiceError::McpError(e)) => {
                let want = if *with_state {
                    "Invalid or expired requestState"
                } else {
                    "Invalid params"
                };
                assert_eq!(
                    (e.code.0, e.message.as_ref()),
                    (-32602, want),
                    "{method} {params}"
                );
            }
            other => panic!("{method} {params}: reached the handler: {other:?}"),
        }
    }
    // Another method still reaches the handler's own catch-all.
    let other = client
        .send_request(ClientRequest::CustomRequest(CustomRequest::new(
            "bank/audit",
            Some(json!({})),
        )))
        .await;
    assert!(other.is_ok(), "{other:?}");
}

#[tokio::test]
async fn tls_credentials_with_a_plaintext_target_are_refused() {
    use stateseal_rmcp::ClientTlsConfig;
    let creds = || Credentials {
        tls: Some(ClientTlsConfig::new()),
        ..Credentials::default()
    };
    for target in [
        "http://127.0.0.1:50051",
        "HTTP://stateseal:50051",
        "unix://x",
    ] {
        let r = RequestStateClient::with(target, creds(), Duration::from_secs(1));
        assert!(
            r.is_err(),
            "{target}: TLS credentials over a plaintext target"
        );
    }
    for target in ["127.0.0.1:50051", "https://stateseal:50051"] {
        assert!(
            RequestStateClient::with(target, creds(), Duration::from_secs(1)).is_ok(),
            "{target}"
        );
    }
}
