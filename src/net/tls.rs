//! TLS for the gRPC port (rustls), with optional client certificates (mTLS).
//!
//! The handshake runs in our own accept loop so that (1) the certificate,
//! key and client CA can be swapped at run time without a restart (each new
//! connection uses the configuration in force), and (2) the tenant is derived
//! from the verified client certificate once per connection and handed to
//! every request on it as a [`PeerIdentity`].

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tonic::transport::server::Connected;

use std::sync::atomic::{AtomicI64, Ordering};

use tokio::sync::Semaphore;

use crate::net::accept::{accept_limited, Counted, HandshakeSlots};
use crate::net::conns::{CertIdentity, ConnInfo, Conns, PeerIdentity};
use crate::net::limits::TransportLimits;

/// Where the TLS material lives (mounted files; re-read on change).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates chaining to this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut v = vec![self.cert.clone(), self.key.clone()];
        v.extend(self.client_ca.clone());
        v
    }

    /// Builds a server configuration from the files as they are now. Errors
    /// name the file, never its content.
    pub fn load(&self) -> Result<LoadedTls, TlsError> {
        fn pem(path: &std::path::Path) -> impl Fn(rustls_pki_types::pem::Error) -> TlsError + '_ {
            move |source| TlsError::Pem {
                path: path.to_owned(),
                source,
            }
        }
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(pem(&self.cert))?
            .collect::<Result<_, _>>()
            .map_err(pem(&self.cert))?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate(self.cert.clone()));
        }
        let cert_not_after = not_after(certs[0].as_ref());
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|_| TlsError::NoKey(self.key.clone()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Versions)?;
        let mut client_ca_not_after = None;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                let mut earliest = i64::MAX;
                for c in CertificateDer::pem_file_iter(ca).map_err(pem(ca))? {
                    let c = c.map_err(pem(ca))?;
                    earliest = earliest.min(not_after(c.as_ref()));
                    roots.add(c).map_err(|source| TlsError::BadCa {
                        path: ca.clone(),
                        source,
                    })?;
                }
                if roots.is_empty() {
                    return Err(TlsError::NoCa(ca.clone()));
                }
                client_ca_not_after = Some(earliest);
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|source| TlsError::Verifier {
                            path: ca.clone(),
                            source,
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg =
            builder
                .with_single_cert(certs, key)
                .map_err(|source| TlsError::KeyMismatch {
                    path: self.cert.clone(),
                    source,
                })?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(LoadedTls {
            config: Arc::new(cfg),
            cert_not_after,
            client_ca_not_after,
        })
    }
}

/// Why TLS material was refused. Each names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {source}", path.display())]
    Pem {
        path: PathBuf,
        source: rustls_pki_types::pem::Error,
    },
    #[error("{}: no certificate", .0.display())]
    NoCertificate(PathBuf),
    #[error("{}: no usable private key", .0.display())]
    NoKey(PathBuf),
    #[error("{}: no CA certificate", .0.display())]
    NoCa(PathBuf),
    #[error("{}: {source}", path.display())]
    BadCa {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("{}: {source}", path.display())]
    Verifier {
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
    #[error("{}: certificate and key do not match: {source}", path.display())]
    KeyMismatch {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("tls: {0}")]
    Versions(rustls::Error),
}

/// A server configuration and the expiry dates of what it was built from.
#[derive(Debug)]
pub struct LoadedTls {
    pub config: Arc<ServerConfig>,
    /// notAfter (Unix seconds) of the server certificate.
    pub cert_not_after: i64,
    /// The earliest notAfter of the client CA bundle (mTLS only).
    pub client_ca_not_after: Option<i64>,
}

/// The TLS configuration in force on the gRPC port: swapped whole on a
/// reload, with the expiry dates the alerts read.
#[derive(Clone, Debug)]
pub struct TlsInForce {
    pub files: TlsFiles,
    pub config: Arc<ArcSwap<ServerConfig>>,
    /// Digest of the files' contents in force (see `reload`).
    pub digest: [u8; 32],
    pub expiry: Arc<TlsExpiry>,
}

/// notAfter (Unix seconds) of the server certificate in force, and the
/// earliest notAfter of the client CA bundle in force (0: none); for the
/// expiry alerts.
#[derive(Debug, Default)]
pub struct TlsExpiry {
    pub cert_not_after: AtomicI64,
    pub client_ca_not_after: AtomicI64,
}

