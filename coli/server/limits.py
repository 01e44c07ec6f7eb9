"""Keeping one request from stalling the others: heavy work off the event loop, and text
that can never fit the context refused by its length before anything reads it.

Parsing a large body, rendering a chat template and tokenizing run in a small pool of
worker threads (``off_loop``), so /health and running streams keep their pace while one
request is prepared. The tokenizers library releases the GIL while it encodes (see
``coli.tokenizer.Tokenizer.encode``), Jinja yields it between bytecodes.

``check_length`` refuses a text longer than ``ctx`` tokens could cover: no token of the
vocabulary spells more than ``max_token_chars`` characters, so a text longer than
``ctx * max_token_chars`` (times a margin for normalizers that compose characters) needs
more than ``ctx`` tokens. That is a sound bound, not an estimate; it only skips work.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from coli.server.errors import ApiError

log = logging.getLogger("coli.server")

PREPARE_THREADS = 2  # requests prepared at once; more wait for a thread, not for the loop
NORMALIZER_MARGIN = 4  # NFC/NFKC may compose up to 3 code points into one
BIG_INPUT = 1 << 20  # characters: past this, memory is handed back to the system afterwards

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="coli-prepare")
        return _pool


async def off_loop(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a worker thread; exceptions (ApiError included) pass through."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


# -- memory ---------------------------------------------------------------------------------------

_libc = None


def release_memory() -> None:
    """Give freed heap pages back to the system (glibc keeps them in its arenas otherwise:
    a large request would leave the server hundreds of MB bigger for good)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)


# -- the length bound -----------------------------------------------------------------------------


def max_token_chars(tokenizer) -> int | None:
    """The most characters one token can stand for, or None when there is no bound (a
    vocabulary with an unknown-token fallback maps a whole unknown word to one token)."""
    backend = getattr(tokenizer, "_backend", None)
    if backend is None:
        return None
    try:
        model = json.loads(backend.to_str()).get("model") or {}
    except (ValueError, AttributeError):
        return None
    if model.get("unk_token") is not None and not model.get("byte_fallback"):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(piece) for piece in vocab), default=1) or 1


def char_limit(server) -> int | None:
    """Characters past which a prompt cannot fit the server's context (None: no bound)."""
    limit = getattr(server, "_char_limit", False)
    if limit is False:
        per_token = max_token_chars(server.model.tokenizer)
        limit = None if per_token is None else server.runner.ctx * per_token * NORMALIZER_MARGIN
        server._char_limit = limit
    return limit


def check_length(server, chars: int, param: str = "messages") -> None:
    """400 (context_length_exceeded) for a text of ``chars`` characters that no tokenization
    could fit in the context; called before the text is tokenized."""
    limit = char_limit(server)
    if limit is not None and chars > limit:
        raise ApiError(400, f"context_length_exceeded: the prompt has {chars} characters; the context holds "
                            f"{server.runner.ctx} tokens, which cannot spell more than {limit} characters",
                       code="context_length_exceeded", param=param)
