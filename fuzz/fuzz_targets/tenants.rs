//! The tenants parser: never a panic; what parses maps every identity to
//! exactly one tenant.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stateseal::internals::auth::Tenants;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = Tenants::parse(data) {
        for e in &t.tenants {
            if let Some(u) = &e.uri {
                let found = t.by_certificate(std::slice::from_ref(u), &[]);
                assert_eq!(found.as_ref().map(|f| f.as_str()), Some(e.name.as_str()));
            }
            if let Some(d) = &e.dns {
                let found = t.by_certificate(&[], std::slice::from_ref(d));
                assert_eq!(found.as_ref().map(|f| f.as_str()), Some(e.name.as_str()));
            }
        }
        let _ = t.by_bearer(data);
    }
});
