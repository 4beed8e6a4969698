"""The transport as a bare grpcio client sees it: the server's idle closes
are graceful (HTTP/2 GOAWAY), so a call that crosses one is never lost."""

from __future__ import annotations

import random
import threading

import grpc

from conftest import start_stateseal
from stateseal_mcp._proto.stateseal.v1 import stateseal_pb2, stateseal_pb2_grpc


def test_calls_that_cross_an_idle_close_are_never_lost(tmp_path):
    # Ten grpcio channels, each its own connection (a local subchannel pool:
    # by default they would share one, kept busy by all), 100 Seals each,
    # each 80-120 ms after the last, against a 100 ms idle timeout: about
    # half race a close. No retry of our own: grpcio's transparent retry
    # resends what a GOAWAY says was not processed.
    proc, addr = start_stateseal(tmp_path, "--idle-timeout-ms", "100")
    failed: list[str] = []
    rng = random.Random(59)
    gaps = [[rng.uniform(0.08, 0.12) for _ in range(100)] for _ in range(10)]

    def caller(mine: list[float]) -> None:
        with grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            stub = stateseal_pb2_grpc.RequestStateStub(ch)
            req = stateseal_pb2.SealRequest(
                binding=stateseal_pb2.Binding(subject="s", method="tools/call", params_digest=bytes(32)),
                state=b"x",
            )
            for gap in mine:
                threading.Event().wait(gap)
                try:
                    stub.Seal(req, timeout=10)
                except grpc.RpcError as e:
                    failed.append(f"{e.code()}: {e.details()}")

    try:
        threads = [threading.Thread(target=caller, args=(g,)) for g in gaps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert not failed, f"{len(failed)} of 1000 calls failed: {failed[:5]}"
