"""The memory plan: will this model fit, before a single weight is read?

Weights at the chosen format (from tensor shapes in the file headers: safetensors
headers, GGUF tensor infos, a converted manifest) + the KV cache for the context and
slots + working buffers + the runtime itself, against the memory this process can
really use: MemAvailable, the cgroup's limit minus its usage (cgroup v2 and v1), or
``COLI_MEMORY_LIMIT`` (bytes or ``2G``; an override for tests and for sharing a
machine). Swap is not counted: a model that only fits in swap runs at disk speed.

For a converted MoE model the experts take ``--ram-budget`` minus everything else
(``--ram-budget`` is the whole process); without one, under a cgroup limit, the budget
is taken from that limit (``auto_ram_budget``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from coli.errors import ModelLoadError

BYTES = {"f32": 4.0, "bf16": 2.0, "int8": 1.0 + 2 / 32, "int4": 0.5 + 4 / 32, "int4s": 0.5 + 2 / 32}
RUNTIME = 160 << 20  # the interpreter, NumPy, tokenizers and the engine's own code, measured ~150 MiB
MIN_CTX = 512  # the least context per slot worth starting with
HEAD_NAMES = ("embed_tokens", "lm_head", "token_embd", "output.weight")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def parse_size(text: str) -> int:
    from coli.experts.store import parse_size as p

    return p(text)


def _cgroup_limit() -> int | None:
    """Memory left under this process's cgroup limit (limit - usage), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrl, path = parts[1], parts[2]
        if ctrl == "":  # v2
            base, limit_f, usage_f = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in ctrl.split(","):
            base, limit_f, usage_f = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        d = base / path.lstrip("/")
        while True:  # the tightest limit on the way up
            try:
                raw = (d / limit_f).read_text().strip()
                if raw != "max" and int(raw) < 1 << 60:
                    left = int(raw) - int((d / usage_f).read_text().strip())
                    best = left if best is None else min(best, left)
            except (OSError, ValueError):
                pass
            if d == base or d.parent == d:
                break
            d = d.parent
    return best


def usable_memory() -> tuple[int | None, str]:
    """(bytes this process can still use, where the number comes from)."""
    env = os.environ.get("COLI_MEMORY_LIMIT")
    if env:
        try:
            return parse_size(env), "COLI_MEMORY_LIMIT"
        except ValueError as e:
            raise ModelLoadError(f"COLI_MEMORY_LIMIT={env!r}: {e}") from None
    from coli.engine import available_memory

    avail, cg = available_memory(), _cgroup_limit()
    if cg is not None and (avail is None or cg < avail):
        return max(cg, 0), "cgroup limit"
    return avail, "MemAvailable"


