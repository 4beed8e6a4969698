//! A key-encryption key (KEK) held in a PKCS#11 token (an HSM).
//!
//! [`Pkcs11Kek`] wraps and unwraps small secrets (stateseal's 32-byte root
//! keys) with AES-256-GCM computed *inside* the token: the AES key never
//! leaves it. A wrapped blob is `iv (12) || ciphertext || tag (16)`.
//!
//! The token is named by an RFC 7512 `pkcs11:` URI, e.g.
//! `pkcs11:token=stateseal;object=kek-2026?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/run/secrets/hsm-pin`
//!
//! Process-wide facts this module has to live with (PKCS#11 is a C API with
//! global state per loaded module):
//!
//! * A module may be `C_Initialize`d only once per process until
//!   `C_Finalize`. `dlopen` of the same file returns the same instance, so a
//!   second `Pkcs11::new(path)` + `initialize` gets
//!   `CKR_CRYPTOKI_ALREADY_INITIALIZED`. We therefore keep one context per
//!   (canonical) module path in a process-wide registry, initialise it once
//!   (serialised; concurrent `C_Initialize` calls are not safe with every
//!   module), treat "already initialised" as success, and never finalise
//!   (cryptoki 0.12 no longer finalises on drop, and `C_Finalize` would
//!   pull the module out from under every other live [`Pkcs11Kek`]).
//! * Login state is per token per process, not per session: once one session
//!   is logged in, `C_Login` on another returns `CKR_USER_ALREADY_LOGGED_IN`
//!   *without checking the PIN*. To keep "wrong PIN" meaning something, the
//!   registry remembers a digest of the PIN that logged each token in and
//!   compares against it in that case. The token logs out by itself when its
//!   last session closes, so we never call `C_Logout` (it would log out every
//!   other live [`Pkcs11Kek`] on the same token).

use std::collections::HashMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Function, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};
use cryptoki::mechanism::aead::GcmParams;
use cryptoki::mechanism::{Mechanism, MechanismType};
use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};
use cryptoki::slot::Slot;
use cryptoki::types::{AuthPin, Ulong};
use rand::rngs::OsRng;
use rand::RngCore;
use sha2::{Digest, Sha256};
use zeroize::{Zeroize, Zeroizing};

/// AES-256 key length in bytes.
const KEY_LEN: u64 = 32;
/// GCM nonce length in bytes (the 96-bit IV that GCM processes directly).
const IV_LEN: usize = 12;
/// GCM tag length in bytes.
const TAG_LEN: usize = 16;
/// Longest PIN file we read (a PIN is a few dozen bytes at most).
const MAX_PIN_FILE: usize = 1024;
/// `CK_TOKEN_INFO.label` is 32 bytes, blank padded.
const MAX_TOKEN_LABEL: usize = 32;

