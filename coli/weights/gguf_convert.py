"""`coli convert model.gguf OUT`: a GGUF into a converted coli directory (what streaming
experts within --ram-budget needs). The model is built once from ``GGUFWeights`` through
a recorder that appends every tensor to the output as ``RecordingWeights`` does for a
Hugging Face directory (Q8_0/Q4_0 still repacked bit for bit); config.json,
tokenizer.json and tokenizer_config.json are written from the GGUF's metadata."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from coli.weights.converted import ConvertedWriter
from coli.weights.gguf import GGUFModel, GGUFWeights, hf_config
from coli.weights.gguf_vocab import tokenizer_from_gguf
from coli.weights.source import Weights


class _NoExperts:
    streamed = False
    table = None

    def __init__(self, E: int):
        import numpy as np

        self.counts = np.zeros(E, dtype=np.int64)


class GGUFRecording(Weights):
    """GGUFWeights that writes every tensor it hands out into a ConvertedWriter."""

    def __init__(self, inner: GGUFWeights, writer: ConvertedWriter, progress=None):
        self.inner, self.writer, self.progress = inner, writer, progress
        self.quant, self.head_quant = inner.quant, inner.head_quant

    def _tick(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress(n)

    def has(self, name):
        return self.inner.has(name)

    def __call__(self, name, *shape):
        arr = self.inner(name, *shape)
        self.writer.add_f32(name, arr)
        self._tick()
        return arr

    def matrix(self, name, rows, cols, fmt=None, row_order=None):
        m = self.inner.matrix(name, rows, cols, fmt, row_order)
        self.writer.add_matrix(name, m)
        self._tick()
        return m

    def experts(self, prefix, sub, names, E, H, I, k):
        mats = list(self.inner.expert_matrices(prefix, E, H, I, self.quant))
        self._tick(3)
        self.writer.add_experts(prefix, mats)
        return _NoExperts(E)


def fingerprint(g: GGUFModel) -> str:
    h = hashlib.sha256()
    for f in g.files:
        with open(f, "rb") as fh:
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(1 << 20))
    return h.hexdigest()


def convert_gguf(src: Path, out: Path, quant: str | None, head_quant: str | None, progress=None):
    """Write the converted model of GGUF ``src`` into the (empty) directory ``out``."""
    from coli.models import build_model

    g = GGUFModel(src)
    raw = hf_config(g)
    cfg = g.config()
    inner = GGUFWeights(g, quant, head_quant)
    writer = ConvertedWriter(out, inner.quant, inner.head_quant)
    build_model(cfg, GGUFRecording(inner, writer, progress))
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    tok = tokenizer_from_gguf(g)
    tok._backend.save(str(out / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens}
    if tok.chat_template:
        tcfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    writer.finish(fingerprint(g), cfg.model_type)
