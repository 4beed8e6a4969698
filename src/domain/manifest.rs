//! The sealed manifest of what was asked (README, MCP binding profile).
//!
//! Seal may carry the `input_required` result's `inputRequests` object. It is
//! validated against the MCP 2026-07-28 schema and reduced to a compact
//! manifest — for each key: the kind of question and, for a form, what each
//! field accepts — which travels encrypted inside the token (format 2,
//! `docs/token-format.md`). Open may carry the retry's `inputResponses`; with
//! a manifest in the token, the answers come back filtered against it, each
//! drop listed with a fixed reason code.
//!
//! Rules (each a test in `tests/it/manifest.rs`):
//! - input requests: an object of 0..=64 unique, non-empty keys (none: a
//!   round that asked nothing, whose manifest drops every answer); each an
//!   object with `method` `elicitation/create` (form mode — `mode` absent or
//!   `"form"` — with a flat `requestedSchema` of primitive properties; or URL
//!   mode with an `https` URL, `http` only to loopback, and `elicitationId`
//!   a string when present),
//!   `sampling/createMessage` (with `messages` and `maxTokens`) or
//!   `roots/list`. A form field whose name or title asks for a password,
//!   token, key or payment credential is refused under the `deny` policy
//!   (the default), logged under `warn`, not looked at under `off`
//!   ([`credential`](super::credential)).
//! - answers: a key nobody asked is dropped (`UNASKED`); an answer of the
//!   wrong shape for its question (an elicitation answer without a valid
//!   `action`, a sampling answer without `role` and `content`, a roots answer
//!   without `roots`) is dropped (`KIND_MISMATCH`); a form `accept` whose
//!   `content` does not satisfy the sealed schema (types, enums, required,
//!   bounds, formats, no unknown fields) is dropped (`INVALID_CONTENT`), as
//!   is any answer object holding a number beyond the range of a double;
//!   `content` on a URL-mode answer is removed (`URL_CONTENT`) and on a
//!   `decline`/`cancel` answer too (`UNEXPECTED_CONTENT`), the rest of the
//!   answer kept.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::domain::canon::{canonicalize, ExactNumber, NumberMode};
use crate::domain::credential::{field_looks_like_credential, looks_like_credential};
use crate::domain::error::Reject;

/// What [`Manifest::build`] does with a form that asks for a credential
/// ([`credential`](super::credential)).
pub use crate::domain::credential::CredentialPolicy;

/// Largest compact manifest, in bytes (sealed inside the token).
pub const MAX_MANIFEST: usize = 16 * 1024;
/// Most questions in one `inputRequests` object.
pub const MAX_QUESTIONS: usize = 64;
/// Most fields in one form.
pub const MAX_FIELDS: usize = 64;
/// Longest key (of a question or a form field), in bytes.
pub const MAX_KEY: usize = 256;

/// Why an answer, or part of it, was dropped. The wire strings are fixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    Unasked,
    KindMismatch,
    InvalidContent,
    UrlContent,
    UnexpectedContent,
}

impl DropReason {
    pub const ALL: [DropReason; 5] = [
        DropReason::Unasked,
        DropReason::KindMismatch,
        DropReason::InvalidContent,
        DropReason::UrlContent,
        DropReason::UnexpectedContent,
    ];

    pub const fn code(self) -> &'static str {
        match self {
            DropReason::Unasked => "UNASKED",
            DropReason::KindMismatch => "KIND_MISMATCH",
            DropReason::InvalidContent => "INVALID_CONTENT",
            DropReason::UrlContent => "URL_CONTENT",
            DropReason::UnexpectedContent => "UNEXPECTED_CONTENT",
        }
    }
}

