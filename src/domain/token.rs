//! The token wire format (versions 1 and 2).
//!
//! ```text
//! token  = base64url-nopad( header[9] | nonce[24] | ciphertext[len(plain)] | tag[16] )
//! header = format[1] | key_id[4, big-endian] | expires_at[4, big-endian Unix seconds]
//! format = version << 4 | flags
//!                            (high nibble: 1 = plain is the state; 2 = plain
//!                             carries a sealed manifest of the questions;
//!                             bit 0: single-use;
//!                             bits 1-3: params binding version - 1, so 0 = v1, 1 = v2)
//! plain  = state                                            (version 1)
//!        | len(manifest)[2, big-endian] | manifest | state  (version 2)
//! AAD    = header | lp(tenant) | lp(subject) | lp(method) | params_digest[32]
//!          where lp(x) = len(x)[4, big-endian] | x
//! cipher = XChaCha20-Poly1305 under HKDF-SHA256(root[key_id], tenant)
//! ```
//!
//! 49 bytes of overhead over the state. The header is authenticated (it is in
//! the AAD), so the key is found by id, expiry can drive ledger garbage
//! collection, and the single-use flag cannot be stripped or set by anyone
//! without the key. The binding travels in the AAD only and costs no bytes.
//! The ledger id of a token is HMAC-SHA256 over its nonce under a per-tenant
//! key, so the ledger never stores the token.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::aead::AeadInPlace;
use chacha20poly1305::XNonce;
use hmac::Mac;
use zeroize::Zeroizing;

use crate::domain::binding::{Binding, BindingVersion};
use crate::domain::codec::{Codec, Reader};
use crate::domain::error::Reject;
use crate::domain::keyring::{KeyId, TenantKeys, Wiped};

pub const VERSION: u8 = 1;
/// The format of a token whose plaintext starts with a manifest.
pub const VERSION_MANIFEST: u8 = 2;
pub const HEADER_LEN: usize = 9;
pub const NONCE_LEN: usize = 24;
pub const TAG_LEN: usize = 16;
/// Bytes a token adds to the state before base64.
pub const OVERHEAD: usize = HEADER_LEN + NONCE_LEN + TAG_LEN;
/// The most a manifest adds (its length prefix and itself).
pub const MANIFEST_ROOM: usize = 2 + crate::domain::manifest::MAX_MANIFEST;

const FLAG_SINGLE_USE: u8 = 0x01;
const BINDING_SHIFT: u8 = 1;
const BINDING_MASK: u8 = 0x0e;

/// Length of the base64url (no padding) form of `n` bytes.
pub const fn encoded_len(n: usize) -> usize {
    (n * 4).div_ceil(3)
}

/// The authenticated header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub key_id: KeyId,
    pub expires_at: u32,
    pub single_use: bool,
    /// The params binding the token was sealed under.
    pub binding: BindingVersion,
    /// The plaintext starts with a manifest of the questions (format 2).
    pub manifest: bool,
}

impl Header {
    pub fn to_bytes(self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        let binding = (self.binding.number() as u8 - 1) << BINDING_SHIFT;
        let version = if self.manifest {
            VERSION_MANIFEST
        } else {
            VERSION
        };
        h[0] = (version << 4) | binding | if self.single_use { FLAG_SINGLE_USE } else { 0 };
        h[1..5].copy_from_slice(&self.key_id.0.to_be_bytes());
        h[5..9].copy_from_slice(&self.expires_at.to_be_bytes());
        h
    }
}

impl Codec for Header {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bytes());
    }

    fn read(r: &mut Reader<'_>) -> Option<Self> {
        let first = r.u8()?;
        let manifest = match first >> 4 {
            VERSION => false,
            VERSION_MANIFEST => true,
            _ => return None,
        };
        let binding = match (first & BINDING_MASK) >> BINDING_SHIFT {
            0 => BindingVersion::V1,
            1 => BindingVersion::V2,
            _ => return None,
        };
        Some(Header {
            key_id: KeyId(r.u32()?),
            expires_at: r.u32()?,
            single_use: first & FLAG_SINGLE_USE != 0,
            binding,
            manifest,
        })
    }
}

fn aad(header: &[u8; HEADER_LEN], b: &Binding) -> Vec<u8> {
    let fields: [&[u8]; 3] = [
        b.tenant.as_str().as_bytes(),
        b.subject.as_bytes(),
        b.method.as_str().as_bytes(),
    ];
    let len = HEADER_LEN + fields.iter().map(|f| 4 + f.len()).sum::<usize>() + 32;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(header);
    for f in fields {
        // Fields are bounded far below 4 GiB by the service limits.
        out.extend_from_slice(&(f.len() as u32).to_be_bytes());
        out.extend_from_slice(f);
    }
    out.extend_from_slice(&b.params.0);
    out
}

