"""Binding v2 computed in Python against the service's vectors file, and the
subject as the TypeScript package computes it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stateseal_mcp.binding import BindingError, canonical, params_digest, params_digest_of_text, subject_for

VECTORS = json.loads((Path(__file__).parents[3] / "tests" / "data" / "binding-vectors.json").read_text())


def test_every_vector():
    assert len(VECTORS["vectors"]) > 20
    for v in VECTORS["vectors"]:
        assert params_digest_of_text(v["method"], v["params"]).hex() == v["digest_hex"], v["note"]


def test_every_refused_vector():
    assert VECTORS["refused"]
    for v in VECTORS["refused"]:
        with pytest.raises(BindingError):
            params_digest_of_text(v["method"], v["params"])


def test_parsed_values_bind_like_their_text():
    # What a handler holds (ints exact, floats doubles) binds like the text.
    for text in ('{"name":"t","arguments":{"n":9007199254740993}}', '{"name":"t","arguments":{"x":0.1,"y":1e21}}'):
        assert params_digest("tools/call", json.loads(text)) == params_digest_of_text("tools/call", text)


def test_numbers():
    assert canonical(9007199254740993) == "9007199254740993E0"
    assert canonical(9007199254740992) == "9007199254740992"
    assert canonical(10**21) == "1e+21"
    assert canonical(1e16) == "10000000000000000"
    assert canonical(0.000001) == "0.000001"
    assert canonical(1e-7) == "1e-7"
    assert canonical(-0.0) == "0"
    for bad in (math.nan, math.inf):
        with pytest.raises(BindingError):
            canonical(bad)
    with pytest.raises(BindingError):
        canonical("\ud800")


def test_subject_matches_the_typescript_package():
    # The same cases as clients/typescript/test/binding.test.ts.
    assert subject_for("transfer-service", None) == "mcp:b38d9b19dbcdf908b7b429ef9990b3ec09537f9b4cbb3b6c9b49862cd943c347"
    assert subject_for("transfer-service", '["c",null,"ü"]') == "mcp:10e5d7a890f146ff0ba8f1e469b5b1764095bdfe24853648c8983994d651e02b"
    assert subject_for("dienst-ü", '["c","i","s"]') == "mcp:90f8c4fccfea5bcaea6e89c7ba9d05c672ff3ffe232d5a77e3c0b8c4aa37c1ad"


RFC8785 = Path(__file__).parents[3] / "tests" / "data" / "rfc8785"


@pytest.mark.parametrize("name", ["arrays", "french", "structures", "unicode", "values", "weird"])
def test_rfc8785_reference_vectors(name):
    # Values as a handler holds them (floats are doubles): byte for byte the
    # reference output, member order by UTF-16 code units included.
    held = json.loads((RFC8785 / "input" / f"{name}.json").read_text(encoding="utf-8"))
    assert canonical(held).encode("utf-8") == (RFC8785 / "output" / f"{name}.json").read_bytes()
