"""`coli convert`: a Hugging Face directory -> a converted coli directory.

The model is built once through ``RecordingWeights``, which quantizes every tensor the
architecture asks for and appends it to the output files as it goes, so the converted
directory holds exactly what loading needs, in the format it needs. Output is written
under a temporary name beside the destination and renamed at the end: an interrupted
conversion leaves no directory that loads.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from coli import colscale
from coli.config import ModelConfig
from coli.errors import InvalidRequestError
from coli.quant import check_format
from coli.weights.converted import CARRIED_FILES, COL_SCALE, ConvertedWriter, is_converted, source_fingerprint
from coli.weights.safetensors import Checkpoint
from coli.weights.source import HFWeights, default_head_quant


class _NoExperts:
    """What the recorded model holds instead of experts (they went to experts.bin)."""

    streamed = False
    table = None

    def __init__(self, E: int):
        self.counts = np.zeros(E, dtype=np.int64)


class RecordingWeights(HFWeights):
    """HFWeights that writes every tensor it hands out into a ConvertedWriter."""

    def __init__(self, ckpt: Checkpoint, quant: str, head_quant: str, writer: ConvertedWriter, progress=None,
                 calibration=None):
        super().__init__(ckpt, quant, head_quant, calibration)
        self.writer, self.progress = writer, progress

    def _tick(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress(n)

    def __call__(self, name, *shape):
        arr = super().__call__(name, *shape)
        self.writer.add_f32(name, arr)
        self._tick()
        return arr

    def matrix(self, name, rows, cols, fmt=None, row_order=None):
        m = super().matrix(name, rows, cols, fmt, row_order)
        self.writer.add_matrix(name, m)
        self._tick()
        return m

    def scaled_matrix(self, name, rows, cols, fmt=None, norm=None):
        if (fmt or self.quant) not in colscale.FORMATS:  # a plain matrix, written by self.matrix
            return self.matrix(name, rows, cols, fmt), None
        m, s = super().scaled_matrix(name, rows, cols, fmt, norm)
        self.writer.add_matrix(name, m)
        if s is not None:
            self.writer.add_f32(name + COL_SCALE, s)
        self._tick()
        return m, s

    def experts(self, prefix, sub, names, E, H, I, k):
        mats = []
        for e, tensors in enumerate(self.expert_tensors(prefix, sub, names, E, H, I)):
            mats.append(self.quantize_expert(prefix, sub, names, e, tensors))
            self._tick(3)
        self.writer.add_experts(prefix, mats)
        return _NoExperts(E)


def convert(src: str | os.PathLike, dst: str | os.PathLike, quant: str = "int4", *, head_quant: str | None = None,
            force: bool = False, progress=None, calibration: list[str] | dict | None = None,
            calibration_progress=None) -> Path:
    """Convert ``src`` (a Hugging Face directory or a GGUF file) into ``dst``; returns dst.

    ``progress(n_tensors)`` is called as tensors are written (total: ``count_tensors``).
    ``calibration``: texts to run ``src`` on in f32 first (coli.calibration.collect), or
    what collect returned for them; int4 matrices are then rounded by GPTQ against their
    inputs' E[x x^T] (``calibration_progress(done, total)`` per piece of text)."""
    from coli.models import build_model

    from coli.weights.gguf import is_gguf

    src, dst = Path(src), Path(dst)
    check_format(quant)
    head_quant = check_format(head_quant or default_head_quant(quant))
    if is_converted(src):
        raise InvalidRequestError(f"{src}: already a converted coli directory")
    gguf = is_gguf(src)  # a GGUF file: coli.weights.gguf_convert writes config, tokenizer and tensors
    if calibration is not None:
        if gguf:
            raise InvalidRequestError(f"{src}: calibration needs a Hugging Face directory (a GGUF's tensors are "
                                      "repacked or re-rounded as they are)")
        if "int4" not in (quant, head_quant):
            raise InvalidRequestError(f"calibration weights int4's rounding only; --quant {quant} and --head-quant "
                                      f"{head_quant} have none")
    cfg = None if gguf else ModelConfig.from_dir(src)
    ckpt = None if gguf else Checkpoint(src)
    if dst.exists() and not force:
        raise InvalidRequestError(f"{dst}: already exists; pass --force to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
    try:
        if gguf:
            from coli.weights.gguf_convert import convert_gguf

            convert_gguf(src, tmp, quant, head_quant, progress)
        else:
            stats = None
            if isinstance(calibration, dict):
                stats = calibration
            elif calibration is not None:
                from coli.calibration import collect

                stats = collect(src, calibration, progress=calibration_progress)
            writer = ConvertedWriter(tmp, quant, head_quant)
            recorder = RecordingWeights(ckpt, quant, head_quant, writer, progress, stats)
            net = build_model(cfg, recorder)
            from coli.speculate import mtp

            if mtp.present(cfg, recorder):  # DeepSeek-V3 / GLM-4.5 MTP layers: kept for --speculative mtp
                mtp.MTPLayer(cfg, recorder, net)
            for name in CARRIED_FILES:
                if (src / name).exists():
                    shutil.copy2(src / name, tmp / name)
            writer.finish(source_fingerprint(src), cfg.model_type)
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def count_tensors(src: str | os.PathLike) -> int:
    from coli.weights.gguf import GGUFModel, is_gguf

    return len(GGUFModel(src).tensors) if is_gguf(src) else len(Checkpoint(src).names())