/// Why a PKCS#11 KEK could not be used.
///
/// Display messages are fixed, one line, and never contain a PIN, key bytes or
/// wrapped bytes. Operator-supplied strings (labels, paths) are printed with
/// `{:?}` so that a control character in them cannot break the line.
#[derive(Debug, thiserror::Error)]
pub enum Pkcs11Error {
    /// The `pkcs11:` URI is malformed or asks for something unsupported.
    #[error("invalid pkcs11 URI: {0}")]
    BadUri(&'static str),
    /// `pin-source` names a file that cannot be read or holds no usable PIN.
    #[error("cannot read a PIN from {path:?}: {reason}")]
    PinFile { path: String, reason: &'static str },
    /// The module at `module-path` cannot be used.
    #[error("PKCS#11 module {path:?} {reason}")]
    Module { path: String, reason: &'static str },
    /// No initialised token carries this label.
    #[error("no PKCS#11 token labelled {0:?}")]
    NoToken(String),
    /// More than one token carries this label.
    #[error("more than one PKCS#11 token labelled {0:?}")]
    AmbiguousToken(String),
    /// `C_Login` refused the PIN.
    #[error("PKCS#11 login failed: wrong PIN")]
    Login,
    /// The token has locked the user PIN.
    #[error("PKCS#11 login failed: the user PIN is locked")]
    PinLocked,
    /// The token is already logged in by this process with a different PIN,
    /// so this PIN cannot be checked (see the module docs).
    #[error(
        "PKCS#11 login failed: the token is already logged in by this process with a different PIN"
    )]
    PinMismatch,
    /// No AES secret key carries this label in the token.
    #[error("no AES secret key labelled {0:?} in the token")]
    NoKey(String),
    /// More than one AES secret key carries this label.
    #[error("more than one AES secret key labelled {0:?} in the token")]
    AmbiguousKey(String),
    /// The key exists but cannot serve as the KEK.
    #[error("the key labelled {label:?} cannot be used: {reason}")]
    BadKey { label: String, reason: &'static str },
    /// `generate` refused because an object with this label already exists.
    #[error("an object labelled {0:?} already exists in the token")]
    KeyExists(String),
    /// The token lacks a mechanism we need.
    #[error("the PKCS#11 token does not support {0}")]
    Unsupported(&'static str),
    /// Unwrapping failed: wrong key, wrong additional data, or tampered or
    /// truncated blob. Deliberately says no more than that.
    #[error("unwrap failed: wrong key, wrong context or tampered data")]
    Crypto,
    /// The operating system's random generator failed.
    #[error("the OS random generator failed")]
    Rng,
    /// Any other PKCS#11 failure: the function and the CKR_* name.
    #[error("PKCS#11 {op} failed: {code}")]
    Hsm { op: &'static str, code: String },
}

/// Maps a cryptoki error to [`Pkcs11Error::Hsm`] with a stable, secret-free
/// code (the `RvError` variant name, e.g. `DeviceError`).
fn hsm(op: &'static str, err: CkError) -> Pkcs11Error {
    let code = match err {
        CkError::Pkcs11(rv, _) => format!("{rv:?}"),
        CkError::LibraryLoading(_) => "library loading".to_owned(),
        CkError::NotSupported => "not supported".to_owned(),
        CkError::NullFunctionPointer => "function not provided by the module".to_owned(),
        CkError::MissingSymbol(s) => format!("missing symbol {s}"),
        CkError::PinNotSet => "PIN not set".to_owned(),
        CkError::InvalidValue => "invalid value".to_owned(),
        CkError::TryFromInt(_)
        | CkError::TryFromSlice(_)
        | CkError::ParseInt(_)
        | CkError::Utf8(_)
        | CkError::NulError(_) => "conversion error".to_owned(),
    };
    Pkcs11Error::Hsm { op, code }
}

// ---------------------------------------------------------------------------
// URI parsing (RFC 7512)
// ---------------------------------------------------------------------------

/// Where the PIN comes from.
enum PinSpec {
    Value(Zeroizing<String>),
    File(PathBuf),
}

/// A parsed `pkcs11:` URI. Only what we use; anything else is refused so that
/// an attribute the operator meant as a constraint is never silently ignored.
struct KekUri {
    module: PathBuf,
    token: String,
    object: String,
    pin: PinSpec,
}

/// Decodes RFC 3986 percent-encoding, refusing malformed `%` sequences.
/// The output never reallocates (decoded <= encoded), so a decoded PIN leaves
/// no stray copy behind once the caller zeroizes it.
fn pct_decode(s: &str) -> Result<Vec<u8>, Pkcs11Error> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex);
            let lo = bytes.get(i + 2).copied().and_then(hex);
            match (hi, lo) {
                (Some(h), Some(l)) => out.push(h << 4 | l),
                _ => {
                    out.zeroize();
                    return Err(Pkcs11Error::BadUri("malformed percent-encoding"));
                }
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn decode_utf8(s: &str) -> Result<String, Pkcs11Error> {
    String::from_utf8(pct_decode(s)?).map_err(|e| {
        e.into_bytes().zeroize();
        Pkcs11Error::BadUri("an attribute value is not UTF-8")
    })
}

/// Sets `slot` once; a repeated attribute is an error (RFC 7512 §2.3).
fn set_once<T>(slot: &mut Option<T>, value: T) -> Result<(), Pkcs11Error> {
    if slot.is_some() {
        return Err(Pkcs11Error::BadUri("duplicate attribute"));
    }
    *slot = Some(value);
    Ok(())
}

fn split_attr(attr: &str) -> Result<(&str, &str), Pkcs11Error> {
    attr.split_once('=')
        .ok_or(Pkcs11Error::BadUri("attribute without '='"))
}

impl KekUri {
    fn parse(uri: &str) -> Result<Self, Pkcs11Error> {
        const SCHEME: &str = "pkcs11:";
        let rest = match uri.get(..SCHEME.len()) {
            Some(s) if s.eq_ignore_ascii_case(SCHEME) => &uri[SCHEME.len()..],
            _ => return Err(Pkcs11Error::BadUri("not a pkcs11: URI")),
        };
        if rest.contains('#') {
            return Err(Pkcs11Error::BadUri("fragments are not allowed"));
        }
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };

        let (mut token, mut object) = (None, None);
        if !path.is_empty() {
            for attr in path.split(';') {
                let (name, value) = split_attr(attr)?;
                match name {
                    "token" => set_once(&mut token, decode_utf8(value)?)?,
                    "object" => set_once(&mut object, decode_utf8(value)?)?,
                    "type" => {
                        if decode_utf8(value)? != "secret-key" {
                            return Err(Pkcs11Error::BadUri("type must be secret-key"));
                        }
                    }
                    _ => return Err(Pkcs11Error::BadUri("unsupported path attribute")),
                }
            }
        }

        let (mut module, mut pin_value, mut pin_source) = (None, None, None);
        if let Some(query) = query {
            for attr in query.split('&') {
                let (name, value) = split_attr(attr)?;
                match name {
                    "module-path" => set_once(&mut module, decode_utf8(value)?)?,
                    "pin-value" => set_once(&mut pin_value, Zeroizing::new(decode_utf8(value)?))?,
                    "pin-source" => set_once(&mut pin_source, decode_utf8(value)?)?,
                    "module-name" => {
                        return Err(Pkcs11Error::BadUri(
                            "module-name is not supported, use module-path",
                        ))
                    }
                    _ => return Err(Pkcs11Error::BadUri("unsupported query attribute")),
                }
            }
        }

        let token = token.ok_or(Pkcs11Error::BadUri("token is required"))?;
        let object = object.ok_or(Pkcs11Error::BadUri("object is required"))?;
        let module = module.ok_or(Pkcs11Error::BadUri("module-path is required"))?;
        if token.is_empty() || object.is_empty() {
            return Err(Pkcs11Error::BadUri("token and object must not be empty"));
        }
        if token.len() > MAX_TOKEN_LABEL {
            return Err(Pkcs11Error::BadUri("token label is longer than 32 bytes"));
        }
        let module = PathBuf::from(module);
        // An absolute path only: a bare name would go through the dynamic
        // loader's search path, which is exactly the guessing we refuse.
        if !module.is_absolute() {
            return Err(Pkcs11Error::BadUri("module-path must be an absolute path"));
        }
        let pin = match (pin_value, pin_source) {
            (Some(v), None) => PinSpec::Value(v),
            (None, Some(src)) => PinSpec::File(pin_file_path(&src)?),
            (Some(_), Some(_)) => {
                return Err(Pkcs11Error::BadUri(
                    "give pin-value or pin-source, not both",
                ))
            }
            (None, None) => return Err(Pkcs11Error::BadUri("pin-value or pin-source is required")),
        };
        Ok(KekUri {
            module,
            token,
            object,
            pin,
        })
    }
}

/// `file:/abs/path` or `file:///abs/path` (empty authority) -> `/abs/path`.
fn pin_file_path(src: &str) -> Result<PathBuf, Pkcs11Error> {
    let path = src
        .strip_prefix("file:")
        .ok_or(Pkcs11Error::BadUri("pin-source must be a file: URI"))?;
    let path = match path.strip_prefix("//") {
        Some(p) if p.starts_with('/') => p,
        Some(_) => {
            return Err(Pkcs11Error::BadUri(
                "pin-source file: URI must not name a host",
            ))
        }
        None => path,
    };
    if !path.starts_with('/') {
        return Err(Pkcs11Error::BadUri(
            "pin-source must be an absolute file path",
        ));
    }
    Ok(PathBuf::from(path))
}

/// Reads a PIN file; trailing CR/LF are trimmed. The buffer is sized up front
/// so it never reallocates (a reallocation would leave an unzeroized copy).
fn read_pin_file(path: &Path) -> Result<Zeroizing<String>, Pkcs11Error> {
    let fail = |reason| Pkcs11Error::PinFile {
        path: path.display().to_string(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|_| fail("cannot open the file"))?;
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_PIN_FILE + 2));
    file.take(MAX_PIN_FILE as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|_| fail("cannot read the file"))?;
    if buf.len() > MAX_PIN_FILE {
        return Err(fail("the file is too long to hold a PIN"));
    }
    while matches!(buf.last(), Some(b'\n' | b'\r')) {
        buf.pop();
    }
    if buf.is_empty() {
        return Err(fail("the file is empty"));
    }
    let pin = std::str::from_utf8(&buf).map_err(|_| fail("the PIN is not UTF-8"))?;
    Ok(Zeroizing::new(pin.to_owned()))
}

// ---------------------------------------------------------------------------
// Process-wide module registry
// ---------------------------------------------------------------------------

/// One loaded and initialised PKCS#11 module.
struct Module {
    path: PathBuf,
    ctx: Pkcs11,
    /// slot id -> SHA-256 of the PIN that logged that token in. Locked across
    /// `C_Login` so that check-and-record is atomic.
    logins: Mutex<HashMap<u64, [u8; 32]>>,
}

/// Locks a mutex, recovering from poisoning: every critical section here
/// leaves its data consistent (a `HashMap` insert, or one complete PKCS#11
/// call), so a panic elsewhere must not turn into a permanent outage.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn modules() -> &'static Mutex<HashMap<PathBuf, Arc<Module>>> {
    static MODULES: OnceLock<Mutex<HashMap<PathBuf, Arc<Module>>>> = OnceLock::new();
    MODULES.get_or_init(Default::default)
}

/// Loads and initialises `path` once per process (keyed by its canonical
/// path, so a symlink and its target share one context) and returns it.
fn module(path: &Path) -> Result<Arc<Module>, Pkcs11Error> {
    let fail = |reason| Pkcs11Error::Module {
        path: path.display().to_string(),
        reason,
    };
    let canonical = std::fs::canonicalize(path).map_err(|_| fail("not found"))?;
    // Held across load + C_Initialize: initialisation is serialised.
    let mut map = lock(modules());
    if let Some(m) = map.get(&canonical) {
        return Ok(Arc::clone(m));
    }
    let ctx = Pkcs11::new(&canonical).map_err(|e| match e {
        CkError::MissingSymbol(_) | CkError::NullFunctionPointer => fail("is not a PKCS#11 module"),
        _ => fail("cannot be loaded"),
    })?;
    // OS_LOCKING_OK: we call from many threads (one session per Pkcs11Kek,
    // each behind its own mutex, but sessions run concurrently). SoftHSM,
    // for one, disables its internal locking when given no init args.
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        // CKR_CRYPTOKI_ALREADY_INITIALIZED: someone else in this process
        // (another library, or code calling cryptoki directly) initialised
        // this module. Adopt it: we cannot know its flags, and we never
        // finalise it.
        Ok(())
        | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, Function::Initialize)) => {}
        Err(e) => return Err(hsm("C_Initialize", e)),
    }
    let m = Arc::new(Module {
        path: canonical.clone(),
        ctx,
        logins: Mutex::default(),
    });
    map.insert(canonical, Arc::clone(&m));
    Ok(m)
}

