"""What every handler reads: the loaded model, its runner and the settings (``Server``)."""
from __future__ import annotations

import json
import time
from functools import lru_cache
from pathlib import Path

from aiohttp import web

from coli.chat_format import detect
from coli.server.config import ServerConfig
from coli.server.errors import ApiError, invalid
from coli.server.telemetry import Telemetry

SERVER = web.AppKey("server", object)


def server_of(request: web.Request) -> "Server":
    return request.app[SERVER]


class Server:
    """A loaded model, its runner and the settings: what every handler reads."""

    def __init__(self, model, runner, config: ServerConfig | None = None):
        self.model, self.runner = model, runner
        self.config = config or ServerConfig()
        self.model_id = self.config.model_id or Path(str(model.path)).name
        self.chat_format = detect(model.config.model_type, model.tokenizer.chat_template)
        self.telemetry = Telemetry(self)
        self.created = int(time.time())
        self.draining = False  # shutting down: requests cut short say so
        self._byte_level = _is_byte_level(model.tokenizer)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)

    def check_model(self, body: dict) -> str:
        """The request's ``model``: absent (this one) or this server's id; else 404."""
        name = body.get("model")
        if name is None:
            return self.model_id
        if not isinstance(name, str):
            raise invalid("model: expected a string", "model")
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} is not served here; this server serves {self.model_id!r} "
                                "(GET /v1/models)", code="model_not_found", param="model")
        return name

    def _token_text(self, token: int) -> str:
        return self.model.tokenizer.decode([token], skip_special_tokens=False)

    def _token_bytes(self, token: int) -> tuple[int, ...]:
        """The token's own bytes (byte-level vocabularies: also a part of a UTF-8 character)."""
        if self._byte_level:
            piece = self.model.tokenizer.id_to_token(token) or ""
            if all(c in _UNICODE_TO_BYTE for c in piece):
                return tuple(_UNICODE_TO_BYTE[c] for c in piece)
        return tuple(self._token_text(token).encode())


# -- token bytes ------------------------------------------------------------------------------


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = _byte_table()


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "_backend", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    try:
        return '"ByteLevel"' in json.dumps(json.loads(decoder.__getstate__()))
    except Exception:
        return False
