//! What a token is bound to, and the canonical parameter digest.
//!
//! Two binding versions; the token header says which one a token was sealed
//! under (authenticated), so a new version rolls out without failing live
//! tokens:
//!
//! - **v2** (sealed by default): a per-method allowlist — `tools/call` and
//!   `prompts/get` bind `{"arguments", "name"}` (absent or `null` arguments
//!   are `{}`), `resources/read` binds `{"uri"}`; nothing else of the params
//!   enters the digest. Numbers bind exactly (see [`canon::NumberMode::Exact`]):
//!   two different numeric values never share a digest. The digest is
//!   SHA-256 of the canonical form of that object.
//! - **v1**: SHA-256 of the RFC 8785 form of the whole params with the
//!   top-level `inputResponses`, `requestState` and `_meta` removed. Numbers
//!   become doubles (lossy past 2^53). Kept to open tokens sealed under it.
//!
//! In both, duplicate object keys anywhere are refused: two parsers that keep
//! different duplicates would otherwise disagree on what was bound.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::domain::canon::{self, NumberMode};

use crate::domain::error::Reject;

/// Top-level params members that belong to the round trip, not to the request.
pub const EXCLUDED_PARAMS: [&str; 3] = ["inputResponses", "requestState", "_meta"];

/// The authenticated caller (an MCP server deployment) a token belongs to.
/// Shared, not copied: every request carries its caller's tenant, and a
/// clone is a reference count.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Tenant(Arc<str>);

impl Tenant {
    /// The implicit tenant of a loopback, unauthenticated deployment.
    pub const DEFAULT: &'static str = "default";

    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Tenant(name.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tenant({:?})", self.0)
    }
}

/// The MCP methods that may answer `input_required`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    ToolsCall,
    PromptsGet,
    ResourcesRead,
}

impl Method {
    pub fn parse(s: &str) -> Result<Self, Reject> {
        match s {
            "tools/call" => Ok(Method::ToolsCall),
            "prompts/get" => Ok(Method::PromptsGet),
            "resources/read" => Ok(Method::ResourcesRead),
            _ => Err(Reject::BadMethod),
        }
    }
    pub const fn as_str(self) -> &'static str {
        match self {
            Method::ToolsCall => "tools/call",
            Method::PromptsGet => "prompts/get",
            Method::ResourcesRead => "resources/read",
        }
    }
}

/// Which params binding a token was sealed under (in its header).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BindingVersion {
    V1,
    V2,
}

impl BindingVersion {
    /// The version new tokens are sealed under.
    pub const CURRENT: BindingVersion = BindingVersion::V2;

    /// From the proto's `binding_version` (0: v1, for callers that predate
    /// the field and send their own v1 digest).
    pub fn from_wire(v: u32) -> Result<Self, Reject> {
        match v {
            0 | 1 => Ok(BindingVersion::V1),
            2 => Ok(BindingVersion::V2),
            _ => Err(Reject::Malformed),
        }
    }
    pub const fn number(self) -> u32 {
        match self {
            BindingVersion::V1 => 1,
            BindingVersion::V2 => 2,
        }
    }
}

/// SHA-256 of the canonical params.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ParamsDigest(pub [u8; 32]);

impl ParamsDigest {
    pub fn from_slice(bytes: &[u8]) -> Result<Self, Reject> {
        <[u8; 32]>::try_from(bytes)
            .map(ParamsDigest)
            .map_err(|_| Reject::Malformed)
    }
}

impl fmt::Debug for ParamsDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ParamsDigest(")?;
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}

/// Everything a token is bound to. The tenant also selects the key.
#[derive(Clone, Debug)]
pub struct Binding {
    pub tenant: Tenant,
    pub subject: String,
    pub method: Method,
    pub params: ParamsDigest,
    /// How `params` was computed (sealed into the token's header).
    pub version: BindingVersion,
}

// === canonical JSON ===

/// RFC 8785 canonical form of any JSON text. Refuses duplicate keys, lone
/// surrogates, numbers beyond the double range and nesting deeper than
/// [`canon::MAX_DEPTH`]. Memory is O(input) (see [`canon`]).
pub fn canonical_json(json: &str) -> Result<Vec<u8>, Reject> {
    canon::canonicalize(json, NumberMode::Rfc8785).map_err(|_| Reject::Malformed)
}

/// The params digest of an MCP request's `params` object under `version`.
pub fn params_digest_for(
    version: BindingVersion,
    method: Method,
    params_json: &str,
) -> Result<ParamsDigest, Reject> {
    match version {
        BindingVersion::V1 => params_digest(params_json),
        BindingVersion::V2 => params_digest_v2(method, params_json),
    }
}

