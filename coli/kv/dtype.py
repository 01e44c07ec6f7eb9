"""The KV cache's precision: ``--kv-cache-dtype`` / ``COLI_KV_CACHE_DTYPE``.

f16 (the default, as llama.cpp's and Ollama's) holds keys and values in IEEE half precision,
rounded to nearest even when written: half the memory of f32 and half the bytes a decode
token's attention reads, which at long contexts is most of what it reads. The attention
widens them exactly, so an f16 cache computes what an f32 cache holding the same rounded
values would. f32 keeps them as computed (the reference the parity tests use)."""
from __future__ import annotations

import os

import numpy as np

from coli.errors import InvalidRequestError

KV_DTYPES = {"f16": np.float16, "f32": np.float32}  # --kv-cache-dtype: what the KV cache stores
DEFAULT_KV_DTYPE = "f16"
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in KV_DTYPES.items()}


def kv_dtype(name: str | None) -> str:
    """A KV cache precision by name, checked; None: $COLI_KV_CACHE_DTYPE, else f16 (as llama.cpp
    and Ollama: half the memory and half the bytes attention reads, at a rounding of 2^-11)."""
    if name is None:
        name = os.environ.get("COLI_KV_CACHE_DTYPE") or DEFAULT_KV_DTYPE
    name = str(name).lower()
    if name not in KV_DTYPES:
        raise InvalidRequestError(f"unknown KV cache dtype {name!r}: use {' or '.join(KV_DTYPES)}")
    return name
