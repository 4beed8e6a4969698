//! The keyset parser: never a panic, errors never echo input, and what
//! parses builds a keyring and survives a write/parse round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stateseal::internals::keyring::{Keyring, KeysetFile};

fuzz_target!(|data: &[u8]| {
    match KeysetFile::parse(data) {
        Ok(file) => {
            Keyring::from_file(&file).expect("a valid keyset builds a keyring");
            let json = file.to_json().expect("serializes");
            let back = KeysetFile::parse(&json).expect("round trip");
            assert_eq!(back.keys.len(), file.keys.len());
        }
        Err(e) => {
            let msg = e.to_string();
            if data.len() >= 12 {
                if let Ok(s) = std::str::from_utf8(data) {
                    // No 12-byte window of the input that is not also in the
                    // fixed text can show up in the message.
                    for w in s.as_bytes().windows(12) {
                        if let Ok(w) = std::str::from_utf8(w) {
                            if w.chars().all(|c| c.is_ascii_alphanumeric()) && msg.contains(w) {
                                assert!(
                                    "stateseal-keyset/v1 invalid JSON unexpected member, type or value at line column key id is reserved"
                                        .contains(w),
                                    "echoed input {w:?} in {msg:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
});