fn pin_digest(slot: Slot, pin: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"stateseal pkcs11 login\0");
    h.update(slot.id().to_be_bytes());
    h.update(pin.as_bytes());
    h.finalize().into()
}

impl Module {
    /// The one initialised slot whose token label is `label`.
    fn find_slot(&self, label: &str) -> Result<Slot, Pkcs11Error> {
        let slots = self
            .ctx
            .get_slots_with_initialized_token()
            .map_err(|e| hsm("C_GetSlotList", e))?;
        let mut found = None;
        for slot in slots {
            let info = self
                .ctx
                .get_token_info(slot)
                .map_err(|e| hsm("C_GetTokenInfo", e))?;
            // cryptoki strips the blank padding; strip it from ours too.
            if info.label() == label.trim_end_matches(' ') {
                if found.is_some() {
                    return Err(Pkcs11Error::AmbiguousToken(label.to_owned()));
                }
                found = Some(slot);
            }
        }
        found.ok_or_else(|| Pkcs11Error::NoToken(label.to_owned()))
    }

    /// Opens an RW session on the URI's token and logs it in as User.
    fn login(&self, uri: &KekUri) -> Result<(Slot, Session), Pkcs11Error> {
        let pin = match &uri.pin {
            PinSpec::Value(v) => Zeroizing::new(v.as_str().to_owned()),
            PinSpec::File(p) => read_pin_file(p)?,
        };
        let slot = self.find_slot(&uri.token)?;
        let session = self
            .ctx
            .open_rw_session(slot)
            .map_err(|e| hsm("C_OpenSession", e))?;
        let digest = pin_digest(slot, &pin);
        // Box::from(&str) allocates exactly once; SecretBox zeroizes on drop.
        let auth = AuthPin::new(Box::from(pin.as_str()));
        let mut logins = lock(&self.logins);
        match session.login(UserType::User, Some(&auth)) {
            Ok(()) => {
                logins.insert(slot.id(), digest);
            }
            Err(CkError::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => {
                // The token did not look at this PIN. Compare it with the one
                // that logged the token in, if it was us. If it was not us
                // (another library in this process) there is nothing to check.
                if logins.get(&slot.id()).is_some_and(|d| *d != digest) {
                    return Err(Pkcs11Error::PinMismatch);
                }
            }
            Err(CkError::Pkcs11(RvError::PinIncorrect | RvError::PinLenRange, _)) => {
                return Err(Pkcs11Error::Login)
            }
            Err(CkError::Pkcs11(RvError::PinLocked, _)) => return Err(Pkcs11Error::PinLocked),
            Err(e) => return Err(hsm("C_Login", e)),
        }
        Ok((slot, session))
    }
}

// ---------------------------------------------------------------------------
// The KEK
// ---------------------------------------------------------------------------

/// An AES-256 key in a PKCS#11 token, used to wrap and unwrap root keys with
/// AES-256-GCM. `Send + Sync`: calls from several threads serialise on the
/// session (a PKCS#11 session runs one operation at a time anyway); open
/// several `Pkcs11Kek`s for parallelism.
pub struct Pkcs11Kek {
    // Field order matters for drop: the session closes before the module's
    // context reference is released (the registry keeps it alive anyway).
    session: Mutex<Session>,
    key: ObjectHandle,
    slot: Slot,
    token: String,
    object: String,
    module: Arc<Module>,
}

impl fmt::Debug for Pkcs11Kek {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pkcs11Kek")
            .field("module", &self.module.path)
            .field("token", &self.token)
            .field("slot", &self.slot.id())
            .field("object", &self.object)
            .finish_non_exhaustive()
    }
}

