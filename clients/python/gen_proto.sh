#!/usr/bin/env bash
# Regenerates the committed gRPC stubs from ../../proto (grpcio-tools).
# tests/test_stubs.py fails when the committed stubs are stale.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/src/stateseal_mcp/_proto}
python -m grpc_tools.protoc -I "$here/../../proto" \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  "$here/../../proto/stateseal/v1/stateseal.proto"
# Generated imports are absolute ("from stateseal.v1 import …"); make them package-relative.
sed -i 's/^from stateseal\.v1 import stateseal_pb2/from . import stateseal_pb2/' "$out/stateseal/v1/stateseal_pb2_grpc.py"
