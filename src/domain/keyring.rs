//! Root keys, their rotation states, and the HKDF subkeys derived from them.
//!
//! A keyset file holds versioned 256-bit root keys. Each key has a state:
//! `staged` (opens only) → `primary` (seals and opens) → `retired` (neither;
//! its material is erased from the file). Staging a key everywhere before
//! promoting it is what lets replicas that reload at different moments never
//! fail an open (Tink's rotation procedure).
//!
//! Per tenant, each root key yields two subkeys by HKDF-SHA256 with the fixed,
//! versioned labels in [`labels`]: the XChaCha20-Poly1305 key, and the HMAC key
//! that turns a token's nonce into its ledger id. Key bytes live only in
//! zeroize-on-drop types, none of which implements a revealing `Debug`.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, OnceLock, RwLock};

use arc_swap::ArcSwap;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::{KeyInit, XChaCha20Poly1305};
use hkdf::Hkdf;
use hmac::Hmac;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::domain::binding::Tenant;

/// Every HKDF label, in one place. Changing one is a format change.
pub mod labels {
    /// HKDF-Extract salt for every root key.
    pub const SALT: &[u8] = b"stateseal/v1 hkdf salt";
    /// HKDF-Expand info prefix of the per-tenant XChaCha20-Poly1305 key.
    pub const TOKEN_AEAD: &[u8] = b"stateseal/v1 token aead key";
    /// HKDF-Expand info prefix of the per-tenant ledger-id HMAC key.
    pub const LEDGER_ID: &[u8] = b"stateseal/v1 ledger id key";
    /// HKDF-Expand info of the audit log's chain MAC key (one per root key).
    pub const AUDIT_CHAIN: &[u8] = b"stateseal/v1 audit chain key";
    /// HKDF-Expand info of the audit log's digest key (subjects, ledger and
    /// attempt ids are logged only as HMACs under it).
    pub const AUDIT_DIGEST: &[u8] = b"stateseal/v1 audit digest key";
}

/// The `format` member every keyset file carries.
pub const KEYSET_FORMAT: &str = "stateseal-keyset/v1";

/// Derived-subkey cache entries kept per root key before the cache is reset.
const MAX_CACHED_TENANTS: usize = 4096;

/// A root key's id. Ids are assigned in increasing order and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub u32);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyState {
    Staged,
    Primary,
    Retired,
}

impl fmt::Display for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyState::Staged => "staged",
            KeyState::Primary => "primary",
            KeyState::Retired => "retired",
        })
    }
}

/// 32 bytes of root key material. Zeroized on drop; `Debug` shows nothing.
#[derive(Clone)]
pub struct KeyMaterial(Zeroizing<[u8; 32]>);

impl KeyMaterial {
    pub fn generate() -> Self {
        let mut k = Zeroizing::new([0u8; 32]);
        rand::rngs::OsRng.fill_bytes(&mut k[..]);
        KeyMaterial(k)
    }
    /// For test vectors and tests only.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        KeyMaterial(Zeroizing::new(bytes))
    }
    /// Material a key-encryption key unwrapped (already zeroize-on-drop).
    pub fn from_unwrapped(bytes: Zeroizing<[u8; 32]>) -> Self {
        KeyMaterial(bytes)
    }
    fn expose(&self) -> &[u8; 32] {
        &self.0
    }
}

// Its only field is `Zeroizing`: the bytes are wiped when it drops.
impl zeroize::ZeroizeOnDrop for KeyMaterial {}

impl fmt::Debug for KeyMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Deliberately omits the key bytes.
        f.write_str("KeyMaterial(..)")
    }
}

impl Serialize for KeyMaterial {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let encoded = Zeroizing::new(URL_SAFE_NO_PAD.encode(self.expose()));
        s.serialize_str(&encoded)
    }
}

impl<'de> Deserialize<'de> for KeyMaterial {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = KeyMaterial;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("32 bytes of key material, base64url without padding")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<KeyMaterial, E> {
                let mut out = Zeroizing::new([0u8; 32]);
                match URL_SAFE_NO_PAD.decode_slice(v, &mut out[..]) {
                    Ok(32) => Ok(KeyMaterial(out)),
                    // Fixed message: never echo the input.
                    _ => Err(E::custom("key material must be 32 bytes of base64url")),
                }
            }
        }
        d.deserialize_str(V)
    }
}

// === keyset file ===

