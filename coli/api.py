"""The Python API: ``coli.load(path) -> Model``.

    model = coli.load("path/to/hf-model-dir")
    logits = model.forward(model.tokenizer.encode("Hello"))   # (T, vocab) float32
    for piece in model.generate([{"role": "user", "content": "Hi"}], max_tokens=64):
        print(piece, end="", flush=True)
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from coli.config import ModelConfig
from coli.engine import Engine, KVCache
from coli.errors import InvalidRequestError, ModelLoadError
from coli.models import build_model
from coli.quant import check_format
from coli.sampling import Sampler, SamplingParams
from coli.stops import StopMatcher
from coli.tokenizer import IncrementalDetokenizer, Tokenizer
from coli.weights.safetensors import Checkpoint
from coli.weights.converted import ConvertedWeights, is_converted
from coli.weights.source import HFWeights

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
PREFILL_CHUNK = 256  # prompt tokens per forward pass


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """An explicit path, else $COLI_MODEL, else the built-in default model."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get("COLI_MODEL")
    if env:
        return Path(env).expanduser()
    if (DEFAULT_MODEL_DIR / "config.json").exists():
        return DEFAULT_MODEL_DIR
    raise ModelLoadError("no model given: pass --model DIR (a Hugging Face model directory) or set COLI_MODEL")


def load(path: str | os.PathLike | None = None, *, threads: int | None = None,
         max_context: int | None = None, quant: str | None = None, head_quant: str | None = None,
         ram_budget: int | str | None = None, pin: int | str | None = None, io: str = "direct",
         prefetch: bool = False, **options) -> "Model":
    """Load a Hugging Face model directory or a converted coli directory.

    ``path`` defaults to $COLI_MODEL, then the built-in model. ``threads`` defaults to
    $COLI_THREADS, then the usable cores; ``max_context`` to the model's own.
    ``quant`` ("f32", "bf16", "int8", "int4", "int4s") is the format of linear layers and
    experts (Hugging Face directories default to f32; a converted directory has its
    own); ``head_quant`` that of the LM head and embeddings (default: the same,
    except int8 under int4 and int4s).

    Converted directories only: ``ram_budget`` (bytes or "2G") caps the RAM for
    experts (default: what is available); below the experts' size they are streamed
    from disk through per-layer caches with a ``pin`` ("512M") hot set learned from
    .coli_usage. ``io`` "direct" (default: bypass the page cache) or "buffered";
    ``prefetch`` reads the next layer's likely experts while a layer computes (off by
    default: on a disk-bound run its wrong guesses cost more reads than it saves; see
    BENCHMARKS.md)."""
    if options:
        raise InvalidRequestError(f"unknown load option(s): {', '.join(sorted(options))}")
    for q in (quant, head_quant):
        if q is not None:
            check_format(q)
    if io not in ("direct", "buffered"):
        raise InvalidRequestError(f"io must be 'direct' or 'buffered' (got {io!r})")
    model_dir = resolve_model_path(path)
    cfg = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    if is_converted(model_dir):
        weights = ConvertedWeights(model_dir, quant, head_quant, dict(
            ram_budget=_size(ram_budget, "ram_budget"), pin=_size(pin, "pin"), io=io, prefetch=prefetch))
    else:
        if ram_budget is not None or pin is not None:
            raise InvalidRequestError(f"{model_dir}: ram_budget and pin need a converted model "
                                      "(coli convert SRC DST --quant int4)")
        weights = HFWeights(Checkpoint(model_dir), quant or "f32", head_quant)
    net = build_model(cfg, weights)
    weights.finish()
    engine = Engine(net, threads=threads, max_context=max_context, weights=weights)
    return Model(model_dir, cfg, tokenizer, engine, weights)


def _size(v, name: str) -> int | None:
    if v is None or isinstance(v, int):
        return v
    from coli.experts.store import parse_size

    try:
        return parse_size(str(v))
    except ValueError as e:
        raise InvalidRequestError(f"{name}: {e}") from None


