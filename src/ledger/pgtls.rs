//! TLS to PostgreSQL with libpq's `sslmode` meanings, on rustls.
//!
//! | `sslmode` | encrypted | server certificate checked |
//! |---|---|---|
//! | `disable` | no | — |
//! | `prefer` (libpq's default) | if the server offers TLS | no |
//! | `require` | yes, or the connection fails | no (as `verify-ca` when `sslrootcert` is given, as libpq does) |
//! | `verify-ca` | yes | chains to `sslrootcert` |
//! | `verify-full` | yes | chains to `sslrootcert` and names the host |
//!
//! `sslmode`, `sslrootcert`, `sslcert` and `sslkey` are read from the
//! connection URL (`?sslmode=verify-full&sslrootcert=/path/ca.pem`) or the
//! key=value string, and the `--database-ssl*` flags override them.
//! `sslcert` + `sslkey` present a client certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::{ConfigFault, LedgerError};

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<Self, LedgerError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return Err(LedgerError::Config(ConfigFault::InvalidSslMode)),
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The TLS settings of the PostgreSQL ledger.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PgTls {
    pub mode: SslMode,
    pub root_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

const OURS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

fn percent_decode(s: &str) -> Result<String, LedgerError> {
    let bad = || LedgerError::Config(ConfigFault::InvalidUrl);
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

impl PgTls {
    /// Takes the TLS settings out of a connection URL or key=value string;
    /// returns what is left for tokio-postgres, and the settings.
    pub fn split(url: &str) -> Result<(String, PgTls), LedgerError> {
        let mut tls = PgTls::default();
        let mut set = |key: &str, value: String| -> Result<(), LedgerError> {
            match key {
                "sslmode" => tls.mode = SslMode::parse(&value)?,
                "sslrootcert" => tls.root_cert = Some(value.into()),
                "sslcert" => tls.client_cert = Some(value.into()),
                _ => tls.client_key = Some(value.into()),
            }
            Ok(())
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let Some((base, query)) = url.split_once('?') else {
                return Ok((url.to_owned(), tls));
            };
            let mut kept = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                if OURS.contains(&k) {
                    set(k, percent_decode(v)?)?;
                } else {
                    kept.push(pair);
                }
            }
            let rest = if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            };
            return Ok((rest, tls));
        }
        // key=value form: values without spaces, or 'quoted'.
        let mut rest = String::new();
        let mut chars = url.trim().char_indices().peekable();
        let s = url.trim();
        while let Some(&(start, _)) = chars.peek() {
            // One token: key=value, the value possibly quoted.
            let mut end = start;
            let mut quoted = false;
            let mut escaped = false;
            for (i, c) in chars.by_ref() {
                end = i + c.len_utf8();
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == '\'' {
                    quoted = !quoted;
                } else if c.is_whitespace() && !quoted {
                    end = i;
                    break;
                }
            }
            let token = &s[start..end];
            let key = token.split('=').next().unwrap_or("").trim();
            if OURS.contains(&key) {
                let value = token[key.len()..]
                    .trim_start()
                    .trim_start_matches('=')
                    .trim();
                let value = value
                    .strip_prefix('\'')
                    .and_then(|v| v.strip_suffix('\''))
                    .unwrap_or(value);
                set(key, value.replace("\\'", "'").replace("\\\\", "\\"))?;
            } else if !token.trim().is_empty() {
                rest.push_str(token);
                rest.push(' ');
            }
            while chars.peek().is_some_and(|(_, c)| c.is_whitespace()) {
                chars.next();
            }
        }
        Ok((rest.trim_end().to_owned(), tls))
    }

    /// The settings given by flags win over the URL's.
    pub fn override_with(mut self, flags: &PgTlsFlags) -> PgTls {
        if let Some(m) = flags.mode {
            self.mode = m;
        }
        if let Some(p) = &flags.root_cert {
            self.root_cert = Some(p.clone());
        }
        if let Some(p) = &flags.client_cert {
            self.client_cert = Some(p.clone());
        }
        if let Some(p) = &flags.client_key {
            self.client_key = Some(p.clone());
        }
        self
    }

    /// tokio-postgres's own mode: whether TLS is tried and required.
    pub fn wire_mode(&self) -> tokio_postgres::config::SslMode {
        match self.mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }

    /// The rustls client configuration for these settings.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, LedgerError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verify = match (self.mode, &self.root_cert) {
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(LedgerError::Config(ConfigFault::NeedsRootCert(self.mode)))
            }
            (SslMode::VerifyFull, Some(ca)) => Verify::Full(ca),
            (SslMode::VerifyCa | SslMode::Require, Some(ca)) => Verify::Chain(ca),
            (_, _) => Verify::Nothing,
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|_| LedgerError::Config(ConfigFault::NoProtocolVersion))?;
        let builder = match verify {
            Verify::Nothing => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider.clone()))),
            Verify::Full(ca) => builder.with_root_certificates(roots(ca)?),
            Verify::Chain(ca) => {
                let inner =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots(ca)?), provider)
                        .build()
                        .map_err(|_| LedgerError::Config(ConfigFault::NoUsableCa))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
            }
        };
        match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert, "sslcert")?;
                let key = read_key(key)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|_| LedgerError::Config(ConfigFault::UnusableClientCertificate))
            }
            (None, None) => Ok(builder.with_no_client_auth()),
            _ => Err(LedgerError::Config(ConfigFault::CertWithoutKey)),
        }
    }

    /// The connector for tokio-postgres.
    pub fn connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, LedgerError> {
        Ok(tokio_postgres_rustls::MakeRustlsConnect::new(
            self.client_config()?,
        ))
    }
}