impl Pkcs11Kek {
    /// Parses an RFC 7512 URI and opens it:
    /// `pkcs11:token=LABEL;object=KEYLABEL?module-path=/path/lib.so&pin-value=1234`
    /// (or `pin-source=file:/path` instead of `pin-value`). Finds the token by
    /// label, opens an RW session, logs in as User, and finds exactly one AES
    /// secret key with that label; it must be 256 bits and allow
    /// encrypt/decrypt, and the token must support `CKM_AES_GCM`.
    ///
    /// # Errors
    /// [`Pkcs11Error::BadUri`], `PinFile`, `Module`, `NoToken`,
    /// `AmbiguousToken`, `Login`, `PinLocked`, `PinMismatch`, `NoKey`,
    /// `AmbiguousKey`, `BadKey`, `Unsupported`, or `Hsm` for anything else the
    /// module reports.
    pub fn open(uri: &str) -> Result<Self, Pkcs11Error> {
        let uri = KekUri::parse(uri)?;
        let module = module(&uri.module)?;
        let (slot, session) = module.login(&uri)?;

        // Asked for by name: listing every mechanism makes cryptoki log an
        // error line for each one it has no name for.
        match module.ctx.get_mechanism_info(slot, MechanismType::AES_GCM) {
            Ok(_) => {}
            Err(CkError::Pkcs11(RvError::MechanismInvalid, _)) => {
                return Err(Pkcs11Error::Unsupported("CKM_AES_GCM"))
            }
            Err(e) => return Err(hsm("C_GetMechanismInfo", e)),
        }

        let template = [
            Attribute::Class(ObjectClass::SECRET_KEY),
            Attribute::KeyType(KeyType::AES),
            Attribute::Label(uri.object.as_bytes().to_vec()),
        ];
        let found = session
            .find_objects(&template)
            .map_err(|e| hsm("C_FindObjects", e))?;
        let key = match found.as_slice() {
            [] => return Err(Pkcs11Error::NoKey(uri.object)),
            [key] => *key,
            _ => return Err(Pkcs11Error::AmbiguousKey(uri.object)),
        };
        check_key(&session, key, &uri.object)?;

        Ok(Pkcs11Kek {
            session: Mutex::new(session),
            key,
            slot,
            token: uri.token,
            object: uri.object,
            module,
        })
    }