/// The questions, by key. Serialized compactly (short member names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest(BTreeMap<String, Question>);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "k")]
enum Question {
    #[serde(rename = "f")]
    Form {
        #[serde(rename = "p")]
        fields: BTreeMap<String, Field>,
        #[serde(rename = "r", default, skip_serializing_if = "Vec::is_empty")]
        required: Vec<String>,
    },
    #[serde(rename = "u")]
    Url,
    #[serde(rename = "s")]
    Sampling,
    #[serde(rename = "r")]
    Roots,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum FieldKind {
    #[serde(rename = "s")]
    String,
    #[serde(rename = "n")]
    Number,
    #[serde(rename = "i")]
    Integer,
    #[serde(rename = "b")]
    Boolean,
    /// A multi-select: an array of strings from `choices`.
    #[serde(rename = "m")]
    Multi,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum StrFormat {
    #[serde(rename = "email")]
    Email,
    #[serde(rename = "uri")]
    Uri,
    #[serde(rename = "date")]
    Date,
    #[serde(rename = "date-time")]
    DateTime,
}

/// What one form field accepts. `lo`/`hi` are the length bounds of a
/// string, the value bounds of a number, the item bounds of a multi-select.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Field {
    #[serde(rename = "t")]
    kind: FieldKind,
    #[serde(rename = "e", default, skip_serializing_if = "Option::is_none")]
    choices: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lo: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hi: Option<f64>,
    #[serde(rename = "fmt", default, skip_serializing_if = "Option::is_none")]
    format: Option<StrFormat>,
    /// A number's bounds as written (an integer exactly; a fraction as the
    /// shortest text of its double), compared exactly with the answer's
    /// text. Tokens sealed before these were kept compare with `lo`/`hi`'s
    /// shortest text.
    #[serde(rename = "lx", default, skip_serializing_if = "Option::is_none")]
    lo_text: Option<String>,
    #[serde(rename = "hx", default, skip_serializing_if = "Option::is_none")]
    hi_text: Option<String>,
}

/// One JSON text, checked: well formed, no duplicate keys at any depth
/// (two parsers keeping different duplicates would disagree on what was
/// asked or answered), nesting bounded. Then parsed.
fn parse_checked(json: &str, bad: Reject) -> Result<Value, Reject> {
    canonicalize(json, NumberMode::Exact).map_err(|_| bad)?;
    serde_json::from_str(json).map_err(|_| bad)
}

fn bad<T>() -> Result<T, Reject> {
    Err(Reject::BadInputRequests)
}

impl Manifest {
    /// Validates an `inputRequests` object and builds its manifest. Returns
    /// the manifest and the names of credential-looking fields that the
    /// `warn` policy let through (empty otherwise).
    pub fn build(json: &str, policy: CredentialPolicy) -> Result<(Manifest, Vec<String>), Reject> {
        let v = parse_checked(json, Reject::BadInputRequests)?;
        let Value::Object(requests) = v else {
            return bad();
        };
        // No questions is a manifest too: a state-only round ("still
        // working, call again") that lets no answer through.
        if requests.len() > MAX_QUESTIONS {
            return bad();
        }
        let mut questions = BTreeMap::new();
        let mut warned = Vec::new();
        for (key, request) in &requests {
            if key.is_empty() || key.len() > MAX_KEY {
                return bad();
            }
            let mut q = question(request, policy, &mut warned)?;
            if let Question::Form { fields, .. } = &mut q {
                // A number's bounds as written: the parsed value above is
                // a double (9007199254740993 would be ...992).
                for (name, f) in fields.iter_mut() {
                    if matches!(f.kind, FieldKind::Number | FieldKind::Integer) {
                        let path = |b: &'static str| {
                            [
                                key.as_str(),
                                "params",
                                "requestedSchema",
                                "properties",
                                name,
                                b,
                            ]
                        };
                        f.lo_text = raw_member(json, &path("minimum"));
                        f.hi_text = raw_member(json, &path("maximum"));
                    }
                }
            }
            questions.insert(key.clone(), q);
        }
        Ok((Manifest(questions), warned))
    }

    /// The compact form sealed in the token.
    pub fn encode(&self) -> Result<Vec<u8>, Reject> {
        let bytes = serde_json::to_vec(self).map_err(|_| Reject::BadInputRequests)?;
        if bytes.len() > MAX_MANIFEST {
            return Err(Reject::TooLarge);
        }
        Ok(bytes)
    }

    /// The manifest of an authenticated token.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, Reject> {
        // Only this code writes manifests, and the token's tag covers them:
        // a failure here is a bug, answered as an unreadable token.
        serde_json::from_slice(bytes).map_err(|_| Reject::Malformed)
    }

    /// The answers filtered against the questions.
    pub fn filter(&self, answers: Answers) -> Filtered {
        let mut kept: BTreeMap<String, Box<RawValue>> = BTreeMap::new();
        let mut dropped = Vec::new();
        for (key, raw) in answers.0 {
            let Some(q) = self.0.get(&key) else {
                dropped.push((key, DropReason::Unasked));
                continue;
            };
            match judge(q, &raw) {
                Verdict::Keep => {
                    kept.insert(key, raw);
                }
                Verdict::Drop(why) => dropped.push((key, why)),
                Verdict::StripContent(why) => {
                    let stripped = without_content(&raw);
                    dropped.push((key.clone(), why));
                    kept.insert(key, stripped);
                }
            }
        }
        Filtered {
            json: serde_json::to_string(&kept).expect("raw JSON values serialize"),
            dropped,
        }
    }
}

/// `inputResponses` as received: checked, each answer's text kept verbatim.
pub struct Answers(BTreeMap<String, Box<RawValue>>);

impl Answers {
    /// Checks the retry's `inputResponses` (one JSON object, no duplicate
    /// keys at any depth). Done before the token is opened, so a malformed
    /// answer never costs a single-use token.
    pub fn parse(json: &str) -> Result<Answers, Reject> {
        // The canonicalizer refuses duplicates and bad text; the map refuses
        // anything but an object.
        canonicalize(json, NumberMode::Exact).map_err(|_| Reject::Malformed)?;
        serde_json::from_str(json)
            .map(Answers)
            .map_err(|_| Reject::Malformed)
    }
}

/// What Open returns with a manifest: the answers kept (as JSON) and the
/// drops.
#[derive(Debug, PartialEq)]
pub struct Filtered {
    pub json: String,
    pub dropped: Vec<(String, DropReason)>,
}

enum Verdict {
    Keep,
    Drop(DropReason),
    StripContent(DropReason),
}

