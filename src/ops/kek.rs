//! Key-encryption keys: what `--keyset-kek URI` names, to keep the
//! keyset's root keys off disk in the clear.
//!
//! - `file:PATH`: 32 random bytes (base64url) in a file of their own, kept
//!   apart from the keyset (another Secret, another mount). Root keys are
//!   wrapped with XChaCha20-Poly1305 under an HKDF subkey of them.
//! - `pkcs11:…` (RFC 7512): an AES-256 key inside an HSM; root keys are
//!   wrapped with AES-256-GCM computed in the token ([`pkcs11`]).
//!
//! Each wrapped blob is bound to its key id (the additional data). Threat
//! models: docs/security.md, "Root keys at rest".

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::aead::{Aead, Payload};
use chacha20poly1305::{KeyInit, XChaCha20Poly1305, XNonce};
use hkdf::Hkdf;
use rand::RngCore;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::domain::keyring::{Kek, KeysetError};

pub mod pkcs11;

/// HKDF labels of the file KEK. Changing one is a format change.
const FILE_KEK_SALT: &[u8] = b"stateseal/v1 file kek salt";
const FILE_KEK_INFO: &[u8] = b"stateseal/v1 file kek xchacha20poly1305";
const NONCE: usize = 24;

/// What a KEK URI names.
enum Scheme<'a> {
    File(&'a Path),
    Pkcs11,
}

fn scheme(uri: &str) -> Result<Scheme<'_>, KeysetError> {
    let has = |p: &str| {
        uri.get(..p.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(p))
    };
    if has("file://") {
        // Only an empty host: file:///path.
        match uri.get(7..) {
            Some(rest) if rest.starts_with('/') => Ok(Scheme::File(Path::new(rest))),
            _ => Err(KeysetError::Refused(
                "a file: KEK names no host: file:PATH or file:///PATH".to_owned(),
            )),
        }
    } else if has("file:") {
        Ok(Scheme::File(Path::new(&uri[5..])))
    } else if has("pkcs11:") {
        Ok(Scheme::Pkcs11)
    } else {
        Err(KeysetError::Refused(
            "a key-encryption key is file:PATH or a pkcs11: URI".to_owned(),
        ))
    }
}

/// Opens the KEK `uri` names.
pub fn open(uri: &str) -> Result<Arc<dyn Kek>, KeysetError> {
    match scheme(uri)? {
        Scheme::File(path) => Ok(Arc::new(FileKek::open(path)?)),
        Scheme::Pkcs11 => Ok(Arc::new(Hsm::open(uri)?)),
    }
}

/// Creates a new KEK where `uri` says: a new file (refused if it exists),
/// or a new key in the token (refused if its label is taken).
pub fn generate(uri: &str) -> Result<(), KeysetError> {
    match scheme(uri)? {
        Scheme::File(path) => FileKek::generate(path),
        Scheme::Pkcs11 => pkcs11::Pkcs11Kek::generate(uri).map_err(|e| kek_error(&e)),
    }
}

/// The HSM's own message: fixed text, labels and paths, never a PIN.
fn kek_error(e: &pkcs11::Pkcs11Error) -> KeysetError {
    KeysetError::Refused(format!("key-encryption key: {e}"))
}

/// A KEK in a file.
pub struct FileKek {
    aead: XChaCha20Poly1305,
    path: PathBuf,
}

