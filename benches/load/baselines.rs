//! What stateseal is measured against, beside the no-op on stateseal
//! itself: the echo server (`echo`; with its journal, `echo_fsync`), the
//! fdatasync scenario's file, the handoff scenario's thread, and a private
//! redis-server (`redis`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use stateseal::proto::{OpenRequest, SealRequest};

use crate::ports;

/// The echo baseline: the RequestState service answering Seal with a
/// response of the size stateseal's would have, doing nothing else; and,
/// with a journal, Open with a response of an Open's size after the
/// journal's group commit (`echo_fsync`).
struct Echo {
    journal: Option<Journal>,
}

#[tonic::async_trait]
impl stateseal::proto::request_state_server::RequestState for Echo {
    async fn seal(
        &self,
        req: tonic::Request<SealRequest>,
    ) -> Result<tonic::Response<stateseal::proto::SealResponse>, tonic::Status> {
        let n = stateseal::internals::token::encoded_len(
            stateseal::internals::token::OVERHEAD + req.get_ref().state.len(),
        );
        Ok(tonic::Response::new(stateseal::proto::SealResponse {
            request_state: "A".repeat(n),
            expires_at_unix: 1_900_000_600,
            key_id: "1".into(),
        }))
    }
    async fn open(
        &self,
        req: tonic::Request<OpenRequest>,
    ) -> Result<tonic::Response<stateseal::proto::OpenResponse>, tonic::Status> {
        let journal = self
            .journal
            .as_ref()
            .ok_or_else(|| tonic::Status::unimplemented("echo without a journal"))?;
        let token = req.into_inner().request_state;
        // A record as the ledger's: 64 bytes from the token.
        let mut record = [0u8; Journal::RECORD];
        let n = token.len().min(record.len());
        record[..n].copy_from_slice(&token.as_bytes()[..n]);
        journal.append(record).await?;
        // The state an Open of this token would return.
        let state = (token.len() * 3 / 4).saturating_sub(stateseal::internals::token::OVERHEAD);
        Ok(tonic::Response::new(stateseal::proto::OpenResponse {
            state: vec![0x5a; state],
            expires_at_unix: 1_900_000_600,
            key_id: "1".into(),
            consumed: true,
            ..Default::default()
        }))
    }
    async fn commit(
        &self,
        _: tonic::Request<stateseal::proto::CommitRequest>,
    ) -> Result<tonic::Response<stateseal::proto::CommitResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
    async fn release(
        &self,
        _: tonic::Request<stateseal::proto::ReleaseRequest>,
    ) -> Result<tonic::Response<stateseal::proto::ReleaseResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
    async fn renew(
        &self,
        _: tonic::Request<stateseal::proto::RenewRequest>,
    ) -> Result<tonic::Response<stateseal::proto::RenewResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("echo"))
    }
}

type JournalJob = (
    [u8; Journal::RECORD],
    tokio::sync::oneshot::Sender<Result<(), String>>,
);

/// `echo_fsync`'s store: a group commit shaped as the sled ledger's writer
/// (one thread fed by a std channel, answers by oneshot; a round takes
/// every call waiting), whose round is the least a durable acknowledgement
/// needs: one `pwrite` of a 64-byte record per call into a preallocated,
/// zero-filled file (so `fdatasync` has no size to commit), one
/// `fdatasync`, and the ledger's probe (the size change of a second file)
/// before the answers. It decides nothing and keeps no index. Stops for
/// good at the first failure, as the ledger does. With a commit delay
/// (`--echo-fsync-delay-us`) it waits that long after a round's first call
/// before it takes the rest.
pub struct Journal {
    tx: std::sync::mpsc::Sender<JournalJob>,
    /// Removed with the journal.
    pub dir: tempfile::TempDir,
}

impl Journal {
    const RECORD: usize = 64;
    /// Written round after round from the start again: 64 Ki records.
    const SIZE: u64 = 4 << 20;

    /// A journal in a new temporary directory under `parent` (the system's
    /// temporary directory without one).
    pub fn create(
        parent: Option<&std::path::Path>,
        delay: std::time::Duration,
    ) -> std::io::Result<Self> {
        let (dir, file) = preallocated(parent, "journal")?;
        let probe = std::fs::File::create(dir.path().join("probe"))?;
        probe.sync_all()?;
        std::fs::File::open(dir.path())?.sync_all()?;
        let (tx, rx) = std::sync::mpsc::channel::<JournalJob>();
        std::thread::Builder::new()
            .name("echo-journal".into())
            .spawn(move || Self::run(&file, &probe, &rx, delay))?;
        Ok(Journal { tx, dir })
    }

    fn run(
        file: &std::fs::File,
        probe: &std::fs::File,
        rx: &std::sync::mpsc::Receiver<JournalJob>,
        delay: std::time::Duration,
    ) {
        use std::os::unix::fs::FileExt;
        let (mut at, mut probe_len, mut dead) = (0u64, 0u64, None::<String>);
        let mut buf = Vec::new();
        while let Ok(first) = rx.recv() {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            let mut jobs = vec![first];
            jobs.extend(rx.try_iter());
            let result = match &dead {
                Some(e) => Err(e.clone()),
                None => {
                    buf.clear();
                    for (record, _) in &jobs {
                        buf.extend_from_slice(record);
                    }
                    if at + buf.len() as u64 > Self::SIZE {
                        at = 0;
                    }
                    let r = file
                        .write_all_at(&buf, at)
                        .and_then(|()| file.sync_data())
                        .and_then(|()| {
                            probe_len ^= 1;
                            probe.set_len(probe_len)
                        })
                        .map_err(|e| format!("echo journal: {e}"));
                    at += buf.len() as u64;
                    if let Err(e) = &r {
                        dead = Some(e.clone());
                    }
                    r
                }
            };
            for (_, reply) in jobs {
                let _ = reply.send(result.clone());
            }
        }
    }