/// One entry of a keyset file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRecord {
    pub id: u32,
    pub state: KeyState,
    /// Unix seconds.
    pub created_at: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promoted_at: Option<u64>,
    /// When the key stopped being primary; retirement is safe once
    /// `demoted_at + max TTL + clock skew` has passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demoted_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_at: Option<u64>,
    /// Absent once retired, and in a wrapped keyset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub material: Option<KeyMaterial>,
    /// In a wrapped keyset: the material encrypted under the keyset's KEK
    /// (base64url, no padding); absent once retired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrapped: Option<String>,
}

/// What `keys list` shows (as a table, or this as JSON): each key's state
/// and dates (RFC 3339), never its material.
#[derive(Clone, Debug, Serialize)]
pub struct KeyListing {
    pub now: String,
    pub keys: Vec<ListedKey>,
}

/// One key of a [`KeyListing`].
#[derive(Clone, Debug, Serialize)]
pub struct ListedKey {
    pub id: u32,
    pub state: KeyState,
    pub created_at: String,
    pub promoted_at: Option<String>,
    pub demoted_at: Option<String>,
    pub retired_at: Option<String>,
    /// The primary's time in that state, in seconds.
    pub primary_for_seconds: Option<u64>,
    /// A demoted staged key's time since its demotion, in seconds.
    pub demoted_for_seconds: Option<u64>,
    /// When retiring it becomes safe (absent for a retired key, and for the
    /// primary, which must be demoted first).
    pub retire_after: Option<String>,
    pub retirable_now: bool,
}

/// The keyset file (JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysetFile {
    pub format: String,
    /// Set in a wrapped keyset: the kind of key-encryption key (`file` or
    /// `pkcs11`) that wraps every key's material. Only `wrapped` material
    /// then, never clear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kek: Option<String>,
    /// Set in a wrapped keyset: a random id, chosen when it was wrapped,
    /// that every wrapped blob is bound to (with its key id), so a blob from
    /// another keyset under the same KEK does not open here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyset_id: Option<String>,
    pub keys: Vec<KeyRecord>,
}

/// A key-encryption key: wraps and unwraps root key material. `aad` binds
/// each wrapped blob to its key id. Implementations (a file, a PKCS#11
/// token) live with the operations code; errors never hold key bytes.
pub trait Kek: Send + Sync + fmt::Debug {
    /// `file` or `pkcs11`: what a wrapped keyset records in `kek`.
    fn kind(&self) -> &'static str;
    fn wrap(&self, aad: &[u8], key: &[u8; 32]) -> Result<Vec<u8>, KeysetError>;
    fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<[u8; 32]>, KeysetError>;
}

/// What a wrapped key's blob is bound to: its keyset's id and its own.
fn wrap_aad(keyset_id: Option<&str>, id: u32) -> Vec<u8> {
    let ks = keyset_id.unwrap_or("").as_bytes();
    let mut aad = b"stateseal/v1 wrapped root key".to_vec();
    aad.extend_from_slice(&(ks.len() as u32).to_be_bytes());
    aad.extend_from_slice(ks);
    aad.extend_from_slice(&id.to_be_bytes());
    aad
}

/// What retirement must wait for, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetirePolicy {
    /// The servers' `--max-ttl`.
    pub max_ttl: u64,
    /// The servers' `--clock-skew`.
    pub clock_skew: u64,
    /// How long a written keyset may take to reach every replica.
    pub rollout: u64,
}

impl Default for RetirePolicy {
    fn default() -> Self {
        RetirePolicy {
            max_ttl: 3600,
            clock_skew: 60,
            rollout: 120,
        }
    }
}