@dataclass
class Plan:
    model: str
    quant: str
    head_quant: str
    weights: int  # dense part
    experts: int  # expert bytes held in RAM (all, or the cache a budget leaves)
    experts_total: int
    kv_per_token: int
    ctx: int
    kv_slots: int
    buffers: int
    usable: int | None
    usable_from: str
    notes: list[str] = field(default_factory=list)

    @property
    def kv(self) -> int:
        return self.kv_per_token * self.ctx * self.kv_slots

    @property
    def total(self) -> int:
        return self.weights + self.experts + self.kv + self.buffers + RUNTIME

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def rows(self) -> list[tuple[str, str, str]]:
        exp = "" if self.experts == self.experts_total else f" (of {_gib(self.experts_total)}, rest streamed)"
        out = [("weights", _gib(self.weights), f"{self.quant}, head {self.head_quant}")]
        if self.experts_total:
            out.append(("experts", _gib(self.experts), self.quant + exp))
        out += [("kv cache", _gib(self.kv), f"{self.ctx} tokens x {self.kv_slots} slot(s), {self.kv_per_token} B/token"),
                ("buffers", _gib(self.buffers), "activations of one prefill chunk"),
                ("runtime", _gib(RUNTIME), "interpreter and libraries"),
                ("total", _gib(self.total), "fits" if self.fits else "does NOT fit"),
                ("usable", _gib(self.usable) if self.usable is not None else "unknown", self.usable_from)]
        return out

    def as_dict(self) -> dict:
        return {"model": self.model, "quant": self.quant, "head_quant": self.head_quant, "weights_bytes": self.weights,
                "experts_bytes": self.experts, "kv_bytes": self.kv, "ctx": self.ctx, "kv_slots": self.kv_slots,
                "buffers_bytes": self.buffers + RUNTIME, "total_bytes": self.total, "usable_bytes": self.usable,
                "usable_from": self.usable_from, "fits": self.fits}

    def refusal(self) -> str:
        """One line: what does not fit, and what would."""
        short = f"{self.model}: needs about {_gib(self.total)} ({_gib(self.weights + self.experts)} weights at " \
                f"{self.quant}, {_gib(self.kv)} KV for {self.ctx} tokens x {self.kv_slots} slot(s)) but only " \
                f"{_gib(self.usable or 0)} is usable ({self.usable_from})"
        return short + "; " + "; ".join(self.suggestions()) if self.suggestions() else short

    def suggestions(self) -> list[str]:
        out, room = [], (self.usable or 0) - self.buffers - RUNTIME
        for q in ("int8", "int4"):
            if BYTES[q] < BYTES[self.quant] and self.quant not in ("int4", "int4s"):
                w = (self.weights + self.experts_total) * BYTES[q] / BYTES[self.quant]
                if w + self.kv_per_token * MIN_CTX * self.kv_slots <= room:
                    out.append(f"try --quant {q}")
                    break
        if self.experts_total:
            budget = room - self.weights - self.kv
            if budget > 0:
                out.append(f"convert it (coli convert) and pass --ram-budget {max(budget >> 30, 1)}G to stream experts")
        if self.kv and self.weights + self.experts < room:
            fit = (room - self.weights - self.experts) // max(self.kv_per_token * self.kv_slots, 1)
            if fit >= MIN_CTX // 4:
                out.append(f"or a smaller --ctx (about {int(fit)} fits) or fewer --kv-slots")
        return out


def _cache_head_dim(cfg) -> int:
    """The widest row of one head the attention reads from the cache (MLA: its latent and
    rotary parts), as the model's layers report it (``cache_head_dim``)."""
    r = cfg.raw
    if cfg.model_type == "deepseek_v3":
        return int(r.get("kv_lora_rank") or 0) + int(r.get("qk_rope_head_dim") or 0)
    return cfg.head_dim


def kv_cache_dtype_of(cfg, requested: str | None) -> str:
    """The KV cache dtype an engine of this model will use: the one requested (or the
    default), except f32 where the heads are wider than an f16 cache's attention reads
    (Engine: ``model.f16_kv_ok()``)."""
    from coli._engine import kernels as K
    from coli.kv.dtype import kv_dtype

    dt = kv_dtype(requested)
    return "f32" if dt == "f16" and _cache_head_dim(cfg) > K.F16_HEAD_MAX else dt


def _kv_per_token(cfg, itemsize: int = 2) -> int:
    """KV bytes of one token, every layer, at ``itemsize`` bytes a value (f16: 2)."""
    if cfg.model_type == "deepseek_v3":
        return cfg.num_hidden_layers * _cache_head_dim(cfg) * itemsize
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize


F32_MATRICES = ("kv_b_proj", "attn_kv_b", "attn_k_b", "attn_v_b")  # MLA's absorbed kv_b is held in f32


def _tensor_bytes(shapes, quant: str, head_quant: str) -> tuple[int, int]:
    """(dense, experts) bytes of (name, shape) tensors at the chosen formats."""
    dense = experts = 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        if len(shape) < 2 or any(f in name for f in F32_MATRICES):
            dense += 4 * n
        elif any(h in name for h in HEAD_NAMES):
            dense += int(n * BYTES[head_quant])
        elif ".experts." in name or "_exps" in name or len(shape) == 3:
            experts += int(n * BYTES[quant])
        else:
            dense += int(n * BYTES[quant])
    return dense, experts


