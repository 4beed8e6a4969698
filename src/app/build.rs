//! The composition root: checks the arguments, binds the listeners,
//! creates the data directory, loads or creates the keyset, opens the
//! ledger, and hands [`crate::app::server::run`] a [`Prepared`] server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use zeroize::Zeroizing;

use crate::app::server::{ServeOptions, TenantsInForce};
use crate::cli::{AuthMode, LedgerKind, ServeArgs};
use crate::clock::guard::TimeGuard;
use crate::clock::{Clock, SystemClock};
use crate::domain::binding::Tenant;
use crate::domain::keyring::{Keyring, KeyringHandle, KeysetError, KeysetFile};
use crate::domain::sealer::{Limits, Sealer};
use crate::grpc::auth::{Authenticator, Tenants};
use crate::ledger::postgres::{PgLedger, PgOptions};
use crate::ledger::sled::SledLedger;
use crate::ledger::{Ledger, LedgerError};
use crate::net::limits::TransportLimits;
use crate::net::tls::{TlsFiles, TlsInForce};
use crate::ops::reload::read_files;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Invalid(#[from] Misconfigured),
    /// Its message names the file and the cause: not a source as well, or
    /// the cause would print twice.
    #[error("{0}")]
    Tls(crate::net::tls::TlsError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Keyset(#[from] KeysetError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Tenants(#[from] crate::grpc::auth::TenantsError),
    #[error(transparent)]
    Audit(#[from] crate::ops::audit::AuditError),
}

/// Flags that cannot work together, each with what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum Misconfigured {
    #[error("--default-ttl and --max-ttl must be positive, and default <= max")]
    TtlBounds,
    #[error(
        "--max-state-bytes and --max-input-bytes are capped at 16 MiB and --max-params-bytes at 64 MiB"
    )]
    SizeCaps,
    #[error("--tls-client-ca is only used with --auth mtls")]
    ClientCaWithoutMtls,
    #[error(
        "refusing to serve plaintext without caller authentication on non-loopback address {0}; \
         add `--auth bearer --tenants FILE --tls-cert FILE --tls-key FILE` or `--auth mtls \
         --tenants FILE --tls-cert FILE --tls-key FILE --tls-client-ca FILE`, listen on \
         127.0.0.1 or ::1, or pass --insecure-plaintext"
    )]
    PlaintextWithoutAuth(SocketAddr),
    #[error("--auth bearer needs --tenants")]
    BearerWithoutTenants,
    #[error(
        "refusing to accept bearer secrets in plaintext on non-loopback address {0}; give \
         --tls-cert and --tls-key, or pass --insecure-plaintext"
    )]
    BearerInPlaintext(SocketAddr),
    #[error("--auth mtls needs --tls-cert, --tls-key, --tls-client-ca and --tenants")]
    MtlsIncomplete,
    #[error(
        "--ledger sled keeps single-use records in this replica only, but --expected-replicas \
         is {0}: use --ledger postgres for several replicas"
    )]
    SledWithReplicas(u32),
    #[error("--ledger postgres needs --database-url or --database-url-file")]
    PostgresWithoutUrl,
}

/// Everything `server::run` needs, built from the arguments.
pub struct Prepared {
    pub sealer: Arc<Sealer>,
    pub options: ServeOptions,
    pub keyset_path: PathBuf,
}

impl ServeArgs {
    pub fn limits(&self) -> Result<Limits, ConfigError> {
        if self.default_ttl == 0 || self.max_ttl == 0 || self.default_ttl > self.max_ttl {
            return Err(Misconfigured::TtlBounds.into());
        }
        if self.max_state_bytes > 16 * 1024 * 1024
            || self.max_params_bytes > 64 * 1024 * 1024
            || self.max_input_bytes > 16 * 1024 * 1024
        {
            return Err(Misconfigured::SizeCaps.into());
        }
        Ok(Limits {
            max_state: self.max_state_bytes,
            max_params_json: self.max_params_bytes,
            max_ttl: self.max_ttl,
            default_ttl: self.default_ttl,
            clock_skew: self.clock_skew,
            default_lease: self.default_lease_s.clamp(1, self.max_lease_s.max(1)),
            max_lease: self.max_lease_s.max(1),
            max_input_json: self.max_input_bytes,
            credential_policy: self.credential_fields,
            ..Limits::default()
        })
    }

