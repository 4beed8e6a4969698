//! The manifest of input requests and the answer filter, on hostile text
//! (`questions \0 answers`). Properties: no panic; a manifest that builds
//! survives its compact encoding unchanged; the filter returns one JSON
//! object whose keys were all asked, and accounts for every answer key
//! (kept, dropped, or kept with its content removed).
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use serde_json::value::RawValue;
use stateseal::internals::manifest::{Answers, CredentialPolicy, DropReason, Manifest};

/// One JSON object, member texts kept raw: answers may hold numbers no
/// double can (kept verbatim by design), which a `Value` cannot.
type Members = BTreeMap<String, Box<RawValue>>;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (questions, answers) = text.split_once('\0').unwrap_or((text, "{}"));
    let Ok((manifest, _)) = Manifest::build(questions, CredentialPolicy::Warn) else {
        return;
    };
    if let Ok(bytes) = manifest.encode() {
        assert_eq!(Manifest::decode(&bytes).expect("decodes"), manifest);
    }
    let asked: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(questions).expect("built from an object");
    let Ok(parsed) = Answers::parse(answers) else {
        return;
    };
    let sent: Members = serde_json::from_str(answers).expect("checked to be an object");
    let f = manifest.filter(parsed);
    let kept: Members = serde_json::from_str(&f.json).expect("the filter writes one JSON object");
    for k in kept.keys() {
        assert!(asked.contains_key(k), "kept an unasked key");
        assert!(sent.contains_key(k), "kept a key nobody sent");
    }
    for (k, why) in &f.dropped {
        assert!(sent.contains_key(k));
        let stripped = matches!(why, DropReason::UrlContent | DropReason::UnexpectedContent);
        assert_eq!(kept.contains_key(k), stripped, "drop and keep disagree");
        if stripped {
            let answer: Members =
                serde_json::from_str(kept[k].get()).expect("a stripped answer is an object");
            assert!(!answer.contains_key("content"), "content left in");
        }
    }
    for k in sent.keys() {
        assert!(
            kept.contains_key(k) || f.dropped.iter().any(|(d, _)| d == k),
            "an answer vanished without a reason"
        );
    }
});
