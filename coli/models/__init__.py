"""Architecture registry: ``model_type`` -> the module ``coli.models.<model_type>``.

Each architecture module is pure wiring over ``coli.models.base`` and exposes
``build(cfg, weights) -> DecoderLM``. Adding one is a new small file plus a line
here and a line in ``tests/test_models.py``.
"""
from __future__ import annotations

import importlib

from coli.config import ModelConfig
from coli.errors import UnsupportedModelError
from coli.models.base import DecoderLM

SUPPORTED = ("deepseek_v3", "gemma3_text", "glm4_moe", "llama", "mixtral", "olmoe", "qwen2", "qwen3", "qwen3_moe")


def build_model(cfg: ModelConfig, weights) -> DecoderLM:
    """``weights``: a coli.weights source (Hugging Face checkpoint or converted directory)."""
    if cfg.model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"config.json: model_type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    module = importlib.import_module(f"coli.models.{cfg.model_type}")
    return module.build(cfg, weights)