impl std::fmt::Debug for FileKek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileKek")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl FileKek {
    pub fn open(path: &Path) -> Result<Self, KeysetError> {
        let fail = |why: &str| {
            KeysetError::Refused(format!("key-encryption key file {}: {why}", path.display()))
        };
        let text = Zeroizing::new(std::fs::read(path).map_err(|e| fail(&e.to_string()))?);
        #[cfg(unix)]
        if let Ok(m) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            if m.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "the key-encryption key file is readable by group or others; make it 0400 (a Secret's defaultMode)");
            }
        }
        let trimmed = text.trim_ascii();
        let mut raw = Zeroizing::new([0u8; 32]);
        match URL_SAFE_NO_PAD.decode_slice(trimmed, &mut raw[..]) {
            Ok(32) => {}
            // Fixed message: never echo the file.
            _ => return Err(fail(
                "not 32 bytes of base64url (make one with `stateseal keys kek-generate file:PATH`)",
            )),
        }
        let hk = crate::domain::keyring::Wiped(Hkdf::<Sha256>::new(Some(FILE_KEK_SALT), &raw[..]));
        let mut key = Zeroizing::new([0u8; 32]);
        hk.0.expand(FILE_KEK_INFO, &mut key[..])
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        Ok(FileKek {
            aead: XChaCha20Poly1305::new((&*key).into()),
            path: path.to_owned(),
        })
    }

    /// Writes 32 random bytes, base64url, to a new file of mode 0600.
    pub fn generate(path: &Path) -> Result<(), KeysetError> {
        let mut raw = Zeroizing::new([0u8; 32]);
        rand::rngs::OsRng.fill_bytes(&mut raw[..]);
        let text = Zeroizing::new(URL_SAFE_NO_PAD.encode(&raw[..]) + "\n");
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts.open(path).map_err(|e| {
            KeysetError::Refused(format!("key-encryption key file {}: {e}", path.display()))
        })?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        Ok(())
    }
}

impl Kek for FileKek {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn wrap(&self, aad: &[u8], key: &[u8; 32]) -> Result<Vec<u8>, KeysetError> {
        let mut nonce = [0u8; NONCE];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let ct = self
            .aead
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: key, aad })
            .map_err(|_| KeysetError::Invalid("key wrapping failed"))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&ct);
        Ok(out)
    }

    fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<[u8; 32]>, KeysetError> {
        let wrong = || {
            KeysetError::Refused(
                "wrong key-encryption key, or the wrapped key was changed".to_owned(),
            )
        };
        if blob.len() != NONCE + 32 + 16 {
            return Err(wrong());
        }
        let (nonce, ct) = blob.split_at(NONCE);
        let pt = Zeroizing::new(
            self.aead
                .decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
                .map_err(|_| wrong())?,
        );
        to_key(&pt).ok_or_else(wrong)
    }
}

fn to_key(pt: &[u8]) -> Option<Zeroizing<[u8; 32]>> {
    let mut out = Zeroizing::new([0u8; 32]);
    if pt.len() != 32 {
        return None;
    }
    out.copy_from_slice(pt);
    Some(out)
}

/// A KEK in a PKCS#11 token. A call that fails for another reason than
/// the data (a session or handle the token no longer knows: it was
/// restarted or re-inserted) opens the token again and is tried once more,
/// so that later reloads work without a restart.
struct Hsm {
    uri: Zeroizing<String>,
    kek: std::sync::Mutex<Arc<pkcs11::Pkcs11Kek>>,
}

impl std::fmt::Debug for Hsm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hsm").finish_non_exhaustive()
    }
}

impl Hsm {
    fn open(uri: &str) -> Result<Self, KeysetError> {
        let k = pkcs11::Pkcs11Kek::open(uri).map_err(|e| kek_error(&e))?;
        Ok(Hsm {
            uri: Zeroizing::new(uri.to_owned()),
            kek: std::sync::Mutex::new(Arc::new(k)),
        })
    }

    fn call<T>(
        &self,
        f: impl Fn(&pkcs11::Pkcs11Kek) -> Result<T, pkcs11::Pkcs11Error>,
    ) -> Result<T, KeysetError> {
        let current = self.kek.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match f(&current) {
            Err(pkcs11::Pkcs11Error::Hsm { .. }) => {
                tracing::warn!("the PKCS#11 token failed a call; opening it again");
                let fresh =
                    Arc::new(pkcs11::Pkcs11Kek::open(&self.uri).map_err(|e| kek_error(&e))?);
                *self.kek.lock().unwrap_or_else(|p| p.into_inner()) = fresh.clone();
                f(&fresh).map_err(|e| kek_error(&e))
            }
            other => other.map_err(|e| kek_error(&e)),
        }
    }
}

impl Kek for Hsm {
    fn kind(&self) -> &'static str {
        "pkcs11"
    }

    fn wrap(&self, aad: &[u8], key: &[u8; 32]) -> Result<Vec<u8>, KeysetError> {
        self.call(|k| k.wrap(aad, key))
    }

    fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<[u8; 32]>, KeysetError> {
        let pt = self.call(|k| k.unwrap(aad, blob))?;
        to_key(&pt).ok_or_else(|| KeysetError::Refused("a wrapped key is not 32 bytes".to_owned()))
    }
}
