//! Compiles `proto/` with protox (pure Rust: no system `protoc` needed) and
//! writes the encoded descriptor set for gRPC server reflection.
use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // .cargo/config.toml selects poly1305's portable backend (about 2x faster
    // for token-sized messages); a RUSTFLAGS variable silently replaces it.
    if std::env::var_os("CARGO_CFG_POLY1305_FORCE_SOFT").is_none() {
        println!(
            "cargo:warning=built without --cfg poly1305_force_soft (RUSTFLAGS replaced \
             .cargo/config.toml?): sealing and opening small tokens is about 2x slower"
        );
    }
    // The same list sets --cfg tokio_unstable, which lets the server's
    // runtime switch tokio's LIFO slot off (src/server.rs, `runtime`).
    if std::env::var_os("CARGO_CFG_TOKIO_UNSTABLE").is_none() {
        println!(
            "cargo:warning=built without --cfg tokio_unstable (RUSTFLAGS replaced \
             .cargo/config.toml?): the server keeps tokio's LIFO slot and writes every \
             answer on its own, at 10-35% more CPU per call"
        );
    }
    let proto = "proto/stateseal/v1/stateseal.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("stateseal_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Messages that carry state, tokens, subjects or params get a
        // redacting Debug written by hand (src/lib.rs).
        .skip_debug([
            "stateseal.v1.Binding",
            "stateseal.v1.SealRequest",
            "stateseal.v1.SealResponse",
            "stateseal.v1.OpenRequest",
            "stateseal.v1.OpenResponse",
            "stateseal.v1.CommitRequest",
            "stateseal.v1.RenewRequest",
            "stateseal.v1.ReleaseRequest",
        ])
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
