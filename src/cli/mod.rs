//! The command line and environment, as clap types only: no I/O, no
//! composition. Secrets are given as file paths, never inline.
//! The composition root (`app/build.rs`) turns [`ServeArgs`] into a running
//! server's parts.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::domain::keyring::RetirePolicy;
use crate::ops::audit::OnFailure;

#[derive(Debug, Parser)]
#[command(
    name = "stateseal",
    version,
    about = "Seal and open MCP requestState tokens"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gRPC service.
    Serve(Box<ServeArgs>),
    /// Manage keyset files.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Work with audit logs.
    #[command(subcommand)]
    Audit(AuditCommand),
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Write a fresh keyset with one primary key (refuses to overwrite);
    /// wrapped by --kek when given.
    Init {
        file: PathBuf,
        /// Wrap the keys under this key-encryption key (file:PATH or pkcs11:…).
        #[arg(long)]
        kek: Option<KekUri>,
    },
    /// Add a new staged key (opens only) and print its id. A wrapped
    /// keyset needs its --kek.
    Add {
        file: PathBuf,
        #[arg(long)]
        kek: Option<KekUri>,
    },
    /// Wrap every key under --to-kek: a clear keyset, or one wrapped by
    /// --kek. The file is replaced atomically.
    Rewrap {
        file: PathBuf,
        /// The key-encryption key the keyset is wrapped by now (none for a
        /// clear keyset).
        #[arg(long)]
        kek: Option<KekUri>,
        #[arg(long)]
        to_kek: KekUri,
    },
    /// Create a key-encryption key: a new file (file:PATH, mode 0600), or a
    /// new AES-256 key in a PKCS#11 token (pkcs11:token=…;object=…?…).
    KekGenerate { kek: KekUri },
    /// Make a staged key primary; the old primary becomes staged. Refused
    /// until the key has been in the file for --rollout seconds.
    Promote {
        file: PathBuf,
        id: u32,
        /// Seconds a written keyset may take to reach every replica.
        #[arg(long, default_value_t = 120)]
        rollout: u64,
        /// Promote even if replicas may not have loaded the key yet.
        #[arg(long)]
        force: bool,
    },
    /// Retire a staged key once no unexpired token can carry it
    /// (demotion + rollout + max TTL + clock skew).
    Retire {
        file: PathBuf,
        id: u32,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Retire even if tokens sealed under it may still be unexpired.
        #[arg(long)]
        force: bool,
    },
    /// List key ids, states and times (never key bytes): RFC 3339 UTC times,
    /// ages, and when each key may be retired; `--json` for scripts.
    List {
        file: PathBuf,
        /// One JSON document instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        policy: PolicyArgs,
    },
}

/// What retirement must wait for (`keys retire`, `keys list`).
#[derive(Clone, Copy, Debug, Args)]
pub struct PolicyArgs {
    /// The servers' --max-ttl, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub max_ttl: u64,
    /// The servers' --clock-skew, in seconds.
    #[arg(long, default_value_t = 60)]
    pub clock_skew: u64,
    /// Seconds a written keyset may take to reach every replica (a mounted
    /// Secret: kubelet sync period plus its cache TTL).
    #[arg(long, default_value_t = 120)]
    pub rollout: u64,
}

impl From<PolicyArgs> for RetirePolicy {
    fn from(a: PolicyArgs) -> Self {
        RetirePolicy {
            max_ttl: a.max_ttl,
            clock_skew: a.clock_skew,
            rollout: a.rollout,
        }
    }
}

/// A key-encryption key's URI. It may hold a PIN (`pin-value`), so its
/// `Debug` shows only its scheme.
#[derive(Clone)]
pub struct KekUri(pub String);

impl std::str::FromStr for KekUri {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(KekUri(s.to_owned()))
    }
}

