//! The params canonicalizer. Differential oracle: whatever we accept, an
//! independent RFC 8785 implementation (serde_json_canonicalizer over
//! serde_json) writes identically. Properties: both modes are idempotent,
//! the exact mode differs from RFC 8785 only in numbers, and the binding
//! profile's member extraction (`object_members`) accepts exactly the
//! objects the full canonicalizer accepts, each member as it appears there.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stateseal::internals::canon::{canonicalize, object_members, NumberMode};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let ours = canonicalize(text, NumberMode::Rfc8785);
    if let Ok(ours) = &ours {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
            let theirs = serde_json_canonicalizer::to_vec(&v).expect("their canonical form");
            assert_eq!(ours, &theirs, "differs from the reference implementation");
        }
        let again = canonicalize(
            std::str::from_utf8(ours).expect("utf-8"),
            NumberMode::Rfc8785,
        )
        .expect("canonical form re-parses");
        assert_eq!(&again, ours, "not idempotent");
    }
    let exact = canonicalize(text, NumberMode::Exact);
    if let Ok(exact) = &exact {
        let again = canonicalize(
            std::str::from_utf8(exact).expect("utf-8"),
            NumberMode::Exact,
        )
        .expect("exact form re-parses");
        assert_eq!(&again, exact, "exact mode not idempotent");
        if let Ok(ours) = &ours {
            if !exact.contains(&b'E') {
                assert_eq!(exact, ours, "exact mode changed a non-number");
            }
        }
    }
    let names = ["name", "arguments", "uri"];
    match object_members(text, NumberMode::Exact, &names) {
        Ok(found) => {
            let full = exact.expect("members extracted where the whole was refused");
            for (name, value) in names.iter().zip(found) {
                let Some(value) = value else { continue };
                let mut member = format!("\"{name}\":").into_bytes();
                member.extend_from_slice(&value);
                assert!(
                    full.windows(member.len()).any(|w| w == member.as_slice()),
                    "a member's canonical form is not the one in the whole"
                );
            }
        }
        Err(_) => assert!(
            exact.is_err() || exact.is_ok_and(|e| e.first() != Some(&b'{')),
            "an object the canonicalizer accepts was refused by object_members"
        ),
    }
});
