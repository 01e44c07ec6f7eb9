"""Reading request bodies: each known field checked, with an API-shaped 400 naming it.

Absent fields and JSON null read as "not given"; unknown fields are ignored.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Sequence

from aiohttp import web

from coli.server.errors import ApiError, invalid
from coli.server.limits import off_loop
from coli.server.state import SERVER

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
          dict: "an object"}


MAX_DEPTH = 100  # JSON nesting accepted (a chat with tools needs a handful; JSON schemas a few dozen)
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object (413 past the size limit, 400 when it is not JSON, is
    nested deeper than MAX_DEPTH, or holds a lone UTF-16 surrogate, naming the field).
    Parsing and checking run off the event loop."""
    timeout = request.app[SERVER].config.request_timeout if SERVER in request.app else None
    try:
        async with asyncio.timeout(timeout):  # a body sent a byte at a time must not hold a connection
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} seconds (--request-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is larger than the limit of {request.client_max_size} bytes "
                            "(--max-body)", code="request_too_large") from None
    if not raw:
        raise invalid("the request body is empty: expected a JSON object")
    if len(raw) < 1 << 16:  # small bodies: a thread hop would cost more than the work
        return parse_body(raw)
    return await off_loop(parse_body, raw)


def parse_body(raw: bytes) -> dict:
    """``read_json``'s checks on the bytes of a body."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_kind(body)}")
    check_text(body)
    return body


def check_text(body: dict) -> None:
    """400 for nesting past MAX_DEPTH or a lone surrogate in any string (a value or a key),
    naming where it is, e.g. ``messages[0].content``. Iterative: no recursion limit."""
    stack = [(body, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise invalid(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", _where(path))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                raise _surrogate(path + (key,))
            if isinstance(value, str):
                if not value.isascii() and _SURROGATE.search(value):
                    raise _surrogate(path + (key,))
            elif isinstance(value, (dict, list)):
                stack.append((value, path + (key,), depth + 1))


def _surrogate(path: tuple) -> ApiError:
    where = _where(path)
    return invalid(f"{where}: the text holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a "
                   "character; send valid Unicode", where)


def _where(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, str) and not p.isascii():
            p = p.encode("utf-8", "backslashreplace").decode()  # a key's own surrogate, written as an escape
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else "an infinite number"  # JSON has neither; Python's reader allows them
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
