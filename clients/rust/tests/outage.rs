//! At most once through outages (issue 57): a handler that returned keeps
//! its Commit until it lands, so an outage that starts as the handler
//! returns — of stateseal's audit sink, of its PostgreSQL ledger, of
//! stateseal itself — never runs it a second time: the user's replay after
//! the outage is refused as used. The real binary, a real rmcp server and
//! client on 127.0.0.1, a 3 s lease.
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::transfer::confirm_question;
use common::*;
use futures::future::BoxFuture;
use futures::FutureExt as _;
use rmcp::model::*;
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use serde_json::{json, Value};
use stateseal_rmcp::{Binding, RequestStateClient, StatesealBoundary};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

/// Awaited by each confirmed run of the tool before it returns, with the
/// run's `id` argument and how many runs of that id there were before it.
type Hook = Arc<dyn Fn(u64, usize) -> BoxFuture<'static, ()> + Send + Sync>;

/// `close_account`: asks to confirm (with a state), then, confirmed, counts
/// its run — the side effect — and awaits the hook before it returns. The
/// first run of an `id` whose arguments say `"fail": true` reports failure
/// (`isError`).
#[derive(Clone)]
struct Account {
    runs: Arc<Mutex<HashMap<u64, usize>>>,
    hook: Hook,
}

impl Account {
    fn new(hook: Hook) -> Self {
        Account {
            runs: Arc::default(),
            hook,
        }
    }

    fn runs(&self, id: u64) -> usize {
        self.runs
            .lock()
            .expect("runs")
            .get(&id)
            .copied()
            .unwrap_or(0)
    }
}

impl ServerHandler for Account {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_protocol_version(ProtocolVersion::V_2026_07_28)
            .with_server_info(Implementation::new("account-service", "1"))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = request.arguments.clone().unwrap_or_default();
        let id = arguments.get("id").and_then(Value::as_u64).unwrap_or(0);
        let confirmed = request
            .input_responses
            .as_ref()
            .and_then(|a| a.get("confirm"))
            .filter(|a| a.get("action").and_then(Value::as_str) == Some("accept"))
            .and_then(|a| a.get("content")?.get("confirm")?.as_bool())
            == Some(true);
        if request.request_state.as_deref() != Some("close") || !confirmed {
            return Ok(InputRequiredResult::new(
                Some(confirm_question(&json!(id))?),
                Some("close".into()),
            )
            .into());
        }
        let before = {
            let mut runs = self.runs.lock().expect("runs");
            let n = runs.entry(id).or_default();
            *n += 1;
            *n - 1
        };
        (self.hook)(id, before).await;
        if before == 0 && arguments.get("fail") == Some(&json!(true)) {
            return Ok(CallToolResult::error(vec![ContentBlock::text("backend hiccup")]).into());
        }
        Ok(
            CallToolResult::success(vec![ContentBlock::text(format!("account {id} closed"))])
                .into(),
        )
    }
}

/// The boundary's logs on the test's output, as `RUST_LOG` asks (none
/// when it is unset).
fn logs() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// A boundary in front of `ss` asking for a 3 s lease.
fn boundary(ss: &Stateseal) -> stateseal_rmcp::Builder {
    StatesealBoundary::builder(
        RequestStateClient::new(&ss.addr).expect("client"),
        "account-service",
    )
    .lease_seconds(3)
}

