"""The ``.coli_kv`` file: one KV slot's token history and its keys and values.

    offset       size  field
    0            8     magic b"COLI_KV\\n"
    8            4     format version, uint32 little-endian (FORMAT_VERSION)
    12           4     header length H, uint32 little-endian
    16           H     header: UTF-8 JSON (see ``Layout`` and ``write_state``)
    16+H         4n    token ids, int32 little-endian
    ...          L*n*kw*b   keys, little-endian, (layers, tokens, k_width)
    ...          L*n*vw*b   values, likewise, (layers, tokens, v_width)
    end-8        4     CRC-32 (zlib) of every byte before it, uint32 little-endian
    end-4        4     b"END\\n"

The keys and values are the cache's own dtype, the header's ``dtype``: "float16" (b = 2,
the default cache) or "float32" (b = 4).

A file is written whole to a temporary name in the same directory, flushed and
fsync'ed, then renamed over the old one and the directory fsync'ed: a kill at any
moment leaves the old file or the new one, never a mix. docs/FORMAT.md is the
reader's documentation of this layout.
"""
from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"COLI_KV\n"
END = b"END\n"
FORMAT_VERSION = 1
FILE_DTYPES = {"float16": "<f2", "float32": "<f4"}  # header dtype -> the payload's NumPy dtype


def layout_of(dtype: str) -> str:
    """The header's ``layout`` for a cache of ``dtype`` ("float16" or "float32")."""
    return f"tokens:int32[n] k:{dtype}[layers,n,k_width] v:{dtype}[layers,n,v_width]"


_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_TRAILER = struct.Struct("<I4s")  # crc32, END
_MAX_HEADER = 1 << 20


class KVFileError(Exception):
    """A state file that must not be used; ``str(err)`` says why, in a few words."""


@dataclass(frozen=True)
class Layout:
    """What a file's KV must match to be reused: the model and the cache's shape."""

    fingerprint: str  # of the model directory (coli.kv.store.model_fingerprint)
    n_layers: int
    k_width: int
    v_width: int
    dtype: str = "float32"  # of the cache
    weight_format: str = "f32"  # how the weights computed it (coli.kv.store.weight_format)

    def mismatch(self, header: dict) -> str | None:
        """Why a file with ``header`` does not fit this layout, or None."""
        if header.get("fingerprint") != self.fingerprint:
            return "it belongs to another model (fingerprint differs)"
        if header.get("weight_format") != self.weight_format:
            return (f"it was computed with {header.get('weight_format')!r} weights, "
                    f"this model runs {self.weight_format!r}")
        for key in ("n_layers", "k_width", "v_width", "dtype"):
            if header.get(key) != getattr(self, key):
                return f"its {key} is {header.get(key)!r}, this model's is {getattr(self, key)!r}"
        if header.get("layout") != layout_of(self.dtype):
            return f"unknown layout {header.get('layout')!r}"
        return None


@dataclass
class KVState:
    header: dict
    tokens: list[int]
    k: np.ndarray  # (layers, n, k_width), the header's dtype
    v: np.ndarray  # (layers, n, v_width)


def slot_file(directory: str | os.PathLike, slot: int) -> Path:
    """``.coli_kv`` for slot 0, ``.coli_kv.N`` for slot N."""
    return Path(directory) / (".coli_kv" if slot == 0 else f".coli_kv.{slot}")


