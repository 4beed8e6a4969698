//! Who is calling: every request gets exactly one [`Tenant`] in its
//! extensions before it reaches the service, or is refused with a fixed
//! message (`UNAUTHENTICATED`: no or bad credentials; `PERMISSION_DENIED`: a
//! valid client certificate that maps to no tenant, or to several).
//!
//! - `none`: no caller authentication; one implicit tenant. Only on loopback
//!   unless explicitly allowed (see `config`).
//! - `bearer`: `authorization: Bearer <secret>`; the tenants file holds the
//!   SHA-256 of each tenant's secret, compared in constant time against every
//!   entry (no early exit). The secret itself is never stored or logged.
//! - `mtls`: the TLS handshake requires a client certificate chaining to the
//!   configured client CA; the tenant is the tenants-file entry whose `uri`
//!   equals a URI SAN (e.g. a SPIFFE id) or whose `dns` equals a DNS SAN of
//!   the leaf certificate.

use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

use crate::domain::binding::Tenant;
use crate::net::conns::{conn_of, ConnInfo, PeerIdentity};

/// One tenant and the identities that map to it.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantEntry {
    pub name: String,
    /// A URI SAN of the client certificate (e.g. `spiffe://…`).
    #[serde(default)]
    pub uri: Option<String>,
    /// A DNS SAN of the client certificate.
    #[serde(default)]
    pub dns: Option<String>,
    /// Hex SHA-256 of the tenant's bearer secret.
    #[serde(default, deserialize_with = "hex32_opt")]
    pub bearer_sha256: Option<[u8; 32]>,
}

impl fmt::Debug for TenantEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantEntry")
            .field("name", &self.name)
            .field("uri", &self.uri)
            .field("dns", &self.dns)
            .field("bearer", &self.bearer_sha256.is_some())
            .finish()
    }
}

/// 64 hex digits → 32 bytes; works on bytes, so no input can make it slice
/// inside a multibyte character.
pub fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let b = s.trim().as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

fn hex32_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<[u8; 32]>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    s.map(|s| {
        parse_hex32(&s)
            .ok_or_else(|| serde::de::Error::custom("bearer_sha256 must be 64 hex digits"))
    })
    .transpose()
}

/// The tenants file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenants {
    pub tenants: Vec<TenantEntry>,
}

/// Why a tenants file is refused. Fixed words with at most a position and
/// a tenant name: never a digest or another value of the file.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("tenants file: not valid (at line {line}, column {column}: {what})")]
    Invalid {
        line: usize,
        column: usize,
        what: &'static str,
    },
    #[error("tenants file: a name must have 1 to 256 bytes")]
    BadName,
    #[error("tenants file: duplicate tenant {0:?}")]
    Duplicate(String),
    #[error("tenants file: tenant {0:?} has no identity")]
    NoIdentity(String),
    #[error("tenants file: tenant {tenant:?} repeats a {kind} identity of an earlier tenant")]
    RepeatedIdentity { tenant: String, kind: &'static str },
}

impl Tenants {
    /// Parses and validates a tenants file. Errors are fixed messages with at
    /// most a position and a tenant name: never a digest or other value.
    pub fn parse(bytes: &[u8]) -> Result<Self, TenantsError> {
        let t: Tenants = serde_json::from_slice(bytes).map_err(|e| TenantsError::Invalid {
            line: e.line(),
            column: e.column(),
            what: match e.classify() {
                serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                    "invalid JSON"
                }
                _ => "unexpected member or value",
            },
        })?;
        let mut names = std::collections::HashSet::new();
        let mut identities = std::collections::HashSet::new();
        for e in &t.tenants {
            if e.name.is_empty() || e.name.len() > 256 {
                return Err(TenantsError::BadName);
            }
            if !names.insert(e.name.as_str()) {
                return Err(TenantsError::Duplicate(e.name.clone()));
            }
            if e.uri.is_none() && e.dns.is_none() && e.bearer_sha256.is_none() {
                return Err(TenantsError::NoIdentity(e.name.clone()));
            }
            // Every identity maps to exactly one tenant: a second entry with
            // the same digest or SAN would silently remap a caller.
            let ids = [
                e.uri.as_ref().map(|u| ("uri", u.as_bytes().to_vec())),
                e.dns.as_ref().map(|d| ("dns", d.as_bytes().to_vec())),
                e.bearer_sha256.map(|h| ("bearer", h.to_vec())),
            ];
            for id in ids.into_iter().flatten() {
                let kind = id.0;
                if !identities.insert(id) {
                    return Err(TenantsError::RepeatedIdentity {
                        tenant: e.name.clone(),
                        kind,
                    });
                }
            }
        }
        Ok(t)
    }

    /// The tenant of a client certificate's SANs: exactly one entry must match.
    pub fn by_certificate(&self, uris: &[String], dns: &[String]) -> Option<Tenant> {
        self.certificate_identity(uris, dns).map(|(t, _)| t)
    }

    /// The tenant of a client certificate's SANs and the SAN that matched
    /// (the URI when the entry names both): exactly one entry must match.
    pub fn certificate_identity(
        &self,
        uris: &[String],
        dns: &[String],
    ) -> Option<(Tenant, String)> {
        let matched = |e: &TenantEntry| {
            e.uri
                .as_ref()
                .filter(|u| uris.contains(u))
                .or(e.dns.as_ref().filter(|d| dns.contains(d)))
                .cloned()
        };
        let mut found = self
            .tenants
            .iter()
            .filter_map(|e| matched(e).map(|san| (e, san)));
        match (found.next(), found.next()) {
            (Some((e, san)), None) => Some((Tenant::new(e.name.as_str()), san)),
            _ => None,
        }
    }

    /// The tenant whose bearer digest matches `secret`, comparing against
    /// every entry in constant time.
    pub fn by_bearer(&self, secret: &[u8]) -> Option<Tenant> {
        let digest: [u8; 32] = Sha256::digest(secret).into();
        let mut found: Option<&TenantEntry> = None;
        for e in &self.tenants {
            if let Some(want) = &e.bearer_sha256 {
                if bool::from(want.ct_eq(&digest)) {
                    found = Some(e);
                }
            }
        }
        found.map(|e| Tenant::new(e.name.as_str()))
    }
}

