//! `--h2load-bodies`: the gRPC-framed requests `benches/h2load.sh` sends.

use stateseal::proto::request_state_client::RequestStateClient;
use stateseal::proto::{OpenRequest, SealRequest};
use tonic_health::pb::HealthCheckRequest;

use super::clients::{binding, connect, json_binding, ClientIo};

/// A gRPC message as it goes on the wire: uncompressed flag, big-endian
/// length, the protobuf bytes.
fn grpc_frame(m: &impl prost::Message) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0u8];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// The request bodies `benches/h2load.sh` sends: the same requests as the
/// noop, seal and open scenarios, plus a seal with `params_json`.
pub async fn write_h2load_bodies(dir: &std::path::Path, addr: &str, state_size: usize) {
    std::fs::create_dir_all(dir).expect("create the bodies directory");
    let state = vec![0x5a; state_size];
    let seal = SealRequest {
        binding: Some(binding()),
        state: state.clone(),
        ..Default::default()
    };
    let seal_json = SealRequest {
        binding: Some(json_binding()),
        state,
        ..Default::default()
    };
    let token = RequestStateClient::new(connect(addr, "stateseal", ClientIo::Vectored).await)
        .seal(seal.clone())
        .await
        .expect("seal the token the open body carries")
        .into_inner()
        .request_state;
    let open = OpenRequest {
        request_state: token,
        binding: Some(binding()),
        ..Default::default()
    };
    let noop = HealthCheckRequest {
        service: String::new(),
    };
    for (name, bytes) in [
        ("noop", grpc_frame(&noop)),
        ("seal", grpc_frame(&seal)),
        ("seal_json", grpc_frame(&seal_json)),
        ("open", grpc_frame(&open)),
    ] {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).expect("write a body");
    }
    eprintln!("wrote h2load bodies to {}", dir.display());
}
