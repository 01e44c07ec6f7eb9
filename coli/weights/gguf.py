"""GGUF files (llama.cpp's format) loaded directly: ``-m model.gguf``.

A GGUF holds the whole model in one file (or a split set ``NAME-00001-of-0000N.gguf``):
key/value metadata (architecture, sizes, tokenizer, chat template) and tensors under
llama.cpp's names. ``GGUFModel`` opens it (memory-mapped, through the ``gguf``
package's reader), ``config()`` maps the metadata onto a coli ``ModelConfig``
(coli/weights/gguf_config.py) and
``GGUFWeights`` serves its tensors under the Hugging Face names the architecture
files ask for, undoing what llama.cpp's converter did to them (Llama's q/k row
permutation, Gemma's ``1 +`` norms).

Weights: F32/F16/BF16 are used as they are; Q8_0 and Q4_0 are 32-weight groups with
one fp16 scale, exactly coli's int8 / int4s, and Q4_1 (an fp16 scale and an fp16 min)
is exactly coli's int4 (same nibble order: byte i of a group holds element i low and
i + 16 high), so they are repacked bit for bit when the chosen format is theirs. Every
other type (Q5_0/1, K-quants, IQ) is
dequantized with ``gguf.quants`` and quantized to the chosen format; by default the
closest coli format (see ``closest_format``). docs/MODELS.md has the table.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from coli._engine import kernels as K
from coli.config import ModelConfig
from coli.errors import ModelLoadError
from coli.quant import check_format, quantize
from coli.weights.gguf_config import ARCHS, hf_config
from coli.weights.source import ResidentExperts, Weights, default_head_quant

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAGIC = b"GGUF"

# ggml type name -> the coli format it maps to by default
_CLOSEST = {"F32": "f32", "F16": "f32", "BF16": "bf16", "F64": "f32", "Q8_0": "int8", "Q8_1": "int8",
            "Q8_K": "int8", "Q6_K": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8"}
REPACK = {"Q8_0": "int8", "Q4_0": "int4s", "Q4_1": "int4"}
DEQUANT_ROWS = 1024  # rows dequantized at a time (see GGUFWeights._dequant)


def closest_format(type_name: str) -> str:
    """The coli format a ggml type maps to by default: exact for F32/F16/BF16 and the
    repackable Q8_0/Q4_0/Q4_1, int8 for 5- to 8-bit types, int4 for 4 bits and below."""
    return REPACK.get(type_name) or _CLOSEST.get(type_name, "int4")


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def split_files(path: Path) -> list[Path]:
    """Every file of a split GGUF given any one of them (or the one file)."""
    m = SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"{path}: split GGUF is missing {', '.join(missing)}")
    return files


def _value(field):
    """A reader field's Python value (str, number, bool or list)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    v = field.parts[field.data[0]].tolist()[0]
    return bool(v) if types[0] == gguf.GGUFValueType.BOOL else v


class GGUFModel:
    """An opened GGUF (all files of a split one): ``meta`` and ``tensors`` by name."""

    def __init__(self, path: str | os.PathLike):
        try:
            import gguf
        except ImportError:  # pragma: no cover - a dependency
            raise ModelLoadError("reading GGUF files needs the gguf package (pip install gguf)") from None
        self.path = Path(path)
        self.files = split_files(self.path)
        self.meta: dict = {}
        self.tensors: dict = {}
        for f in self.files:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(4)
            if head != MAGIC:
                raise ModelLoadError(f"{f}: not a GGUF file (it starts with {head!r}, not b'GGUF')")
            try:
                r = gguf.GGUFReader(f, "r")
            except Exception as e:  # the reader raises ValueError, struct errors, IndexError ... on damage
                raise ModelLoadError(f"{f}: truncated or corrupt GGUF ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None
            if not self.meta:
                self.meta = {k: _value(v) for k, v in r.fields.items() if not k.startswith("GGUF.")}
            for t in r.tensors:
                if t.data_offset + t.n_bytes > size:
                    raise ModelLoadError(f"{f}: truncated: tensor {t.name!r} ends at byte "
                                         f"{t.data_offset + t.n_bytes} but the file has {size} bytes")
                self.tensors[t.name] = t
        self.arch = str(self.meta.get("general.architecture", ""))
        if self.arch not in ARCHS:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                                 f"supported: {', '.join(ARCHS)}")

    def get(self, key: str, default=None):
        """Metadata ``key``; a leading ``.`` is prefixed with the architecture."""
        if key.startswith("."):
            key = self.arch + key
        return self.meta.get(key, default)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def file_types(self) -> Counter:
        """How many weight matrices each ggml type holds (what ``coli show`` prints)."""
        return Counter(t.tensor_type.name for t in self.tensors.values() if len(t.shape) >= 2)

    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(hf_config(self), source=str(self.path))