fn judge(q: &Question, raw: &RawValue) -> Verdict {
    let answer = match serde_json::from_str::<Value>(raw.get()) {
        Ok(Value::Object(answer)) => answer,
        Ok(_) => return Verdict::Drop(DropReason::KindMismatch),
        // Checked JSON that a `Value` cannot hold: an object with a number
        // beyond any double inside. No schema bound can be judged on it.
        Err(_) if raw.get().starts_with('{') => return Verdict::Drop(DropReason::InvalidContent),
        Err(_) => return Verdict::Drop(DropReason::KindMismatch),
    };
    match q {
        Question::Form { .. } | Question::Url => {
            let action = match answer.get("action").and_then(Value::as_str) {
                Some(a @ ("accept" | "decline" | "cancel")) => a,
                _ => return Verdict::Drop(DropReason::KindMismatch),
            };
            let has_content = answer.contains_key("content");
            match (q, action) {
                (Question::Url, _) if has_content => Verdict::StripContent(DropReason::UrlContent),
                (Question::Form { fields, required }, "accept") => {
                    let ok = match answer.get("content") {
                        Some(Value::Object(c)) => {
                            // Each value's text too: numbers are judged on it.
                            let texts = serde_json::from_str::<RawContent>(raw.get())
                                .ok()
                                .and_then(|r| r.content)
                                .unwrap_or_default();
                            form_content_ok(fields, required, c, &texts)
                        }
                        None => required.is_empty(),
                        Some(_) => false,
                    };
                    if ok {
                        Verdict::Keep
                    } else {
                        Verdict::Drop(DropReason::InvalidContent)
                    }
                }
                (_, _) if has_content => Verdict::StripContent(DropReason::UnexpectedContent),
                _ => Verdict::Keep,
            }
        }
        Question::Sampling => {
            let shaped = answer.get("role").is_some_and(Value::is_string)
                && answer
                    .get("content")
                    .is_some_and(|c| c.is_object() || c.is_array());
            if shaped {
                Verdict::Keep
            } else {
                Verdict::Drop(DropReason::KindMismatch)
            }
        }
        Question::Roots => {
            if answer.get("roots").is_some_and(Value::is_array) {
                Verdict::Keep
            } else {
                Verdict::Drop(DropReason::KindMismatch)
            }
        }
    }
}

fn without_content(raw: &RawValue) -> Box<RawValue> {
    let mut members: BTreeMap<String, Box<RawValue>> =
        serde_json::from_str(raw.get()).expect("checked to be an object");
    members.remove("content");
    RawValue::from_string(serde_json::to_string(&members).expect("raw JSON values serialize"))
        .expect("serialized JSON is JSON")
}

/// The text of the member at `path` (object keys from the top), as
/// written; `None` when a step is not an object or lacks the key.
fn raw_member(json: &str, path: &[&str]) -> Option<String> {
    let (first, rest) = path.split_first()?;
    let map: BTreeMap<String, &RawValue> = serde_json::from_str(json).ok()?;
    let v = map.get(*first)?;
    if rest.is_empty() {
        return Some(v.get().trim().to_owned());
    }
    raw_member(v.get(), rest)
}

/// An answer's `content` as the texts of its values.
#[derive(Deserialize)]
struct RawContent {
    #[serde(default)]
    content: Option<BTreeMap<String, Box<RawValue>>>,
}

fn form_content_ok(
    fields: &BTreeMap<String, Field>,
    required: &[String],
    content: &Map<String, Value>,
    texts: &BTreeMap<String, Box<RawValue>>,
) -> bool {
    required.iter().all(|r| content.contains_key(r))
        && content.iter().all(|(name, v)| {
            fields
                .get(name)
                .is_some_and(|f| field_ok(f, v, texts.get(name).map(|t| t.get())))
        })
}

fn within(f: &Field, x: f64) -> bool {
    f.lo.is_none_or(|lo| x >= lo) && f.hi.is_none_or(|hi| x <= hi)
}

/// A number answer against its field, on exact decimal values: its text
/// against the bounds' texts, and integer-ness of the written value.
fn number_ok(f: &Field, v: &Value, text: Option<&str>) -> bool {
    if !v.is_number() {
        return false;
    }
    let Some(x) = text.and_then(|t| ExactNumber::parse(t.trim())) else {
        return false;
    };
    let bound = |text: &Option<String>, double: Option<f64>| -> Option<Option<ExactNumber>> {
        match (text, double) {
            (Some(t), _) => Some(Some(ExactNumber::parse(t)?)),
            (None, Some(d)) => Some(Some(ExactNumber::parse(
                &serde_json::Number::from_f64(d)?.to_string(),
            )?)),
            (None, None) => Some(None),
        }
    };
    let (Some(lo), Some(hi)) = (bound(&f.lo_text, f.lo), bound(&f.hi_text, f.hi)) else {
        return false;
    };
    (f.kind != FieldKind::Integer || x.is_integer())
        && lo.is_none_or(|lo| x >= lo)
        && hi.is_none_or(|hi| x <= hi)
}

