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

/// Opens the KEK `uri` names.
pub fn open(uri: &str) -> Result<Arc<dyn Kek>, KeysetError> {
    if let Some(path) = uri.strip_prefix("file:") {
        Ok(Arc::new(FileKek::open(Path::new(path))?))
    } else if uri.starts_with("pkcs11:") || uri.starts_with("PKCS11:") {
        let k = pkcs11::Pkcs11Kek::open(uri).map_err(|e| kek_error(&e))?;
        Ok(Arc::new(Hsm(k)))
    } else {
        Err(KeysetError::Refused(
            "--keyset-kek must be file:PATH or a pkcs11: URI".to_owned(),
        ))
    }
}

/// Creates a new KEK where `uri` says: a new file (refused if it exists),
/// or a new key in the token (refused if its label is taken).
pub fn generate(uri: &str) -> Result<(), KeysetError> {
    if let Some(path) = uri.strip_prefix("file:") {
        FileKek::generate(Path::new(path))
    } else if uri.starts_with("pkcs11:") || uri.starts_with("PKCS11:") {
        pkcs11::Pkcs11Kek::generate(uri).map_err(|e| kek_error(&e))
    } else {
        Err(KeysetError::Refused(
            "a KEK is file:PATH or a pkcs11: URI".to_owned(),
        ))
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
        let trimmed = text.trim_ascii();
        let mut raw = Zeroizing::new([0u8; 32]);
        match URL_SAFE_NO_PAD.decode_slice(trimmed, &mut raw[..]) {
            Ok(32) => {}
            // Fixed message: never echo the file.
            _ => return Err(fail(
                "not 32 bytes of base64url (make one with `stateseal keys kek-generate file:PATH`)",
            )),
        }
        let hk = Hkdf::<Sha256>::new(Some(FILE_KEK_SALT), &raw[..]);
        let mut key = Zeroizing::new([0u8; 32]);
        hk.expand(FILE_KEK_INFO, &mut key[..])
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

/// A KEK in a PKCS#11 token.
#[derive(Debug)]
struct Hsm(pkcs11::Pkcs11Kek);

impl Kek for Hsm {
    fn kind(&self) -> &'static str {
        "pkcs11"
    }

    fn wrap(&self, aad: &[u8], key: &[u8; 32]) -> Result<Vec<u8>, KeysetError> {
        self.0.wrap(aad, key).map_err(|e| kek_error(&e))
    }

    fn unwrap(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<[u8; 32]>, KeysetError> {
        let pt = self.0.unwrap(aad, blob).map_err(|e| kek_error(&e))?;
        to_key(&pt).ok_or_else(|| KeysetError::Refused("a wrapped key is not 32 bytes".to_owned()))
    }
}
