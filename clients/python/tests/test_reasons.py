"""The package's reason tables against the one source,
proto/stateseal/v1/reasons.json: every reason the service gives is either a
client fault or transient here, exactly as that file says."""

import json
import pathlib

import grpc

from stateseal_mcp.client import StatesealError

SOURCE = pathlib.Path(__file__).resolve().parents[3] / "proto" / "stateseal" / "v1" / "reasons.json"


def test_reasons_match_the_one_source():
    src = json.loads(SOURCE.read_text())
    reasons = src["reasons"]
    assert reasons, "no reasons in the source"
    for r in reasons:
        e = StatesealError(r["reason"], getattr(grpc.StatusCode, r["code"]), r["message"])
        assert e.client_fault == (r["side"] == "client"), r
        assert e.retryable == (r["side"] == "transient"), r
    every = {r["reason"] for r in reasons}
    assert StatesealError.CLIENT_REASONS | StatesealError.TRANSIENT_REASONS == every
    assert StatesealError.TRANSPORT_CLIENT_CODES == set(src["transport"]["client"])
    assert StatesealError.TRANSPORT_TRANSIENT_CODES == set(src["transport"]["transient"])
    for code in grpc.StatusCode:
        e = StatesealError(code.name, code, "", from_stateseal=False)
        assert e.client_fault == (code.name in src["transport"]["client"]), code
        assert e.retryable == (code.name in src["transport"]["transient"]), code