    /// The transport limits from the flags (the rest at their defaults).
    pub fn transport_limits(&self) -> TransportLimits {
        use std::time::Duration;
        TransportLimits {
            max_concurrent_streams: self.max_streams.max(1),
            max_connections: self.max_connections.max(1),
            max_aux_connections: self.max_aux_connections.max(1),
            request_timeout: Duration::from_millis(self.request_timeout_ms.max(10)),
            max_connection_age: Duration::from_secs(self.max_connection_age_s.max(1)),
            max_connection_age_grace: Duration::from_secs(self.max_connection_age_grace_s),
            max_inflight_bytes: self.max_inflight_bytes,
            max_tls_handshakes: self.max_tls_handshakes.max(1),
            tls_handshake_timeout: Duration::from_millis(self.handshake_timeout_ms.max(10)),
            shutdown_grace: Duration::from_millis(self.shutdown_grace_ms),
            max_connections_per_ip: self.max_connections_per_ip,
            idle_timeout: Duration::from_millis(self.idle_timeout_ms.max(10)),
            auth_deadline: Duration::from_millis(self.auth_deadline_ms.max(10)),
            ..TransportLimits::default()
        }
    }

    /// Checks the transport and authentication policy and loads the TLS
    /// material and tenants: plaintext without caller authentication, or
    /// bearer secrets without TLS, only on loopback unless explicitly allowed.
    pub fn security(
        &self,
    ) -> Result<(Authenticator, Option<TlsInForce>, Option<TenantsInForce>), ConfigError> {
        let invalid = |m: Misconfigured| Err(ConfigError::Invalid(m));
        let tls_files = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            _ => None,
        };
        if self.tls_client_ca.is_some() && self.auth != AuthMode::Mtls {
            return invalid(Misconfigured::ClientCaWithoutMtls);
        }
        let tenants = match &self.tenants {
            Some(p) => {
                let (contents, digest) =
                    read_files(std::slice::from_ref(p)).map_err(|source| ConfigError::Io {
                        path: p.clone(),
                        source,
                    })?;
                let t = Tenants::parse(&contents[0])?;
                Some((p.clone(), Arc::new(ArcSwap::from_pointee(t)), digest))
            }
            None => None,
        };
        let loopback = self.listen.ip().is_loopback();
        let auth = match self.auth {
            AuthMode::None => {
                if !loopback {
                    if !self.insecure_plaintext {
                        return invalid(Misconfigured::PlaintextWithoutAuth(self.listen));
                    }
                    tracing::warn!(listen = %self.listen, "--insecure-plaintext: serving without caller authentication on a non-loopback address");
                }
                Authenticator::Implicit(Tenant::new(Tenant::DEFAULT))
            }
            AuthMode::Bearer => {
                let Some((_, t, _)) = &tenants else {
                    return invalid(Misconfigured::BearerWithoutTenants);
                };
                if tls_files.is_none() && !loopback {
                    if !self.insecure_plaintext {
                        return invalid(Misconfigured::BearerInPlaintext(self.listen));
                    }
                    tracing::warn!(listen = %self.listen, "--insecure-plaintext: bearer secrets travel in plaintext");
                }
                Authenticator::Bearer(t.clone())
            }
            AuthMode::Mtls => {
                let (Some(_), Some((_, t, _))) = (
                    tls_files.as_ref().and_then(|f| f.client_ca.as_ref()),
                    &tenants,
                ) else {
                    return invalid(Misconfigured::MtlsIncomplete);
                };
                Authenticator::MutualTls(t.clone())
            }
        };
        let tls = match tls_files {
            Some(files) => {
                // Digest first, load second: a change in between is seen
                // as a new version at the first poll, never missed.
                let paths = files.paths();
                let (_, digest) = read_files(&paths).map_err(|source| ConfigError::Io {
                    path: paths[0].clone(),
                    source,
                })?;
                let loaded = files.load().map_err(ConfigError::Tls)?;
                Some(TlsInForce::new(files, loaded, digest))
            }
            None => None,
        };
        Ok((auth, tls, tenants))
    }

    /// Opens the configured ledger.
    /// `tenants`: how many the tenants file names (1 without one).
    pub async fn open_ledger(&self, tenants: u64) -> Result<Arc<dyn Ledger>, ConfigError> {
        // The record bound, and each tenant's: by default the bound divided
        // among the tenants in force, again at each reload of the tenants
        // file. The same on either backend.
        let max = match self.max_ledger_records {
            0 => u64::MAX,
            n => n,
        };
        let share = match (self.max_ledger_records_per_tenant, self.auth) {
            (Some(0), _) | (None, AuthMode::None) => Share::Fixed(u64::MAX),
            (Some(n), _) => Share::Fixed(n),
            (None, _) => Share::Among(tenants),
        };
        match self.ledger {
            LedgerKind::Sled => {
                if self.expected_replicas > 1 {
                    return Err(Misconfigured::SledWithReplicas(self.expected_replicas).into());
                }
                let sled = SledLedger::open(&self.data_dir.join("ledger"))?.with_max_records(max);
                let sled = match share {
                    Share::Fixed(n) => sled.with_max_tenant_records(n),
                    Share::Among(t) => sled.with_share_among(t),
                };
                Ok(Arc::new(
                    sled.with_inherited_lease_grace(self.clock_skew.saturating_mul(2))
                        .with_lease_collection_margin(self.clock_skew),
                ))
            }
            LedgerKind::Postgres => {
                let url = match (&self.database_url, &self.database_url_file) {
                    (Some(u), None) => Zeroizing::new(u.clone()),
                    (None, Some(f)) => Zeroizing::new(
                        std::fs::read_to_string(f)
                            .map_err(|source| ConfigError::Io {
                                path: f.clone(),
                                source,
                            })?
                            .trim()
                            .to_owned(),
                    ),
                    _ => return Err(Misconfigured::PostgresWithoutUrl.into()),
                };
                let opts = PgOptions {
                    pool_size: self.db_pool_size.clamp(1, 256),
                    timeout: std::time::Duration::from_millis(self.db_timeout_ms.max(10)),
                    skew: self.clock_skew,
                    require_synchronous: self.require_synchronous_replication,
                    recount_every: crate::ledger::postgres::RECOUNT_EVERY,
                    replication_every: std::time::Duration::from_millis(
                        self.replication_check_interval_ms.max(100),
                    ),
                    tls: crate::ledger::pgtls::PgTlsFlags {
                        mode: self.database_sslmode,
                        root_cert: self.database_sslrootcert.clone(),
                        client_cert: self.database_sslcert.clone(),
                        client_key: self.database_sslkey.clone(),
                    },
                };
                let pg = PgLedger::connect(&url, opts).await?.with_max_records(max);
                Ok(Arc::new(match share {
                    Share::Fixed(n) => pg.with_max_tenant_records(n),
                    Share::Among(t) => pg.with_share_among(t),
                }))
            }
        }
    }

    /// Creates the data dir, loads (or on first start creates) the keyset and
    /// opens the ledger.
    pub async fn prepare(&self) -> Result<Prepared, ConfigError> {
        let limits = self.limits()?;
        let (auth, tls, tenants) = self.security()?;
        let health_listener = bind_optional(self.health_listen).await?;
        let metrics_listener = bind_optional(self.metrics_listen).await?;
        create_private_dir(&self.data_dir)?;
        let kek = match &self.keyset_kek {
            Some(uri) => Some(crate::ops::kek::open(&uri.0)?),
            None => None,
        };
        let keyset_path = match &self.keyset {
            Some(p) => p.clone(),
            None => {
                let p = self.data_dir.join("keyset.json");
                if !p.exists() {
                    let mut ks = KeysetFile::generate(SystemClock::new().now_unix());
                    if let Some(kek) = &kek {
                        ks.rewrap(None, kek.as_ref())?;
                    }
                    ks.write(&p, true)?;
                    tracing::info!(path = %p.display(), wrapped = kek.is_some(), "created a new keyset");
                }
                p
            }
        };
        let io = |source| ConfigError::Io {
            path: keyset_path.clone(),
            source,
        };
        let (contents, digest) = read_files(std::slice::from_ref(&keyset_path)).map_err(io)?;
        let ring = Keyring::from_file_with(&KeysetFile::parse(&contents[0])?, kek.as_deref())?;
        tracing::info!(keys = ?ring.summary(), "keyset loaded");
        let named = tenants
            .as_ref()
            .map_or(1, |(_, t, _)| t.load().tenants.len() as u64);
        let ledger = self.open_ledger(named).await?;
        let guard = TimeGuard::new(self.clock_skew, ledger.stored_high_water());
        if !guard.synced() {
            tracing::error!(
                "the wall clock is behind the time an earlier run recorded: not serving until \
                 it catches up (see docs/operations.md, Clocks)"
            );
        }
        let metrics = Arc::new(crate::ops::metrics::Metrics::new());
        let keys = Arc::new(KeyringHandle::new(ring));
        let audit = self.audit(&keys)?;
        let sealer = Sealer::new(keys, ledger, Arc::new(SystemClock::new()), limits)
            .with_guard(guard)
            .with_figures(metrics.clone());
        Ok(Prepared {
            sealer: Arc::new(sealer),
            options: ServeOptions {
                auth,
                tls,
                tenants,
                health_listener,
                metrics_listener,
                keyset: Some((keyset_path.clone(), digest)),
                reload_every: std::time::Duration::from_millis(self.reload_interval_ms.max(100)),
                limits: self.transport_limits(),
                gc_every: std::time::Duration::from_millis(self.gc_interval_ms.max(50)),
                metrics,
                audit,
                keyset_kek: kek,
                ..ServeOptions::default()
            },
            keyset_path,
        })
    }
}