/// Where a seal's nonce comes from.
#[derive(Clone, Copy, Debug)]
pub enum Nonce<'a> {
    /// A fresh random 192-bit nonce: what the service always uses.
    Fresh,
    /// The caller's nonce: for frozen test vectors only.
    Fixed(&'a [u8; NONCE_LEN]),
}

/// Seals `state`, and `manifest` when given (format 2; at most
/// [`MAX_MANIFEST`](crate::domain::manifest::MAX_MANIFEST) bytes). The one
/// way to seal a token.
pub fn seal(
    keys: &TenantKeys,
    header: Header,
    binding: &Binding,
    manifest: Option<&[u8]>,
    state: &[u8],
    nonce: Nonce<'_>,
) -> Result<String, Reject> {
    let fresh;
    let nonce = match nonce {
        Nonce::Fixed(n) => n,
        Nonce::Fresh => {
            let mut n = [0u8; NONCE_LEN];
            rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut n);
            fresh = n;
            &fresh
        }
    };
    // The header names the binding version the digest was computed under,
    // and the format says whether a manifest leads the plaintext.
    let header = Header {
        binding: binding.version,
        manifest: manifest.is_some(),
        ..header
    };
    let h = header.to_bytes();
    let extra = manifest.map_or(0, |m| 2 + m.len());
    let mut buf = Zeroizing::new(Vec::with_capacity(OVERHEAD + extra + state.len()));
    header.encode(&mut buf);
    buf.extend_from_slice(nonce);
    if let Some(m) = manifest {
        let len = u16::try_from(m.len())
            .ok()
            .filter(|&n| usize::from(n) <= crate::domain::manifest::MAX_MANIFEST)
            .ok_or(Reject::TooLarge)?;
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(m);
    }
    buf.extend_from_slice(state);
    let tag = keys
        .aead
        .encrypt_in_place_detached(
            XNonce::from_slice(nonce),
            &aad(&h, binding),
            &mut buf[HEADER_LEN + NONCE_LEN..],
        )
        // The only failure is a plaintext beyond XChaCha20's 256 GiB limit.
        .map_err(|_| Reject::TooLarge)?;
    buf.extend_from_slice(&tag);
    Ok(URL_SAFE_NO_PAD.encode(&*buf))
}

/// A token as received: parsed and bounds-checked, but NOT authenticated.
/// Anything read from it is untrusted until [`UntrustedToken::open`] succeeds.
/// Its buffer is decrypted in place and becomes the state: zeroized on drop.
pub struct UntrustedToken {
    bytes: Zeroizing<Vec<u8>>,
    raw_header: [u8; HEADER_LEN],
    header: Header,
}

impl std::fmt::Debug for UntrustedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the token.
        f.debug_struct("UntrustedToken")
            .field("len", &self.bytes.len())
            .finish_non_exhaustive()
    }
}

/// A token that opened: authentic, for this binding. The state is zeroized
/// on drop; `Debug` shows neither it nor the ledger id.
pub struct Opened {
    pub header: Header,
    pub state: Zeroizing<Vec<u8>>,
    /// The sealed manifest (format 2 tokens).
    pub manifest: Option<Zeroizing<Vec<u8>>>,
    /// The token's nonce, from which its ledger id is derived on demand
    /// (a reusable token never needs one).
    nonce: [u8; NONCE_LEN],
}

impl Opened {
    /// The id under which a single-use token is recorded in the ledger:
    /// HMAC-SHA256 of its nonce under the tenant's ledger-id key (`keys`
    /// must be the ones it opened under).
    pub fn ledger_id(&self, keys: &TenantKeys) -> [u8; 32] {
        ledger_id(keys, &self.nonce)
    }
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("header", &self.header)
            .field("state_len", &self.state.len())
            .finish_non_exhaustive()
    }
}

impl UntrustedToken {
    /// Decodes and checks lengths and the header. `max_state` bounds the size.
    pub fn parse(token: &str, max_state: usize) -> Result<Self, Reject> {
        if token.len() > encoded_len(OVERHEAD + max_state + MANIFEST_ROOM) {
            return Err(Reject::TooLarge);
        }
        // Strict: rejects padding, other alphabets and non-zero trailing bits,
        // so each token has exactly one string form.
        let bytes = Zeroizing::new(
            URL_SAFE_NO_PAD
                .decode(token)
                .map_err(|_| Reject::Malformed)?,
        );
        if bytes.len() < OVERHEAD {
            return Err(Reject::Malformed);
        }
        // The bytes as received are kept: they are what the tag covers.
        let h: [u8; HEADER_LEN] = Reader::new(&bytes).array().ok_or(Reject::Malformed)?;
        let header = Header::read(&mut Reader::new(&h)).ok_or(Reject::Malformed)?;
        // Only a token with a manifest may use the manifest's room.
        if !header.manifest && bytes.len() > OVERHEAD + max_state {
            return Err(Reject::TooLarge);
        }
        Ok(UntrustedToken {
            bytes,
            raw_header: h,
            header,
        })
    }

