//! The domain core: what a token is and what opening one means. No tonic,
//! no clap, no process-wide state; time, keys and the ledger are handed in.
//!
//! Lowest first: [`error`] (rejection reasons), [`canon`] (RFC 8785),
//! [`codec`] (bounds-checked reading of the binary formats) and
//! [`credential`] (the policy on forms that ask for a credential);
//! [`binding`] and [`manifest`]; [`keyring`] (keyset file, rotation, HKDF
//! subkeys); [`token`] (the wire format and the reservation); [`sealer`]
//! (limits, expiry, single use over a [`Ledger`](crate::ledger::Ledger)).

pub mod binding;
pub mod canon;
pub mod codec;
pub mod credential;
pub mod error;
pub mod keyring;
pub mod manifest;
pub mod sealer;
pub mod token;
