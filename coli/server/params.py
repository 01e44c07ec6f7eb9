"""Reading request bodies: each known field checked, with an API-shaped 400 naming it.

Absent fields and JSON null read as "not given"; unknown fields are ignored.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence

from aiohttp import web

from coli.server.errors import ApiError, invalid

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
          dict: "an object"}


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object (413 past the size limit, 400 when it is not JSON)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than the limit of {request.client_max_size} bytes "
                            "(--max-body)", code="request_too_large") from None
    if not raw:
        raise invalid("the request body is empty: expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return _KINDS.get(type(v), type(v).__name__)


def _is(v, kind) -> bool:
    if kind is int:  # JSON has one number type: 2.0 is an integer too (as JSON Schema says)
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, kind)


def get(body: dict, name: str, kind, default=None, *, param: str | None = None):
    """``body[name]`` if given, checked to be of ``kind`` (a type or a tuple of types)."""
    v = body.get(name)
    if v is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not any(_is(v, k) for k in kinds):
        want = " or ".join(_KINDS[k] for k in kinds)
        raise invalid(f"{param or name}: expected {want}, got {_kind(v)}", param or name)
    if kinds == (float,):
        return float(v)
    if int in kinds and isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def number(body: dict, name: str, lo: float | None = None, hi: float | None = None, default=None):
    v = get(body, name, float, default)
    if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
        raise invalid(f"{name} must be between {lo:g} and {hi:g}, got {v:g}" if hi is not None
                      else f"{name} must be at least {lo:g}, got {v:g}", name)
    return v


def integer(body: dict, name: str, lo: int | None = None, hi: int | None = None, default=None):
    v = get(body, name, int, default)
    if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
        raise invalid(f"{name} must be an integer from {lo} to {hi}, got {v}" if hi is not None
                      else f"{name} must be an integer of at least {lo}, got {v}", name)
    return v


def choice(body: dict, name: str, options: Sequence[str], default=None):
    v = get(body, name, str, default)
    if v is not None and v not in options:
        raise invalid(f"{name} must be one of {', '.join(map(repr, options))}, got {v!r}", name)
    return v


def stop_list(body: dict, name: str, limit: int | None) -> list[str]:
    """Stop sequences: a string or an array of non-empty strings."""
    v = body.get(name)
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid(f"{name}: expected a string or an array of strings", name)
    if any(s == "" for s in items):
        raise invalid(f"{name}: stop sequences must not be empty", name)
    if limit is not None and len(items) > limit:
        raise invalid(f"{name}: at most {limit} stop sequences, got {len(items)}", name)
    return list(dict.fromkeys(items))