def make_plan(path: str | os.PathLike, *, quant: str | None = None, head_quant: str | None = None,
              ctx: int | None = None, kv_slots: int = 1, ram_budget: int | None = None,
              kv_cache_dtype: str | None = None) -> Plan:
    """The plan for loading ``path`` (a resolved model path); reads headers only."""
    from coli.config import ModelConfig
    from coli.weights.converted import is_converted, read_manifest
    from coli.weights.gguf import GGUFWeights, is_gguf, open_model
    from coli.weights.source import default_head_quant

    path = Path(path)
    notes: list[str] = []
    if is_gguf(path):
        g = open_model(path)
        cfg = g.config()
        w = GGUFWeights(g, quant, head_quant)
        quant, head_quant = w.quant, w.head_quant
        shapes = [(n, tuple(int(d) for d in t.shape)) for n, t in g.tensors.items()
                  if not n.startswith("blk.") or int(n.split(".")[1]) < cfg.num_hidden_layers]  # not MTP blocks
        dense, exp = _tensor_bytes(shapes, quant, head_quant)
    elif is_converted(path):
        cfg = ModelConfig.from_dir(path)
        m = read_manifest(path)
        quant, head_quant = m["quant"], m["head_quant"]
        dense, exp = m["dense"]["bytes"], m["experts"]["bytes"]
    else:
        from coli.weights.safetensors import Checkpoint

        cfg = ModelConfig.from_dir(path)
        quant = quant or "f32"
        head_quant = head_quant or default_head_quant(quant)
        ck = Checkpoint(path)
        dense, exp = _tensor_bytes([(n, ck.shape(n)) for n in ck.names()], quant, head_quant)
    usable, source = usable_memory()
    from coli.kv.dtype import ITEMSIZE

    per_token = _kv_per_token(cfg, ITEMSIZE[kv_cache_dtype_of(cfg, kv_cache_dtype)])
    buffers = 256 * (4 * cfg.hidden_size + 3 * max(cfg.intermediate_size, cfg.moe_intermediate_size)
                     + cfg.vocab_size) * 4
    held = exp
    if ram_budget is not None and exp:
        held = min(exp, max(ram_budget - dense - buffers - RUNTIME - per_token * MIN_CTX * kv_slots, 0))
        if held < exp:
            notes.append(f"--ram-budget {_gib(ram_budget)} leaves {_gib(held)} for experts")
    if ctx is None:  # the runner caps the model's context to memory: plan with what will be left
        room = (usable or 1 << 62) - dense - held - buffers - RUNTIME
        ctx = int(min(cfg.max_position_embeddings, max(MIN_CTX, room // 2 // max(per_token * kv_slots, 1))))
        ctx = min(ctx, cfg.max_position_embeddings)
    return Plan(str(path), quant, head_quant, dense, held, exp, per_token, ctx, kv_slots, buffers, usable, source, notes)


def check(plan: Plan) -> None:
    if not plan.fits:
        raise ModelLoadError(plan.refusal())


def auto_ram_budget(path: str | os.PathLike) -> int | None:
    """With no --ram-budget, a converted MoE model under a cgroup limit (or
    COLI_MEMORY_LIMIT) takes the limit as its budget, so it streams instead of being killed."""
    usable, source = usable_memory()
    if source == "MemAvailable" or usable is None:
        return None
    return usable


def check_before_load(path, quant=None, head_quant=None, ctx=None, ram_budget=None,
                      kv_cache_dtype=None) -> tuple[Plan, int | None]:
    """The plan of loading ``path``; raises the one-line refusal when it does not fit.
    Also returns the RAM for experts of a converted MoE model: what ``ram_budget`` (the
    whole process) leaves after everything else, or under a cgroup limit /
    COLI_MEMORY_LIMIT with no budget, what that limit leaves; None: the store's default."""
    from coli.weights.converted import is_converted

    converted = is_converted(path)
    budget = ram_budget
    if budget is None and converted:
        budget = auto_ram_budget(path)
    plan = make_plan(path, quant=quant, head_quant=head_quant, ctx=ctx, ram_budget=budget, kv_cache_dtype=kv_cache_dtype)
    if ram_budget is not None and (plan.usable is None or ram_budget < plan.usable):
        plan.usable, plan.usable_from = ram_budget, "--ram-budget"  # the whole process must fit in it
    if budget is None and converted and plan.experts_total and plan.usable is not None:
        # the store streams what MemAvailable does not hold: count what it will keep
        plan.experts = min(plan.experts_total, max(plan.usable - plan.weights - plan.kv - plan.buffers - RUNTIME, 0))
    check(plan)
    return plan, (plan.experts if budget is not None and converted and plan.experts_total else None)