def write_state(path: str | os.PathLike, layout: Layout, tokens: list[int], k: np.ndarray, v: np.ndarray, *,
                slot: int = 0, model_path: str | None = None) -> None:
    """Atomically replace ``path`` with this state. k: (layers, n, k_width), v likewise."""
    path = Path(path)
    n = len(tokens)
    L = layout.n_layers
    if k.shape != (L, n, layout.k_width) or v.shape != (L, n, layout.v_width):
        raise ValueError(f"write_state: k{k.shape} v{v.shape} do not match {n} tokens of {layout}")
    if layout.dtype not in FILE_DTYPES:
        raise ValueError(f"write_state: a cache of {layout.dtype!r} (not {' or '.join(FILE_DTYPES)})")
    fmt = FILE_DTYPES[layout.dtype]
    header = dict(fingerprint=layout.fingerprint, weight_format=layout.weight_format, n_layers=L,
                  k_width=layout.k_width, v_width=layout.v_width, dtype=layout.dtype, layout=layout_of(layout.dtype), tokens=n,
                  slot=slot, saved_at=time.time(), model_path=model_path)
    head = json.dumps(header, sort_keys=True).encode()
    parts = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head,
             np.asarray(tokens, dtype="<i4").tobytes(),
             memoryview(np.ascontiguousarray(k, dtype=fmt)).cast("B"),
             memoryview(np.ascontiguousarray(v, dtype=fmt)).cast("B")]
    # a fresh name, created exclusively and never through a symlink (mkstemp: O_EXCL | O_NOFOLLOW)
    fd, name = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
    tmp = Path(name)
    crc = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for p in parts:
                crc = zlib.crc32(p, crc)
                f.write(p)
            f.write(_TRAILER.pack(crc, END))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The header of a state file and the file's size; checks its framing, not its checksum."""
    path = Path(path)
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        pre = f.read(_PREFIX.size)
        if len(pre) < _PREFIX.size:
            raise KVFileError("it is too short to be a KV state file")
        magic, version, hlen = _PREFIX.unpack(pre)
        if magic != MAGIC:
            raise KVFileError("it is not a KV state file (bad magic)")
        if version != FORMAT_VERSION:
            raise KVFileError(f"its format version is {version}; this colibri reads version {FORMAT_VERSION}")
        if hlen > _MAX_HEADER or _PREFIX.size + hlen + _TRAILER.size > size:
            raise KVFileError("it is truncated (header)")
        try:
            header = json.loads(f.read(hlen))
        except ValueError:
            raise KVFileError("its header is corrupt") from None
    if not isinstance(header, dict):
        raise KVFileError("its header is corrupt")
    try:
        n, L, kw, vw = (int(header[key]) for key in ("tokens", "n_layers", "k_width", "v_width"))
    except (KeyError, TypeError, ValueError):
        raise KVFileError("its header lacks the cache's shape") from None
    if min(n, L, kw, vw) < 0:
        raise KVFileError("its header is corrupt")
    dtype = header.get("dtype", "float32")
    if dtype not in FILE_DTYPES:
        raise KVFileError(f"its dtype {dtype!r} is not one this colibri reads")
    b = np.dtype(FILE_DTYPES[dtype]).itemsize
    if size != _PREFIX.size + hlen + 4 * n + b * n * L * (kw + vw) + _TRAILER.size:
        raise KVFileError(f"its size ({size} bytes) does not match its header: truncated or corrupt")
    return header, size


def read_state(path: str | os.PathLike, layout: Layout | None = None) -> KVState:
    """Read and verify a whole state file; raises KVFileError saying why it cannot be used.

    With ``layout``, a file of another model or cache shape is refused before its
    payload is read."""
    header, size = read_header(path)
    if layout is not None and (why := layout.mismatch(header)):
        raise KVFileError(why)
    with open_regular(path) as f:
        data = f.read()
    if len(data) != size:
        raise KVFileError("it changed while being read")
    crc, end = _TRAILER.unpack_from(data, size - _TRAILER.size)
    if end != END or zlib.crc32(memoryview(data)[: size - _TRAILER.size]) != crc:
        raise KVFileError("its checksum does not match: the file is corrupt")
    n, L, kw, vw = (int(header[key]) for key in ("tokens", "n_layers", "k_width", "v_width"))
    at = _PREFIX.size + _PREFIX.unpack_from(data)[2]
    tokens = np.frombuffer(data, dtype="<i4", count=n, offset=at)
    at += 4 * n
    fmt = FILE_DTYPES[header.get("dtype", "float32")]  # (checked by read_header)
    k = np.frombuffer(data, dtype=fmt, count=L * n * kw, offset=at).reshape(L, n, kw)  # (L, n, kw)
    at += k.nbytes
    v = np.frombuffer(data, dtype=fmt, count=L * n * vw, offset=at).reshape(L, n, vw)  # (L, n, vw)
    return KVState(header, [int(t) for t in tokens], k, v)


def open_regular(path: str | os.PathLike):
    """``path`` opened for reading when it is a regular file; KVFileError for a FIFO, a
    device or a directory (opened without blocking, so a FIFO cannot hang the reader)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KVFileError("it is not a regular file")
    return os.fdopen(fd, "rb")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
