"""The converted coli model directory (documented in docs/FORMAT.md).

    coli.json      manifest: format version, quantization, source fingerprint, tensor index
    dense.bin      every non-expert tensor, 64-byte aligned, ready to map
    experts.bin    every expert of every MoE layer, gate|up|down packed contiguously,
                   one expert per ``stride`` bytes (a multiple of 4096, for direct I/O)
    config.json, tokenizer.json, ...   carried over from the source

``ConvertedWriter`` produces it (driven by ``coli convert``); ``ConvertedWeights``
serves it to the architecture files: dense tensors are views of the mapped file and
experts come from an ``ExpertStore`` (resident or streamed within a RAM budget).
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import numpy as np

from coli._engine import kernels as K
from coli.errors import ModelLoadError
from coli.quant import FORMATS
from coli.weights.source import Weights

MANIFEST = "coli.json"
FORMAT_NAME = "coli"
FORMAT_VERSION = 3  # 3: column scales (NAME.col_scale); 2: int4 is the asymmetric format; 1's int4 is int4s
COL_SCALE = ".col_scale"  # f32 (cols,) beside a matrix stored as Q(W / s): it stands for dequantize * s
ALIGN_DENSE = 64
ALIGN_EXPERT = 4096
CARRIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "special_tokens_map.json")


def is_converted(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / MANIFEST).exists()


def source_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and every safetensors file's name, size and header."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f.name.encode() + str(f.stat().st_size).encode() + head + fh.read(min(n, 100 << 20)))
    return h.hexdigest()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


MATRIX_KEYS = ("data", "scales", "mins")


def _matrix_arrays(m: K.QMatrix) -> list[np.ndarray]:
    return [a for a in m.arrays() if a is not None]


class ConvertedWriter:
    """Appends tensors to dense.bin / experts.bin in ``out_dir`` and writes the manifest last."""

    def __init__(self, out_dir: Path, quant: str, head_quant: str):
        self.dir = out_dir
        self.quant, self.head_quant = quant, head_quant
        self._dense = open(out_dir / "dense.bin", "wb")
        self._experts = open(out_dir / "experts.bin", "wb")
        self._dense_crc = 0
        self.tensors: dict[str, dict] = {}
        self.expert_layers: dict[str, dict] = {}
        self.parts: list[dict] | None = None
        self.stride = 0
        self.expert_crcs: list[int] = []

    def _put_dense(self, arr: np.ndarray) -> list[int]:
        pos = self._dense.tell()
        pad = _round_up(pos, ALIGN_DENSE) - pos
        if pad:
            self._dense.write(b"\0" * pad)
            self._dense_crc = zlib.crc32(b"\0" * pad, self._dense_crc)
        raw = np.ascontiguousarray(arr).tobytes()
        self._dense.write(raw)
        self._dense_crc = zlib.crc32(raw, self._dense_crc)
        return [pos + pad, len(raw)]

    def add_f32(self, name: str, arr: np.ndarray) -> None:
        if name not in self.tensors:
            self.tensors[name] = {"kind": "f32", "shape": list(arr.shape),
                                  "data": self._put_dense(arr.astype(np.float32))}

    def add_matrix(self, name: str, m: K.QMatrix) -> None:
        if name not in self.tensors:
            entry = {"kind": "matrix", "fmt": m.format, "rows": m.rows, "cols": m.cols,
                     "data": self._put_dense(m.data)}
            if m.scales is not None:
                entry["scales"] = self._put_dense(m.scales)
            if m.mins is not None:
                entry["mins"] = self._put_dense(m.mins)
            self.tensors[name] = entry

    def add_experts(self, layer: str, experts: list[tuple[K.QMatrix, K.QMatrix, K.QMatrix]]) -> None:
        if self.parts is None:  # the layout of one expert, shared by every layer
            parts, off = [], 0
            for part, m in zip(("gate", "up", "down"), experts[0]):
                entry = {"name": part, "fmt": m.format, "rows": m.rows, "cols": m.cols}
                for key, arr in zip(MATRIX_KEYS, _matrix_arrays(m)):
                    off = _round_up(off, ALIGN_DENSE)
                    entry[key] = [off, arr.nbytes]
                    off += arr.nbytes
                parts.append(entry)
            self.parts, self.stride = parts, _round_up(off, ALIGN_EXPERT)
        self.expert_layers[layer] = {"first": len(self.expert_crcs), "count": len(experts)}
        for mats in experts:
            blob = bytearray(self.stride)
            for entry, m in zip(self.parts, mats):
                if (m.format, m.rows, m.cols) != (entry["fmt"], entry["rows"], entry["cols"]):
                    raise ModelLoadError(f"{layer}: experts of different shapes cannot share one experts.bin")
                for key, arr in zip(MATRIX_KEYS, _matrix_arrays(m)):
                    off, n = entry[key]
                    blob[off : off + n] = arr.tobytes()
            self._experts.write(blob)
            self.expert_crcs.append(zlib.crc32(blob))

    def finish(self, fingerprint: str, model_type: str) -> None:
        for f in (self._dense, self._experts):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "quant": self.quant, "head_quant": self.head_quant,
            "model_type": model_type, "source_fingerprint": fingerprint,
            "dense": {"file": "dense.bin", "bytes": (self.dir / "dense.bin").stat().st_size,
                      "crc32": self._dense_crc, "tensors": self.tensors},
            "experts": {"file": "experts.bin", "bytes": (self.dir / "experts.bin").stat().st_size,
                        "stride": self.stride, "parts": self.parts or [], "layers": self.expert_layers,
                        "crc32": self.expert_crcs},
        }
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        tmp.rename(self.dir / MANIFEST)


def read_manifest(model_dir: Path) -> dict:
    path = model_dir / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise ModelLoadError(f"{path}: not a coli manifest")
    if m.get("version") == 1:
        _upgrade_v1(m)
    if m.get("version") == 2:  # the same layout, written before column scales existed (it has none)
        m["version"] = FORMAT_VERSION
    if m.get("version") != FORMAT_VERSION:
        raise ModelLoadError(f"{path}: format version {m.get('version')} is not supported (this coli reads "
                             f"versions 1 to {FORMAT_VERSION}); convert the model again")
    for section in ("dense", "experts"):
        f = model_dir / m[section]["file"]
        size = f.stat().st_size if f.exists() else -1
        if size != m[section]["bytes"]:
            what = "missing" if size < 0 else f"truncated or altered ({size} bytes, manifest says {m[section]['bytes']})"
            raise ModelLoadError(f"{f}: {what}; convert the model again")
    return m


class ConvertedWeights(Weights):
    """Tensors of a converted directory: dense ones mapped, experts from an ExpertStore."""

    def __init__(self, model_dir: Path, quant: str | None = None, head_quant: str | None = None,
                 store_options: dict | None = None):
        from coli.experts.store import ExpertStore

        self.dir = model_dir
        self.manifest = m = read_manifest(model_dir)
        if quant is not None and quant != m["quant"]:
            raise ModelLoadError(f"{model_dir}: converted to {m['quant']}, cannot load as {quant}; "
                                 f"omit --quant or convert the source again with --quant {quant}")
        if head_quant is not None and head_quant != m["head_quant"]:
            raise ModelLoadError(f"{model_dir}: converted with head {m['head_quant']}, cannot load with {head_quant}")
        self.quant, self.head_quant = m["quant"], m["head_quant"]
        dense_path = model_dir / m["dense"]["file"]
        self._dense = np.memmap(dense_path, dtype=np.uint8, mode="r") if m["dense"]["bytes"] else np.zeros(0, np.uint8)
        if zlib.crc32(self._dense) != m["dense"]["crc32"]:
            raise ModelLoadError(f"{dense_path}: checksum mismatch (the file was altered or damaged); "
                                 "convert the model again")
        self._tensors = m["dense"]["tensors"]
        self.store = ExpertStore(model_dir, m, **(store_options or {}))

    def _entry(self, name: str) -> dict:
        e = self._tensors.get(name)
        if e is None:
            raise ModelLoadError(f"{self.dir / MANIFEST}: tensor {name!r} is missing")
        return e

    def _view(self, span: list[int], dtype) -> np.ndarray:
        off, n = span
        return self._dense[off : off + n].view(dtype)

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        e = self._entry(name)
        if e["kind"] != "f32" or tuple(e["shape"]) != tuple(shape):
            raise ModelLoadError(f"{self.dir / MANIFEST}: tensor {name!r} is {e['kind']} {e.get('shape')}, "
                                 f"expected f32 {list(shape)}")
        a = self._view(e["data"], np.float32).reshape(shape)
        # Norms and biases (small) are copied out of the mapping: read every step, each would map
        # the large page-cache page around it, and with it the rows of the matrices beside it that
        # packing (coli.weights.packing) has replaced by tiles and unmapped.
        return a.copy() if a.nbytes <= SMALL_F32 else a

    def has(self, name: str) -> bool:
        return name in self._tensors

    def matrix(self, name: str, rows: int, cols: int, fmt: str | None = None, row_order=None) -> K.QMatrix:
        e = self._entry(name)
        if e["kind"] != "matrix" or (e["rows"], e["cols"]) != (rows, cols):
            raise ModelLoadError(f"{self.dir / MANIFEST}: tensor {name!r} is not a ({rows}, {cols}) matrix")
        return matrix_view(e, lambda span, dt: self._view(span, dt))

    def scaled_matrix(self, name: str, rows: int, cols: int, fmt: str | None = None, norm=None):
        s = self(name + COL_SCALE, cols) if self.has(name + COL_SCALE) else None
        return self.matrix(name, rows, cols, fmt), s

    def experts(self, prefix, sub, names, E, H, I, k):
        return self.store.layer(prefix, E, H, I, k)

    def finish(self) -> None:
        self.store.finish()

    def flush(self) -> None:
        self.store.usage.save()

    def close(self) -> None:
        self.store.close()


def _upgrade_v1(m: dict) -> None:
    """Version 1 named today's int4s (symmetric groups, no mins) "int4"; the bytes are the same."""
    rename = {"int4": "int4s"}.get
    m["quant"], m["head_quant"] = rename(m["quant"], m["quant"]), rename(m["head_quant"], m["head_quant"])
    for e in list(m["dense"]["tensors"].values()) + list(m["experts"]["parts"]):
        if "fmt" in e:
            e["fmt"] = rename(e["fmt"], e["fmt"])
    m["version"] = FORMAT_VERSION


SMALL_F32 = 1 << 20  # f32 tensors up to this size are copied into memory at load (see ConvertedWeights)

DTYPE_OF = {"f32": np.float32, "bf16": np.uint16, "int8": np.int8, "int4": np.uint8, "int4s": np.uint8}


def matrix_view(entry: dict, view) -> K.QMatrix:
    """A QMatrix over bytes described by a manifest entry; ``view(span, dtype)`` gives the arrays."""
    fmt, rows, cols = entry["fmt"], entry["rows"], entry["cols"]
    if fmt not in FORMATS:
        raise ModelLoadError(f"manifest: unknown format {fmt!r}")
    kp = K.padded(cols)
    width = {"f32": cols, "bf16": cols, "int8": kp, "int4": kp // 2, "int4s": kp // 2}[fmt]
    data = view(entry["data"], DTYPE_OF[fmt]).reshape(rows, width)
    scales = view(entry["scales"], np.float16).reshape(rows, kp // 32) if "scales" in entry else None
    mins = view(entry["mins"], np.float16).reshape(rows, kp // 32) if "mins" in entry else None
    return K.QMatrix(K.FORMATS[fmt], data, scales, rows, cols, mins)