    /// The claimed header; untrusted (used only to choose the key).
    pub fn header(&self) -> Header {
        self.header
    }

    /// Authenticates and decrypts. Any change to any byte, or any other
    /// binding, gives `Rejected`.
    pub fn open(mut self, keys: &TenantKeys, binding: &Binding) -> Result<Opened, Reject> {
        if self.header.binding != binding.version {
            return Err(Reject::Rejected);
        }
        // The header bytes as received: they are what the tag covers.
        let aad = aad(&self.raw_header, binding);
        // parse() checked the length: header, nonce and tag are there.
        let tag_at = self.bytes.len().saturating_sub(TAG_LEN);
        let tag: [u8; TAG_LEN] = Reader::new(&self.bytes[tag_at..])
            .array()
            .ok_or(Reject::Malformed)?;
        let mut r = Reader::new(&self.bytes);
        let nonce: [u8; NONCE_LEN] = r
            .take(HEADER_LEN)
            .and_then(|_| r.array())
            .ok_or(Reject::Malformed)?;
        self.bytes.truncate(tag_at);
        keys.aead
            .decrypt_in_place_detached(
                XNonce::from_slice(&nonce),
                &aad,
                &mut self.bytes[HEADER_LEN + NONCE_LEN..],
                (&tag).into(),
            )
            .map_err(|_| Reject::Rejected)?;
        // The plaintext moves to the front of the same allocation, which
        // becomes the state: no unwiped copy is left behind.
        self.bytes.drain(..HEADER_LEN + NONCE_LEN);
        let manifest = if self.header.manifest {
            let mut r = Reader::new(&self.bytes);
            let m = r
                .u16()
                .and_then(|len| r.take(usize::from(len)))
                .map(|m| Zeroizing::new(m.to_vec()))
                .ok_or(Reject::Malformed)?;
            let used = r.used();
            self.bytes.drain(..used);
            Some(m)
        } else {
            None
        };
        let state = Zeroizing::new(std::mem::take(&mut *self.bytes));
        Ok(Opened {
            header: self.header,
            state,
            manifest,
            nonce,
        })
    }
}

/// HMAC-SHA256 of the nonce under the tenant's ledger-id key. The keyed
/// state is cloned into a [`Wiped`] and finalized in place, so no copy of
/// it outlives this call unwiped.
pub fn ledger_id(keys: &TenantKeys, nonce: &[u8; NONCE_LEN]) -> [u8; 32] {
    let mut mac = Wiped(keys.ledger_mac.0.clone());
    mac.0.update(nonce);
    mac.0.finalize_reset().into_bytes().into()
}

#[cfg(test)]
mod tests;

/// The keyed hash of a caller's attempt id: HMAC-SHA256 under the tenant's
/// ledger-id key, over a label and the id, first 16 bytes. The ledger keeps
/// this, never the attempt id.
pub fn attempt_hash(keys: &TenantKeys, attempt_id: &str) -> [u8; 16] {
    let mut mac = Wiped(keys.ledger_mac.0.clone());
    mac.0.update(b"stateseal/v1 attempt id\0");
    mac.0.update(attempt_id.as_bytes());
    let full: [u8; 32] = mac.0.finalize_reset().into_bytes().into();
    let mut out = [0u8; 16];
    out.copy_from_slice(&full[..16]);
    out
}

// === reservations ===

/// First byte of a reservation string (never a token's: those start 0x1_).
const RESERVATION_FORMAT: u8 = 0x52;
/// AAD label of reservations.
const RESERVATION_LABEL: &[u8] = b"stateseal/v1 reservation";
const RESERVATION_PLAIN: usize = 8 + 32 + 16 + 8;
const RESERVATION_LEN: usize = 1 + 4 + NONCE_LEN + RESERVATION_PLAIN + TAG_LEN;
/// The length of every reservation string.
pub const RESERVATION_CHARS: usize = encoded_len(RESERVATION_LEN);

/// What a reservation string carries, encrypted and authenticated under the
/// tenant's key: the ledger key of the token, the reservation id and the
/// lease's end. Opaque to the caller, unforgeable, bound to the tenant.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ReservationClaims {
    pub expires_at: u64,
    pub ledger_id: [u8; 32],
    pub rid: [u8; 16],
    pub lease_until: u64,
}