/// How callers are identified.
#[derive(Clone)]
pub enum Authenticator {
    /// No caller authentication: every request belongs to one implicit tenant.
    Implicit(Tenant),
    /// Bearer secrets from the (reloadable) tenants file.
    Bearer(Arc<ArcSwap<Tenants>>),
    /// The tenant the client certificate maps to in the tenants file in force.
    MutualTls(Arc<ArcSwap<Tenants>>),
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Authenticator::Implicit(_) => "Authenticator::Implicit",
            Authenticator::Bearer(_) => "Authenticator::Bearer",
            Authenticator::MutualTls(_) => "Authenticator::MutualTls",
        })
    }
}

impl Authenticator {
    /// Attaches the caller's tenant to the request, or refuses it.
    pub fn authenticate<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        let conn = conn_of(req.extensions());
        let result = self.identify(req);
        // What the connection's bounds go by (see `conns`): a failure takes
        // the connection out of the authenticated ones (first to be
        // evicted) until a call on it passes again, and failures in a row
        // close it (bearer and mTLS alike).
        match (&result, conn) {
            (Ok(_), Some(c)) => c.authenticated(),
            (Err(_), Some(c)) => c.auth_failed(),
            _ => {}
        }
        result
    }

    fn identify<T>(&self, mut req: Request<T>) -> Result<Request<T>, Status> {
        let (tenant, caller) = match self {
            Authenticator::Implicit(t) => (t.clone(), Caller::from("none")),
            Authenticator::Bearer(tenants) => {
                let header = req
                    .metadata()
                    .get("authorization")
                    .ok_or_else(|| Status::unauthenticated("missing credentials"))?;
                let secret = header
                    .as_bytes()
                    .strip_prefix(b"Bearer ")
                    .ok_or_else(|| Status::unauthenticated("invalid credentials"))?;
                let tenant = tenants
                    .load()
                    .by_bearer(secret)
                    .ok_or_else(|| Status::unauthenticated("invalid credentials"))?;
                let caller = Caller(format!("bearer:{}", tenant.as_str()).into());
                (tenant, caller)
            }
            Authenticator::MutualTls(tenants) => match req
                .extensions()
                .get::<ConnInfo<PeerIdentity>>()
                .map(|i| &i.peer)
            {
                Some(PeerIdentity::Certificate(cert)) => {
                    if unix_now() > cert.not_after {
                        return Err(Status::unauthenticated("client certificate expired"));
                    }
                    let (tenant, san) = tenants
                        .load()
                        .certificate_identity(&cert.uris, &cert.dns)
                        .ok_or_else(|| {
                            Status::permission_denied("client certificate maps to no tenant")
                        })?;
                    (tenant, Caller(san.into()))
                }
                _ => return Err(Status::unauthenticated("client certificate required")),
            },
        };
        req.extensions_mut().insert(tenant);
        req.extensions_mut().insert(caller);
        Ok(req)
    }
}

/// Who called, as the audit log names them: the client certificate's SAN
/// that matched its tenants entry, `bearer:<tenant>`, or `none` without
/// caller authentication. Never a secret.
#[derive(Clone, Debug)]
pub struct Caller(pub std::sync::Arc<str>);

