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
from coli.engine import Engine, KVCache, kv_dtype, release_threads
from coli.errors import InvalidRequestError, ModelLoadError
from coli.models import build_model
from coli.plan import check_before_load
from coli.quant import check_format
from coli.sampling import Sampler, SamplingParams
from coli.stops import StopMatcher
from coli.tokenizer import IncrementalDetokenizer, Tokenizer
from coli.weights.safetensors import Checkpoint
from coli.weights.converted import ConvertedWeights, is_converted
from coli.weights.gguf import is_gguf, open_gguf
from coli.weights.packing import pack_dense, pack_experts
from coli.weights.source import HFWeights

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
PREFILL_CHUNK = 256  # prompt tokens per forward pass


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """An explicit path, else $COLI_MODEL, else the built-in default model."""
    from coli.hub import resolve_name  # a path, or a hub name found in the local cache

    if path:
        return resolve_name(str(path))
    env = os.environ.get("COLI_MODEL")
    if env:
        return resolve_name(env)
    if (DEFAULT_MODEL_DIR / "config.json").exists():
        return DEFAULT_MODEL_DIR
    raise ModelLoadError("no model given: pass --model DIR (a Hugging Face model directory) or set COLI_MODEL")


def load(path: str | os.PathLike | None = None, *, threads: int | None = None,
         max_context: int | None = None, quant: str | None = None, head_quant: str | None = None,
         ram_budget: int | str | None = None, pin: int | str | None = None, io: str = "direct",
         prefetch: bool = False, process_budget: int | str | None = None,
         kv_cache_dtype: str | None = None, progress=None, **options) -> "Model":
    """Load a Hugging Face model directory or a converted coli directory.

    ``path`` defaults to $COLI_MODEL, then the built-in model. ``threads`` defaults to
    $COLI_THREADS, then the usable cores; ``max_context`` to the model's own.
    ``quant`` ("f32", "bf16", "int8", "int4", "int4s") is the format of linear layers and
    experts (Hugging Face directories default to f32; a converted directory has its
    own); ``head_quant`` that of the LM head and embeddings (default: the same,
    except int8 under int4 and int4s).

    ``process_budget`` (bytes or "2G", what the CLI's --ram-budget sets) is the whole
    process's memory: the RAM for experts is what it leaves after the dense weights, KV
    and buffers (see coli.plan). Converted directories only: ``ram_budget`` caps the RAM for
    experts alone (default: what is available, or what a cgroup limit leaves); below the experts' size they are streamed
    from disk through per-layer caches with a ``pin`` ("512M") hot set learned from
    .coli_usage (``pin="auto"``: half the budget, ranked by the model's expert atlas too). ``io`` "direct" (default: bypass the page cache) or "buffered";
    ``prefetch`` reads the next layer's likely experts while a layer computes (off by
    default: on a disk-bound run its wrong guesses cost more reads than it saves; see
    BENCHMARKS.md). ``kv_cache_dtype`` is what the KV cache stores: "f16" (the default, or
    $COLI_KV_CACHE_DTYPE) or "f32". ``progress(done, total)`` is called as the tensors of a Hugging Face
    directory are read (and quantized)."""
    if options:
        raise InvalidRequestError(f"unknown load option(s): {', '.join(sorted(options))}")
    for q in (quant, head_quant):
        if q is not None:
            check_format(q)
    if io not in ("direct", "buffered"):
        raise InvalidRequestError(f"io must be 'direct' or 'buffered' (got {io!r})")
    kv_cache_dtype = kv_dtype(kv_cache_dtype)
    model_dir = resolve_model_path(path)
    # the memory check, before any weight is read; --ram-budget is the whole process
    plan, experts_budget = check_before_load(model_dir, quant, head_quant, max_context,
                                             _size(process_budget, "process_budget"), kv_cache_dtype)
    if ram_budget is not None:  # the Python API's experts-only budget
        experts_budget = _size(ram_budget, "ram_budget")
    if is_gguf(model_dir):  # a GGUF file: config, tokenizer and weights all come from it
        streams = ram_budget is not None or plan.experts < plan.experts_total  # experts would not all fit
        cfg, tokenizer, weights = open_gguf(model_dir, quant, head_quant,
                                            (ram_budget or process_budget) if streams else None)
    else:
        cfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        if is_converted(model_dir):
            store = dict(ram_budget=experts_budget, io=io, prefetch=prefetch)
            if pin == "auto":  # the hot set ranked by the expert atlas too (coli atlas)
                from coli.atlas.pinning import pin_prior

                store.update(pin=None, pin_prior=pin_prior(model_dir))
            else:
                store["pin"] = _size(pin, "pin")
            weights = ConvertedWeights(model_dir, quant, head_quant, store)
        else:
            if ram_budget is not None or pin is not None:
                raise InvalidRequestError(f"{model_dir}: ram_budget and pin need a converted model "
                                          "(coli convert SRC DST --quant int4)")
            ckpt = Checkpoint(model_dir)
            if progress is not None:
                ckpt.on_read = progress
            weights = HFWeights(ckpt, quant or "f32", head_quant)
    net = build_model(cfg, weights)
    weights.finish()
    pack_dense(net)
    pack_experts(net)
    engine = Engine(net, threads=threads, max_context=max_context, weights=weights, kv_cache_dtype=kv_cache_dtype)
    model = Model(model_dir, cfg, tokenizer, engine, weights)
    model.plan = plan
    if is_gguf(model_dir):  # `coli list` shows the GGUFs given by path
        from coli.models_cache import remember_gguf

        remember_gguf(model_dir)
    return model


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

    def score_options(self, prefix_ids: Sequence[int], options: Sequence[Sequence[int]]) -> list[tuple[float, ...]]:
        """Each option's per-token log-probabilities after ``prefix_ids``: the prefix is
        computed once, the options in batched steps (``coli.scoring``). Nothing is generated."""
        from coli.scoring import score_options

        return score_options(self.engine, prefix_ids, options, chunk=PREFILL_CHUNK)

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
        try:
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
        finally:  # retire this thread's OpenMP workers: a Runner's thread may compute next (coli.threads)
            release_threads()

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
