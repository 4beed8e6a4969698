"""The boundary's answers to failed stateseal calls against the table both
packages share, clients/boundary.json: every stateseal reason and every gRPC
status without one, under every setting of `on_replay` and `reask`."""

import json
import pathlib

import grpc
import pytest

from stateseal_mcp.client import StatesealError
from stateseal_mcp.middleware import Refusal, call_refusal, open_refusal, renewal_lost, resend, retry_commit

ROOT = pathlib.Path(__file__).resolve().parents[3]
TABLE = json.loads((ROOT / "clients" / "boundary.json").read_text())
REASONS = json.loads((ROOT / "proto" / "stateseal" / "v1" / "reasons.json").read_text())
CASES = TABLE["cases"]


def _error(e: dict) -> StatesealError:
    return StatesealError(e["reason"], getattr(grpc.StatusCode, e["code"]), "", from_stateseal=e["from_stateseal"])


def _as_row(r: Refusal) -> dict:
    row = {"kind": r.kind}
    if not r.reask:
        row.update(code=r.code, message=r.message, data=dict(r.data) if r.data is not None else None)
    row["log"] = {"warning": "warn"}.get(r.log, r.log)
    return row


def test_the_table_covers_every_reason_and_every_status():
    seen = {(c["error"]["reason"], c["error"]["from_stateseal"]) for c in CASES}
    assert {(r["reason"], True) for r in REASONS["reasons"]} <= seen
    assert {(c.name, False) for c in grpc.StatusCode if c.name != "OK"} <= seen
    for r in REASONS["reasons"]:
        (case,) = [c for c in CASES if c["error"]["reason"] == r["reason"] and c["error"]["from_stateseal"]]
        assert case["error"]["code"] == r["code"], r
    for c in CASES:
        configs = {(o["config"]["on_replay"], o["config"]["reask"]) for o in c["open"]}
        assert configs == {("error", True), ("error", False), ("reask", True), ("reask", False)}, c["error"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f'{c["error"]["reason"]}-{"stateseal" if c["error"]["from_stateseal"] else "transport"}')
def test_each_failure_is_answered_as_the_table_says(case):
    e = _error(case["error"])
    for o in case["open"]:
        got = _as_row(open_refusal(e, on_replay=o["config"]["on_replay"], reask=o["config"]["reask"]))
        assert got == o["then"], o["config"]
    assert _as_row(call_refusal(e, sealing=True)) == case["seal"]
    assert resend(e) == case["resend_open_or_release"]
    assert retry_commit(e) == case["retry_commit"]
    assert renewal_lost(e) == case["renewal_lost"]
