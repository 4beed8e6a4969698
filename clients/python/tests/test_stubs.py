"""The committed gRPC stubs match what grpcio-tools generates from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run(
        ["bash", str(HERE / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
    )
    committed = HERE / "src" / "stateseal_mcp" / "_proto" / "stateseal" / "v1"
    for name in ("stateseal_pb2.py", "stateseal_pb2.pyi", "stateseal_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "stateseal" / "v1" / name, committed / name, shallow=False), (
            f"{name} is stale: run clients/python/gen_proto.sh"
        )