/// Why a keyset file or a move on it was refused. Messages never hold key bytes.
#[derive(Debug, thiserror::Error)]
pub enum KeysetError {
    #[error("keyset file: {0}")]
    Io(#[from] std::io::Error),
    #[error("keyset file is not a valid keyset: {0}")]
    Parse(String),
    #[error("keyset is invalid: {0}")]
    Invalid(&'static str),
    #[error("refused: {0}")]
    Refused(String),
}

impl KeysetFile {
    /// A new keyset with one primary key.
    pub fn generate(now: u64) -> Self {
        KeysetFile {
            format: KEYSET_FORMAT.to_owned(),
            kek: None,
            keyset_id: None,
            keys: vec![KeyRecord {
                id: 1,
                state: KeyState::Primary,
                created_at: now,
                promoted_at: Some(now),
                demoted_at: None,
                retired_at: None,
                material: Some(KeyMaterial::generate()),
                wrapped: None,
            }],
        }
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, KeysetError> {
        let file: KeysetFile = serde_json::from_slice(bytes).map_err(|e| {
            // A fixed message with the position only: serde's own messages
            // quote values ("invalid type: string \"…\""), and key material
            // pasted into the wrong member would end up in a log.
            KeysetError::Parse(format!(
                "{} at line {}, column {}",
                match e.classify() {
                    serde_json::error::Category::Syntax | serde_json::error::Category::Eof =>
                        "invalid JSON",
                    _ => "unexpected member, type or value",
                },
                e.line(),
                e.column()
            ))
        })?;
        file.validate()?;
        Ok(file)
    }

    pub fn read(path: &Path) -> Result<Self, KeysetError> {
        let bytes = Zeroizing::new(std::fs::read(path)?);
        Self::parse(&bytes)
    }

    /// Checks the invariants every loaded keyset must hold.
    pub fn validate(&self) -> Result<(), KeysetError> {
        if self.format != KEYSET_FORMAT {
            return Err(KeysetError::Invalid(
                "unknown format (want stateseal-keyset/v1)",
            ));
        }
        let mut ids = std::collections::HashSet::new();
        let mut primaries = 0;
        for k in &self.keys {
            if k.id == 0 {
                return Err(KeysetError::Invalid("key id 0 is reserved"));
            }
            if !ids.insert(k.id) {
                return Err(KeysetError::Invalid("duplicate key id"));
            }
            let held = match (&k.material, &k.wrapped, &self.kek) {
                (None, None, _) => false,
                (Some(_), None, None) | (None, Some(_), Some(_)) => true,
                (Some(_), Some(_), _) => {
                    return Err(KeysetError::Invalid(
                        "a key has both clear and wrapped material",
                    ))
                }
                (Some(_), None, Some(_)) => {
                    return Err(KeysetError::Invalid(
                        "a wrapped keyset (kek set) holds a key in the clear",
                    ))
                }
                (None, Some(_), None) => {
                    return Err(KeysetError::Invalid(
                        "a key is wrapped but the keyset names no kek",
                    ))
                }
            };
            match (k.state, held) {
                (KeyState::Primary, true) => primaries += 1,
                (KeyState::Staged, true) | (KeyState::Retired, false) => {}
                (KeyState::Retired, true) => {
                    return Err(KeysetError::Invalid("a retired key must not keep material"))
                }
                (_, false) => return Err(KeysetError::Invalid("a live key has no material")),
            }
        }
        if self
            .kek
            .as_deref()
            .is_some_and(|k| k != "file" && k != "pkcs11")
        {
            return Err(KeysetError::Invalid("unknown kek (want file or pkcs11)"));
        }
        if self.kek.is_some() != self.keyset_id.is_some() {
            return Err(KeysetError::Invalid(
                "a wrapped keyset needs a keyset_id, and only a wrapped one has one",
            ));
        }
        if primaries != 1 {
            return Err(KeysetError::Invalid("exactly one key must be primary"));
        }
        Ok(())
    }

    /// Serializes into a zeroize-on-drop buffer allocated once at its exact
    /// size (measured by a first pass that writes nowhere), so no
    /// reallocation leaves a copy of key material in freed memory.
    pub fn to_json(&self) -> Result<Zeroizing<Vec<u8>>, KeysetError> {
        struct Count(usize);
        impl std::io::Write for Count {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0 += b.len();
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut n = Count(0);
        serde_json::to_writer_pretty(&mut n, self)
            .map_err(|_| KeysetError::Invalid("keyset cannot be serialized"))?;
        let mut out = Zeroizing::new(Vec::with_capacity(n.0 + 1));
        serde_json::to_writer_pretty(&mut *out, self)
            .map_err(|_| KeysetError::Invalid("keyset cannot be serialized"))?;
        out.push(b'\n');
        debug_assert_eq!(out.len(), out.capacity());
        Ok(out)
    }

    /// Writes atomically (temp file in the same directory, fsync, rename) with
    /// mode 0600. With `create_new`, refuses to replace an existing file.
    pub fn write(&self, path: &Path, create_new: bool) -> Result<(), KeysetError> {
        self.validate()?;
        let json = self.to_json()?;
        if create_new && path.exists() {
            return Err(KeysetError::Refused(format!(
                "{} exists; not overwriting a keyset",
                path.display()
            )));
        }
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let file_name = path
            .file_name()
            .ok_or(KeysetError::Invalid("keyset path has no file name"))?
            .to_string_lossy()
            .into_owned();
        let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
        let result = (|| -> std::io::Result<()> {
            let mut f = open_private(&tmp)?;
            f.write_all(&json)?;
            f.sync_all()?;
            if create_new {
                // hard_link fails if the target exists: no window to clobber.
                std::fs::hard_link(&tmp, path)?;
                std::fs::remove_file(&tmp)?;
            } else {
                std::fs::rename(&tmp, path)?;
            }
            std::fs::File::open(dir)?.sync_all()
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map_err(KeysetError::Io)
    }

    fn next_id(&self) -> Result<u32, KeysetError> {
        self.keys
            .iter()
            .map(|k| k.id)
            .max()
            .unwrap_or(0)
            .checked_add(1)
            .ok_or(KeysetError::Invalid("no key id left"))
    }

    fn find_mut(&mut self, id: u32) -> Result<&mut KeyRecord, KeysetError> {
        self.keys
            .iter_mut()
            .find(|k| k.id == id)
            .ok_or_else(|| KeysetError::Refused(format!("no key with id {id}")))
    }

    /// Adds a new staged key (opens only) and returns its id. A wrapped
    /// keyset needs its KEK, which wraps the new key.
    pub fn add_staged(&mut self, now: u64, kek: Option<&dyn Kek>) -> Result<u32, KeysetError> {
        let id = self.next_id()?;
        // The KEK must open what is there already (a wrong KEK is refused
        // before it wraps anything).
        self.check_opens(kek)?;
        let material = KeyMaterial::generate();
        let (material, wrapped) = match kek {
            None => (Some(material), None),
            Some(kek) => (
                None,
                Some(wrap_one(kek, self.keyset_id.as_deref(), id, &material)?),
            ),
        };
        self.keys.push(KeyRecord {
            id,
            state: KeyState::Staged,
            created_at: now,
            promoted_at: None,
            demoted_at: None,
            retired_at: None,
            material,
            wrapped,
        });
        Ok(id)
    }

    /// Checks that `kek` is what this keyset needs: none for a clear one,
    /// one of the recorded kind for a wrapped one. A wrapped keyset without
    /// a KEK, or a clear one with a KEK, is refused: never a silent
    /// fall-back to the clear.
    fn kek_fits(&self, kek: Option<&dyn Kek>) -> Result<(), KeysetError> {
        match (&self.kek, kek) {
            (None, None) => Ok(()),
            (Some(kind), Some(kek)) if kind == kek.kind() => Ok(()),
            (Some(kind), Some(kek)) => Err(KeysetError::Refused(format!(
                "the keyset is wrapped by a {kind} KEK, not {}",
                kek.kind()
            ))),
            (Some(_), None) => Err(wrapped_needs_kek()),
            (None, Some(_)) => Err(clear_with_kek()),
        }
    }

    /// One key's clear material (unwrapped with `kek` in a wrapped keyset),
    /// `None` once retired. Made one at a time, where it is used: no list
    /// of keys is ever collected into a buffer freed unwiped. Callers check
    /// [`Self::kek_fits`] once first.
    fn material_of(
        &self,
        k: &KeyRecord,
        kek: Option<&dyn Kek>,
    ) -> Result<Option<KeyMaterial>, KeysetError> {
        match (&k.material, &k.wrapped, kek) {
            (Some(m), None, None) => Ok(Some(m.clone())),
            (None, Some(w), Some(kek)) => {
                let blob = URL_SAFE_NO_PAD
                    .decode(w)
                    .map_err(|_| KeysetError::Invalid("a wrapped key is not base64url"))?;
                let bytes = kek
                    .unwrap(&wrap_aad(self.keyset_id.as_deref(), k.id), &blob)
                    .map_err(|e| {
                        let why = match e {
                            KeysetError::Refused(m) => m,
                            other => other.to_string(),
                        };
                        KeysetError::Refused(format!(
                            "the key-encryption key does not open key {}: {why}",
                            k.id
                        ))
                    })?;
                Ok(Some(KeyMaterial::from_unwrapped(bytes)))
            }
            (None, None, _) => Ok(None),
            _ => Err(KeysetError::Invalid(
                "a key's material does not match the keyset's kek",
            )),
        }
    }

    /// Checks that `kek` opens every live key of this keyset.
    pub fn check_opens(&self, kek: Option<&dyn Kek>) -> Result<(), KeysetError> {
        self.kek_fits(kek)?;
        for k in &self.keys {
            self.material_of(k, kek)?;
        }
        Ok(())
    }

    /// Wraps every live key under `to` (from the clear, or unwrapped with
    /// `from`): the keyset is then wrapped by `to` only.
    pub fn rewrap(&mut self, from: Option<&dyn Kek>, to: &dyn Kek) -> Result<(), KeysetError> {
        self.kek_fits(from)?;
        // A new keyset id: what this wrapping binds every blob to.
        let mut id = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut id);
        let keyset_id: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let mut wrapped = HashMap::new();
        for k in &self.keys {
            if let Some(m) = self.material_of(k, from)? {
                wrapped.insert(k.id, wrap_one(to, Some(&keyset_id), k.id, &m)?);
            }
        }
        for k in &mut self.keys {
            if let Some(w) = wrapped.remove(&k.id) {
                k.material = None;
                k.wrapped = Some(w);
            }
        }
        self.kek = Some(to.kind().to_owned());
        self.keyset_id = Some(keyset_id);
        self.validate()?;
        // What was wrapped opens with `to`.
        self.check_opens(Some(to))
    }

    /// Makes a staged key primary; the old primary becomes staged (it keeps
    /// opening the tokens it sealed). Unless `force`, the key must have been
    /// in the file for `rollout` seconds: a replica that has not yet reloaded
    /// the keyset that added it could not open what it seals.
    pub fn promote(
        &mut self,
        id: u32,
        now: u64,
        rollout: u64,
        force: bool,
    ) -> Result<(), KeysetError> {
        let k = self.find_mut(id)?;
        match k.state {
            KeyState::Staged => {
                let ready_at = k.created_at.saturating_add(rollout);
                if now < ready_at && !force && k.promoted_at.is_none() {
                    return Err(KeysetError::Refused(format!(
                        "key {id} was added less than {rollout} s ago; replicas may not have \
                         loaded it yet (promote at or after unix time {ready_at}, or pass --force)"
                    )));
                }
            }
            KeyState::Primary => {
                return Err(KeysetError::Refused(format!("key {id} is already primary")))
            }
            KeyState::Retired => {
                return Err(KeysetError::Refused(format!(
                    "key {id} is retired and cannot come back"
                )))
            }
        }
        for k in &mut self.keys {
            if k.state == KeyState::Primary {
                k.state = KeyState::Staged;
                k.demoted_at = Some(now);
            }
        }
        let k = self.find_mut(id)?;
        k.state = KeyState::Primary;
        k.promoted_at = Some(now);
        k.demoted_at = None;
        Ok(())
    }

    /// The earliest time at which `id` can be retired without failing an
    /// unexpired token: demotion + rollout + max TTL + clock skew, where
    /// `rollout` bounds how long the last replica may keep sealing with the
    /// key after its demotion was written (the time a new keyset takes to
    /// reach every replica). A key that was never primary sealed nothing and
    /// can go at once. `None`: no safe time can be known (the key is primary,
    /// or a hand-edited file says it was promoted but never demoted).
    pub fn safe_retire_at(&self, id: u32, policy: RetirePolicy) -> Option<u64> {
        let k = self.keys.iter().find(|k| k.id == id)?;
        match (k.promoted_at, k.demoted_at) {
            (None, None) => Some(0),
            (_, Some(d)) => Some(d + policy.rollout + policy.max_ttl + policy.clock_skew),
            (Some(_), None) => None,
        }
    }

    /// Retires a staged key and erases its material. Refuses the primary, and
    /// (unless `force`) a key that may still have unexpired tokens.
    pub fn retire(
        &mut self,
        id: u32,
        now: u64,
        policy: RetirePolicy,
        force: bool,
    ) -> Result<(), KeysetError> {
        let safe_at = self.safe_retire_at(id, policy);
        let k = self.find_mut(id)?;
        match k.state {
            KeyState::Primary => {
                return Err(KeysetError::Refused(format!(
                    "key {id} is primary; promote another key first"
                )))
            }
            KeyState::Retired => {
                return Err(KeysetError::Refused(format!("key {id} is already retired")))
            }
            KeyState::Staged => {}
        }
        match safe_at {
            Some(at) if now < at && !force => {
                return Err(KeysetError::Refused(format!(
                    "key {id} may still carry unexpired tokens until unix time {at} \
                     (demotion + rollout + max TTL + clock skew); pass --force to retire it anyway"
                )))
            }
            None if !force => {
                return Err(KeysetError::Refused(format!(
                    "key {id} was primary but has no demotion time, so no safe retirement \
                     time is known; pass --force to retire it anyway"
                )))
            }
            _ => {}
        }
        k.state = KeyState::Retired;
        k.retired_at = Some(now);
        k.material = None;
        k.wrapped = None;
        Ok(())
    }
}

fn wrap_one(
    kek: &dyn Kek,
    keyset_id: Option<&str>,
    id: u32,
    m: &KeyMaterial,
) -> Result<String, KeysetError> {
    Ok(URL_SAFE_NO_PAD.encode(kek.wrap(&wrap_aad(keyset_id, id), m.expose())?))
}

fn wrapped_needs_kek() -> KeysetError {
    KeysetError::Refused(
        "the keyset is wrapped: give its key-encryption key (--keyset-kek, or --kek for keys)"
            .to_owned(),
    )
}

fn clear_with_kek() -> KeysetError {
    KeysetError::Refused(
        "a key-encryption key was given but the keyset holds its keys in the clear; wrap it \
         first with `stateseal keys rewrap`"
            .to_owned(),
    )
}

/// `t` (Unix seconds) as RFC 3339 UTC, e.g. `2026-11-30T14:26:30Z`.
pub fn rfc3339(t: u64) -> String {
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let days = (t / 86_400) as i64;
    let secs = t % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

/// A duration in seconds as `3d4h`, `5h12m`, `7m30s` or `42s`.
pub fn human_age(secs: u64) -> String {
    let (d, h, m, s) = (
        secs / 86_400,
        secs % 86_400 / 3600,
        secs % 3600 / 60,
        secs % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m"),
        _ => format!("{d}d{h:02}h"),
    }
}

impl KeysetFile {
    /// The listing of `keys list`, as JSON values (never key material):
    /// per key its id, state, RFC 3339 times, how long it has been primary or
    /// demoted, and when it may be retired.
    pub fn listing(&self, now: u64, policy: RetirePolicy) -> KeyListing {
        let time = |t: Option<u64>| t.map(rfc3339);
        let keys = self
            .keys
            .iter()
            .map(|k| {
                let retire_at = match k.state {
                    KeyState::Retired => None,
                    _ => self.safe_retire_at(k.id, policy),
                };
                ListedKey {
                    id: k.id,
                    state: k.state,
                    created_at: rfc3339(k.created_at),
                    promoted_at: time(k.promoted_at),
                    demoted_at: time(k.demoted_at),
                    retired_at: time(k.retired_at),
                    primary_for_seconds: (k.state == KeyState::Primary)
                        .then(|| k.promoted_at.map(|p| now.saturating_sub(p)))
                        .flatten(),
                    demoted_for_seconds: k
                        .demoted_at
                        .filter(|_| k.state == KeyState::Staged)
                        .map(|d| now.saturating_sub(d)),
                    retire_after: retire_at.map(|t| {
                        if t == 0 {
                            rfc3339(k.created_at)
                        } else {
                            rfc3339(t)
                        }
                    }),
                    retirable_now: match (k.state, retire_at) {
                        (KeyState::Staged, Some(t)) => now >= t,
                        _ => false,
                    },
                }
            })
            .collect();
        KeyListing {
            now: rfc3339(now),
            keys,
        }
    }
}

#[cfg(unix)]
fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

#[cfg(not(unix))]
fn open_private(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
}

// === impl Keyring ===

/// Subkeys of one root key for one tenant.
pub struct TenantKeys {
    pub(crate) aead: XChaCha20Poly1305,
    /// HMAC-SHA256 keyed with the ledger-id subkey (its keyed inner and
    /// outer states, computed once): a token's ledger id is this over its
    /// nonce.
    pub(crate) ledger_mac: Wiped<Hmac<Sha256>>,
}

// Both fields wipe themselves on drop (the AEAD key through
// chacha20poly1305's own ZeroizeOnDrop, the HMAC state through `Wiped`).
impl zeroize::ZeroizeOnDrop for TenantKeys {}

/// A value of a type that keeps derived secrets in plain fields and has no
/// zeroizing drop of its own (the HMAC and HKDF states of the `hmac` and
/// `hkdf` crates). On drop it is overwritten in place with a value derived
/// from no secret, and the write is kept from being optimised away with
/// `black_box`. Safe Rust cannot wipe the crates' own stack temporaries;
/// `Wiped` covers every such state this crate stores or creates.
pub struct Wiped<T: Blank>(pub T);

/// A value of the type that holds no secret.
pub trait Blank {
    fn blank() -> Self;
}

impl Blank for Hmac<Sha256> {
    fn blank() -> Self {
        <Hmac<Sha256> as hmac::Mac>::new_from_slice(&[]).expect("HMAC takes keys of any length")
    }
}

impl Blank for Hkdf<Sha256> {
    fn blank() -> Self {
        Hkdf::<Sha256>::from_prk(&[0u8; 32]).expect("32 bytes is a valid PRK length")
    }
}

impl<T: Blank> Wiped<T> {
    /// Overwrites the value now (as drop does).
    pub fn wipe(&mut self) {
        self.0 = T::blank();
        std::hint::black_box(&self.0);
    }
}

impl<T: Blank> Drop for Wiped<T> {
    fn drop(&mut self) {
        self.wipe();
    }
}

impl<T: Blank> zeroize::ZeroizeOnDrop for Wiped<T> {}

impl<T: Blank> fmt::Debug for Wiped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Wiped(..)")
    }
}

impl fmt::Debug for TenantKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantKeys").finish_non_exhaustive()
    }
}

/// The audit log's keys of one root key (not per tenant): the chain MAC
/// key and the key of the digests that stand in for subjects and ids.
pub struct AuditKeys {
    chain: Wiped<Hmac<Sha256>>,
    digest: Wiped<Hmac<Sha256>>,
}

impl AuditKeys {
    /// HMAC-SHA256 over the previous line's MAC and this line's body.
    pub fn chain_mac(&self, prev: &[u8; 32], body: &[u8]) -> [u8; 32] {
        use hmac::Mac;
        let mut m = self.chain.0.clone();
        m.update(prev);
        m.update(body);
        let out: [u8; 32] = m.finalize().into_bytes().into();
        out
    }

    /// The first 16 bytes of HMAC-SHA256 over `field` (a fixed name that
    /// keeps a subject's digest from equalling an attempt id's) and the
    /// `parts`, each length-prefixed.
    pub fn digest(&self, field: &str, parts: &[&[u8]]) -> [u8; 16] {
        use hmac::Mac;
        let mut m = self.digest.0.clone();
        m.update(&(field.len() as u32).to_be_bytes());
        m.update(field.as_bytes());
        for p in parts {
            m.update(&(p.len() as u32).to_be_bytes());
            m.update(p);
        }
        let full: [u8; 32] = m.finalize().into_bytes().into();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        out
    }
}

// Both fields wipe themselves on drop (`Wiped`).
impl zeroize::ZeroizeOnDrop for AuditKeys {}

impl fmt::Debug for AuditKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuditKeys(..)")
    }
}

