"""A memory-mapped safetensors reader.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, [begin, end) byte offsets into the data section), then the
data. The whole file is mapped once; a tensor is a NumPy view of its bytes, so
opening a checkpoint costs one header parse per file and no copies.

Every structural problem (short file, bad header, offsets past the end, sizes
that disagree with the shape) is a ``ModelLoadError`` naming the file.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np

from coli.errors import ModelLoadError

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element)
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits; widened to f32 by to_f32()
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One mapped .safetensors file: ``names()``, ``dtype(name)``, ``shape(name)``, ``raw(name)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise ModelLoadError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or n > MAX_HEADER or 8 + n > size:
                    raise ModelLoadError(
                        f"{self.path}: truncated or corrupt safetensors file (header of {n} bytes, file of {size})"
                    )
                try:
                    header = json.loads(f.read(n))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ModelLoadError(f"{self.path}: corrupt safetensors header ({e})") from None
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise ModelLoadError(f"{self.path}: cannot read ({e.strerror})") from None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        data_size = size - self._data_start
        self._info: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dt, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ModelLoadError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if dt not in DTYPES:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {dt}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
            if end - begin != nbytes or begin < 0:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} of shape {list(shape)} {dt} should take {nbytes} bytes, "
                    f"header says {end - begin}"
                )
            if end > data_size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {self._data_start + end} "
                    f"but the file has {size} bytes"
                )
            self._info[name] = (dt, shape, begin, end)

    def names(self) -> list[str]:
        return list(self._info)

    def dtype(self, name: str) -> str:
        return self._info[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]

    def raw(self, name: str) -> np.ndarray:
        """The stored bits as a read-only view into the mapping (BF16 as uint16)."""
        dt, shape, begin, end = self._info[name]
        if end == begin:
            return np.zeros(shape, dtype=DTYPES[dt])
        arr = np.frombuffer(self._map, dtype=DTYPES[dt], count=(end - begin) // DTYPES[dt].itemsize,
                            offset=self._data_start + begin)
        return arr.reshape(shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident memory (MADV_DONTNEED on the
        whole pages inside the run of released tensors around it: neighbours released
        before share their boundary pages). Always safe on this read-only shared mapping: a
        later read faults pages back in from the file; only memory is saved."""
        dt, shape, begin, end = self._info[name]
        if self._map is None or end == begin or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin, end = self._data_start + begin, self._data_start + end
        runs = getattr(self, "_released", None)
        if runs is None:
            runs = self._released = []
        for b, e in list(runs):  # merge with the released runs it touches (tensors are packed back to back)
            if b <= end and begin <= e:
                runs.remove((b, e))
                begin, end = min(b, begin), max(e, end)
        runs.append((begin, end))
        page = mmap.PAGESIZE
        start = -(-begin // page) * page  # whole pages inside the run only
        stop = end // page * page
        if stop > start:
            try:
                self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)
            except (OSError, ValueError):
                pass


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 array of a tensor: the mapped view itself for F32, a widened copy otherwise."""
    if dtype == "F32":
        return raw
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


class Checkpoint:
    """All tensors of a Hugging Face model directory: one file, a sharded index, or any *.safetensors."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index}: unreadable shard index ({e})") from None
            shard_names = sorted(set(weight_map.values()))
            for s in shard_names:
                if not (self.dir / s).exists():
                    raise ModelLoadError(f"{index}: lists shard {s} which is missing from {self.dir}")
            files = [self.dir / s for s in shard_names]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{self.dir}: no *.safetensors weights found (PyTorch .bin checkpoints are not supported)")
        self.files = [SafetensorsFile(p) for p in files]
        self.on_read = None  # progress(done, total): called as tensors are read (coli.load's progress)
        self._read: set[str] = set()
        self._where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.names():
                self._where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)

    def f32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as float32, checked against ``shape`` when given."""
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        if shape is not None and tuple(f.shape(name)) != tuple(shape):
            raise ModelLoadError(
                f"{f.path}: tensor {name!r} has shape {list(f.shape(name))}, expected {list(shape)} from config.json"
            )
        dt = f.dtype(name)
        if dt not in ("F32", "F16", "BF16", "F64"):
            raise ModelLoadError(f"{f.path}: tensor {name!r} is {dt}, expected a floating-point tensor")
        arr = np.ascontiguousarray(to_f32(f.raw(name), dt))
        if self.on_read is not None and name not in self._read:
            self._read.add(name)
            self.on_read(len(self._read), len(self._where))
        if dt != "F32":  # a widened copy: the source pages are not needed any more
            f.release(name)
        return arr

    def release(self, name: str) -> None:
        """Let the pages of tensor ``name`` go (``SafetensorsFile.release``) once a converted
        copy of it is all that is used."""
        f = self._where.get(name)
        if f is not None:
            f.release(name)
