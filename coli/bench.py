"""`coli bench`: prefill and decode speed, TTFT, expert hit rate and I/O of one model.

Each repeat uses its own random prompt (rotating prompts, so a cache cannot simply
replay one request), runs a fresh context's prefill, then greedy decode. Reported
numbers are medians over repeats, with min and max beside them.
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from coli.engine import StepStats


@dataclass
class RunResult:
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float
    hit_rate: float
    bytes_read_per_token: float
    io_wait_s: float


@dataclass
class BenchResult:
    model: str
    quant: str
    threads: int
    prompt_tokens: int
    gen_tokens: int
    repeats: int
    simd: str
    resident: dict
    kv_bytes_per_token: int
    peak_rss_bytes: int
    weight_bytes_per_token: int  # weights one decode token reads (dense matrices + top-k experts)
    bandwidth_bytes_s: float  # memory read bandwidth measured with the same threads
    roofline_tok_s: float  # bandwidth / weight_bytes_per_token
    runs: list[RunResult] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(getattr(r, key) for r in self.runs)

    def spread(self, key: str) -> tuple[float, float]:
        vals = [getattr(r, key) for r in self.runs]
        return min(vals), max(vals)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["median"] = {k: self.median(k) for k in RunResult.__dataclass_fields__}
        return d


def _delta(a: StepStats, b: StepStats) -> StepStats:
    d = StepStats()
    for f in ("tokens", "seconds", "io_wait", "experts_needed", "experts_hit", "bytes_read"):
        setattr(d, f, getattr(b, f) - getattr(a, f))
    return d


def _copy(s: StepStats) -> StepStats:
    c = StepStats()
    c += s
    return c


def run(model, *, prompt_tokens: int = 128, gen_tokens: int = 64, repeats: int = 3, seed: int = 0,
        label: str = "") -> BenchResult:
    """Benchmark a loaded ``coli.Model``."""
    from coli._engine import kernels as K

    eng = model.engine
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, V, size=prompt_tokens).tolist() for _ in range(repeats + 1)]
    runs = []
    for r, prompt in enumerate(prompts):
        cache = eng.new_cache(prompt_tokens + gen_tokens)
        s0 = _copy(eng.totals)
        t0 = time.perf_counter()
        for i in range(0, len(prompt), 256):
            logits = eng.step([(cache, prompt[i : i + 256])])
        tok = int(np.argmax(logits[0]))
        ttft = time.perf_counter() - t0
        s1 = _copy(eng.totals)
        for _ in range(gen_tokens):
            logits = eng.step([(cache, [tok])])
            tok = int(np.argmax(logits[0]))
        t_dec = time.perf_counter() - t0 - ttft
        dec = _delta(s1, eng.totals)
        if r == 0:
            continue  # warm-up: first-touch page faults, thread start, allocations
        runs.append(RunResult(
            prefill_tok_s=prompt_tokens / (s1.seconds - s0.seconds),
            decode_tok_s=gen_tokens / t_dec,
            ttft_s=ttft,
            hit_rate=dec.experts_hit / dec.experts_needed if dec.experts_needed else 1.0,
            bytes_read_per_token=dec.bytes_read / gen_tokens,
            io_wait_s=dec.io_wait,
        ))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the bandwidth probe's buffer
    per_token = weight_bytes_per_token(model)
    bw = memory_bandwidth()
    attn = model.engine.model.layers[0].attn
    kv_per_token = 2 * attn.nkv * attn.hd * 4 * model.config.num_hidden_layers
    w = model.weights
    return BenchResult(
        model=label or str(model.path), quant=getattr(w, "quant", "f32"), threads=eng.threads,
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, simd=K.simd_name(),
        resident=eng.resident_bytes(), kv_bytes_per_token=kv_per_token,
        peak_rss_bytes=peak_rss, weight_bytes_per_token=per_token, bandwidth_bytes_s=bw, roofline_tok_s=bw / per_token, runs=runs)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step of one token reads: every matrix but the embedding
    table (one row of it), plus num_experts_per_tok experts of each MoE layer."""
    net = model.engine.model
    total = sum(m.nbytes for m in _matrices(net) if m is not net.embed)
    if net.lm_head.mat is net.embed:
        total += net.embed.nbytes
    for moe in net.moe_layers:
        total += moe.k * expert_bytes(moe)
    return total


def expert_bytes(moe) -> int:
    mats = moe.table.get(0)
    if mats[0] is None:  # streamed: slots hold whole experts
        return moe.experts.store.stride
    return sum(m.nbytes for m in mats)


def _matrices(net):
    for layer in net.layers:
        a = layer.attn
        yield from (a.q_proj.mat, a.k_proj.mat, a.v_proj.mat, a.o_proj.mat)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "mat"):
            yield from (layer.mlp.gate.mat, layer.mlp.up.mat, layer.mlp.down.mat)
    yield net.lm_head.mat


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second the kernels' threads read from a buffer much larger than the caches
    (best of ``repeats``)."""
    from coli._engine import kernels as K

    buf = np.ones(nbytes // 8, dtype=np.int64)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        K.read_bytes(buf)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best