    /// AES-256-GCM encrypts `plaintext` in the token with a fresh random
    /// 12-byte IV and a 16-byte tag, authenticating `aad`.
    /// Output: `iv || ciphertext || tag`.
    ///
    /// # Errors
    /// [`Pkcs11Error::Rng`] if the OS RNG fails; `Hsm` if the token fails.
    pub fn wrap(&self, aad: &[u8], plaintext: &[u8]) -> Result<Vec<u8>, Pkcs11Error> {
        let mut iv = [0u8; IV_LEN];
        OsRng
            .try_fill_bytes(&mut iv)
            .map_err(|_| Pkcs11Error::Rng)?;
        let sealed = {
            // GcmParams borrows `iv` mutably (a token may write back an IV it
            // chose); it is read below only after the mechanism is gone, so
            // the output carries whatever IV the token really used.
            let params = GcmParams::new(&mut iv, aad, Ulong::new(TAG_LEN as u64 * 8))
                .map_err(|e| hsm("C_EncryptInit", e))?;
            let mech = Mechanism::AesGcm(params);
            let session = lock(&self.session);
            session
                .encrypt(&mech, self.key, plaintext)
                .map_err(|e| hsm("C_Encrypt", e))?
        };
        // PKCS#11 GCM output is ciphertext || tag.
        if sealed.len() != plaintext.len() + TAG_LEN {
            return Err(Pkcs11Error::Hsm {
                op: "C_Encrypt",
                code: "unexpected output length".into(),
            });
        }
        let mut out = Vec::with_capacity(IV_LEN + sealed.len());
        out.extend_from_slice(&iv);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// Inverse of [`wrap`](Self::wrap). Fails with [`Pkcs11Error::Crypto`] on
    /// a wrong key, wrong `aad`, or any truncation or tampering.
    ///
    /// # Errors
    /// [`Pkcs11Error::Crypto`] as above; `Hsm` if the token fails otherwise.
    pub fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<Vec<u8>>, Pkcs11Error> {
        if blob.len() < IV_LEN + TAG_LEN {
            return Err(Pkcs11Error::Crypto);
        }
        let (iv_in, sealed) = blob.split_at(IV_LEN);
        let mut iv = [0u8; IV_LEN];
        iv.copy_from_slice(iv_in);
        let params = GcmParams::new(&mut iv, aad, Ulong::new(TAG_LEN as u64 * 8))
            .map_err(|e| hsm("C_DecryptInit", e))?;
        let mech = Mechanism::AesGcm(params);
        let session = lock(&self.session);
        match session.decrypt(&mech, self.key, sealed) {
            // Into Zeroizing at once; zeroize clears the Vec's whole capacity.
            Ok(pt) => {
                let pt = Zeroizing::new(pt);
                if pt.len() != sealed.len() - TAG_LEN {
                    return Err(Pkcs11Error::Hsm {
                        op: "C_Decrypt",
                        code: "unexpected output length".into(),
                    });
                }
                Ok(pt)
            }
            // A failed tag check. The spec's code for it is
            // CKR_ENCRYPTED_DATA_INVALID (..._LEN_RANGE for a bad length),
            // which newer SoftHSM returns; SoftHSM 2.6.1 (Debian 12) returns
            // CKR_GENERAL_ERROR from C_Decrypt when GCM's final tag check
            // fails. C_DecryptInit succeeded, so at this point a general
            // error is that check; at worst a real device fault is reported
            // as "cannot unwrap", which still refuses.
            Err(CkError::Pkcs11(
                RvError::EncryptedDataInvalid
                | RvError::EncryptedDataLenRange
                | RvError::GeneralError,
                Function::Decrypt,
            )) => Err(Pkcs11Error::Crypto),
            Err(e) => Err(hsm("C_Decrypt", e)),
        }
    }

    /// Creates a token-resident, private, sensitive, non-extractable AES-256
    /// key labelled with the URI's `object`, usable only for
    /// encrypt/decrypt, in the URI's token. Refuses if any object with that
    /// label already exists. (Check-then-create is not atomic across
    /// processes; run key generation from one place.)
    ///
    /// # Errors
    /// As [`open`](Self::open) up to the login, then
    /// [`Pkcs11Error::KeyExists`], or `Hsm` if generation fails.
    pub fn generate(uri: &str) -> Result<(), Pkcs11Error> {
        let uri = KekUri::parse(uri)?;
        let module = module(&uri.module)?;
        let (_slot, session) = module.login(&uri)?;

        let label = uri.object.as_bytes().to_vec();
        let existing = session
            .find_objects(&[Attribute::Label(label.clone())])
            .map_err(|e| hsm("C_FindObjects", e))?;
        if !existing.is_empty() {
            return Err(Pkcs11Error::KeyExists(uri.object));
        }
        let template = [
            Attribute::Class(ObjectClass::SECRET_KEY),
            Attribute::KeyType(KeyType::AES),
            Attribute::ValueLen(Ulong::new(KEY_LEN)),
            Attribute::Label(label),
            Attribute::Token(true),
            Attribute::Private(true),
            Attribute::Sensitive(true),
            Attribute::Extractable(false),
            Attribute::Encrypt(true),
            Attribute::Decrypt(true),
            Attribute::Wrap(false),
            Attribute::Unwrap(false),
            Attribute::Sign(false),
            Attribute::Verify(false),
            Attribute::Derive(false),
        ];
        session
            .generate_key(&Mechanism::AesKeyGen, &template)
            .map_err(|e| hsm("C_GenerateKey", e))?;
        Ok(())
    }
}

/// Checks that `key` is a 256-bit key that may encrypt and decrypt.
fn check_key(session: &Session, key: ObjectHandle, label: &str) -> Result<(), Pkcs11Error> {
    let bad = |reason| Pkcs11Error::BadKey {
        label: label.to_owned(),
        reason,
    };
    let attrs = session
        .get_attributes(
            key,
            &[
                AttributeType::ValueLen,
                AttributeType::Encrypt,
                AttributeType::Decrypt,
                AttributeType::NeverExtractable,
                AttributeType::AlwaysSensitive,
            ],
        )
        .map_err(|e| hsm("C_GetAttributeValue", e))?;
    let (mut len, mut enc, mut dec, mut never_out, mut always_secret) =
        (None, false, false, false, false);
    for a in attrs {
        match a {
            Attribute::ValueLen(l) => len = Some(*l),
            Attribute::Encrypt(b) => enc = b,
            Attribute::Decrypt(b) => dec = b,
            Attribute::NeverExtractable(b) => never_out = b,
            Attribute::AlwaysSensitive(b) => always_secret = b,
            _ => {}
        }
    }
    if len != Some(KEY_LEN) {
        return Err(bad("not a 256-bit key"));
    }
    if !(enc && dec) {
        return Err(bad("it does not allow both encrypt and decrypt"));
    }
    // An imported key, or one that was ever extractable, has existed
    // outside the token: whoever kept a copy unwraps offline.
    if !(never_out && always_secret) {
        return Err(bad(
            "it has existed outside the token (not CKA_NEVER_EXTRACTABLE and CKA_ALWAYS_SENSITIVE); \
             generate it in the token (keys kek-generate)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &str = "module-path=/usr/lib/softhsm/libsofthsm2.so";

    fn parse(uri: &str) -> Result<KekUri, Pkcs11Error> {
        KekUri::parse(uri)
    }

    fn bad(uri: &str) -> &'static str {
        match parse(uri) {
            Err(Pkcs11Error::BadUri(why)) => why,
            Err(e) => panic!("{uri}: expected BadUri, got {e}"),
            Ok(_) => panic!("{uri}: expected BadUri, got Ok"),
        }
    }

    #[test]
    fn parses_pin_value_and_percent_decodes() {
        let u = parse(&format!(
            "pkcs11:token=my%20token;object=kek%3b1?{M}&pin-value=12%2634"
        ))
        .unwrap();
        assert_eq!(u.token, "my token");
        assert_eq!(u.object, "kek;1");
        assert_eq!(u.module, PathBuf::from("/usr/lib/softhsm/libsofthsm2.so"));
        match u.pin {
            PinSpec::Value(p) => assert_eq!(p.as_str(), "12&34"),
            PinSpec::File(_) => panic!("expected pin-value"),
        }
    }

    #[test]
    fn parses_pin_source_and_type() {
        for src in ["file:/run/pin", "file:///run/pin", "file:%2Frun%2Fpin"] {
            let u = parse(&format!(
                "PKCS11:type=secret-key;token=t;object=o?pin-source={src}&{M}"
            ))
            .unwrap();
            match u.pin {
                PinSpec::File(p) => assert_eq!(p, PathBuf::from("/run/pin")),
                PinSpec::Value(_) => panic!("expected pin-source"),
            }
        }
    }

    #[test]
    fn rejects_bad_uris() {
        let cases = [
            "http://x",
            "pkcs1",
            "",
            "pkcs11:object=o?module-path=/m.so&pin-value=1",
            "pkcs11:token=t?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o?pin-value=1",
            "pkcs11:token=t;object=o?module-path=/m.so",
            "pkcs11:token=t;object=o?module-path=m.so&pin-value=1",
            "pkcs11:token=t;object=o?module-name=softhsm2&pin-value=1",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-value=1&pin-source=file:/p",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-source=/p",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-source=file:p",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-source=file://host/p",
            "pkcs11:token=t;token=u;object=o?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o;id=%01?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o;type=private?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-value=1&foo=bar",
            "pkcs11:token=t;object?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o%zz?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o%4?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=%ff?module-path=/m.so&pin-value=1",
            "pkcs11:token=;object=o?module-path=/m.so&pin-value=1",
            "pkcs11:token=t;object=o?module-path=/m.so&pin-value=1#frag",
            "pkcs11:token=0123456789abcdef0123456789abcdefX;object=o?module-path=/m.so&pin-value=1",
        ];
        for uri in cases {
            let why = bad(uri);
            let msg = Pkcs11Error::BadUri(why).to_string();
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn bad_uri_never_echoes_the_pin() {
        let uri = "pkcs11:token=t;object=o;id=1?module-path=/m.so&pin-value=SECRETPIN";
        let e = parse(uri).err().unwrap();
        assert!(!e.to_string().contains("SECRETPIN"));
        assert!(!format!("{e:?}").contains("SECRETPIN"));
    }

    #[test]
    fn messages_are_one_line_even_with_hostile_labels() {
        let e = Pkcs11Error::NoKey("a\nb".into());
        assert_eq!(
            e.to_string(),
            r#"no AES secret key labelled "a\nb" in the token"#
        );
    }
}
