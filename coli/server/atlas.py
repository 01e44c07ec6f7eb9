"""GET /experts/atlas: the served model's expert atlas (experts.json, see docs/ATLAS.md).

The document is made by ``coli atlas`` and found beside the model or in coli's cache
(``coli.atlas.find_atlas``), keyed by the model's fingerprint. It is read again when the
file changes, so an atlas made while the server runs shows up without a restart. With
none, the answer is a 404 ``atlas_not_found`` whose message says how to make one.
"""
from __future__ import annotations

import asyncio
import os
import threading
import weakref

from aiohttp import web

from coli.server.errors import ApiError
from coli.server.state import server_of


class AtlasSource:
    """The atlas of one model: its fingerprint computed once, the file re-read when it changes."""

    def __init__(self, model):
        self.model = model
        self.fingerprint: str | None = None
        self._lock = threading.Lock()
        self._key = None
        self._body: bytes | None = None
        self._note = ""

    def get(self) -> tuple[bytes | None, str]:
        from coli import atlas as A
        from coli.kv.store import model_fingerprint

        with self._lock:
            if self.fingerprint is None:
                self.fingerprint = model_fingerprint(self.model.path)
            paths = [os.path.join(self.model.path, A.ATLAS_FILE), str(A.document.cache_path(self.fingerprint))]
            key = tuple(_stamp(p) for p in paths)
            if key != self._key:
                doc, where = A.find_atlas(self.model.path, self.fingerprint)
                self._body = None if doc is None else web.json_response(doc).body
                self._note, self._key = where, key
            return self._body, self._note


_SOURCES: "weakref.WeakKeyDictionary[object, AtlasSource]" = weakref.WeakKeyDictionary()


async def atlas(request: web.Request) -> web.Response:
    server = server_of(request)
    source = _SOURCES.get(server)
    if source is None:
        source = _SOURCES[server] = AtlasSource(server.model)
    body, note = await asyncio.to_thread(source.get)
    if body is None:
        raise ApiError(404, f"this model has no expert atlas yet ({note}); make one with: "
                            f"coli atlas --model {server.model.path}", code="atlas_not_found")
    return web.Response(body=body, content_type="application/json")


def _stamp(path: str):
    try:
        st = os.stat(path)
        return st.st_mtime_ns, st.st_size
    except OSError:
        return None
