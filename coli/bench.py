"""`coli bench`: prefill and decode speed, TTFT, expert hit rate and I/O of one model.

Each repeat uses its own random prompt (rotating prompts, so a cache cannot simply
replay one request), runs a fresh context's prefill, then decodes: greedy by default, or
with ``decode="random"`` each step is fed the next token of a seeded random continuation
instead of the argmax. A random-weight model's greedy tokens soon repeat one token, so its
routing repeats too and any expert cache hits almost always; fed varied tokens, its
routing moves the way a real conversation's does, which is what a cache A/B needs.
Reported numbers are medians over repeats, with min and max beside them.

The roofline is what memory bandwidth allows: the bytes a decode token must read (the
weights it uses, and the KV cache its attention reads at the run's mean context) over the
bandwidth the kernels' threads get from a buffer larger than the caches. The bandwidth is
probed right after each repeat's decode, so a run is judged against the memory it had: on
a machine shared with other work the available bandwidth moves between seconds, and one
probe at the end would compare every run with whatever that moment gave.
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from coli.engine import StepStats
from coli.kv.dtype import ITEMSIZE


@dataclass
class RunResult:
    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float
    hit_rate: float
    bytes_read_per_token: float
    io_wait_s: float
    bandwidth_bytes_s: float = 0.0  # the memory probe right after this run's decode
    roofline_fraction: float = 0.0  # decode_tok_s x (weights + KV read per token) / bandwidth_bytes_s


@dataclass
class BenchResult:
    model: str
    decode: str  # "greedy" or "random" decode input
    quant: str
    threads: int  # the most the kernels may use
    prompt_tokens: int
    gen_tokens: int
    repeats: int
    simd: str
    resident: dict
    kv_bytes_per_token: int
    kv_bytes_per_token_expanded: int  # what full per-head K/V would take (differs for MLA)
    peak_rss_bytes: int
    weight_bytes_per_token: int  # weights one decode token reads (dense matrices + top-k experts)
    kv_bytes_read_per_token: int  # KV cache a decode token's attention reads, at the runs' mean context
    bandwidth_bytes_s: float  # memory read bandwidth with the same threads: the median of the runs' probes
    roofline_tok_s: float  # bandwidth / (weight_bytes_per_token + kv_bytes_read_per_token)
    runs: list[RunResult] = field(default_factory=list)
    threads_in_use: int = 0  # at the end: fewer than threads while the machine was too busy (coli/threads.py)
    kv_cache_dtype: str = "f16"  # what the KV cache stores (--kv-cache-dtype)

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


DECODE_MODES = ("greedy", "random")


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux: VmHWM of its own address space, since
    getrusage's ru_maxrss carries a parent's peak over into a child started by fork + exec
    (multiprocessing's spawn), which would report the parent's memory as the child's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CLEAR_REFS = "/proc/self/clear_refs"  # Linux: writing 5 starts the peak RSS afresh from the current RSS


def _reset_peak_rss() -> None:
    with open(CLEAR_REFS, "w") as f:
        f.write("5")


def run(model, *, prompt_tokens: int = 128, gen_tokens: int = 64, repeats: int = 3, seed: int = 0,
        label: str = "", decode: str = "greedy") -> BenchResult:
    """Benchmark a loaded ``coli.Model``; ``decode`` is "greedy" or "random" (see above)."""
    from coli._engine import kernels as K

    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
    eng = model.engine
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, V, size=prompt_tokens).tolist() for _ in range(repeats + 1)]
    per_token = weight_bytes_per_token(model)
    kv_read = kv_bytes_read_per_token(model, prompt_tokens, gen_tokens)
    feeds = [rng.integers(2, V, size=gen_tokens).tolist() for _ in range(repeats + 1)]
    runs = []
    # a probe between runs needs the peak RSS reset after it (its buffer is not the model's);
    # where that cannot be done, one probe after the last run serves them all
    peak_rss, interleave = 0, os.access(CLEAR_REFS, os.W_OK)
    for r, prompt in enumerate(prompts):
        cache = eng.new_cache(prompt_tokens + gen_tokens)
        s0 = _copy(eng.totals)
        t0 = time.perf_counter()
        for i in range(0, len(prompt), 256):
            logits = eng.step([(cache, prompt[i : i + 256])])
        tok = int(np.argmax(logits[0]))
        ttft = time.perf_counter() - t0
        s1 = _copy(eng.totals)
        for j in range(gen_tokens):
            logits = eng.step([(cache, [tok])])
            tok = int(np.argmax(logits[0])) if decode == "greedy" else feeds[r][j]
        t_dec = time.perf_counter() - t0 - ttft
        dec = _delta(s1, eng.totals)
        if r == 0:
            continue  # warm-up: first-touch page faults, thread start, allocations
        peak_rss = max(peak_rss, peak_rss_bytes())  # the model's, before this run's bandwidth probe
        bw = 0.0
        if interleave:
            bw = memory_bandwidth(repeats=3)
            _reset_peak_rss()
        runs.append(RunResult(
            prefill_tok_s=prompt_tokens / (s1.seconds - s0.seconds),
            decode_tok_s=gen_tokens / t_dec,
            ttft_s=ttft,
            hit_rate=dec.experts_hit / dec.experts_needed if dec.experts_needed else 1.0,
            bytes_read_per_token=dec.bytes_read / gen_tokens,
            io_wait_s=dec.io_wait,
            bandwidth_bytes_s=bw,
        ))
    late = [x for x in runs if not x.bandwidth_bytes_s]
    if late:
        bw = memory_bandwidth()
        for x in late:
            x.bandwidth_bytes_s = bw
    for x in runs:
        x.roofline_fraction = x.decode_tok_s * (per_token + kv_read) / x.bandwidth_bytes_s
    bw = statistics.median(x.bandwidth_bytes_s for x in runs)
    layers = model.engine.model.layers
    item = ITEMSIZE[eng.kv_cache_dtype]
    kv_per_token = sum(l.attn.k_width + l.attn.v_width for l in layers) * item
    expanded = sum(l.attn.expanded_kv_width() if hasattr(l.attn, "expanded_kv_width")
                   else l.attn.k_width + l.attn.v_width for l in layers) * item
    w = model.weights
    return BenchResult(
        model=label or str(model.path), decode=decode, quant=getattr(w, "quant", "f32"), threads=eng.threads,
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, simd=K.simd_name(),
        resident=eng.resident_bytes(), kv_bytes_per_token=kv_per_token, kv_bytes_per_token_expanded=expanded,
        peak_rss_bytes=peak_rss, weight_bytes_per_token=per_token, kv_bytes_read_per_token=kv_read,
        bandwidth_bytes_s=bw, roofline_tok_s=bw / (per_token + kv_read), runs=runs, threads_in_use=eng.threads_in_use,
        kv_cache_dtype=eng.kv_cache_dtype)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step of one token reads: every dense weight (matrices,
    norms, routers, shared experts, MLA's absorbed projections) but the embedding table
    (one row of it), plus num_experts_per_tok experts of each MoE layer."""
    net = model.engine.model
    seen: set[int] = {id(net.embed)} if net.lm_head.mat is not net.embed else set()

    def size(obj) -> int:
        total = 0
        for v in vars(obj).values():
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, np.ndarray):
                total += v.nbytes
            elif hasattr(v, "mat"):  # Linear
                total += v.mat.nbytes + (v.bias.nbytes if v.bias is not None else 0)
            elif v.__class__.__name__ == "GatedMLP":
                total += size(v)
        return total

    total = (0 if id(net.lm_head.mat) in seen else net.lm_head.mat.nbytes) + net.norm.nbytes
    for layer in net.layers:
        total += size(layer.attn) + size(layer.mlp) + layer.input_norm.nbytes + layer.post_norm.nbytes
    for moe in net.moe_layers:
        total += moe.k * expert_bytes(moe)
    return total


def kv_bytes_read_per_token(model, prompt_tokens: int, gen_tokens: int) -> int:
    """Bytes of KV cache one decode step's attention reads, averaged over a run that decodes
    gen_tokens after a prompt of prompt_tokens: every layer reads its cached rows of the
    positions it attends (all before the token, or the last ``window`` of them)."""
    total = 0.0
    for layer in model.engine.model.layers:
        a = layer.attn
        width = (a.k_width + a.v_width) * ITEMSIZE[model.engine.kv_cache_dtype]  # f16 or f32 rows
        window = getattr(a, "window", 0) or 0
        for j in (0, gen_tokens - 1):  # attended positions grow by one per step: the mean of the ends
            n = prompt_tokens + 1 + j
            total += width * (min(n, window) if window > 0 else n) / 2
    return int(total)


def expert_bytes(moe) -> int:
    mats = moe.table.get(0)
    if mats[0] is None:  # streamed: slots hold whole experts
        return moe.experts.store.stride
    return sum(m.nbytes for m in mats)


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