/// A live (staged or primary) root key.
pub struct RootKey {
    id: KeyId,
    state: KeyState,
    material: KeyMaterial,
    cache: RwLock<HashMap<Tenant, Arc<TenantKeys>>>,
    audit: OnceLock<AuditKeys>,
}

impl fmt::Debug for RootKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RootKey")
            .field("id", &self.id)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl RootKey {
    pub fn id(&self) -> KeyId {
        self.id
    }
    pub fn state(&self) -> KeyState {
        self.state
    }

    /// The audit log's keys, derived once.
    pub fn audit_keys(&self) -> &AuditKeys {
        self.audit.get_or_init(|| {
            let hk = Wiped(Hkdf::<Sha256>::new(
                Some(labels::SALT),
                self.material.expose(),
            ));
            let kid = self.id.0.to_be_bytes();
            let mac = |label: &[u8]| {
                let mut k = Zeroizing::new([0u8; 32]);
                hk.0.expand_multi_info(&[label, &kid], &mut k[..])
                    .expect("32 bytes is a valid HKDF-SHA256 output length");
                Wiped(
                    <Hmac<Sha256> as hmac::Mac>::new_from_slice(&k[..])
                        .expect("HMAC takes keys of any length"),
                )
            };
            AuditKeys {
                chain: mac(labels::AUDIT_CHAIN),
                digest: mac(labels::AUDIT_DIGEST),
            }
        })
    }

    /// The tenant's subkeys, derived once and cached.
    pub fn tenant_keys(&self, tenant: &Tenant) -> Arc<TenantKeys> {
        if let Some(k) = self
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(tenant)
        {
            return k.clone();
        }
        let derived = Arc::new(self.derive(tenant));
        let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= MAX_CACHED_TENANTS {
            cache.clear();
        }
        cache.entry(tenant.clone()).or_insert(derived).clone()
    }

    fn derive(&self, tenant: &Tenant) -> TenantKeys {
        // The HKDF state holds the PRK: wiped when it goes out of scope.
        let hk = Wiped(Hkdf::<Sha256>::new(
            Some(labels::SALT),
            self.material.expose(),
        ));
        let hk = &hk.0;
        let kid = self.id.0.to_be_bytes();
        let t = tenant.as_str().as_bytes();
        let tlen = (t.len() as u32).to_be_bytes();
        let mut aead_key = Zeroizing::new([0u8; 32]);
        hk.expand_multi_info(&[labels::TOKEN_AEAD, &kid, &tlen, t], &mut aead_key[..])
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        let mut ledger_id = Zeroizing::new([0u8; 32]);
        hk.expand_multi_info(&[labels::LEDGER_ID, &kid, &tlen, t], &mut ledger_id[..])
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        TenantKeys {
            aead: XChaCha20Poly1305::new((&*aead_key).into()),
            ledger_mac: Wiped(
                <Hmac<Sha256> as hmac::Mac>::new_from_slice(&ledger_id[..])
                    .expect("HMAC takes keys of any length"),
            ),
        }
    }
}