fn field_ok(f: &Field, v: &Value, text: Option<&str>) -> bool {
    match f.kind {
        FieldKind::Boolean => v.is_boolean(),
        FieldKind::Number | FieldKind::Integer => number_ok(f, v, text),
        FieldKind::String => {
            let Some(s) = v.as_str() else { return false };
            if let Some(choices) = &f.choices {
                return choices.iter().any(|c| c == s);
            }
            within(f, s.chars().count() as f64) && f.format.is_none_or(|fmt| format_ok(fmt, s))
        }
        FieldKind::Multi => {
            let Some(items) = v.as_array() else {
                return false;
            };
            let choices = f.choices.as_deref().unwrap_or_default();
            let mut seen = std::collections::HashSet::new();
            within(f, items.len() as f64)
                && items.iter().all(|i| {
                    i.as_str()
                        .is_some_and(|s| choices.iter().any(|c| c == s) && seen.insert(s))
                })
        }
    }
}

fn format_ok(fmt: StrFormat, s: &str) -> bool {
    match fmt {
        StrFormat::Email => match s.split_once('@') {
            Some((local, domain)) => {
                !local.is_empty()
                    && domain.contains('.')
                    && !domain.starts_with('.')
                    && !domain.ends_with('.')
                    && !domain.contains('@')
                    && !s.chars().any(|c| c.is_whitespace() || c.is_control())
            }
            None => false,
        },
        StrFormat::Uri => absolute_uri(s) && !s.chars().any(|c| c.is_whitespace()),
        StrFormat::Date => date_ok(s),
        StrFormat::DateTime => date_time_ok(s),
    }
}

/// Whether `s` starts with the scheme of an absolute URI (RFC 3986: ALPHA
/// *( ALPHA / DIGIT / "+" / "-" / "." ) ":") and has something after it.
fn absolute_uri(s: &str) -> bool {
    let Some((scheme, rest)) = s.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    first_ok && rest_ok && !rest.is_empty()
}

fn digits(s: &str) -> Option<u32> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

/// RFC 3339 `full-date`.
fn date_ok(s: &str) -> bool {
    let b = s.as_bytes();
    // ASCII only: the byte slicing below then never splits a character.
    if !s.is_ascii() || b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let (Some(y), Some(m), Some(d)) = (digits(&s[0..4]), digits(&s[5..7]), digits(&s[8..10]))
    else {
        return false;
    };
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    (1..=days).contains(&d)
}

/// RFC 3339 `date-time`.
fn date_time_ok(s: &str) -> bool {
    if !s.is_ascii() {
        return false;
    }
    let Some((date, time)) = s.split_once(['T', 't']) else {
        return false;
    };
    if !date_ok(date) || time.len() < 9 {
        return false;
    }
    let (clock, zone) = time.split_at(8);
    let c = clock.as_bytes();
    if c[2] != b':' || c[5] != b':' {
        return false;
    }
    let (Some(h), Some(mi), Some(sec)) = (
        digits(&clock[0..2]),
        digits(&clock[3..5]),
        digits(&clock[6..8]),
    ) else {
        return false;
    };
    if h > 23 || mi > 59 || sec > 60 {
        return false;
    }
    let zone = match zone.strip_prefix('.') {
        Some(frac) => {
            let n = frac.bytes().take_while(u8::is_ascii_digit).count();
            if n == 0 {
                return false;
            }
            &frac[n..]
        }
        None => zone,
    };
    match zone {
        "Z" | "z" => true,
        z if z.len() == 6 && (z.starts_with('+') || z.starts_with('-')) && &z[3..4] == ":" => {
            matches!((digits(&z[1..3]), digits(&z[4..6])), (Some(zh), Some(zm)) if zh <= 23 && zm <= 59)
        }
        _ => false,
    }
}

fn question(
    request: &Value,
    policy: CredentialPolicy,
    warned: &mut Vec<String>,
) -> Result<Question, Reject> {
    let Value::Object(r) = request else {
        return bad();
    };
    let params = r.get("params");
    match r.get("method").and_then(Value::as_str) {
        Some("elicitation/create") => {
            let Some(Value::Object(p)) = params else {
                return bad();
            };
            if !p.get("message").is_some_and(Value::is_string) {
                return bad();
            }
            match p.get("mode").map(|m| m.as_str()) {
                None | Some(Some("form")) => form(p, policy, warned),
                Some(Some("url")) => {
                    let url = p.get("url").and_then(Value::as_str);
                    // `elicitationId` is 2025-era; 2026-07-28 has none.
                    let id_ok = p.get("elicitationId").is_none_or(Value::is_string);
                    if !id_ok || !url.is_some_and(url_ok) {
                        return bad();
                    }
                    Ok(Question::Url)
                }
                _ => bad(),
            }
        }
        Some("sampling/createMessage") => {
            let Some(Value::Object(p)) = params else {
                return bad();
            };
            let max_tokens_ok = p
                .get("maxTokens")
                .and_then(Value::as_f64)
                .is_some_and(|n| n >= 1.0 && n.fract() == 0.0);
            if !p.get("messages").is_some_and(Value::is_array) || !max_tokens_ok {
                return bad();
            }
            Ok(Question::Sampling)
        }
        Some("roots/list") => match params {
            None | Some(Value::Object(_)) => Ok(Question::Roots),
            _ => bad(),
        },
        _ => bad(),
    }
}

