//! The stateseal MCP binding profile (docs/token-format.md, "The MCP binding
//! profile"): the binding-v2 params digest and the subject, computed exactly
//! as the service and the Python and TypeScript packages compute them, and
//! tested against the service's `tests/data/binding-vectors.json`.
//!
//! The digest is computed over what the handler sees: the params as rmcp
//! parsed them. serde_json keeps every integer that fits an `i64` or `u64`
//! exactly (so `9007199254740993` and `9007199254740992` differ, as they do
//! in the service and in Python) and parses any other number as the
//! correctly rounded double (`float_roundtrip`), which is then bound exactly
//! as that double.

use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// The binding version this module computes.
pub const BINDING_VERSION: u32 = 2;
/// Deepest nesting of arrays and objects accepted (as the service).
pub const MAX_DEPTH: usize = 128;

/// Params the service would refuse as MALFORMED (not bindable): a missing
/// or non-string `name`/`uri`, nesting deeper than [`MAX_DEPTH`], an
/// unknown method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindingError;

impl std::fmt::Display for BindingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("params cannot be bound (not one JSON object of the required shape)")
    }
}

impl std::error::Error for BindingError {}

/// What of a request's params is bound.
#[derive(Debug, Clone, Copy)]
pub enum Bound<'a> {
    /// `tools/call` or `prompts/get`: the name and the arguments (`None`
    /// is bound as `{}`, as `null` or absent arguments are).
    Named {
        name: &'a str,
        arguments: Option<&'a Map<String, Value>>,
    },
    /// `resources/read`: the URI.
    Uri(&'a str),
}

/// The binding-v2 digest (32 bytes): SHA-256 of the canonical form of
/// `{"arguments":A,"name":N}` or `{"uri":U}`.
pub fn params_digest(bound: Bound<'_>) -> Result<[u8; 32], BindingError> {
    let mut out = String::with_capacity(64);
    match bound {
        Bound::Named { name, arguments } => {
            out.push_str("{\"arguments\":");
            match arguments {
                Some(args) => object(args, 1, &mut out)?,
                None => out.push_str("{}"),
            }
            out.push_str(",\"name\":");
            string(name, &mut out);
            out.push('}');
        }
        Bound::Uri(uri) => {
            out.push_str("{\"uri\":");
            string(uri, &mut out);
            out.push('}');
        }
    }
    Ok(Sha256::digest(out.as_bytes()).into())
}

/// The digest of params given as JSON text (`{"name":…,"arguments":…}` or
/// `{"uri":…}`) for `method`: what the test vectors give.
pub fn params_digest_of_text(method: &str, params_json: &str) -> Result<[u8; 32], BindingError> {
    let params: Value = serde_json::from_str(params_json).map_err(|_| BindingError)?;
    let params = params.as_object().ok_or(BindingError)?;
    match method {
        "tools/call" | "prompts/get" => {
            let name = params
                .get("name")
                .and_then(Value::as_str)
                .ok_or(BindingError)?;
            let arguments = match params.get("arguments") {
                None | Some(Value::Null) => None,
                Some(Value::Object(a)) => Some(a),
                Some(_) => return Err(BindingError),
            };
            params_digest(Bound::Named { name, arguments })
        }
        "resources/read" => {
            let uri = params
                .get("uri")
                .and_then(Value::as_str)
                .ok_or(BindingError)?;
            params_digest(Bound::Uri(uri))
        }
        _ => Err(BindingError),
    }
}

/// RFC 8785 with exact numbers, of a JSON value as serde_json holds it.
pub fn canonical(v: &Value) -> Result<String, BindingError> {
    let mut out = String::new();
    value(v, 0, &mut out)?;
    Ok(out)
}

fn value(v: &Value, depth: usize, out: &mut String) -> Result<(), BindingError> {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => number(n, out)?,
        Value::String(s) => string(s, out),
        Value::Object(m) => object(m, depth, out)?,
        Value::Array(a) => {
            if depth >= MAX_DEPTH {
                return Err(BindingError);
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                value(x, depth + 1, out)?;
            }
            out.push(']');
        }
    }
    Ok(())
}

fn object(m: &Map<String, Value>, depth: usize, out: &mut String) -> Result<(), BindingError> {
    if depth >= MAX_DEPTH {
        return Err(BindingError);
    }
    // Keys sorted by UTF-16 code units (RFC 8785 §3.2.3).
    let mut keys: Vec<(&String, Vec<u16>)> =
        m.keys().map(|k| (k, k.encode_utf16().collect())).collect();
    keys.sort_by(|a, b| a.1.cmp(&b.1));
    out.push('{');
    for (i, (k, _)) in keys.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        string(k, out);
        out.push(':');
        value(&m[k.as_str()], depth + 1, out)?;
    }
    out.push('}');
    Ok(())
}

/// A JSON string with RFC 8785's minimal escapes (as ECMAScript's
/// `JSON.stringify` writes it).
fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                use std::fmt::Write as _;
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Every integer of at most this magnitude is a double exactly, and
/// ECMAScript prints it as its decimal digits.
const EXACT_INT: u64 = 1 << 53;

fn number(n: &Number, out: &mut String) -> Result<(), BindingError> {
    if let Some(u) = n.as_u64() {
        integer(u <= EXACT_INT, false, u, out);
    } else if let Some(i) = n.as_i64() {
        let mag = i.unsigned_abs();
        integer(mag <= EXACT_INT, true, mag, out);
    } else {
        let f = n.as_f64().ok_or(BindingError)?;
        if !f.is_finite() {
            return Err(BindingError);
        }
        out.push_str(&es_number(f));
    }
    Ok(())
}

/// An integer `mag` (negative when `neg`): its digits when it is small
/// enough to be a double printed as itself; otherwise RFC 8785 form when
/// the double ECMAScript prints for it has exactly its value, else
/// `[-]DIGITS E EXPONENT`.
fn integer(small: bool, neg: bool, mag: u64, out: &mut String) {
    if neg && mag != 0 {
        out.push('-');
    }
    if small {
        out.push_str(&mag.to_string());
        return;
    }
    let digits = mag.to_string();
    let es = es_number(mag as f64);
    // Below 1e21 ECMAScript prints an integer-valued double as plain digits.
    if es == digits {
        out.push_str(&es);
        return;
    }
    let trimmed = digits.trim_end_matches('0');
    out.push_str(trimmed);
    out.push('E');
    out.push_str(&(digits.len() - trimmed.len()).to_string());
}

/// ECMAScript `Number::toString` of a finite double (RFC 8785 form; `-0`
/// is `0`).
fn es_number(x: f64) -> String {
    if x == 0.0 {
        return "0".to_owned();
    }
    ryu_js::Buffer::new().format_finite(x).to_owned()
}

/// The subject a token is bound to: `"mcp:" + hex(SHA-256(JSON [audience,
/// principal]))`, as the Python and TypeScript packages compute it
/// (`principal` `None` is JSON `null`: an unauthenticated transport).
pub fn subject_for(audience: &str, principal: Option<&str>) -> String {
    let mut ident = String::from("[");
    string(audience, &mut ident);
    ident.push(',');
    match principal {
        Some(p) => string(p, &mut ident),
        None => ident.push_str("null"),
    }
    ident.push(']');
    let digest = Sha256::digest(ident.as_bytes());
    let mut s = String::with_capacity(4 + 64);
    s.push_str("mcp:");
    for b in digest {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
    }
    s
}
