"""What the server tells about itself: /health, /metrics, /experts, /profile.

None of these calls the engine or takes a KV slot: they read counters the scheduler and
the engine keep as they run (reading them from another thread may see one step late).
"""
from __future__ import annotations

import base64
import os
import time
from collections import deque
from dataclasses import asdict

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
# The text exposition format 0.0.4, as the spec says (prometheus_client >= 0.21 labels its output 1.0.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

from coli.scheduler import Profile, Usage
from coli.server.security import AUTHENTICATED

TIER_DISK, TIER_RAM, TIER_PINNED = 0, 1, 2
PHASES = ("io_wait_seconds", "expert_matmul_seconds", "attention_seconds", "dense_mlp_seconds", "lm_head_seconds")


class ServerMetrics:
    """Series of the HTTP layer (beside the scheduler's ``colibri_scheduler_*``)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests_total = Counter("colibri_server_requests", "HTTP requests answered, by endpoint and status",
                                      ["endpoint", "status"], registry=r)
        self.streams_open = Gauge("colibri_server_streams_open", "Streaming responses in progress", registry=r)
        self.disconnects_total = Counter("colibri_server_disconnects",
                                         "Requests cancelled because their client went away", registry=r)
        self.dropped_total = Counter("colibri_server_streams_dropped",
                                     "Streams dropped because their client stopped reading (byte ceiling)",
                                     registry=r)


class Telemetry:
    def __init__(self, server):
        self.server = server
        self.metrics = ServerMetrics()
        self.turns: deque[dict] = deque(maxlen=server.config.profile_window)
        self.started = time.time()

    def record_turn(self, wall: float, profile: Profile, usage: Usage) -> None:
        """One finished generation, for GET /profile."""
        p = asdict(profile)
        named = sum(p[k] for k in PHASES)
        self.turns.append({
            "finished_at": round(time.time(), 3), "wall_seconds": wall,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens, "forward_passes": profile.steps,
            "disk_seconds": profile.disk_seconds, **{k: p[k] for k in PHASES},
            "other_seconds": max(0.0, wall - named),
            "experts_needed": profile.experts_needed, "experts_hit": profile.experts_hit,
            "bytes_read": profile.bytes_read,
            "draft_tokens": profile.draft_tokens, "accepted_tokens": profile.accepted_tokens,
            "tokens_per_second": usage.completion_tokens / profile.decode_seconds if profile.decode_seconds else None,
        })

    # -- handlers -----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        s = self.server
        snap = s.runner.scheduler.snapshot()
        body = {"status": "closed" if s.runner.scheduler.closed else "ok", **snap}
        if request.get(AUTHENTICATED):
            engine = s.model.engine
            tiers = engine.resident_bytes()
            body.update({
                "model": s.model_id, "context": s.runner.ctx, "kv_cache_dtype": getattr(engine, "kv_cache_dtype", "f32"),
                "uptime_seconds": round(time.time() - self.started, 3),
                "memory": {"dense_bytes": tiers["dense"], "experts_pinned_bytes": tiers["pinned"],
                           "experts_ram_bytes": tiers["cached"], "experts_disk_bytes": tiers["disk"]},
                "hardware": {"threads": engine.threads, "threads_in_use": engine.threads_in_use,
                             "cpus": os.cpu_count(), "simd": _simd()},
            })
            if getattr(s.model, "plan", None) is not None:  # the memory plan it was loaded with (coli.plan)
                body["plan"] = s.model.plan.as_dict()
        return web.json_response(body, status=200 if body["status"] == "ok" else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        data = generate_latest(self.server.runner.metrics.registry) + generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})

    async def experts(self, request: web.Request) -> web.Response:
        return web.json_response(self.expert_grid())

    async def profile(self, request: web.Request) -> web.Response:
        t = self.server.model.engine.totals
        return web.json_response({
            "window": self.turns.maxlen, "turns": list(self.turns),
            "totals": {"forward_passes": self.server.runner.steps, "tokens": t.tokens, "seconds": t.seconds,
                       "io_wait_seconds": t.io_wait, "disk_seconds": t.disk, "expert_matmul_seconds": t.expert_matmul,
                       "attention_seconds": t.attention, "dense_mlp_seconds": t.dense_mlp,
                       "lm_head_seconds": t.lm_head, "other_seconds": t.other, "experts_needed": t.experts_needed,
                       "experts_hit": t.experts_hit, "bytes_read": t.bytes_read},
        })

    # -- the expert grid ----------------------------------------------------------------------

    def expert_grid(self) -> dict:
        """rows = MoE layers, cols = experts per layer; one byte per expert: tier << 6 | heat,
        heat = bit length of the expert's routing count (a log2 bucket, capped at 63)."""
        engine = self.server.model.engine
        layers = engine.model.moe_layers
        rows, cols = len(layers), (layers[0].E if layers else 0)
        cells = np.zeros((rows, cols), dtype=np.uint8)
        routed = np.zeros((rows, cols), dtype=bool)
        last = engine.last  # one StepStats object per step, replaced whole: a consistent read
        for i, m in enumerate(layers):
            counts = np.asarray(m.counts, dtype=np.int64)
            heat = np.minimum(63, np.floor(np.log2(np.maximum(counts, 1))).astype(np.int64) + (counts > 0))
            cells[i] = (heat | (_tiers(m.experts, cols) << 6)).astype(np.uint8)
            if i < len(last.routed) and len(last.routed[i]):
                routed[i, np.unique(last.routed[i])] = True
        bits = np.packbits(routed.reshape(-1), bitorder="little") if rows else np.zeros(0, np.uint8)
        return {"rows": rows, "cols": cols, "seq": self.server.runner.steps,
                "tiers": {"0": "disk", "1": "ram", "2": "pinned"},
                "cells": base64.b64encode(cells.tobytes()).decode(),
                "routed": base64.b64encode(bits.tobytes()).decode(), "routed_tokens": int(last.tokens)}


def _tiers(experts, cols: int) -> np.ndarray:
    """(E,) tier of each expert of one layer's source (coli.experts.store)."""
    if not getattr(experts, "streamed", False):
        return np.full(cols, TIER_RAM, dtype=np.int64)
    slot = np.asarray(experts.slot_of)
    tiers = np.where(slot >= 0, TIER_RAM, TIER_DISK).astype(np.int64)
    held = slot >= 0
    tiers[held & experts.pinned[np.maximum(slot, 0)]] = TIER_PINNED
    return tiers


def _simd() -> str:
    try:
        from coli._engine import kernels

        return kernels.simd_name()
    except Exception:  # an old build without the probe
        return "unknown"