impl std::fmt::Debug for KekUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = self.0.split(':').next().unwrap_or("");
        write!(f, "KekUri({scheme}:..)")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// No caller authentication: one implicit tenant `default` (loopback only
    /// unless --insecure-plaintext).
    None,
    /// `authorization: Bearer <secret>`, secrets' SHA-256 in --tenants.
    Bearer,
    /// Client certificates from --tls-client-ca, mapped by --tenants.
    Mtls,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LedgerKind {
    /// Embedded, in DATA_DIR/ledger: one replica only.
    Sled,
    /// Shared by every replica.
    Postgres,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "STATESEAL_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Directory for the ledger (and the keyset, when --keyset is not given).
    #[arg(long, env = "STATESEAL_DATA_DIR", default_value = "./stateseal-data")]
    pub data_dir: PathBuf,
    /// Keyset file. Without it, DATA_DIR/keyset.json is created on first start.
    #[arg(long, env = "STATESEAL_KEYSET")]
    pub keyset: Option<PathBuf>,
    /// The key-encryption key of a wrapped keyset: `file:PATH` or a
    /// `pkcs11:` URI (RFC 7512). Required for a wrapped keyset; refused
    /// with a clear one.
    #[arg(long, env = "STATESEAL_KEYSET_KEK", hide_env_values = true)]
    pub keyset_kek: Option<KekUri>,
    /// TTL in seconds for seals that ask for 0.
    #[arg(long, env = "STATESEAL_DEFAULT_TTL", default_value_t = 600)]
    pub default_ttl: u32,
    /// Largest TTL in seconds a seal may ask for.
    #[arg(long, env = "STATESEAL_MAX_TTL", default_value_t = 3600)]
    pub max_ttl: u32,
    /// Largest state a token may carry, in bytes.
    #[arg(long, env = "STATESEAL_MAX_STATE_BYTES", default_value_t = 65536)]
    pub max_state_bytes: usize,
    /// Largest params_json accepted, in bytes.
    #[arg(long, env = "STATESEAL_MAX_PARAMS_BYTES", default_value_t = 1048576)]
    pub max_params_bytes: usize,
    /// Seconds ledger records outlive their token, to cover clock skew.
    #[arg(long, env = "STATESEAL_CLOCK_SKEW", default_value_t = 60)]
    pub clock_skew: u64,
    /// Most records the ledger may hold, sled (each costs about 200 bytes of
    /// memory) or PostgreSQL; past it, consuming a token it does not hold is
    /// refused (OVERLOADED) until expired records are collected. 0: no bound.
    #[arg(long, env = "STATESEAL_MAX_LEDGER_RECORDS", default_value_t = 250_000)]
    pub max_ledger_records: u64,
    /// Most ledger records one tenant may hold, so that no tenant (nor
    /// any two) can refuse everyone else: past it, that tenant's new tokens
    /// are refused (OVERLOADED) and no other tenant's. Default: with --auth
    /// bearer or mtls, --max-ledger-records divided by the number of tenants
    /// in the tenants file (again at each reload); none with --auth none
    /// (one tenant). 0: no per-tenant bound.
    #[arg(long, env = "STATESEAL_MAX_LEDGER_RECORDS_PER_TENANT")]
    pub max_ledger_records_per_tenant: Option<u64>,
    /// How callers authenticate.
    #[arg(long, env = "STATESEAL_AUTH", value_enum, default_value = "none")]
    pub auth: AuthMode,
    /// Server certificate chain (PEM). With --tls-key, the gRPC port speaks TLS.
    #[arg(long, env = "STATESEAL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, env = "STATESEAL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA (PEM) that client certificates must chain to (with --auth mtls).
    #[arg(long, env = "STATESEAL_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Tenants file (JSON): names and their certificate SANs or bearer digests.
    #[arg(long, env = "STATESEAL_TENANTS")]
    pub tenants: Option<PathBuf>,
    /// Also serve grpc.health.v1 (and only that) in plaintext on this address,
    /// for probes that cannot present client credentials.
    #[arg(long, env = "STATESEAL_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics (GET /metrics) on this address.
    #[arg(long, env = "STATESEAL_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Allow serving without caller authentication (or bearer secrets without
    /// TLS) on a non-loopback address.
    #[arg(long, env = "STATESEAL_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
    /// Where single-use consumptions are recorded.
    #[arg(long, env = "STATESEAL_LEDGER", value_enum, default_value = "sled")]
    pub ledger: LedgerKind,
    /// PostgreSQL connection URL (prefer --database-url-file: a URL in the
    /// environment or on the command line is visible to other processes).
    #[arg(long, env = "STATESEAL_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// File holding the PostgreSQL connection URL (e.g. a mounted Secret).
    #[arg(
        long,
        env = "STATESEAL_DATABASE_URL_FILE",
        conflicts_with = "database_url"
    )]
    pub database_url_file: Option<PathBuf>,
    /// TLS to PostgreSQL: disable, prefer (the default, as libpq), require,
    /// verify-ca or verify-full (recommended). Overrides the URL's sslmode.
    #[arg(long, env = "STATESEAL_DATABASE_SSLMODE", value_enum)]
    pub database_sslmode: Option<crate::ledger::pgtls::SslMode>,
    /// CA certificate(s) (PEM) the PostgreSQL server's certificate must chain
    /// to. Overrides the URL's sslrootcert.
    #[arg(long, env = "STATESEAL_DATABASE_SSLROOTCERT")]
    pub database_sslrootcert: Option<PathBuf>,
    /// Client certificate chain (PEM) presented to PostgreSQL (with
    /// --database-sslkey). Overrides the URL's sslcert.
    #[arg(long, env = "STATESEAL_DATABASE_SSLCERT", requires = "database_sslkey")]
    pub database_sslcert: Option<PathBuf>,
    /// Private key (PEM) of --database-sslcert. Overrides the URL's sslkey.
    #[arg(long, env = "STATESEAL_DATABASE_SSLKEY", requires = "database_sslcert")]
    pub database_sslkey: Option<PathBuf>,
    /// Connections to PostgreSQL (and consumption batches in flight).
    #[arg(long, env = "STATESEAL_DB_POOL_SIZE", default_value_t = 8)]
    pub db_pool_size: usize,
    /// Bound on connecting to PostgreSQL and on each statement, in milliseconds.
    #[arg(long, env = "STATESEAL_DB_TIMEOUT_MS", default_value_t = 2000)]
    pub db_timeout_ms: u64,
    /// PostgreSQL: refuse to write (LEDGER_UNAVAILABLE, and NOT_SERVING)
    /// unless the primary has a synchronous standby. Without it, asynchronous
    /// replication is logged as a warning and shown in
    /// stateseal_ledger_replication.
    #[arg(long, env = "STATESEAL_REQUIRE_SYNCHRONOUS_REPLICATION")]
    pub require_synchronous_replication: bool,
    /// How often the PostgreSQL primary's replication is checked, in
    /// milliseconds (and at start).
    #[arg(
        long,
        env = "STATESEAL_REPLICATION_CHECK_INTERVAL_MS",
        default_value_t = 60_000
    )]
    pub replication_check_interval_ms: u64,
    /// How many stateseal replicas share this deployment. sled refuses to
    /// start when more than one is declared: each would keep its own ledger.
    #[arg(long, env = "STATESEAL_EXPECTED_REPLICAS", default_value_t = 1)]
    pub expected_replicas: u32,
    /// How often the keyset file is re-read for changes, in milliseconds.
    #[arg(long, env = "STATESEAL_RELOAD_INTERVAL_MS", default_value_t = 2000)]
    pub reload_interval_ms: u64,
    /// Log format on stderr.
    #[arg(long, env = "STATESEAL_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Leave core dumps on. By default the process sets RLIMIT_CORE to 0 and
    /// PR_SET_DUMPABLE to 0 at start: a core would hold keys and state.
    #[arg(long, env = "STATESEAL_ALLOW_CORE_DUMPS")]
    pub allow_core_dumps: bool,
    /// Lease of an OPEN_MODE_RESERVE that asks for 0 seconds.
    #[arg(long, env = "STATESEAL_DEFAULT_LEASE_S", default_value_t = 30)]
    pub default_lease_s: u32,
    /// Largest lease an OPEN_MODE_RESERVE may ask for (longer asks are capped).
    #[arg(long, env = "STATESEAL_MAX_LEASE_S", default_value_t = 300)]
    pub max_lease_s: u32,
    /// Largest input_requests_json / input_responses_json accepted, in bytes.
    #[arg(long, env = "STATESEAL_MAX_INPUT_BYTES", default_value_t = 262144)]
    pub max_input_bytes: usize,
    /// What Seal does with a form field whose name or title asks for a
    /// password, token, key or payment credential: deny (BAD_INPUT_REQUESTS),
    /// warn (seal and log) or off.
    #[arg(
        long,
        env = "STATESEAL_CREDENTIAL_FIELDS",
        value_enum,
        default_value = "deny"
    )]
    pub credential_fields: crate::domain::manifest::CredentialPolicy,
    /// How often expired ledger records are collected, in milliseconds.
    #[arg(long, env = "STATESEAL_GC_INTERVAL_MS", default_value_t = 30_000)]
    pub gc_interval_ms: u64,
    /// HTTP/2 streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, env = "STATESEAL_MAX_STREAMS", default_value_t = 128)]
    pub max_streams: u32,
    /// Open connections on the gRPC port; more wait in the backlog.
    #[arg(long, env = "STATESEAL_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Open connections on the health port and on the metrics port, each.
    #[arg(long, env = "STATESEAL_MAX_AUX_CONNECTIONS", default_value_t = 64)]
    pub max_aux_connections: usize,
    /// Connections from one source address on the gRPC and health ports,
    /// each; over it a new one evicts that address's idlest connection, or
    /// is refused. 0: a quarter of the port's connection cap.
    #[arg(long, env = "STATESEAL_MAX_CONNECTIONS_PER_IP", default_value_t = 0)]
    pub max_connections_per_ip: usize,
    /// A connection with no open stream for this long is closed, in
    /// milliseconds (gRPC clients reconnect on their next call).
    #[arg(long, env = "STATESEAL_IDLE_TIMEOUT_MS", default_value_t = 300_000)]
    pub idle_timeout_ms: u64,
    /// With --auth bearer: a connection that has not sent a request with a
    /// valid credential within this many milliseconds is closed (so is one
    /// with 16 failed requests and none that passed).
    #[arg(long, env = "STATESEAL_AUTH_DEADLINE_MS", default_value_t = 10_000)]
    pub auth_deadline_ms: u64,
    /// Bound on handling one request, in milliseconds.
    #[arg(long, env = "STATESEAL_REQUEST_TIMEOUT_MS", default_value_t = 10_000)]
    pub request_timeout_ms: u64,
    /// Connections are closed after this many seconds (and cut 30 s later):
    /// the bound on how long an open connection outlives a replaced client CA.
    #[arg(long, env = "STATESEAL_MAX_CONNECTION_AGE_S", default_value_t = 600)]
    pub max_connection_age_s: u64,
    /// Seconds an aged connection may finish its streams before it is cut.
    #[arg(
        long,
        env = "STATESEAL_MAX_CONNECTION_AGE_GRACE_S",
        default_value_t = 30
    )]
    pub max_connection_age_grace_s: u64,
    /// Request bytes in flight, process-wide; over it, RESOURCE_EXHAUSTED.
    #[arg(long, env = "STATESEAL_MAX_INFLIGHT_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_inflight_bytes: usize,
    /// Bound on a TLS handshake (or, in plaintext, on receiving the HTTP/2
    /// preface), in milliseconds.
    #[arg(long, env = "STATESEAL_HANDSHAKE_TIMEOUT_MS", default_value_t = 5_000)]
    pub handshake_timeout_ms: u64,
    /// TLS handshakes (or plaintext connections waiting for their HTTP/2
    /// preface) in progress at once per listener; a new one evicts the oldest.
    #[arg(long, env = "STATESEAL_MAX_TLS_HANDSHAKES", default_value_t = 64)]
    pub max_tls_handshakes: usize,
    /// After SIGTERM, how long in-flight requests may take before they are
    /// cut, in milliseconds.
    #[arg(long, env = "STATESEAL_SHUTDOWN_GRACE_MS", default_value_t = 20_000)]
    pub shutdown_grace_ms: u64,
    /// Audit log: one chained JSON line per decision and key event, to this
    /// file (rotated by --audit-max-bytes) or `-` for standard output. No
    /// audit log when absent.
    #[arg(long, env = "STATESEAL_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// The audit file is rotated (renamed to FILE.<first seq>) once it
    /// reaches this size.
    #[arg(long, env = "STATESEAL_AUDIT_MAX_BYTES", default_value_t = 100 * 1024 * 1024)]
    pub audit_max_bytes: u64,
    /// Log one successful Seal in this many (refusals and every other
    /// decision are always logged).
    #[arg(long, env = "STATESEAL_AUDIT_SAMPLE_SEALS", default_value_t = 1)]
    pub audit_sample_seals: u32,
    /// When the audit log cannot be written: `closed` refuses requests
    /// (AUDIT_UNAVAILABLE) and holds each answer until its line is written;
    /// `open` serves on and counts the lines it drops.
    #[arg(
        long,
        env = "STATESEAL_AUDIT_ON_FAILURE",
        value_enum,
        default_value = "closed"
    )]
    pub audit_on_failure: OnFailure,
    /// This replica's name in audit lines (default: $HOSTNAME, the pod name
    /// in Kubernetes, else the kernel's host name).
    #[arg(long, env = "STATESEAL_REPLICA_ID")]
    pub replica_id: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Check an audit log's chain: every line's MAC over the line before it.
    /// Give the rotated files first (FILE.<seq>, in name order), then FILE.
    /// Exits 1, naming each file and line, when a line was changed,
    /// removed, inserted or reordered.
    Verify {
        /// The keyset whose keys made the chain (a retired key's lines need
        /// a keyset that still holds it).
        #[arg(long)]
        keyset: PathBuf,
        /// The keyset's key-encryption key, when it is wrapped.
        #[arg(long)]
        keyset_kek: Option<KekUri>,
        /// Check a log that continues after this line (`SEQ:MAC`, as an
        /// earlier verify printed it) instead of from the chain's start.
        #[arg(long)]
        after: Option<String>,
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}