class Model:
    """A loaded model: ``forward`` for logits, ``generate`` for text."""

    def __init__(self, path: Path, config: ModelConfig, tokenizer: Tokenizer, engine: Engine, weights=None):
        self.path, self.config, self.tokenizer, self.engine = path, config, tokenizer, engine
        self.weights = weights
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_id)
        self.generation_defaults = _generation_defaults(path)

    def __repr__(self) -> str:
        c = self.config
        kind = f"{c.num_experts} experts top-{c.num_experts_per_tok}" if c.num_experts else "dense"
        return f"<coli.Model {c.model_type} {c.num_hidden_layers} layers, {kind}, from {self.path}>"

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh context: (len(token_ids), vocab_size) float32."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidRequestError("forward: token_ids is empty")
        cache = self.engine.new_cache(len(ids))
        out = np.empty((len(ids), self.config.vocab_size), dtype=np.float32)
        for i in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[i : i + PREFILL_CHUNK]
            out[i : i + len(chunk)] = self.engine.step([(cache, chunk)], all_logits=True)
        return out

    def prompt_ids(self, prompt_or_messages, *, raw: bool = False, **template_kwargs) -> list[int]:
        """Token ids of a prompt: a list of chat messages is rendered with the chat
        template; a string is rendered as one user message, or used as-is when raw."""
        if isinstance(prompt_or_messages, str):
            if raw:
                ids = self.tokenizer.encode(prompt_or_messages)
            else:
                ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt_or_messages}], **template_kwargs)
        else:
            ids = self.tokenizer.encode_chat(list(prompt_or_messages), **template_kwargs)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def generate(self, prompt_or_messages, *, max_tokens: int = 256, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, min_p: float = 0.0,
                 seed: int | None = None, stop: str | Sequence[str] | None = None, raw: bool = False,
                 cache: KVCache | None = None, **template_kwargs) -> Iterator[str]:
        """Stream the answer as text pieces.

        ``prompt_or_messages``: chat messages, or a string (a user message, or a raw
        prompt with ``raw=True``). Sampling defaults come from the model's
        generation_config.json (greedy when it does not sample). Generation ends at
        an end-of-turn token, a stop string (not included), or max_tokens.

        ``cache`` (from ``model.engine.new_cache()``) keeps a context across calls:
        the part of the new prompt it already holds is not computed again."""
        params = self.sampling_params(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
        params.validate()
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1 (got {max_tokens})")
        ids = self.prompt_ids(prompt_or_messages, raw=raw, **template_kwargs)
        return self._stream(ids, max_tokens, Sampler(params), StopMatcher(stop), cache)

    def sampling_params(self, *, temperature: float | None = None, top_p: float | None = None,
                        top_k: int | None = None, min_p: float = 0.0, seed: int | None = None) -> SamplingParams:
        """Sampling parameters with the model's generation_config.json filling what is None."""
        d = self.generation_defaults
        return SamplingParams(
            temperature=d.get("temperature", 0.0) if temperature is None else temperature,
            top_p=d.get("top_p", 1.0) if top_p is None else top_p,
            top_k=d.get("top_k", 0) if top_k is None else top_k,
            min_p=min_p, seed=seed)

    def _stream(self, ids: list[int], max_tokens: int, sampler: Sampler, stops: StopMatcher,
                cache: KVCache | None) -> Iterator[str]:
        room = self.engine.max_context - len(ids)
        if room <= 0:
            raise InvalidRequestError(
                f"context_length_exceeded: the prompt has {len(ids)} tokens, the context holds {self.engine.max_context}")
        max_tokens = min(max_tokens, room)
        if cache is None:
            cache = self.engine.new_cache(len(ids) + max_tokens)
        reuse = min(common_prefix(cache.tokens, ids), len(ids) - 1)  # recompute >= 1 token for its logits
        cache.truncate(reuse)
        detok = IncrementalDetokenizer(self.tokenizer)
        for i in range(reuse, len(ids), PREFILL_CHUNK):
            logits = self.engine.step([(cache, ids[i : i + PREFILL_CHUNK])])
        generated: list[int] = []
        while True:
            tok = sampler.sample(logits[0], generated)
            if tok in self.eos_ids:
                break
            generated.append(tok)
            text, done = stops.push(detok.push(tok))
            if text:
                yield text
            if done:
                return
            if len(generated) >= max_tokens:
                break
            logits = self.engine.step([(cache, [tok])])
        text, _ = stops.push(detok.flush())
        tail = text + stops.flush()
        if self.weights is not None:
            self.weights.flush()
        if tail:
            yield tail

    def close(self) -> None:
        """Save the routing history and release files and I/O threads."""
        if self.weights is not None:
            self.weights.close()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _generation_defaults(path: Path) -> dict:
    """Sampling defaults from generation_config.json; greedy unless it says do_sample."""
    try:
        g = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(g, dict) or not g.get("do_sample"):
        return {}
    return {k: g[k] for k in ("temperature", "top_p", "top_k") if isinstance(g.get(k), (int, float))}