/// Binding v2: the allowlisted members of the params, numbers exact.
pub fn params_digest_v2(method: Method, params_json: &str) -> Result<ParamsDigest, Reject> {
    let malformed = |_| Reject::Malformed;
    let mut h = Sha256::new();
    match method {
        Method::ToolsCall | Method::PromptsGet => {
            let m = canon::object_members(params_json, NumberMode::Exact, &["name", "arguments"])
                .map_err(malformed)?;
            let name = m[0].as_deref().filter(|n| n.first() == Some(&b'"'));
            let name = name.ok_or(Reject::Malformed)?;
            let arguments: &[u8] = match m[1].as_deref() {
                None | Some(b"null") => b"{}",
                Some(a) if a.first() == Some(&b'{') => a,
                Some(_) => return Err(Reject::Malformed),
            };
            h.update(br#"{"arguments":"#);
            h.update(arguments);
            h.update(br#","name":"#);
            h.update(name);
            h.update(b"}");
        }
        Method::ResourcesRead => {
            let m = canon::object_members(params_json, NumberMode::Exact, &["uri"])
                .map_err(malformed)?;
            let uri = m[0].as_deref().filter(|u| u.first() == Some(&b'"'));
            h.update(br#"{"uri":"#);
            h.update(uri.ok_or(Reject::Malformed)?);
            h.update(b"}");
        }
    }
    Ok(ParamsDigest(h.finalize().into()))
}

/// Binding v1: the params digest of an MCP request's `params` object.
pub fn params_digest(params_json: &str) -> Result<ParamsDigest, Reject> {
    let canonical =
        canon::canonicalize_object_without(params_json, NumberMode::Rfc8785, &EXCLUDED_PARAMS)
            .map_err(|_| Reject::Malformed)?;
    Ok(ParamsDigest(Sha256::digest(&canonical).into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_and_whitespace_do_not_change_the_digest() {
        let a = params_digest(r#"{"name":"t","arguments":{"b":1,"a":[1,2]}}"#);
        let b =
            params_digest("{ \"arguments\" : { \"a\" : [1, 2], \"b\" : 1.0 },\n \"name\": \"t\" }");
        assert_eq!(a, b);
    }

    #[test]
    fn round_trip_members_are_excluded_but_nested_ones_are_not() {
        let base = params_digest(r#"{"name":"t","arguments":{}}"#);
        let with = params_digest(
            r#"{"name":"t","arguments":{},"requestState":"x","inputResponses":{"a":1},"_meta":{"p":1}}"#,
        );
        assert_eq!(base, with);
        let nested = params_digest(r#"{"name":"t","arguments":{"_meta":1}}"#);
        assert_ne!(base, nested);
    }

    #[test]
    fn duplicate_keys_non_objects_and_trailing_data_are_malformed() {
        assert_eq!(params_digest(r#"{"a":1,"a":2}"#), Err(Reject::Malformed));
        assert_eq!(
            params_digest(r#"{"x":{"a":1,"a":1}}"#),
            Err(Reject::Malformed)
        );
        assert_eq!(params_digest("[1]"), Err(Reject::Malformed));
        assert_eq!(params_digest("{} {}"), Err(Reject::Malformed));
        assert_eq!(params_digest(r#"{"s":"\ud800"}"#), Err(Reject::Malformed));
        let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(canonical_json(&deep), Err(Reject::Malformed));
    }

    #[test]
    fn debug_forms_name_the_tenant_and_only_a_digest_prefix() {
        assert_eq!(format!("{:?}", Tenant::new("acme")), r#"Tenant("acme")"#);
        let mut d = [0u8; 32];
        d[..5].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef, 0x77]);
        assert_eq!(format!("{:?}", ParamsDigest(d)), "ParamsDigest(deadbeef…)");
    }

    #[test]
    fn wire_versions() {
        use BindingVersion::{V1, V2};
        assert_eq!(
            BindingVersion::from_wire(0),
            Ok(V1),
            "callers that predate the field"
        );
        assert_eq!(BindingVersion::from_wire(1), Ok(V1));
        assert_eq!(BindingVersion::from_wire(2), Ok(V2));
        assert_eq!(BindingVersion::from_wire(3), Err(Reject::Malformed));
        assert_eq!((V1.number(), V2.number()), (1, 2));
        assert_eq!(BindingVersion::CURRENT, V2);
    }

    #[test]
    fn methods() {
        for m in ["tools/call", "prompts/get", "resources/read"] {
            assert_eq!(Method::parse(m).map(Method::as_str), Ok(m));
        }
        for m in ["tools/list", "", "Tools/Call", "sampling/createMessage"] {
            assert_eq!(Method::parse(m), Err(Reject::BadMethod));
        }
    }
}