/// The keys in force: the primary seals, staged and primary open.
#[derive(Debug)]
pub struct Keyring {
    keys: HashMap<KeyId, Arc<RootKey>>,
    primary: Arc<RootKey>,
    /// When the primary was promoted (Unix seconds), from the keyset file.
    primary_since: Option<u64>,
    /// The wrapped keyset's id (`None` in the clear).
    keyset_id: Option<String>,
}

impl Keyring {
    /// The keys in force of a clear keyset.
    pub fn from_file(file: &KeysetFile) -> Result<Self, KeysetError> {
        Self::from_file_with(file, None)
    }

    /// The keys in force, unwrapped with `kek` in a wrapped keyset.
    pub fn from_file_with(file: &KeysetFile, kek: Option<&dyn Kek>) -> Result<Self, KeysetError> {
        file.validate()?;
        file.kek_fits(kek)?;
        let mut keys = HashMap::new();
        let mut primary = None;
        let mut primary_since = None;
        for rec in &file.keys {
            let Some(material) = file.material_of(rec, kek)? else {
                continue; // retired
            };
            let key = Arc::new(RootKey {
                id: KeyId(rec.id),
                state: rec.state,
                material,
                cache: RwLock::new(HashMap::new()),
                audit: OnceLock::new(),
            });
            if rec.state == KeyState::Primary {
                primary = Some(key.clone());
                primary_since = rec.promoted_at.or(Some(rec.created_at));
            }
            keys.insert(KeyId(rec.id), key);
        }
        let primary = primary.ok_or(KeysetError::Invalid("exactly one key must be primary"))?;
        Ok(Keyring {
            keys,
            primary,
            primary_since,
            keyset_id: file.keyset_id.clone(),
        })
    }