impl From<&str> for Caller {
    fn from(s: &str) -> Self {
        Caller(s.into())
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants() -> Tenants {
        let a = hex(&Sha256::digest(b"secret-a"));
        let b = hex(&Sha256::digest(b"secret-b"));
        Tenants::parse(
            format!(
                r#"{{"tenants":[
                    {{"name":"a","uri":"spiffe://t/a","bearer_sha256":"{a}"}},
                    {{"name":"b","dns":"b.svc","bearer_sha256":"{b}"}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn bearer_lookup() {
        let t = tenants();
        assert_eq!(t.by_bearer(b"secret-a").unwrap().as_str(), "a");
        assert_eq!(t.by_bearer(b"secret-b").unwrap().as_str(), "b");
        assert!(t.by_bearer(b"secret-c").is_none());
        assert!(t.by_bearer(b"").is_none());
    }

    #[test]
    fn certificate_lookup_needs_exactly_one_match() {
        let t = tenants();
        assert_eq!(
            t.by_certificate(&["spiffe://t/a".into()], &[])
                .unwrap()
                .as_str(),
            "a"
        );
        assert_eq!(
            t.by_certificate(&[], &["b.svc".into()]).unwrap().as_str(),
            "b"
        );
        assert!(t.by_certificate(&["spiffe://t/c".into()], &[]).is_none());
        assert!(
            t.by_certificate(&["spiffe://t/a".into()], &["b.svc".into()])
                .is_none(),
            "ambiguous"
        );
    }

    #[test]
    fn bad_tenants_files() {
        for bad in [
            r#"{"tenants":[{"name":"a"}]}"#,
            r#"{"tenants":[{"name":"a","dns":"x"},{"name":"a","dns":"y"}]}"#,
            r#"{"tenants":[{"name":"a","bearer_sha256":"zz"}]}"#,
            r#"{"tenants":[{"name":"","dns":"x"}]}"#,
            r#"{"tenants":[{"name":"a","dns":"x","extra":1}]}"#,
        ] {
            assert!(Tenants::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn hex_digests_with_multibyte_characters_are_refused_not_a_panic() {
        // 64 bytes, with a 2-byte character straddling a hex pair boundary.
        let bad = format!("a{}é{}", "0".repeat(30), "0".repeat(31));
        assert_eq!(bad.len(), 64);
        let file = format!(r#"{{"tenants":[{{"name":"a","bearer_sha256":"{bad}"}}]}}"#);
        assert!(Tenants::parse(file.as_bytes()).is_err());
        assert_eq!(parse_hex32(&"ab".repeat(32)), Some([0xab; 32]));
        assert_eq!(parse_hex32(&"AB".repeat(32)), Some([0xab; 32]));
        assert_eq!(parse_hex32(&"g0".repeat(32)), None);
    }

    #[test]
    fn an_identity_maps_to_one_tenant_only() {
        let a = hex(&Sha256::digest(b"secret-a"));
        for dup in [
            format!(
                r#"{{"tenants":[{{"name":"a","bearer_sha256":"{a}"}},{{"name":"b","bearer_sha256":"{}"}}]}}"#,
                a.to_uppercase()
            ),
            r#"{"tenants":[{"name":"a","uri":"spiffe://x"},{"name":"b","uri":"spiffe://x"}]}"#
                .to_string(),
            r#"{"tenants":[{"name":"a","dns":"x.svc"},{"name":"b","dns":"x.svc"}]}"#.to_string(),
        ] {
            let err = Tenants::parse(dup.as_bytes()).unwrap_err().to_string();
            assert!(err.contains("repeats"), "{err}");
            assert!(!err.contains(&a), "{err}");
        }
    }

    #[test]
    fn errors_never_echo_values() {
        let secret = "0123456789abcdef-not-hex-but-secret-looking-value-0123456789abcd";
        for bad in [
            format!(r#"{{"tenants":[{{"name":"a","bearer_sha256":"{secret}"}}]}}"#),
            format!(r#"{{"tenants":[{{"name":"a","dns":1,"x":"{secret}"}}]}}"#),
            format!(r#"{{"tenants":[{{"name":"a","{secret}":1}}]}}"#),
            format!(r#"{{"tenants":[{{"name":{{"{secret}":1}}}}]}}"#),
        ] {
            let err = Tenants::parse(bad.as_bytes()).unwrap_err().to_string();
            assert!(!err.contains("secret-looking"), "{err}");
        }
    }

    #[test]
    fn debug_hides_bearer_digests() {
        let t = tenants();
        let d = format!("{t:?}");
        assert!(!d.contains(&hex(&Sha256::digest(b"secret-a"))));
    }
}