    /// Returns once the record is on disk.
    async fn append(&self, record: [u8; Self::RECORD]) -> Result<(), tonic::Status> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .send((record, reply))
            .map_err(|_| tonic::Status::unavailable("echo journal stopped"))?;
        answer
            .await
            .map_err(|_| tonic::Status::unavailable("echo journal stopped"))?
            .map_err(tonic::Status::unavailable)
    }
}

/// A new temporary directory under `parent` (the system's temporary
/// directory without one) holding `name`: `Journal::SIZE` zero bytes,
/// synced (the directory is not).
fn preallocated(
    parent: Option<&std::path::Path>,
    name: &str,
) -> std::io::Result<(tempfile::TempDir, std::fs::File)> {
    use std::io::Write;
    let dir = match parent {
        Some(p) => tempfile::tempdir_in(p)?,
        None => tempfile::tempdir()?,
    };
    let mut file = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(dir.path().join(name))?;
    file.write_all(&vec![0u8; Journal::SIZE as usize])?;
    file.sync_all()?;
    Ok((dir, file))
}

/// The fdatasync scenario's file: preallocated and zero-filled as the echo
/// journal's, so that `fdatasync` has no size to commit, written at the
/// next 64-byte slot each time.
pub struct FloorFile {
    file: std::fs::File,
    at: std::sync::Mutex<u64>,
    /// Removed with the file.
    pub dir: tempfile::TempDir,
}

impl FloorFile {
    pub fn create(parent: Option<&std::path::Path>) -> std::io::Result<Self> {
        let (dir, file) = preallocated(parent, "floor")?;
        std::fs::File::open(dir.path())?.sync_all()?;
        Ok(FloorFile {
            file,
            at: std::sync::Mutex::new(0),
            dir,
        })
    }

    pub fn write(&self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut at = self.at.lock().expect("floor offset");
        if *at + Journal::RECORD as u64 > Journal::SIZE {
            *at = 0;
        }
        self.file.write_all_at(&[0x5a; Journal::RECORD], *at)?;
        *at += Journal::RECORD as u64;
        self.file.sync_data()
    }
}

/// The handoff scenario's thread: fed by a std channel and answering by
/// oneshot, as the sled ledger's writer is, and doing nothing else.
pub struct Handoff {
    tx: std::sync::mpsc::Sender<tokio::sync::oneshot::Sender<()>>,
}

impl Handoff {
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<tokio::sync::oneshot::Sender<()>>();
        std::thread::Builder::new()
            .name("handoff".into())
            .spawn(move || {
                for reply in rx {
                    let _ = reply.send(());
                }
            })?;
        Ok(Handoff { tx })
    }

    /// Returns once the thread has answered.
    pub async fn call(&self) -> Result<(), tonic::Status> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx
            .send(reply)
            .map_err(|_| tonic::Status::unavailable("handoff thread stopped"))?;
        answer
            .await
            .map_err(|_| tonic::Status::unavailable("handoff thread stopped"))
    }
}

/// Starts the echo server on 127.0.0.1 with stateseal's transport settings
/// (with `journal`, it answers Open too: `echo_fsync`).
pub async fn start_echo(journal: Option<Journal>) -> String {
    // stateseal's own listener: the same connection limits, TCP_NODELAY
    // and write coalescing as the server it is the baseline for.
    let lim = stateseal::internals::limits::TransportLimits::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind echo server");
    let addr = listener.local_addr().expect("echo addr");
    let incoming = stateseal::internals::accept::limited_incoming(
        listener,
        lim.max_connections,
        lim.max_tls_handshakes,
        lim.tls_handshake_timeout,
        stateseal::internals::conns::Conns::new(
            lim.conn_policy(
                lim.max_connections,
                stateseal::internals::limits::CallerAuth::None,
            ),
            Arc::default(),
        ),
    );
    // A health service too, so that `--serve-echo` has its own no-op.
    let (_, health) = tonic_health::server::health_reporter();
    let routes = tonic::service::Routes::new(health)
        .add_service(
            stateseal::proto::request_state_server::RequestStateServer::new(Echo { journal }),
        )
        .prepare();
    let svc = tower_layer::Layer::layer(&stateseal::internals::conns::ConnActivityLayer, routes);
    tokio::spawn(async move {
        let streams = lim.max_concurrent_streams;
        stateseal::internals::serve::serve(incoming, svc, &lim, streams, std::future::pending())
            .await;
    });
    addr.to_string()
}

/// A private redis-server with every write fsynced before its answer.
pub struct RedisServer {
    child: std::process::Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_redis() -> Option<RedisServer> {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = ports::free_port();
    let child = std::process::Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--dir"])
        .arg(dir.path())
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ])
        .stdout(std::process::Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("\n*** SKIPPED: the redis scenario (cannot start redis-server: {e}) ***\n");
            // Under CI a skip fails, as in the tests (tests/it/common/skip.rs).
            let allowed = std::env::var("STATESEAL_ALLOW_SKIPS").unwrap_or_default();
            assert!(
                std::env::var("STATESEAL_FAIL_ON_SKIP").as_deref() != Ok("1")
                    || allowed.split(',').any(|a| a.trim() == "redis-scenario"),
                "SKIPPED under STATESEAL_FAIL_ON_SKIP=1: the redis scenario"
            );
            return None;
        }
    };
    let srv = RedisServer { child, port, dir };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(srv)
}
