"""The stateseal MCP binding profile (the service README, "MCP binding
profile"; docs/token-format.md): the binding-v2 params digest and the
subject, computed exactly as the service and the TypeScript package compute
them. Tested against the service's tests/data/binding-vectors.json.

Numbers bind exactly: a number whose value is exactly that of the double
ECMAScript prints for it is written in RFC 8785 (ECMAScript) form; any other
is written `[-]DIGITS E EXPONENT`. Python ints are exact; `decimal.Decimal`
values (from `json.loads(..., parse_float=Decimal)`) are exact; floats are
doubles already.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

__all__ = ["BINDING_VERSION", "BindingError", "canonical", "params_digest", "params_digest_of_text", "subject_for"]

#: The binding version this module computes.
BINDING_VERSION = 2
#: Deepest nesting of arrays and objects accepted (as the service).
MAX_DEPTH = 128

_LONE_SURROGATE = re.compile(r"[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]")


class BindingError(ValueError):
    """Params the service would refuse as MALFORMED (not bindable)."""

    def __init__(self) -> None:
        super().__init__("params cannot be bound (not one well-formed JSON object of the required shape)")


def _decimal_parts(d: Decimal) -> tuple[bool, str, int]:
    """Sign, significant digits without leading or trailing zeros ('' for
    zero) and exponent of a finite decimal."""
    sign, digits, exp = d.as_tuple()
    assert isinstance(exp, int)
    s = "".join(map(str, digits)).lstrip("0")
    if not s:
        return (False, "", 0)
    stripped = s.rstrip("0")
    return (bool(sign), stripped, exp + len(s) - len(stripped))


def _es_number(x: float) -> str:
    """ECMAScript Number::toString of a finite double (RFC 8785 form)."""
    if x == 0:
        return "0"
    neg, digits, exp = _decimal_parts(Decimal(repr(abs(x))))
    k = len(digits)
    n = exp + k  # value = 0.DIGITS × 10^n
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        out = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + ("+" if e > 0 else "-") + str(abs(e))
    return ("-" if x < 0 else "") + out


#: Every int of at most this magnitude is a double exactly, and ECMAScript
#: prints it as its decimal digits (it is below 1e21).
_EXACT_INT = 2**53


def _number(v: int | float | Decimal) -> str:
    if type(v) is int and -_EXACT_INT <= v <= _EXACT_INT:
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise BindingError()
        return _es_number(v)
    d = Decimal(v)
    if not d.is_finite():
        raise BindingError()
    exact = _decimal_parts(d)
    try:
        f = float(d)
    except OverflowError:
        f = math.inf
    if math.isfinite(f):
        # The value as ECMAScript prints the nearest double: equal to the
        # number's own value → RFC 8785 form (as the service decides).
        es = _es_number(f)
        if _decimal_parts(Decimal(es)) == exact:
            return es
    neg, digits, exp = exact
    return f"{'-' if neg else ''}{digits}E{exp}"


def _lone_surrogate(s: str) -> bool:
    # An ASCII string (most are) holds none: no regex scan.
    return not s.isascii() and _LONE_SURROGATE.search(s) is not None


def _string(s: str) -> str:
    if _lone_surrogate(s):
        raise BindingError()
    # What json.dumps(s, ensure_ascii=False) writes for a str, without
    # building an encoder each time.
    return encode_basestring(s)


def _sort_key(kv: tuple[str, str]) -> str:
    return kv[0]


def _utf16_sort_key(kv: tuple[str, str]) -> bytes:
    return kv[0].encode("utf-16-be", "surrogatepass")


def canonical(v: Any, depth: int = 0) -> str:
    """RFC 8785 with exact numbers, of a JSON value as Python holds it."""
    # The common types first, by exact type (no ABC checks); any other,
    # subclasses included, takes the general path below.
    t = type(v)
    if t is str:
        return _string(v)
    if t is dict:
        return _members(v, depth)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float, Decimal)):
        return _number(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, Mapping):
        return _members(v, depth)
    if isinstance(v, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise BindingError()
        return "[" + ",".join(canonical(x, depth + 1) for x in v) + "]"
    raise BindingError()


def _members(v: Mapping[Any, Any], depth: int) -> str:
    if depth >= MAX_DEPTH:
        raise BindingError()
    items = []
    ascii_keys = True
    for k in v:
        if not isinstance(k, str):
            raise BindingError()
        ascii_keys = ascii_keys and k.isascii()
        items.append((k, canonical(v[k], depth + 1)))
    # RFC 8785 orders members by UTF-16 code units; for ASCII keys that is
    # the strings' own order.
    items.sort(key=_sort_key if ascii_keys else _utf16_sort_key)
    return "{" + ",".join(f"{_string(k)}:{c}" for k, c in items) + "}"


def params_digest(method: str, params: Mapping[str, Any]) -> bytes:
    """The binding-v2 digest (32 bytes) of request params as Python holds
    them: `{"arguments", "name"}` for tools/call and prompts/get (absent or
    null arguments = {}), `{"uri"}` for resources/read; nothing else."""
    if not isinstance(params, Mapping):
        raise BindingError()
    if method == "resources/read":
        uri = params.get("uri")
        if not isinstance(uri, str):
            raise BindingError()
        bound = '{"uri":' + _string(uri) + "}"
    elif method in ("tools/call", "prompts/get"):
        name = params.get("name")
        args = params.get("arguments")
        if args is None:
            args = {}
        if not isinstance(name, str) or not isinstance(args, Mapping):
            raise BindingError()
        bound = '{"arguments":' + canonical(args, 1) + ',"name":' + _string(name) + "}"
    else:
        raise BindingError()
    # The service also checks every other member (it canonicalizes the whole
    # text); values a handler sees went through JSON already.
    for k, v in params.items():
        if k not in ("name", "arguments", "uri"):
            _check(v, 1)
    return hashlib.sha256(bound.encode("utf-8")).digest()


def _check(v: Any, depth: int) -> None:
    """Raises BindingError where `canonical` would, without writing the
    canonical form."""
    if isinstance(v, str):
        if _lone_surrogate(v):
            raise BindingError()
        return
    if type(v) is int and -_EXACT_INT <= v <= _EXACT_INT:
        return
    if v is None or v is True or v is False:
        return
    if isinstance(v, (int, float, Decimal)):
        _number(v)
        return
    if isinstance(v, Mapping):
        if depth >= MAX_DEPTH:
            raise BindingError()
        for k in v:
            if not isinstance(k, str) or _lone_surrogate(k):
                raise BindingError()
            _check(v[k], depth + 1)
        return
    if isinstance(v, (list, tuple)):
        if depth >= MAX_DEPTH:
            raise BindingError()
        for x in v:
            _check(x, depth + 1)
        return
    raise BindingError()


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise BindingError()
        out[k] = v
    return out


def _no_constant(_: str) -> Any:
    raise BindingError()


def params_digest_of_text(method: str, params_json: str) -> bytes:
    """The digest of params given as JSON text, numbers exact (decimals
    parsed as `Decimal`), duplicate keys refused."""
    try:
        params = json.loads(
            params_json, parse_float=Decimal, object_pairs_hook=_unique, parse_constant=_no_constant
        )
    except (ValueError, RecursionError):  # BindingError is a ValueError
        raise BindingError() from None
    return params_digest(method, params)


@functools.lru_cache(maxsize=1024)
def subject_for(audience: str, principal: str | None) -> str:
    """`"mcp:" + hex(SHA-256(JSON [audience, principal]))`, as the TypeScript
    package computes it (remembered for the last 1,024 principals)."""
    ident = json.dumps([audience, principal], separators=(",", ":"), ensure_ascii=False)
    return "mcp:" + hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()