/// The `--database-ssl*` flags (each overrides the URL's setting).
#[derive(Clone, Debug, Default)]
pub struct PgTlsFlags {
    pub mode: Option<SslMode>,
    pub root_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

enum Verify<'a> {
    Nothing,
    Chain(&'a Path),
    Full(&'a Path),
}

fn read_certs(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, LedgerError> {
    use rustls::pki_types::pem::PemObject;
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|_| {
            LedgerError::Config(ConfigFault::UnreadableCertificates {
                what,
                path: path.to_owned(),
            })
        })?;
    if certs.is_empty() {
        return Err(LedgerError::Config(ConfigFault::NoCertificate {
            what,
            path: path.to_owned(),
        }));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, LedgerError> {
    use rustls::pki_types::pem::PemObject;
    // Never the key's bytes in an error.
    PrivateKeyDer::from_pem_file(path)
        .map_err(|_| LedgerError::Config(ConfigFault::UnreadableKey(path.to_owned())))
}

fn roots(ca: &Path) -> Result<RootCertStore, LedgerError> {
    let mut store = RootCertStore::empty();
    for c in read_certs(ca, "sslrootcert")? {
        store
            .add(c)
            .map_err(|_| LedgerError::Config(ConfigFault::UnusableCertificate))?;
    }
    Ok(store)
}

/// `verify-ca` (and `require` with a root): the chain is checked, the name
/// is not. webpki checks the name only after the chain verified, so a
/// name error means the chain is good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a root: encrypted, the certificate not
/// checked (libpq's meaning; the README recommends verify-full).
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Why TLS to PostgreSQL failed, in fixed words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TlsFailure {
    /// The server answered the TLS request with `N`.
    #[error("the PostgreSQL server does not offer TLS, which sslmode={} requires", .0.as_str())]
    NotOffered(SslMode),
    /// The server's certificate did not verify.
    #[error("the PostgreSQL server's certificate failed verification (sslmode={})", .0.as_str())]
    BadCertificate(SslMode),
    /// Any other TLS error.
    #[error("TLS handshake with PostgreSQL failed (sslmode={})", .0.as_str())]
    Handshake(SslMode),
}

/// The TLS failure behind a connection error, found by its type: a rustls
/// error anywhere in the chain of sources.
pub fn tls_failure(e: &(dyn std::error::Error + 'static), mode: SslMode) -> Option<TlsFailure> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(match r {
                rustls::Error::InvalidCertificate(_) => TlsFailure::BadCertificate(mode),
                _ => TlsFailure::Handshake(mode),
            });
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(found) = tls_failure(inner, mode) {
                    return Some(found);
                }
            }
        }
        cur = err.source();
    }
    None
}

/// Asks the server whether it offers TLS, as libpq does: the protocol's
/// `SSLRequest` message, answered by one byte, `S` or `N`. Only for a
/// configuration with one server (one host, or one `hostaddr`, and at most
/// one port), and at the address tokio-postgres connects to (`hostaddr`
/// when given, else `host`): with several, the failure it reports could be
/// another server's. `None` when it cannot tell (several servers, a Unix
/// socket, no answer within `limit`, any other byte).
pub async fn server_offers_tls(
    cfg: &tokio_postgres::Config,
    limit: std::time::Duration,
) -> Option<bool> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let port = match cfg.get_ports() {
        [] => 5432,
        [p] => *p,
        _ => return None,
    };
    let target = match (cfg.get_hostaddrs(), cfg.get_hosts()) {
        ([addr], [] | [_]) => std::net::SocketAddr::new(*addr, port).to_string(),
        ([], [tokio_postgres::config::Host::Tcp(h)]) => format!("{h}:{port}"),
        _ => return None,
    };
    let ask = async {
        let mut tcp = tokio::net::TcpStream::connect(target.as_str()).await.ok()?;
        tcp.write_all(&SSL_REQUEST).await.ok()?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await.ok()?;
        match answer[0] {
            b'S' => Some(true),
            b'N' => Some(false),
            _ => None,
        }
    };
    tokio::time::timeout(limit, ask).await.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_settings_are_taken_out() {
        let (rest, tls) = PgTls::split(
            "postgres://u@db:5432/test?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@db:5432/test?application_name=x");
        assert_eq!(tls.mode, SslMode::VerifyFull);
        assert_eq!(tls.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
        let (rest, tls) =
            PgTls::split("host=db user=u sslmode=require sslrootcert='/a b/ca.pem' dbname=test")
                .unwrap();
        assert_eq!(rest, "host=db user=u dbname=test");
        assert_eq!(tls.mode, SslMode::Require);
        assert_eq!(tls.root_cert.as_deref(), Some(Path::new("/a b/ca.pem")));
        let (rest, tls) = PgTls::split("postgres://u@db/test").unwrap();
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgres://u@db/test", SslMode::Prefer)
        );
        assert!(PgTls::split("postgres://db/x?sslmode=maybe").is_err());
    }

    #[test]
    fn verify_modes_need_a_root() {
        for mode in [SslMode::VerifyCa, SslMode::VerifyFull] {
            let e = PgTls {
                mode,
                ..PgTls::default()
            }
            .client_config()
            .unwrap_err();
            assert!(
                matches!(e, LedgerError::Config(ConfigFault::NeedsRootCert(_))),
                "{e}"
            );
            assert!(e.to_string().contains("needs sslrootcert"), "{e}");
        }
    }
}
