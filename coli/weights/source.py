"""Where a model's weights come from, and in which format they are used.

The architecture files ask a ``Weights`` source for what they need — f32 tensors
(norms, routers, biases), matrices in the chosen format, and the experts of a MoE
layer — and never learn whether the answer was quantized from a Hugging Face
checkpoint at load time (``HFWeights``), mapped from a converted directory
(``coli.weights.converted.ConvertedWeights``), or written out by ``coli convert``.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from coli._engine import kernels as K
from coli.quant import check_format, quantize
from coli.weights.safetensors import Checkpoint


def default_head_quant(quant: str) -> str:
    """LM head and embeddings: int8 under int4 and int4s (the head is the most quantization-sensitive
    matrix)."""
    return {"int4": "int8", "int4s": "int8"}.get(quant, quant)


class ResidentExperts:
    """Every expert of a layer in memory: nothing to read, one group covering all.

    ``region``: the one buffer all of the layer's expert arrays lie in, if they do (a
    converted model's experts, read whole), which coli.weights.packing may pack them into."""

    streamed = False

    def __init__(self, table: K.ExpertTable, region: np.ndarray | None = None):
        self.table = table
        self.region = region
        self.counts = np.zeros(table.n_experts, dtype=np.int64)  # tokens routed to each expert

    def groups(self, idx: np.ndarray) -> list[None]:
        return [None]

    def load(self, active) -> None:
        pass

    def start(self, active, keep) -> None:
        pass

    def prefetch(self, idx: np.ndarray) -> None:
        pass


class Weights:
    """The interface architectures build from (see HFWeights for the reference implementation)."""

    quant: str
    head_quant: str

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def matrix(self, name: str, rows: int, cols: int, fmt: str | None = None,
               row_order: np.ndarray | None = None) -> K.QMatrix:
        """Matrix ``name`` in ``fmt`` (default: self.quant). ``row_order`` reorders a source
        checkpoint's rows (e.g. interleaved RoPE dims into halves); a converted directory
        already stores the reordered matrix and ignores it."""
        raise NotImplementedError

    def scaled_matrix(self, name: str, rows: int, cols: int, fmt: str | None = None,
                      norm: np.ndarray | None = None) -> tuple[K.QMatrix, np.ndarray | None]:
        """Matrix ``name`` and its column scales (coli.colscale) or None: the matrix stands for
        ``dequantize(m) * s``. Used for the embedding table and the LM head (``norm``: the
        weight of the norm before it); a source that does not choose scales hands out the
        plain matrix."""
        return self.matrix(name, rows, cols, fmt), None

    def experts(self, prefix: str, sub: str, names: tuple[str, str, str], E: int, H: int, I: int, k: int):
        raise NotImplementedError

    def finish(self) -> None:
        """Called once the whole model is built."""

    def flush(self) -> None:
        """Persist what was learned while running (routing history)."""

    def close(self) -> None:
        """Release files and threads."""

    def linear(self, name: str, rows: int, cols: int, bias: bool = False, row_order: np.ndarray | None = None):
        from coli.models.base import Linear

        b = self(name.removesuffix(".weight") + ".bias", rows) if bias else None
        if b is not None and row_order is not None:  # biases are stored as read, in both sources
            b = np.ascontiguousarray(b[row_order])
        return Linear(self.matrix(name, rows, cols, row_order=row_order), b)



class HFWeights(Weights):
    """A Hugging Face checkpoint, quantized to ``quant`` as it loads. ``calibration`` maps
    matrix names to statistics of their inputs (coli.calibration.collect), which int4
    rounds by (coli.quant.quantize); a matrix without an entry gets the plain fit."""

    def __init__(self, ckpt: Checkpoint, quant: str = "f32", head_quant: str | None = None,
                 calibration: dict[str, np.ndarray] | None = None):
        self.ckpt = ckpt
        self.quant = check_format(quant)
        self.head_quant = check_format(head_quant or default_head_quant(quant))
        self.calibration = calibration or {}

    def __call__(self, name: str, *shape: int) -> np.ndarray:
        return self.ckpt.f32(name, shape)

    def has(self, name: str) -> bool:
        return name in self.ckpt

    def matrix(self, name: str, rows: int, cols: int, fmt: str | None = None,
               row_order: np.ndarray | None = None) -> K.QMatrix:
        w = self.ckpt.f32(name, (rows, cols))
        if row_order is not None:
            w = np.ascontiguousarray(w[row_order])
        q = quantize(w, fmt or self.quant, self.calibration.get(name))
        if (fmt or self.quant) != "f32":  # the quantized copy is what runs: the source pages can go
            self.ckpt.release(name)
        return q

    def scaled_matrix(self, name: str, rows: int, cols: int, fmt: str | None = None, norm=None):
        from coli import colscale

        fmt = fmt or self.quant
        if fmt not in colscale.FORMATS:
            return self.matrix(name, rows, cols, fmt), None
        q, s = colscale.choose(self.ckpt.f32(name, (rows, cols)), fmt, self.calibration.get(name), norm)
        self.ckpt.release(name)
        return q, s

    def expert_tensors(self, prefix: str, sub: str, names, E: int, H: int, I: int) -> Iterator[tuple]:
        """(gate (I, H), up (I, H), down (H, I)) float32 for each expert, from per-expert
        tensors or transformers 5's fused gate_up_proj / down_proj."""
        g, u, d = names
        if self.has(f"{prefix}.{sub}.gate_up_proj"):
            gu = self.ckpt.f32(f"{prefix}.{sub}.gate_up_proj", (E, 2 * I, H))  # (E, 2I, H)
            dn = self.ckpt.f32(f"{prefix}.{sub}.down_proj", (E, H, I))  # (E, H, I)
            for e in range(E):
                yield gu[e, :I], gu[e, I:], dn[e]
        else:
            f = self.ckpt.f32
            for e in range(E):
                yield (f(f"{prefix}.{sub}.{e}.{g}.weight", (I, H)), f(f"{prefix}.{sub}.{e}.{u}.weight", (I, H)),
                       f(f"{prefix}.{sub}.{e}.{d}.weight", (H, I)))

    def quantize_expert(self, prefix: str, sub: str, names, e: int, mats) -> tuple[K.QMatrix, ...]:
        """Expert e's (gate, up, down) in self.quant, each with its calibration statistics if any."""
        return tuple(quantize(np.ascontiguousarray(m), self.quant, self.calibration.get(f"{prefix}.{sub}.{e}.{n}.weight"))
                     for m, n in zip(mats, names))

    def experts(self, prefix, sub, names, E, H, I, k) -> ResidentExperts:
        table = K.ExpertTable(E, H, I, K.FORMATS[self.quant])
        for e, mats in enumerate(self.expert_tensors(prefix, sub, names, E, H, I)):
            table.set(e, *self.quantize_expert(prefix, sub, names, e, mats))
            if self.quant != "f32":
                for n in (f"{prefix}.{sub}.{e}.{x}.weight" for x in names):
                    self.ckpt.release(n)
        if self.quant != "f32":
            for n in (f"{prefix}.{sub}.gate_up_proj", f"{prefix}.{sub}.down_proj"):
                self.ckpt.release(n)
        return ResidentExperts(table)