impl TlsInForce {
    /// The files as loaded at start, in force from now.
    pub fn new(files: TlsFiles, loaded: LoadedTls, digest: [u8; 32]) -> Self {
        let expiry = Arc::new(TlsExpiry::default());
        let config = Arc::new(ArcSwap::new(loaded.config.clone()));
        let t = TlsInForce {
            files,
            config,
            digest,
            expiry,
        };
        t.record(&loaded);
        t
    }

    /// Loads the files again and puts the result in force.
    pub fn reload(&self) -> Result<(), TlsError> {
        let loaded = self.files.load()?;
        self.config.store(loaded.config.clone());
        self.record(&loaded);
        Ok(())
    }

    fn record(&self, loaded: &LoadedTls) {
        let e = &self.expiry;
        e.cert_not_after
            .store(loaded.cert_not_after, Ordering::Relaxed);
        e.client_ca_not_after
            .store(loaded.client_ca_not_after.unwrap_or(0), Ordering::Relaxed);
    }
}

/// A TLS connection and what its handshake established about the peer.
pub type AuthedStream = Counted<TlsStream<TcpStream>, PeerIdentity>;

impl Connected for AuthedStream {
    type ConnectInfo = ConnInfo<PeerIdentity>;
    fn connect_info(&self) -> ConnInfo<PeerIdentity> {
        ConnInfo {
            peer: self.peer().clone(),
            conn: self.conn().clone(),
        }
    }
}

fn not_after(der: &[u8]) -> i64 {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c.validity().not_after.timestamp())
        .unwrap_or(0)
}

/// The SANs and expiry of a DER certificate (already verified by rustls).
pub fn identity(der: &[u8]) -> CertIdentity {
    use x509_parser::extensions::GeneralName;
    let mut uris = Vec::new();
    let mut dns = Vec::new();
    let mut not_after = i64::MIN; // unparseable: treated as expired
    if let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) {
        not_after = cert.validity().not_after.timestamp();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::URI(u) => uris.push((*u).to_owned()),
                    GeneralName::DNSName(d) => dns.push((*d).to_owned()),
                    _ => {}
                }
            }
        }
    }
    CertIdentity {
        uris,
        dns,
        not_after,
    }
}

/// Accepts TCP connections (at most `limits.max_connections` open), runs
/// each handshake under the configuration in force — bounded in time, at
/// most `limits.max_tls_handshakes` at once (a new one evicts the oldest) —
/// and yields streams with what the handshake established. Failed
/// handshakes are counted (`stateseal_tls_handshake_failures_total`) and
/// logged at debug only, so unauthenticated peers cannot flood the log.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ArcSwap<ServerConfig>>,
    limits: &TransportLimits,
    conns: Arc<Conns>,
) -> tokio_stream::wrappers::ReceiverStream<Result<AuthedStream, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let slots = HandshakeSlots::new(limits.max_tls_handshakes, conns.stats().clone());
    let timeout = limits.tls_handshake_timeout;
    tokio::spawn(async move {
        while let Some((tcp, peer_addr, permit, conn)) =
            accept_limited(&listener, &connections, Some(&slots), &conns).await
        {
            let mut ticket = slots.admit();
            let acceptor = TlsAcceptor::from(config.load_full());
            let tx = tx.clone();
            let stats = conns.stats().clone();
            tokio::spawn(async move {
                let handshake = tokio::select! {
                    // A handshake already done wins over an eviction that
                    // raced it.
                    biased;
                    r = tokio::time::timeout(timeout, acceptor.accept(tcp)) => r,
                    _ = &mut ticket.evicted => return,
                    // Evicted at its address's cap: never served.
                    () = conn.marked() => return,
                };
                drop(ticket);
                let stream = match handshake {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(peer = %peer_addr, error = %e, "TLS handshake refused");
                        return;
                    }
                    Err(_) => {
                        stats.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(peer = %peer_addr, "TLS handshake timed out");
                        return;
                    }
                };
                let peer = match stream.get_ref().1.peer_certificates() {
                    Some([leaf, ..]) => {
                        PeerIdentity::Certificate(Arc::new(identity(leaf.as_ref())))
                    }
                    _ => PeerIdentity::Anonymous,
                };
                let _ = tx
                    .send(Ok(Counted::new(stream, permit, conn).with_peer(peer)))
                    .await;
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