impl ServeArgs {
    /// Starts the audit log, when asked for: its `start` line is written
    /// before the server listens.
    pub fn audit(
        &self,
        keys: &Arc<KeyringHandle>,
    ) -> Result<Option<Arc<crate::ops::audit::Audit>>, ConfigError> {
        use crate::ops::audit::{Audit, AuditConfig, Sink};
        let Some(path) = &self.audit_log else {
            return Ok(None);
        };
        let sink = if path.as_os_str() == "-" {
            Sink::Stdout
        } else {
            Sink::File(path.clone())
        };
        let replica = self.replica_id.clone().unwrap_or_else(default_replica_id);
        // The chain's head, in the data directory: outside the log's
        // directory, where a restart can trust it.
        let head = matches!(sink, Sink::File(_)).then(|| self.data_dir.join("audit-head"));
        let cfg = AuditConfig {
            sink,
            max_bytes: self.audit_max_bytes,
            sample_seals: self.audit_sample_seals,
            on_failure: self.audit_on_failure,
            replica,
            head,
        };
        let audit = Audit::start(cfg, keys.clone())?;
        tracing::info!(path = %path.display(), on_failure = ?self.audit_on_failure, "audit log started");
        Ok(Some(audit))
    }
}

/// `$HOSTNAME` (the pod name in Kubernetes), else the kernel's host name.
fn default_replica_id() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "stateseal".to_owned())
}

async fn bind_optional(
    addr: Option<SocketAddr>,
) -> Result<Option<tokio::net::TcpListener>, ConfigError> {
    match addr {
        Some(a) => tokio::net::TcpListener::bind(a)
            .await
            .map(Some)
            .map_err(|source| ConfigError::Io {
                path: PathBuf::from(a.to_string()),
                source,
            }),
        None => Ok(None),
    }
}

fn create_private_dir(dir: &Path) -> Result<(), ConfigError> {
    let io = |source| ConfigError::Io {
        path: dir.to_owned(),
        source,
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io)
    }
    #[cfg(not(unix))]
    {
        std::fs::create_dir_all(dir).map_err(io)
    }
}

/// One tenant's share of the ledger's record bound.
#[derive(Clone, Copy)]
enum Share {
    /// A configured number (`u64::MAX`: none).
    Fixed(u64),
    /// The bound divided among this many tenants, and among those in force
    /// after each reload.
    Among(u64),
}