_LAST: dict = {}


def open_model(path: str | os.PathLike) -> GGUFModel:
    """GGUFModel(path), reusing the last one opened while the file is unchanged (the plan
    and the load both read the header; a big vocabulary takes a moment to parse)."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if _LAST.get("key") != key:
        _LAST.clear()
        _LAST.update(key=key, model=GGUFModel(p))
    return _LAST["model"]


# Hugging Face name -> llama.cpp name, for the names coli's architecture files ask for.
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # multi-head latent attention (deepseek2); kv_b_proj is rebuilt from attn_k_b / attn_v_b (GGUFWeights._kv_b)
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}
_GEMMA3_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_GLM4MOE_LAYER = {"post_attention_layernorm": "post_attention_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_HF = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_EXPERT_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def gguf_name(arch: str, hf: str) -> str | None:
    base, _, suffix = hf.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    if hf.endswith(".mlp.gate.e_score_correction_bias"):  # the router's selection bias
        return f"blk.{hf.split('.')[2]}.exp_probs_b.bias"
    m = _HF.match(hf)
    if not m:
        return None
    i, part, suffix = m.groups()
    table = {**_LAYER, **_GEMMA3_LAYER} if arch == "gemma3" else {**_LAYER, **_GLM4MOE_LAYER} if arch == "glm4moe" \
        else _LAYER
    return f"blk.{i}.{table[part]}.{suffix}" if part in table else None


def unpermute_rows(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (its convert_hf_to_gguf
    ``permute``: per head, rotate-half rows interleaved for ggml's RoPE)."""
    hd = rows // n_head
    h, s, j = np.meshgrid(np.arange(n_head), np.arange(2), np.arange(hd // 2), indexing="ij")
    return (h * hd + 2 * j + s).reshape(-1)  # hf row h*hd + s*hd/2 + j <- gguf row h*hd + 2j + s


class GGUFWeights(Weights):
    """Tensors of a GGUF under Hugging Face names, in the chosen coli format."""

    def __init__(self, g: GGUFModel, quant: str | None = None, head_quant: str | None = None,
                 ram_budget=None):
        self.g = g
        if ram_budget is not None:
            raise ModelLoadError(f"{g.path}: --ram-budget streams experts from a converted directory; convert the "
                                 f"GGUF first: coli convert {g.path} OUT --quant int4, then load OUT")
        mats = [n for n, t in g.tensors.items() if len(t.shape) >= 2 and n not in ("token_embd.weight", "output.weight")]
        common = Counter(g.type_name(n) for n in mats).most_common(1)
        self.quant = check_format(quant) if quant else closest_format(common[0][0] if common else "F32")
        head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
        if head_quant:
            self.head_quant = check_format(head_quant)
        elif quant:
            self.head_quant = default_head_quant(quant)
        else:
            self.head_quant = closest_format(g.type_name(head))
        self.permute = g.arch == "llama"
        self.n_head = int(g.get(".attention.head_count"))
        kv = g.get(".attention.head_count_kv", self.n_head)
        self.n_head_kv = int(kv[0] if isinstance(kv, list) else kv)
        self.norm_shift = 1.0 if g.arch == "gemma3" else 0.0

    # -- names --------------------------------------------------------------------------------

    def _name(self, hf: str) -> str:
        name = gguf_name(self.g.arch, hf)
        if name is None or name not in self.g.tensors:
            raise ModelLoadError(f"{self.g.path}: tensor {name or hf!r} (for {hf}) is missing")
        return name

    def has(self, name: str) -> bool:
        n = gguf_name(self.g.arch, name)
        if n is not None and n.endswith(".attn_kv_b.weight") and n not in self.g.tensors:
            return n.replace("attn_kv_b", "attn_k_b") in self.g.tensors
        return n is not None and n in self.g.tensors

    def _order(self, hf: str, rows: int) -> np.ndarray | None:
        if self.permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
            return unpermute_rows(rows, self.n_head if ".q_proj." in hf else self.n_head_kv)
        return None

    # -- tensors ------------------------------------------------------------------------------

    def _f32(self, t) -> np.ndarray:
        """A tensor as float32 in numpy order (rows, cols)."""
        kind = t.tensor_type.name
        if kind == "F32":
            return np.asarray(t.data, dtype=np.float32)
        if kind == "F16":
            return np.asarray(t.data).astype(np.float32)
        return self._dequant(t, np.asarray(t.data))

    def _kv_b(self, name: str) -> np.ndarray:
        """MLA's kv_b_proj (nh * (nope + v), kv_lora) as Hugging Face has it. llama.cpp's converter
        splits it per head into attn_k_b, the nope rows transposed (nh, kv_lora, nope), and
        attn_v_b (nh, v, kv_lora); GGUFs written before that keep it whole as attn_kv_b."""
        kb_name = gguf_name(self.g.arch, name).replace("attn_kv_b", "attn_k_b")
        vb_name = kb_name.replace("attn_k_b", "attn_v_b")
        if kb_name not in self.g.tensors or vb_name not in self.g.tensors:
            raise ModelLoadError(f"{self.g.path}: tensors {kb_name!r} and {vb_name!r} (or {gguf_name(self.g.arch, name)!r}) "
                                 "are missing")
        kb, vb = self.g.tensors[kb_name], self.g.tensors[vb_name]
        nope, lora, nh = (int(d) for d in kb.shape)  # ggml order: innermost first
        k = self._f32(kb).reshape(nh, lora, nope).transpose(0, 2, 1)  # (nh, nope, lora)
        v = self._f32(vb).reshape(nh, -1, lora)  # (nh, v, lora)
        return np.concatenate([k, v], axis=1).reshape(-1, lora)

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        gname = gguf_name(self.g.arch, name)
        if gname and gname.endswith(".attn_kv_b.weight") and gname not in self.g.tensors:
            arr = self._kv_b(name)
            if arr.shape != tuple(shape):
                raise ModelLoadError(f"{self.g.path}: attn_k_b/attn_v_b give kv_b_proj {list(arr.shape)}, "
                                     f"expected {list(shape)}")
            return np.ascontiguousarray(arr, dtype=np.float32)
        t = self.g.tensors[self._name(name)]
        arr = self._f32(t)
        if arr.size != int(np.prod(shape)):
            raise ModelLoadError(f"{self.g.path}: tensor {t.name!r} has {arr.size} values, expected {list(shape)}")
        arr = arr.reshape(shape)
        if name.endswith(".bias") and (order := self._order(name, shape[0])) is not None:
            arr = arr[order]
        if self.norm_shift and name.endswith("norm.weight"):
            arr = arr - np.float32(self.norm_shift)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def matrix(self, name: str, rows: int, cols: int, fmt: str | None = None, row_order=None) -> K.QMatrix:
        gname = self._name(name)
        t = self.g.tensors[gname]
        if tuple(int(d) for d in t.shape) != (cols, rows):
            raise ModelLoadError(f"{self.g.path}: tensor {gname!r} has shape {list(t.shape)[::-1]}, "
                                 f"expected {[rows, cols]}")
        order = self._order(name, rows)
        if row_order is not None:
            order = row_order if order is None else order[row_order]
        return self._to_matrix(t, np.asarray(t.data), rows, cols, fmt or self.quant, order)

    def _to_matrix(self, t, data: np.ndarray, rows: int, cols: int, fmt: str, order) -> K.QMatrix:
        kind = t.tensor_type.name
        if REPACK.get(kind) == fmt:
            blocks = data.reshape(rows, -1)
            if order is not None:
                blocks = blocks[order]
            return repack(blocks, kind, rows, cols)
        if kind in ("F32", "F16"):
            w = np.asarray(data, dtype=np.float32).reshape(rows, cols)
        else:
            w = self._dequant(t, data).reshape(rows, cols)
        if order is not None:
            w = w[order]
        return quantize(np.ascontiguousarray(w, dtype=np.float32), fmt)

    def _dequant(self, t, data):
        """float32 values of raw blocks ``data`` (..., row bytes), DEQUANT_ROWS rows at a time into
        one output array: gguf's dequantizers keep several float temporaries of their input, so
        a whole large tensor at once (a 49152 x 576 embedding) would multiply the peak memory."""
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        flat = data.reshape(-1, data.shape[-1])
        out = np.empty((flat.shape[0], flat.shape[1] // size * block), dtype=np.float32)
        try:
            for i in range(0, len(flat), DEQUANT_ROWS):
                out[i : i + DEQUANT_ROWS] = gguf.quants.dequantize(flat[i : i + DEQUANT_ROWS], t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"{self.g.path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, "
                                 "which coli cannot read (gguf has no dequantizer for it)") from None
        return out.reshape(*data.shape[:-1], out.shape[1])

    def _stacked(self, prefix: str, part: str):
        i = prefix.split(".")[2]
        name = f"blk.{i}.ffn_{part}_exps.weight"
        if name not in self.g.tensors:
            raise ModelLoadError(f"{self.g.path}: tensor {name!r} is missing")
        return self.g.tensors[name]

    def expert_matrices(self, prefix: str, E: int, H: int, I: int, fmt: str):
        """(gate, up, down) QMatrix of each expert from the stacked ffn_*_exps tensors."""
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        stacks = {p: self._stacked(prefix, p) for p in shapes}
        for p, t in stacks.items():
            rows, cols = shapes[p]
            if tuple(int(d) for d in t.shape) != (cols, rows, E):
                raise ModelLoadError(f"{self.g.path}: tensor {t.name!r} has shape {list(t.shape)[::-1]}, "
                                     f"expected {[E, rows, cols]}")
        data = {p: np.asarray(t.data).reshape(E, shapes[p][0], -1) for p, t in stacks.items()}
        for e in range(E):
            yield tuple(self._to_matrix(stacks[p], data[p][e], *shapes[p], fmt, None) for p in ("gate", "up", "down"))

    def expert_tensors(self, prefix, sub, names, E, H, I):
        """(gate, up, down) float32 per expert (what ``coli convert`` quantizes)."""
        for mats in self.expert_matrices(prefix, E, H, I, "f32"):
            yield tuple(np.asarray(m.data) for m in mats)

    def experts(self, prefix, sub, names, E, H, I, k) -> ResidentExperts:
        table = K.ExpertTable(E, H, I, K.FORMATS[self.quant])
        for e, mats in enumerate(self.expert_matrices(prefix, E, H, I, self.quant)):
            table.set(e, *mats)
        return ResidentExperts(table)


def repack(blocks: np.ndarray, kind: str, rows: int, cols: int) -> K.QMatrix:
    """Q8_0 / Q4_0 / Q4_1 blocks (rows, nb * block bytes) as coli int8 / int4s / int4, bit for bit."""
    nb = cols // 32
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = np.ascontiguousarray(blocks).reshape(rows, nb, size)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(rows, nb)
    if kind == "Q8_0":
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, nb * 32)
        return K.QMatrix(K.FORMATS["int8"], q, d, rows, cols)
    if kind == "Q4_0":
        q = np.ascontiguousarray(b[..., 2:]).reshape(rows, nb * 16)
        return K.QMatrix(K.FORMATS["int4s"], q, d, rows, cols)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(rows, nb)
    q = np.ascontiguousarray(b[..., 4:]).reshape(rows, nb * 16)
    return K.QMatrix(K.FORMATS["int4"], q, d, rows, cols, mins=m)


def open_gguf(path: str | os.PathLike, quant: str | None = None, head_quant: str | None = None, ram_budget=None):
    """(ModelConfig, Tokenizer, GGUFWeights) of a GGUF file."""
    from coli.weights.gguf_vocab import tokenizer_from_gguf

    g = open_model(path)
    _LAST.clear()  # the model holds it from here; the cache only bridges the plan and the load
    cfg = g.config()
    tokenizer = tokenizer_from_gguf(g)
    return cfg, tokenizer, GGUFWeights(g, quant, head_quant, ram_budget)