    pub fn load(path: &Path) -> Result<Self, KeysetError> {
        Self::from_file(&KeysetFile::read(path)?)
    }

    pub fn primary(&self) -> &Arc<RootKey> {
        &self.primary
    }

    /// When the primary key became primary (Unix seconds), if known.
    pub fn primary_since(&self) -> Option<u64> {
        self.primary_since
    }

    /// A key that may open tokens (staged or primary); `None` if unknown or retired.
    pub fn get(&self, id: KeyId) -> Option<&Arc<RootKey>> {
        self.keys.get(&id)
    }

    /// Why `next` may not replace this keyring in a running server: another
    /// keyset (its id changed: wrapped anew, or another file), or a key id
    /// in both whose material changed. Keys are added, promoted and retired;
    /// an id never changes its bytes, so a file that says otherwise was
    /// written by someone other than `stateseal keys`.
    pub fn refuses_successor(&self, next: &Keyring) -> Option<String> {
        if self.keyset_id != next.keyset_id {
            return Some(
                "the keyset's id changed (wrapped anew, or another keyset): restart to take it"
                    .to_owned(),
            );
        }
        for (id, key) in &self.keys {
            if let Some(n) = next.keys.get(id) {
                let same: bool = subtle::ConstantTimeEq::ct_eq(
                    &key.material.expose()[..],
                    &n.material.expose()[..],
                )
                .into();
                if !same {
                    return Some(format!("key {id}'s material changed"));
                }
            }
        }
        None
    }

    /// Ids and states, never material.
    pub fn summary(&self) -> Vec<(KeyId, KeyState)> {
        let mut v: Vec<_> = self.keys.values().map(|k| (k.id, k.state)).collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }
}

/// The keyring in force, swapped atomically on reload.
#[derive(Debug)]
pub struct KeyringHandle(ArcSwap<Keyring>);

impl KeyringHandle {
    pub fn new(ring: Keyring) -> Self {
        KeyringHandle(ArcSwap::from_pointee(ring))
    }
    pub fn current(&self) -> Arc<Keyring> {
        self.0.load_full()
    }
    pub fn replace(&self, ring: Keyring) {
        self.0.store(Arc::new(ring));
    }
}

#[cfg(test)]
mod tests;