/// The user's replay of a completed retry: asked again while the answer is
/// retryable ("in progress", "temporarily unavailable"), as a client would,
/// for at most 60 s.
async fn replay(
    client: &Client,
    a: &InputRequiredResult,
    id: u64,
) -> Result<CallToolResponse, ErrorData> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let r = call(
            client,
            "close_account",
            json!({ "id": id }),
            Some((a, yes())),
        )
        .await;
        let retryable = matches!(&r, Err(e) if e.code.0 == -32603
            && ["Request in progress; retry later", "Temporarily unavailable; retry"].contains(&e.message.as_ref()));
        if !retryable || Instant::now() >= end {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One case: `begin` starts the outage just before the handler's first run
/// returns (it returns the instant the outage was seen to be real), and
/// the test ends it `outage` after that with `end`. Then the user replays
/// the same requestState: refused as used, and the side effect counted
/// once.
async fn handler_returns_into_an_outage(
    ss: &Stateseal,
    outage: Duration,
    begin: impl Fn() -> BoxFuture<'static, Instant> + Send + Sync + 'static,
    end: impl FnOnce() -> BoxFuture<'static, ()>,
) {
    logs();
    let (began_tx, mut began) = watch::channel(None);
    let begin = Arc::new(begin);
    let account = Account::new(Arc::new(move |_, before| {
        let (begin, began) = (begin.clone(), began_tx.clone());
        async move {
            if before == 0 {
                began.send_replace(Some(begin().await));
            }
        }
        .boxed()
    }));
    let url = serve_handler(boundary(ss).build().wrap(account.clone())).await;
    let client = connect(&url).await;
    let a = close_confirmed(&client, 7).await;
    let began = tokio::time::timeout(Duration::from_secs(30), began.wait_for(Option::is_some))
        .await
        .expect("the outage began")
        .expect("the hook ran")
        .expect("an instant");
    tokio::time::sleep_until(began + outage).await;
    end().await;
    let replayed = replay(&client, &a, 7).await;
    assert_eq!(
        account.runs(7),
        1,
        "the handler ran again after a {outage:?} outage that began as it returned (the replay got {})",
        describe(&replayed)
    );
    refused(
        replayed,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
}

/// A small tmpfs mounted for one test, unmounted when dropped (lazily if
/// something still holds it).
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounted at `dir`, or `None` after a loud skip named `skip`.
    fn mount(dir: &Path, size: &str, skip: &str) -> Option<Self> {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Tmpfs(dir.to_owned())),
            Ok(o) => {
                let why = format!(
                    "cannot mount a tmpfs here: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                );
                skip::skipped(skip, &why);
                None
            }
            Err(e) => {
                skip::skipped(skip, &format!("cannot run mount: {e}"));
                None
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = std::process::Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
}

/// The audit log (closed, the default) on a 1 MiB tmpfs that the handler
/// fills just before it returns; room again `outage` later.
async fn audit_outage(outage: Duration) {
    let base = tempfile::tempdir().expect("tempdir");
    let mnt = base.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mount point");
    let Some(_tmpfs) = Tmpfs::mount(&mnt, "1m", "rust-package-audit-outage") else {
        return;
    };
    let log = mnt.join("audit.log");
    // Dropped (killed) before the tmpfs is unmounted.
    let ss = Stateseal::start(&["--audit-log", log.to_str().expect("utf-8")]);
    let sealer = RequestStateClient::new(&ss.addr).expect("client");
    let filler = mnt.join("filler");
    let begin = {
        let filler = filler.clone();
        move || {
            let (filler, sealer) = (filler.clone(), sealer.clone());
            async move {
                let _ = tokio::process::Command::new("dd")
                    .args(["if=/dev/zero", "bs=4k"])
                    .arg(format!("of={}", filler.display()))
                    .output()
                    .await;
                // The log's last page may still hold a few lines: seal
                // until one cannot be written (closed: refused).
                let binding = Binding {
                    subject: "filler".into(),
                    method: "tools/call".into(),
                    params_digest: [1; 32],
                };
                for _ in 0..500 {
                    if let Err(e) = sealer
                        .seal(&binding, b"x".to_vec(), 0, true, String::new())
                        .await
                    {
                        assert_eq!(e.reason, "AUDIT_UNAVAILABLE", "{e}");
                        return Instant::now();
                    }
                }
                panic!("the audit sink never failed");
            }
            .boxed()
        }
    };
    let end =
        move || async move { std::fs::remove_file(&filler).expect("remove the filler") }.boxed();
    handler_returns_into_an_outage(&ss, outage, begin, end).await;
}

#[tokio::test]
async fn an_audit_sink_outage_of_2s_as_the_handler_returns_never_runs_it_twice() {
    audit_outage(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn an_audit_sink_outage_of_5s_as_the_handler_returns_never_runs_it_twice() {
    audit_outage(Duration::from_secs(5)).await;
}

/// A TCP proxy on 127.0.0.1 in front of PostgreSQL that can go down: it
/// drops every connection and stops listening (new ones are refused), then
/// listens again on the same port.
struct Proxy {
    port: u16,
    up: watch::Sender<bool>,
    /// Whether it listens now.
    listening: watch::Receiver<bool>,
}

impl Proxy {
    async fn start(target: String) -> Self {
        let port = free_port();
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the proxy");
        let (up, mut want) = watch::channel(true);
        let (listening_tx, listening) = watch::channel(true);
        tokio::spawn(async move {
            let mut listener = Some(listener);
            loop {
                let l = match listener.take() {
                    Some(l) => l,
                    None => bind_again(port).await,
                };
                listening_tx.send_replace(true);
                let mut conns = tokio::task::JoinSet::new();
                loop {
                    tokio::select! {
                        accepted = l.accept() => {
                            if let Ok((inbound, _)) = accepted {
                                conns.spawn(forward(inbound, target.clone()));
                            }
                        }
                        w = want.wait_for(|up| !*up) => {
                            if w.is_err() {
                                return;
                            }
                            break;
                        }
                    }
                }
                // Down: no listener, and every connection cut.
                drop(l);
                conns.abort_all();
                while conns.join_next().await.is_some() {}
                listening_tx.send_replace(false);
                if want.wait_for(|up| *up).await.is_err() {
                    return;
                }
            }
        });
        Proxy {
            port,
            up,
            listening,
        }
    }

    async fn down(&self) {
        self.up.send_replace(false);
        let mut l = self.listening.clone();
        let _ = l.wait_for(|l| !*l).await;
    }

    async fn up(&self) {
        self.up.send_replace(true);
        let mut l = self.listening.clone();
        let _ = l.wait_for(|l| *l).await;
    }
}

async fn bind_again(port: u16) -> tokio::net::TcpListener {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => return l,
            Err(e) if Instant::now() < end => {
                eprintln!("proxy: bind 127.0.0.1:{port} again: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("proxy: cannot listen on 127.0.0.1:{port} again: {e}"),
        }
    }
}

async fn forward(mut inbound: tokio::net::TcpStream, target: String) {
    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
    }
}

/// `url` (`postgres://[user@]host[:port][/db][?…]`) split into its
/// `host:port` (5432 when absent) and the same URL with `host:port`
/// replaced by `with`.
fn through(url: &str, with: &str) -> (String, String) {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (user, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let target = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_owned()
    } else {
        format!("{host}:5432")
    };
    (target, format!("{scheme}://{user}{with}{tail}"))
}

/// The PostgreSQL ledger behind a proxy that goes down just before the
/// handler returns; up again `outage` later.
async fn ledger_outage(outage: Duration) {
    let Some(url) = std::env::var("STATESEAL_TEST_DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        skip::skipped(
            "rust-package-ledger-outage",
            "set STATESEAL_TEST_DATABASE_URL",
        );
        return;
    };
    let (target, _) = through(&url, "");
    let proxy = Arc::new(Proxy::start(target).await);
    let (_, proxied) = through(&url, &format!("127.0.0.1:{}", proxy.port));
    let ss = Stateseal::start(&["--ledger", "postgres", "--database-url", &proxied]);
    // A token to show the outage is real: opening it fails meanwhile.
    let probe = RequestStateClient::new(&ss.addr).expect("client");
    let binding = Binding {
        subject: "probe".into(),
        method: "tools/call".into(),
        params_digest: [2; 32],
    };
    let token = probe
        .seal(&binding, b"p".to_vec(), 0, true, String::new())
        .await
        .expect("seal")
        .request_state;
    let begin = {
        let proxy = proxy.clone();
        move || {
            let (proxy, probe, binding, token) =
                (proxy.clone(), probe.clone(), binding.clone(), token.clone());
            async move {
                proxy.down().await;
                let e = probe
                    .open(
                        &token,
                        &binding,
                        stateseal_rmcp::OpenMode::Consume,
                        0,
                        "probe",
                        String::new(),
                    )
                    .await
                    .expect_err("the ledger answered through a proxy that is down");
                assert_eq!(e.reason, "LEDGER_UNAVAILABLE", "{e}");
                Instant::now()
            }
            .boxed()
        }
    };
    let end = move || async move { proxy.up().await }.boxed();
    handler_returns_into_an_outage(&ss, outage, begin, end).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_outage_of_2s_as_the_handler_returns_never_runs_it_twice() {
    ledger_outage(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_outage_of_5s_as_the_handler_returns_never_runs_it_twice() {
    ledger_outage(Duration::from_secs(5)).await;
}

/// stateseal itself down (killed) while three handlers return, with room
/// for two kept: the failed one's Release and one Commit are kept, the
/// other Commit is counted as not kept; `drain()` returns within its bound
/// while they cannot land, and once stateseal is back both land: the kept
/// Commit's token is used, the released one runs its retry at once.
#[tokio::test]
async fn a_stateseal_outage_keeps_commits_and_releases_and_a_full_set_is_counted() {
    logs();
    let mut ss = Stateseal::start_on(free_port(), &[]);
    let gates: Arc<HashMap<u64, Arc<Semaphore>>> = Arc::new(
        (1..=3)
            .map(|id| (id, Arc::new(Semaphore::new(0))))
            .collect(),
    );
    let started = Arc::new(AtomicUsize::new(0));
    let account = {
        let (gates, started) = (gates.clone(), started.clone());
        Account::new(Arc::new(move |id, before| {
            let (gate, started) = (gates[&id].clone(), started.clone());
            async move {
                if before == 0 {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.expect("gate").forget();
                }
            }
            .boxed()
        }))
    };
    let b = boundary(&ss).max_pending(2).build();
    let url = serve_handler(b.wrap(account.clone())).await;
    let client = connect(&url).await;
    let args = |id: u64| json!({ "id": id, "fail": id == 1 });
    let mut asked_for = HashMap::new();
    let mut retries = HashMap::new();
    for id in 1..=3 {
        let a = asked(call(&client, "close_account", args(id), None).await);
        asked_for.insert(id, a.clone());
        let c = connect(&url).await;
        retries.insert(
            id,
            tokio::spawn(
                async move { call(&c, "close_account", args(id), Some((&a, yes()))).await },
            ),
        );
    }
    until("the three handlers to run", Duration::from_secs(30), || {
        started.load(Ordering::SeqCst) == 3
    })
    .await;
    ss.kill();
    // 1 fails: its Release cannot land, and is kept.
    gates[&1].add_permits(1);
    match retries.remove(&1).expect("1").await.expect("retry 1") {
        Ok(CallToolResponse::Complete(r)) => assert_eq!(r.is_error, Some(true)),
        other => panic!("expected the tool's error result, got {}", describe(&other)),
    }
    assert_eq!(b.overflowed(), 0);
    // 2 returns: its Commit is kept. 3 returns: two are kept, so its
    // Commit is not (tried once), and counted.
    for id in [2, 3] {
        gates[&id].add_permits(1);
        let r = retries.remove(&id).expect("retry").await.expect("retry");
        assert_eq!(done(r), format!("account {id} closed"));
    }
    assert_eq!(b.overflowed(), 1, "the third was kept");
    assert!(
        !b.drain(Duration::from_millis(500)).await,
        "drain() says nothing is left while stateseal is down"
    );
    ss.restart();
    assert!(
        b.drain(Duration::from_secs(30)).await,
        "the kept Commit and Release never landed"
    );
    refused(
        call(
            &client,
            "close_account",
            args(2),
            Some((&asked_for[&2], yes())),
        )
        .await,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    let retried = call(
        &client,
        "close_account",
        args(1),
        Some((&asked_for[&1], yes())),
    )
    .await;
    assert_eq!(done(retried), "account 1 closed");
    assert_eq!((account.runs(1), account.runs(2)), (2, 1));
}

/// A TCP relay on 127.0.0.1 in front of stateseal that can hold every byte
/// it is given, both ways (a stateseal that hangs, its connections open),
/// and pass them on when let go.
struct Holding {
    addr: String,
    hold: watch::Sender<bool>,
}

impl Holding {
    async fn start(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let addr = listener.local_addr().expect("relay address").to_string();
        let (hold, held) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (target, held) = (target.clone(), held.clone());
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(pass(ri, wo, held.clone()), pass(ro, wi, held));
                });
            }
        });
        Holding { addr, hold }
    }

    fn hold(&self, on: bool) {
        self.hold.send_replace(on);
    }
}

/// Passes bytes from `from` to `to`, holding them while `held` says so.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut held: watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if held.wait_for(|h| !*h).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if held.wait_for(|h| !*h).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A boundary in front of `relay` (the client's default 5 s timeout)
/// asking for a 6 s lease, its steps counted into `steps`.
/// `close_account` of `id` as a user runs it: asked, confirmed, closed;
/// the question it answered (what a replay sends again).
async fn close_confirmed(client: &Client, id: u64) -> InputRequiredResult {
    let a = close_confirmed_question(client, id).await;
    let r = call(
        client,
        "close_account",
        json!({ "id": id }),
        Some((&a, yes())),
    )
    .await;
    assert_eq!(done(r), format!("account {id} closed"));
    a
}

fn held_boundary(relay: &Holding, steps: &Arc<stateseal_rmcp::steps::Steps>) -> StatesealBoundary {
    StatesealBoundary::builder(
        RequestStateClient::new(&relay.addr).expect("client"),
        "account-service",
    )
    .lease_seconds(6)
    .commit_delay(Duration::ZERO)
    .steps(steps.clone())
    .build()
}

/// Issue 58, finding 5: a Renew is given up after a third of the lease,
/// not the client's 5 s timeout, which would outlast a short lease. With
/// a 6 s lease and stateseal hanging (a relay holding every byte) from
/// when the handler starts, the first Renew (due 2 s after the Open) has
/// given up before the lease ends, so the keeper tries again in time. Let
/// go, the renewals land, the result is committed, and the replay is
/// refused as used.
#[tokio::test]
async fn a_renewal_against_a_hung_stateseal_gives_up_within_a_third_of_the_lease() {
    use stateseal_rmcp::steps::{Step, Steps};
    logs();
    let ss = Stateseal::start(&[]);
    let relay = Arc::new(Holding::start(ss.addr.clone()).await);
    let steps = Arc::new(Steps::default());
    let gave_up = Arc::new(AtomicUsize::new(usize::MAX));
    let account = {
        let (relay, steps, gave_up) = (relay.clone(), steps.clone(), gave_up.clone());
        Account::new(Arc::new(move |_, before| {
            let (relay, steps, gave_up) = (relay.clone(), steps.clone(), gave_up.clone());
            async move {
                if before > 0 {
                    return;
                }
                relay.hold(true);
                // Until a Renew has given up, or the lease has run out.
                let end = Instant::now() + Duration::from_secs(6);
                while steps.count(Step::RpcRenew) == 0 && Instant::now() < end {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                gave_up.store(steps.count(Step::RpcRenew) as usize, Ordering::SeqCst);
                relay.hold(false);
            }
            .boxed()
        }))
    };
    let url = serve_handler(held_boundary(&relay, &steps).wrap(account.clone())).await;
    let client = connect(&url).await;
    let a = close_confirmed(&client, 7).await;
    assert!(
        gave_up.load(Ordering::SeqCst) >= 1,
        "no Renew against the hung stateseal had given up when the 6 s lease ran out"
    );
    let replayed = replay(&client, &a, 7).await;
    refused(
        replayed,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    assert_eq!(account.runs(7), 1);
}

/// Each try of a Commit is given up after a third of the lease too (review
/// F4), so the lease is renewed between tries before it runs out: with a
/// 6 s lease and stateseal hanging from when the handler returns, the
/// first try (sent at once: no commit delay) has given up within two
/// thirds of the lease, where the client's 5 s timeout would still hold
/// it. Let go, a later try lands and the replay is refused as used.
#[tokio::test]
async fn a_commit_try_against_a_hung_stateseal_gives_up_within_a_third_of_the_lease() {
    use stateseal_rmcp::steps::{Step, Steps};
    logs();
    let ss = Stateseal::start(&[]);
    let relay = Arc::new(Holding::start(ss.addr.clone()).await);
    let steps = Arc::new(Steps::default());
    let account = {
        let relay = relay.clone();
        Account::new(Arc::new(move |_, before| {
            let relay = relay.clone();
            async move {
                if before == 0 {
                    relay.hold(true);
                }
            }
            .boxed()
        }))
    };
    let b = held_boundary(&relay, &steps);
    let url = serve_handler(b.wrap(account.clone())).await;
    let client = connect(&url).await;
    let a = close_confirmed(&client, 8).await;
    let end = Instant::now() + Duration::from_secs(4);
    while steps.count(Step::RpcCommit) == 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tried = steps.count(Step::RpcCommit);
    relay.hold(false);
    assert!(
        tried >= 1,
        "the Commit try against the hung stateseal had not given up two thirds of the 6 s lease in"
    );
    assert!(
        b.drain(Duration::from_secs(30)).await,
        "the Commit never landed"
    );
    refused(
        replay(&client, &a, 8).await,
        -32602,
        "requestState already used",
        Some("request_state_used"),
    );
    assert_eq!(account.runs(8), 1);
}

/// The server closes idle connections with a GOAWAY: a call that crosses
/// that close is served, or refused unprocessed, which this package counts
/// as retryable (tonic reports it CANCELLED or INTERNAL). Five clients (five
/// connections) make 60 Seals each, 80–120 ms apart, against a 100 ms idle
/// timeout; every failure is retryable, and its retry succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_crosses_an_idle_close_is_retryable() {
    use rand::Rng;
    let ss = Stateseal::start(&["--idle-timeout-ms", "100"]);
    let binding = Binding {
        subject: "s".into(),
        method: "tools/call".into(),
        params_digest: [3; 32],
    };
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let c = RequestStateClient::new(&ss.addr).expect("client");
        let binding = binding.clone();
        tasks.push(tokio::spawn(async move {
            let (mut lost, mut retried) = (Vec::new(), 0);
            for _ in 0..60 {
                let gap = rand::thread_rng().gen_range(80..=120);
                tokio::time::sleep(Duration::from_millis(gap)).await;
                let mut tries = 0;
                loop {
                    match c
                        .seal(&binding, b"x".to_vec(), 0, false, String::new())
                        .await
                    {
                        Ok(_) => break,
                        Err(e) if e.retryable() && tries < 2 => {
                            tries += 1;
                            retried += 1;
                        }
                        Err(e) => {
                            lost.push(format!("{e}"));
                            break;
                        }
                    }
                }
            }
            (lost, retried)
        }));
    }
    let (mut lost, mut retried) = (Vec::new(), 0);
    for t in tasks {
        let (l, r) = t.await.expect("caller");
        lost.extend(l);
        retried += r;
    }
    assert!(
        lost.is_empty(),
        "{} of 300 lost ({retried} retried): {lost:?}",
        lost.len()
    );
}

/// The nemesis's finding (seed 16257906604647455624): an Open sent before
/// this boundary's handler of the same token answered, and decided once
/// that handler's lease had run out (stateseal hanging meanwhile), took the
/// token and ran the handler again while the first run's Commit was still
/// kept. Now it finds that Commit kept: the handler does not run again, it
/// is answered "in progress", and its replay "already used".
///
/// Each round: the first confirmed call's handler holds every byte to
/// stateseal (a relay) as it starts; a second call with the same
/// requestState is sent into the hold; the handler returns (its Commit
/// and Renews hang); the relay lets go once the 2 s lease has surely run
/// out. When the second Open reaches stateseal before a stale try of the
/// Commit (the bytes keep their order), it takes the token over: the case
/// above; otherwise the Commit lands and the second Open is refused as
/// used. Either way the handler has run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_decided_after_the_handler_answered_and_its_lease_ran_out_never_runs_it_again() {
    use stateseal_rmcp::steps::{Step, Steps};
    logs();
    let ss = Stateseal::start(&[]);
    let relay = Arc::new(Holding::start(ss.addr.clone()).await);
    let steps = Arc::new(Steps::default());
    let (running_tx, mut running) = watch::channel(0u64);
    let go = Arc::new(tokio::sync::Notify::new());
    let account = {
        let (relay, go) = (relay.clone(), go.clone());
        Account::new(Arc::new(move |id, before| {
            let (relay, go, running) = (relay.clone(), go.clone(), running_tx.clone());
            async move {
                if before == 0 {
                    relay.hold(true);
                    running.send_replace(id);
                    go.notified().await;
                }
            }
            .boxed()
        }))
    };
    // A 10 s client timeout: the second Open waits out the hold.
    let client = RequestStateClient::with(
        &relay.addr,
        stateseal_rmcp::Credentials::default(),
        Duration::from_secs(10),
    )
    .expect("client");
    let b = StatesealBoundary::builder(client, "account-service")
        .lease_seconds(2)
        .commit_delay(Duration::ZERO)
        .steps(steps.clone())
        .build();
    let url = serve_handler(b.wrap(account.clone())).await;
    let client = Arc::new(connect(&url).await);
    let mut taken_over = 0;
    for id in 20..23u64 {
        let a = Arc::new(close_confirmed_question(&client, id).await);
        let bound = steps.count(Step::Binding);
        // The confirmed call, sent in a task of its own.
        let confirmed = || {
            let (client, a) = (client.clone(), a.clone());
            tokio::spawn(async move {
                call(
                    &client,
                    "close_account",
                    json!({ "id": id }),
                    Some((&a, yes())),
                )
                .await
            })
        };
        let first = confirmed();
        tokio::time::timeout(Duration::from_secs(30), running.wait_for(|r| *r == id))
            .await
            .expect("the first run started")
            .expect("the hook ran");
        let opened_at = Instant::now();
        let second = confirmed();
        // The second call has its binding: its Open goes out next.
        let end = Instant::now() + Duration::from_secs(10);
        while steps.count(Step::Binding) < bound + 2 && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        go.notify_one();
        assert_eq!(
            done(first.await.expect("first call")),
            format!("account {id} closed")
        );
        // The lease (2 s from the first Open, before `opened_at`, never
        // renewed) has run out, with a second of the ledger's rounding.
        tokio::time::sleep_until(opened_at + Duration::from_millis(3500)).await;
        relay.hold(false);
        let second = second.await.expect("second call");
        assert_eq!(
            account.runs(id),
            1,
            "the handler ran again (the second call got {})",
            describe(&second)
        );
        if matches!(&second, Err(e) if e.message == "Request in progress; retry later") {
            taken_over += 1;
        }
        refused(
            replay(&client, &a, id).await,
            -32602,
            "requestState already used",
            Some("request_state_used"),
        );
    }
    // Not asserted (which reached stateseal first is up to it): printed.
    println!("{taken_over} of 3 second Opens took the token over");
}

/// The question `close_account` of `id` asks (what the confirmed calls
/// answer).
async fn close_confirmed_question(client: &Client, id: u64) -> InputRequiredResult {
    asked(call(client, "close_account", json!({ "id": id }), None).await)
}

/// A try that runs out its deadline against a hung stateseal is retryable
/// (DEADLINE_EXCEEDED), whichever timer cut it: tonic's channel answers
/// its own deadline CANCELLED "Timeout expired", which the boundary took
/// for a definite failure and gave the kept Commit up on (found beside the
/// nemesis's finding above).
#[tokio::test]
async fn a_try_cut_by_its_deadline_is_retryable() {
    let ss = Stateseal::start(&[]);
    let relay = Holding::start(ss.addr.clone()).await;
    let client = RequestStateClient::new(&relay.addr).expect("client");
    // Connected before the hold.
    let _ = client.commit("not-a-reservation").await;
    relay.hold(true);
    for _ in 0..20 {
        let e = client
            .commit_within("not-a-reservation", Duration::from_millis(50))
            .await
            .expect_err("no answer through the hold");
        assert!(
            stateseal_rmcp::refusal::retry_commit(&e),
            "a try cut by its deadline is not retried: {} {:?}",
            e.reason,
            e.message
        );
    }
    relay.hold(false);
}