/// A URL-mode elicitation opens a page outside the client: `https`, or
/// `http` only to a loopback host (local development). Read with a WHATWG
/// URL parser (the `url` crate), as the user's browser and Node read it:
/// `http://evil.example\@localhost/` is a page on `evil.example`, and is
/// refused. Whitespace and control characters, which WHATWG parsers strip
/// or remove silently, are refused outright.
fn url_ok(url: &str) -> bool {
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let Ok(parsed) = url::Url::parse(url) else {
        return false;
    };
    match parsed.scheme() {
        "https" => parsed.host().is_some(),
        "http" => match parsed.host() {
            Some(url::Host::Domain(d)) => d == "localhost",
            Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
            Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
            None => false,
        },
        _ => false,
    }
}

fn form(
    p: &Map<String, Value>,
    policy: CredentialPolicy,
    warned: &mut Vec<String>,
) -> Result<Question, Reject> {
    let Some(Value::Object(schema)) = p.get("requestedSchema") else {
        return bad();
    };
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        return bad();
    }
    let Some(Value::Object(props)) = schema.get("properties") else {
        return bad();
    };
    if props.len() > MAX_FIELDS {
        return bad();
    }
    let mut fields = BTreeMap::new();
    for (name, def) in props {
        if name.is_empty() || name.len() > MAX_KEY {
            return bad();
        }
        let Value::Object(def) = def else {
            return bad();
        };
        let f = field(def)?;
        // A yes/no or a choice among fixed options carries no secret.
        let free_text = match f.kind {
            FieldKind::Number | FieldKind::Integer => true,
            FieldKind::String => f.choices.is_none(),
            FieldKind::Boolean | FieldKind::Multi => false,
        };
        if free_text && !policy.admits(name, || field_looks_like_credential(name, def), warned) {
            return bad();
        }
        fields.insert(name.clone(), f);
    }
    // The message, where an answer could carry what it asks for: a form
    // with a free-text or number field ("Enter your banking password" above
    // a field named `value`).
    let free = fields.values().any(|f| {
        matches!(f.kind, FieldKind::Number | FieldKind::Integer)
            || (f.kind == FieldKind::String && f.choices.is_none())
    });
    let message = p.get("message").and_then(Value::as_str).unwrap_or("");
    if free && !policy.admits("(message)", || looks_like_credential(message), warned) {
        return bad();
    }
    let required = match schema.get("required") {
        None => Vec::new(),
        Some(Value::Array(r)) => {
            let mut out: Vec<String> = Vec::with_capacity(r.len());
            for name in r {
                match name.as_str() {
                    Some(n) if fields.contains_key(n) && !out.iter().any(|o| o == n) => {
                        out.push(n.to_owned())
                    }
                    _ => return bad(),
                }
            }
            out
        }
        Some(_) => return bad(),
    };
    Ok(Question::Form { fields, required })
}

/// A bound keyword: absent, or a finite number (a non-negative integer for
/// lengths and item counts).
fn bound(def: &Map<String, Value>, name: &str, count: bool) -> Result<Option<f64>, Reject> {
    match def.get(name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && (!count || (x >= 0.0 && x.fract() == 0.0)) => Ok(Some(x)),
            _ => bad(),
        },
    }
}

fn strings(v: Option<&Value>) -> Result<Option<Vec<String>>, Reject> {
    match v {
        None => Ok(None),
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or(Reject::BadInputRequests)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => bad(),
    }
}

