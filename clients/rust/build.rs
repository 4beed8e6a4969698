//! Compiles the service's proto (`../../proto`) with protox (pure Rust: no
//! system `protoc`) into a tonic client, and turns the one reason source
//! (`proto/stateseal/v1/reasons.json`) into the sides the boundary reacts
//! to, so no reason is spelled twice.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = root.join("stateseal/v1/stateseal.proto");
    let reasons = root.join("stateseal/v1/reasons.json");
    println!("cargo:rerun-if-changed={}", proto.display());
    println!("cargo:rerun-if-changed={}", reasons.display());
    let fds = protox::compile([&proto], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;

    let table: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&reasons)?)?;
    let list = |side: &str| -> Vec<String> {
        table["reasons"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["side"] == side)
            .filter_map(|r| r["reason"].as_str().map(str::to_owned))
            .collect()
    };
    let codes = |side: &str| -> Vec<String> {
        table["transport"][side]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.as_str().map(str::to_owned))
            .collect()
    };
    let mut out = String::new();
    for (name, items) in [
        ("CLIENT_REASONS", list("client")),
        ("TRANSIENT_REASONS", list("transient")),
        ("TRANSPORT_CLIENT_CODES", codes("client")),
        ("TRANSPORT_TRANSIENT_CODES", codes("transient")),
    ] {
        assert!(!items.is_empty(), "reasons.json: {name} is empty");
        writeln!(out, "pub(crate) const {name}: &[&str] = &{items:?};")?;
    }
    let domain = table["domain"].as_str().ok_or("reasons.json: no domain")?;
    writeln!(out, "pub(crate) const DOMAIN: &str = {domain:?};")?;
    let dest = PathBuf::from(std::env::var("OUT_DIR")?).join("reasons.rs");
    std::fs::write(dest, out)?;
    Ok(())
}