impl std::fmt::Debug for ReservationClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReservationClaims")
            .field("lease_until", &self.lease_until)
            .finish_non_exhaustive()
    }
}

impl Codec for ReservationClaims {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.expires_at.to_be_bytes());
        out.extend_from_slice(&self.ledger_id);
        out.extend_from_slice(&self.rid);
        out.extend_from_slice(&self.lease_until.to_be_bytes());
    }

    fn read(r: &mut Reader<'_>) -> Option<Self> {
        Some(ReservationClaims {
            expires_at: r.u64()?,
            ledger_id: r.array()?,
            rid: r.array()?,
            lease_until: r.u64()?,
        })
    }
}

fn reservation_aad(key_id: KeyId, tenant: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(5 + RESERVATION_LABEL.len() + 4 + tenant.len());
    aad.push(RESERVATION_FORMAT);
    aad.extend_from_slice(&key_id.0.to_be_bytes());
    aad.extend_from_slice(RESERVATION_LABEL);
    aad.extend_from_slice(&(tenant.len() as u32).to_be_bytes());
    aad.extend_from_slice(tenant.as_bytes());
    aad
}

/// Seals reservation claims under the tenant's subkeys of `key_id`.
pub fn seal_reservation(
    keys: &TenantKeys,
    key_id: KeyId,
    tenant: &str,
    c: &ReservationClaims,
) -> Result<String, Reject> {
    let mut nonce = [0u8; NONCE_LEN];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut nonce);
    let mut buf = Vec::with_capacity(RESERVATION_LEN);
    buf.push(RESERVATION_FORMAT);
    buf.extend_from_slice(&key_id.0.to_be_bytes());
    buf.extend_from_slice(&nonce);
    let body = buf.len();
    c.encode(&mut buf);
    let tag = keys
        .aead
        .encrypt_in_place_detached(
            XNonce::from_slice(&nonce),
            &reservation_aad(key_id, tenant),
            &mut buf[body..],
        )
        .map_err(|_| Reject::TooLarge)?;
    buf.extend_from_slice(&tag);
    Ok(URL_SAFE_NO_PAD.encode(&buf))
}

/// A reservation string decoded once: its key id is readable (to pick the
/// key), the rest is sealed until [`SealedReservation::open`].
pub struct SealedReservation {
    key_id: KeyId,
    /// The decoded bytes (room for base64's conservative length estimate;
    /// exactly `RESERVATION_LEN` are used).
    raw: Zeroizing<[u8; RESERVATION_LEN + 3]>,
}

impl SealedReservation {
    /// Decodes the string; `MALFORMED` unless it has the reservation
    /// format's exact length and version byte.
    pub fn parse(s: &str) -> Result<Self, Reject> {
        if s.len() != RESERVATION_CHARS {
            return Err(Reject::Malformed);
        }
        let mut raw = Zeroizing::new([0u8; RESERVATION_LEN + 3]);
        match URL_SAFE_NO_PAD.decode_slice(s, &mut raw[..]) {
            Ok(RESERVATION_LEN) => {}
            _ => return Err(Reject::Malformed),
        }
        let mut r = Reader::new(&raw[..]);
        let key_id = match (r.u8(), r.u32()) {
            (Some(RESERVATION_FORMAT), Some(id)) => KeyId(id),
            _ => return Err(Reject::Malformed),
        };
        Ok(SealedReservation { key_id, raw })
    }

    /// The key that sealed it.
    pub fn key_id(&self) -> KeyId {
        self.key_id
    }

    /// Authenticates and decrypts it for `tenant` (`REJECTED` if another
    /// tenant's, changed, or sealed under another key).
    pub fn open(mut self, keys: &TenantKeys, tenant: &str) -> Result<ReservationClaims, Reject> {
        let raw = &mut self.raw[..RESERVATION_LEN];
        let tag_at = RESERVATION_LEN - TAG_LEN;
        let mut r = Reader::new(raw);
        let (nonce, tag): ([u8; NONCE_LEN], [u8; TAG_LEN]) = match (
            r.take(5).and_then(|_| r.array()),
            r.take(RESERVATION_PLAIN).and_then(|_| r.array()),
        ) {
            (Some(n), Some(t)) => (n, t),
            _ => return Err(Reject::Malformed),
        };
        keys.aead
            .decrypt_in_place_detached(
                XNonce::from_slice(&nonce),
                &reservation_aad(self.key_id, tenant),
                &mut raw[5 + NONCE_LEN..tag_at],
                (&tag).into(),
            )
            .map_err(|_| Reject::Rejected)?;
        ReservationClaims::read(&mut Reader::new(&raw[5 + NONCE_LEN..tag_at]))
            .ok_or(Reject::Malformed)
    }
}