/// The `const` values of a `oneOf` / `anyOf` list of `{const, title}`.
fn consts(v: Option<&Value>) -> Result<Option<Vec<String>>, Reject> {
    match v {
        None => Ok(None),
        Some(Value::Array(a)) if !a.is_empty() => a
            .iter()
            .map(|o| {
                o.get("const")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or(Reject::BadInputRequests)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => bad(),
    }
}

fn ordered(lo: Option<f64>, hi: Option<f64>) -> Result<(), Reject> {
    match (lo, hi) {
        (Some(lo), Some(hi)) if lo > hi => bad(),
        _ => Ok(()),
    }
}

fn field(def: &Map<String, Value>) -> Result<Field, Reject> {
    let mut f = Field {
        kind: FieldKind::String,
        choices: None,
        lo: None,
        hi: None,
        format: None,
        lo_text: None,
        hi_text: None,
    };
    match def.get("type").and_then(Value::as_str) {
        Some("string") => {
            f.choices = match (strings(def.get("enum"))?, consts(def.get("oneOf"))?) {
                (Some(_), Some(_)) => return bad(),
                (e, o) => e.or(o),
            };
            f.lo = bound(def, "minLength", true)?;
            f.hi = bound(def, "maxLength", true)?;
            f.format = match def.get("format").map(|v| v.as_str()) {
                None => None,
                Some(Some("email")) => Some(StrFormat::Email),
                Some(Some("uri")) => Some(StrFormat::Uri),
                Some(Some("date")) => Some(StrFormat::Date),
                Some(Some("date-time")) => Some(StrFormat::DateTime),
                Some(_) => return bad(),
            };
        }
        Some(t @ ("number" | "integer")) => {
            f.kind = if t == "number" {
                FieldKind::Number
            } else {
                FieldKind::Integer
            };
            f.lo = bound(def, "minimum", false)?;
            f.hi = bound(def, "maximum", false)?;
            // Their texts as written come from the raw JSON (Manifest::build).
        }
        Some("boolean") => f.kind = FieldKind::Boolean,
        Some("array") => {
            f.kind = FieldKind::Multi;
            let Some(Value::Object(items)) = def.get("items") else {
                return bad();
            };
            f.choices = match items.get("type").and_then(Value::as_str) {
                Some("string") => strings(items.get("enum"))?,
                None => consts(items.get("anyOf"))?,
                Some(_) => return bad(),
            };
            if f.choices.is_none() {
                return bad();
            }
            f.lo = bound(def, "minItems", true)?;
            f.hi = bound(def, "maxItems", true)?;
        }
        _ => return bad(),
    }
    ordered(f.lo, f.hi)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` questions, each a form with one string field, under keys of
    /// `key_len` bytes.
    fn questions(n: usize, key_len: usize) -> String {
        let mut q = serde_json::Map::new();
        for i in 0..n {
            let key = format!("{i:0key_len$}");
            q.insert(
                key,
                serde_json::json!({"method": "elicitation/create", "params": {
                    "mode": "form", "message": "Which colour?",
                    "requestedSchema": {"type": "object",
                        "properties": {"colour": {"type": "string"}}}}}),
            );
        }
        Value::Object(q).to_string()
    }

    #[test]
    fn question_count_and_key_length_hold_at_their_bound() {
        let deny = CredentialPolicy::Deny;
        let (m, _) = Manifest::build(&questions(MAX_QUESTIONS, 8), deny).unwrap();
        // Far above 1 KiB, within the 16 KiB bound: it encodes.
        let encoded = m.encode().unwrap();
        assert!(encoded.len() > 2048 && encoded.len() <= MAX_MANIFEST);
        assert_eq!(
            Manifest::build(&questions(MAX_QUESTIONS + 1, 8), deny).unwrap_err(),
            Reject::BadInputRequests
        );
        assert!(Manifest::build(&questions(1, MAX_KEY), deny).is_ok());
        assert_eq!(
            Manifest::build(&questions(1, MAX_KEY + 1), deny).unwrap_err(),
            Reject::BadInputRequests
        );
    }

    /// Each rule of the string formats, at its edges: every check, alone,
    /// refuses what it is there to refuse.
    #[test]
    fn string_formats_hold_at_their_edges() {
        for (fmt, text, ok) in [
            (StrFormat::Date, "2024-04-30", true),
            (StrFormat::Date, "2024-04-31", false),
            (StrFormat::Date, "2024-06-30", true),
            (StrFormat::Date, "2024-11-31", false),
            (StrFormat::Date, "2024-12-31", true),
            (StrFormat::Date, "2024-01-00", false),
            (StrFormat::Date, "2000-02-29", true),
            (StrFormat::Date, "1900-02-29", false),
            (StrFormat::Date, "2023-02-28", true),
            (StrFormat::Date, "2024-01-011", false),
            (StrFormat::Date, "2024-01-0", false),
            (StrFormat::Date, "2024x01-01", false),
            (StrFormat::Date, "2024-01x01", false),
            (StrFormat::Date, "2024-+1-01", false),
            (StrFormat::Date, "2024-01-+1", false),
            (StrFormat::Date, "+024-01-01", false),
            (StrFormat::DateTime, "2026-07-28T23:59:60Z", true),
            (StrFormat::DateTime, "2026-07-28T24:00:00Z", false),
            (StrFormat::DateTime, "2026-07-28T23:60:00Z", false),
            (StrFormat::DateTime, "2026-07-28T23:59:61Z", false),
            (StrFormat::DateTime, "2023-02-29T10:00:00Z", false),
            (StrFormat::DateTime, "2026-07-28T10:00", false),
            (StrFormat::DateTime, "2026-07-28T10:00:0", false),
            (StrFormat::DateTime, "2026-07-28T10-00:00Z", false),
            (StrFormat::DateTime, "2026-07-28T10:00-00Z", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00z", true),
            (StrFormat::DateTime, "2026-07-28T10:00:00.5Z", true),
            (StrFormat::DateTime, "2026-07-28T10:00:00.Z", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00+23:59", true),
            (StrFormat::DateTime, "2026-07-28T10:00:00-02:00", true),
            (StrFormat::DateTime, "2026-07-28T10:00:00+24:00", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00+02:60", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00*02:00", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00+02-00", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00+0200", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00+02:000", false),
            (StrFormat::DateTime, "2026-07-28T10:00:00", false),
            (StrFormat::DateTime, "2026-07-28", false),
            (StrFormat::Email, "a@example.com", true),
            (StrFormat::Email, "@example.com", false),
            (StrFormat::Email, "a@examplecom", false),
            (StrFormat::Email, "a@.example.com", false),
            (StrFormat::Email, "a@example.com.", false),
            (StrFormat::Email, "a@b@example.com", false),
            (StrFormat::Email, "a\u{7}@example.com", false),
            (StrFormat::Email, "a@example.com ", false),
            (StrFormat::Email, "example.com", false),
            (StrFormat::Uri, "mailto:x", true),
            (StrFormat::Uri, "a+b-c.d:x", true),
            (StrFormat::Uri, "noscheme", false),
            (StrFormat::Uri, "1abc:x", false),
            (StrFormat::Uri, "ab_c:x", false),
            (StrFormat::Uri, "abc:", false),
            (StrFormat::Uri, ":x", false),
            (StrFormat::Uri, "mailto:a b", false),
        ] {
            assert_eq!(format_ok(fmt, text), ok, "{fmt:?} {text:?}");
        }
        // A control character that is not whitespace: a WHATWG parser
        // strips it in front of the scheme, and this check refuses it.
        assert!(!url_ok("\u{1}https://example.com/"));
        assert!(!url_ok("https://example.com/\u{7f}"));
    }

    /// A sampling question needs `messages` and a whole `maxTokens` of at
    /// least 1.
    #[test]
    fn a_sampling_question_needs_messages_and_whole_max_tokens() {
        for (params, ok) in [
            (r#"{"messages":[],"maxTokens":1}"#, true),
            (r#"{"messages":[],"maxTokens":0}"#, false),
            (r#"{"messages":[],"maxTokens":1.5}"#, false),
            (r#"{"messages":[],"maxTokens":"1"}"#, false),
            (r#"{"maxTokens":1}"#, false),
            (r#"{"messages":{},"maxTokens":1}"#, false),
        ] {
            let requests =
                format!(r#"{{"s":{{"method":"sampling/createMessage","params":{params}}}}}"#);
            let got = Manifest::build(&requests, CredentialPolicy::Deny);
            assert_eq!(got.is_ok(), ok, "{params}: {got:?}");
        }
    }

    /// The compact manifest holds at its 16 KiB bound: exactly
    /// `MAX_MANIFEST` bytes encode, one more is TOO_LARGE.
    #[test]
    fn a_manifest_encodes_up_to_its_bound() {
        let of = |key_len: usize| Manifest(BTreeMap::from([("k".repeat(key_len), Question::Url)]));
        let overhead = of(0).encode().unwrap().len();
        let at = of(MAX_MANIFEST - overhead).encode().unwrap();
        assert_eq!(at.len(), MAX_MANIFEST);
        assert_eq!(
            of(MAX_MANIFEST - overhead + 1).encode().unwrap_err(),
            Reject::TooLarge
        );
    }

    /// A sampling answer needs both a string `role` and a `content`
    /// (object or array); either alone is of the wrong kind.
    #[test]
    fn a_sampling_answer_needs_its_role_and_content() {
        let m = Manifest(BTreeMap::from([("s".to_owned(), Question::Sampling)]));
        for (answer, kept) in [
            (
                r#"{"role":"assistant","content":{"type":"text","text":"hi"}}"#,
                true,
            ),
            (
                r#"{"role":"assistant","content":[{"type":"text","text":"hi"}]}"#,
                true,
            ),
            (r#"{"role":"assistant"}"#, false),
            (r#"{"content":{"type":"text","text":"hi"}}"#, false),
            (r#"{"role":1,"content":{"type":"text","text":"hi"}}"#, false),
            (r#"{"role":"assistant","content":"hi"}"#, false),
        ] {
            let answers = Answers::parse(&format!(r#"{{"s":{answer}}}"#)).unwrap();
            let f = m.filter(answers);
            if kept {
                assert!(f.dropped.is_empty(), "{answer}: {:?}", f.dropped);
            } else {
                assert_eq!(
                    f.dropped,
                    vec![("s".to_owned(), DropReason::KindMismatch)],
                    "{answer}"
                );
                assert_eq!(f.json, "{}", "{answer}");
            }
        }
    }

    /// An answer `serde_json::Value` cannot hold (a number beyond any
    /// double): inside an object its content is invalid, anything else is
    /// of the wrong kind (kills the mutant that made every such answer
    /// invalid content).
    #[test]
    fn an_answer_beyond_any_double_is_judged_by_its_kind() {
        let (m, _) = Manifest::build(&questions(1, 1), CredentialPolicy::Deny).unwrap();
        for (answer, why) in [
            ("1e400", DropReason::KindMismatch),
            ("[1e400]", DropReason::KindMismatch),
            (
                r#"{"action":"accept","content":{"colour":1e400}}"#,
                DropReason::InvalidContent,
            ),
        ] {
            let answers = Answers::parse(&format!(r#"{{"0":{answer}}}"#)).unwrap();
            let f = m.filter(answers);
            assert_eq!(f.dropped, vec![("0".to_owned(), why)], "{answer}");
            assert_eq!(f.json, "{}", "{answer}");
        }
    }

    /// A manifest of one form question with these `properties` and
    /// `required`.
    fn form(properties: Value, required: Value) -> Result<Manifest, Reject> {
        let q = serde_json::json!({"q": {"method": "elicitation/create", "params": {
            "mode": "form", "message": "Which?",
            "requestedSchema": {"type": "object", "properties": properties,
                "required": required}}}});
        Manifest::build(&q.to_string(), CredentialPolicy::Deny).map(|(m, _)| m)
    }

    /// `required` names distinct fields of the form; an `enum` has at
    /// least one option.
    #[test]
    fn required_names_distinct_fields_and_an_enum_has_options() {
        let two = serde_json::json!({"a": {"type": "string"}, "b": {"type": "string"}});
        assert!(form(two.clone(), serde_json::json!(["a", "b"])).is_ok());
        assert!(form(two.clone(), serde_json::json!(["a"])).is_ok());
        for bad in [
            serde_json::json!(["a", "a"]),
            serde_json::json!(["c"]),
            serde_json::json!([1]),
            serde_json::json!("a"),
        ] {
            assert_eq!(
                form(two.clone(), bad.clone()).unwrap_err(),
                Reject::BadInputRequests,
                "{bad}"
            );
        }
        let one_of = |e: Value| serde_json::json!({"a": {"type": "string", "enum": e}});
        assert!(form(one_of(serde_json::json!(["x"])), serde_json::json!([])).is_ok());
        assert_eq!(
            form(one_of(serde_json::json!([])), serde_json::json!([])).unwrap_err(),
            Reject::BadInputRequests
        );
        // Bounds may meet, never cross.
        for (def, ok) in [
            (
                serde_json::json!({"type": "number", "minimum": 5, "maximum": 5}),
                true,
            ),
            (
                serde_json::json!({"type": "number", "minimum": 6, "maximum": 5}),
                false,
            ),
            (
                serde_json::json!({"type": "string", "minLength": 3, "maxLength": 3}),
                true,
            ),
            (
                serde_json::json!({"type": "string", "minLength": 4, "maxLength": 3}),
                false,
            ),
        ] {
            let got = form(serde_json::json!({ "a": def }), serde_json::json!([]));
            assert_eq!(got.is_ok(), ok, "{def}: {got:?}");
        }
        let titled = |o: Value| serde_json::json!({"a": {"type": "string", "oneOf": o}});
        let x = serde_json::json!([{"const": "x", "title": "X"}]);
        assert!(form(titled(x), serde_json::json!([])).is_ok());
        assert_eq!(
            form(titled(serde_json::json!([])), serde_json::json!([])).unwrap_err(),
            Reject::BadInputRequests
        );
    }

    /// A form field's name is 1 to `MAX_KEY` bytes.
    #[test]
    fn a_form_field_name_holds_at_its_bounds() {
        let build = |name: &str| {
            form(
                serde_json::json!({ name: {"type": "string"} }),
                serde_json::json!([]),
            )
        };
        assert!(build(&"c".repeat(MAX_KEY)).is_ok());
        assert_eq!(
            build(&"c".repeat(MAX_KEY + 1)).unwrap_err(),
            Reject::BadInputRequests
        );
        assert_eq!(build("").unwrap_err(), Reject::BadInputRequests);
    }

    #[test]
    fn formats() {
        assert!(date_ok("2024-02-29") && !date_ok("2023-02-29") && !date_ok("2024-13-01"));
        assert!(date_time_ok("2026-07-28T10:00:00Z"));
        assert!(date_time_ok("2026-07-28t10:00:00.123+02:00"));
        assert!(!date_time_ok("2026-07-28 10:00:00Z") && !date_time_ok("2026-07-28T25:00:00Z"));
        assert!(format_ok(StrFormat::Email, "a@example.com"));
        assert!(!format_ok(StrFormat::Email, "a@b") && !format_ok(StrFormat::Email, "a b@c.d"));
        assert!(format_ok(StrFormat::Uri, "mailto:x") && !format_ok(StrFormat::Uri, "no scheme"));
        assert!(url_ok("https://example.com/x") && url_ok("http://127.0.0.1:8080/cb"));
        assert!(url_ok("http://[::1]:3000/"));
        assert!(!url_ok("http://example.com/") && !url_ok("javascript:alert(1)"));
        assert!(!url_ok("http://localhost.evil.com/") && !url_ok("https://"));
        assert!(!url_ok("http://localhost@evil.com/") && url_ok("HTTPS://Example.com"));
        // Found by the manifest fuzz target: slicing inside a character
        // (a WHATWG parser reads it as https://xn--...example/).
        let _ = url_ok("https:/\u{587}.example/");
        // Read as a browser reads them: the host is evil.example.
        for hostile in [
            "http://evil.example\\@localhost/",
            "http://evil.example\\@127.0.0.1/",
            "http://evil.example\\@[::1]/",
            "http://127.0.0.1.evil.example/",
            "http://localhost./",
            "http://[::ffff:8.8.8.8]/",
            "http:\\\\evil.example\\",
            "https://\u{3000}example.com/",
        ] {
            assert!(!url_ok(hostile), "{hostile}");
        }
        // Spellings of loopback a browser also resolves to loopback.
        // (A backslash ends the host, as in a browser: this is localhost.)
        for local in [
            "http://localhost\\.evil.example/",
            "http://127.1/",
            "http://0x7f.0.0.1/",
            "http://LOCALHOST:80/x",
            "http://127.0.0.2/",
        ] {
            assert!(url_ok(local), "{local}");
        }
        assert!(!date_time_ok("2026-07-28T1\u{587}:00:00Z") && !date_ok("2024-\u{587}-1"));
    }
}
