"""The routing pane's data: one cell per expert per MoE layer, as plain arrays.

A cell has a tier (where the expert's weights live: disk, RAM, or pinned in RAM), a
heat (how many tokens were routed to it, as a log2 bucket 0..63) and a flash (1.0 when
the latest step routed a token to it, decaying step by step). The byte encoding is the
one ``GET /experts`` of ``coli serve`` uses — ``tier << 6 | heat`` per expert, plus a
little-endian bitmap of the experts routed in the latest step — so the local and the
``--url`` front ends draw the same thing. Everything here is pure and unit-tested.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

TIER_DISK, TIER_RAM, TIER_PINNED = 0, 1, 2
TIER_NAMES = {TIER_DISK: "disk", TIER_RAM: "RAM", TIER_PINNED: "pinned"}
# base colour per tier (r, g, b); brightness scales it, a flash blends it toward FLASH
TIER_RGB = {TIER_DISK: (90, 110, 255), TIER_RAM: (40, 220, 90), TIER_PINNED: (255, 170, 0)}
FLASH_RGB = (255, 255, 255)
DECAY = 0.6  # a flash keeps this much of its strength per engine step without the expert
MIN_BRIGHTNESS = 0.22  # a cold expert stays visible


@dataclass(frozen=True)
class ExpertGrid:
    """tiers, heat: (layers, experts) uint8; routed: (layers, experts) bool; seq: the
    engine step the grid was read at (a new seq means a new routing)."""

    tiers: np.ndarray
    heat: np.ndarray
    routed: np.ndarray
    seq: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.tiers.shape

    @property
    def empty(self) -> bool:
        return self.tiers.size == 0


def heat_bucket(counts) -> np.ndarray:
    """Routing counts -> 0 for never, else 1 + floor(log2(count)), capped at 63 (uint8)."""
    c = np.asarray(counts, dtype=np.int64)
    b = np.floor(np.log2(np.maximum(c, 1))).astype(np.int64) + (c > 0)
    return np.minimum(63, b).astype(np.uint8)


def layer_tiers(experts, n: int) -> np.ndarray:
    """(n,) tiers of one MoE layer's expert source (coli.experts.store): resident sources
    are all RAM; streamed ones are RAM where a slot holds the expert, pinned where that
    slot is pinned, disk elsewhere."""
    if not getattr(experts, "streamed", False):
        return np.full(n, TIER_RAM, dtype=np.uint8)
    slot = np.asarray(experts.slot_of)
    tiers = np.where(slot >= 0, TIER_RAM, TIER_DISK).astype(np.uint8)
    held = slot >= 0
    tiers[held & np.asarray(experts.pinned)[np.maximum(slot, 0)]] = TIER_PINNED
    return tiers


def grid_from_engine(engine, seq: int = 0) -> ExpertGrid:
    """Read a local engine's MoE layers (a dense model gives an empty grid)."""
    layers = engine.model.moe_layers
    rows, cols = len(layers), (layers[0].E if layers else 0)
    tiers = np.zeros((rows, cols), np.uint8)
    heat = np.zeros((rows, cols), np.uint8)
    routed = np.zeros((rows, cols), bool)
    last = engine.last  # replaced whole each step: one consistent read
    for i, m in enumerate(layers):
        tiers[i] = layer_tiers(m.experts, cols)
        heat[i] = heat_bucket(m.counts)
        if i < len(last.routed) and len(last.routed[i]):
            routed[i, np.unique(np.asarray(last.routed[i]))] = True
    return ExpertGrid(tiers, heat, routed, seq)


def encode(grid: ExpertGrid) -> dict:
    """The ``GET /experts`` body for a grid."""
    rows, cols = grid.shape
    cells = (grid.heat.astype(np.uint8) & 63) | (grid.tiers.astype(np.uint8) << 6)
    bits = np.packbits(grid.routed.reshape(-1), bitorder="little") if grid.routed.size else np.zeros(0, np.uint8)
    return {"rows": rows, "cols": cols, "seq": grid.seq, "tiers": {"0": "disk", "1": "ram", "2": "pinned"},
            "cells": base64.b64encode(cells.astype(np.uint8).tobytes()).decode(),
            "routed": base64.b64encode(bits.tobytes()).decode()}


def decode(body: dict) -> ExpertGrid:
    """A ``GET /experts`` body -> grid."""
    rows, cols = int(body["rows"]), int(body["cols"])
    cells = np.frombuffer(base64.b64decode(body.get("cells", "")), np.uint8)
    if cells.size != rows * cols:
        raise ValueError(f"/experts: {cells.size} cells for a {rows}x{cols} grid")
    cells = cells.reshape(rows, cols)
    bits = np.frombuffer(base64.b64decode(body.get("routed", "")), np.uint8)
    routed = np.unpackbits(bits, bitorder="little")[: rows * cols].astype(bool)
    if routed.size < rows * cols:
        routed = np.zeros(rows * cols, bool)
    return ExpertGrid(cells >> 6, cells & 63, routed.reshape(rows, cols), int(body.get("seq", 0)))


class Flash:
    """Per-cell flash strength: routed cells jump to 1.0, the rest decay by DECAY for
    each engine step that passed since the last grid (so it tracks steps, not frames)."""

    def __init__(self):
        self.value = np.zeros((0, 0), np.float32)
        self.seq: int | None = None

    def update(self, grid: ExpertGrid, idle_decay: float = 1.0) -> np.ndarray:
        """Take a new reading; with no new step since the last one, fade by ``idle_decay``."""
        if self.value.shape != grid.shape:
            self.value = np.zeros(grid.shape, np.float32)
            self.seq = None
        if self.seq is not None and grid.seq != self.seq:
            steps = max(1, grid.seq - self.seq)
            self.value *= DECAY ** steps
            self.value[grid.routed] = 1.0
        elif self.seq is None:
            self.value[grid.routed] = 1.0
        else:
            self.value *= idle_decay
        self.value[self.value < 0.05] = 0.0
        self.seq = grid.seq
        return self.value


def cell_rgb(tier: int, heat: int, max_heat: int, flash: float) -> tuple[int, int, int]:
    """The colour of one cell: the tier's hue, brighter with heat, whiter with flash."""
    base = TIER_RGB.get(int(tier), TIER_RGB[TIER_DISK])
    level = MIN_BRIGHTNESS + (1 - MIN_BRIGHTNESS) * (heat / max_heat if max_heat else 0.0)
    rgb = [c * level for c in base]
    f = min(1.0, max(0.0, float(flash)))
    return tuple(int(round(c + (w - c) * f)) for c, w in zip(rgb, FLASH_RGB))


def cell_colors(grid: ExpertGrid, flash: np.ndarray | None = None) -> list[list[str]]:
    """"#rrggbb" per cell, heat scaled to the grid's hottest expert."""
    rows, cols = grid.shape
    top = int(grid.heat.max()) if grid.heat.size else 0
    fl = flash if flash is not None and flash.shape == grid.shape else np.zeros(grid.shape, np.float32)
    return [["#%02x%02x%02x" % cell_rgb(grid.tiers[r, c], grid.heat[r, c], top, fl[r, c]) for c in range(cols)]
            for r in range(rows)]


def tier_counts(grid: ExpertGrid) -> dict[str, int]:
    return {name: int((grid.tiers == t).sum()) for t, name in TIER_NAMES.items()}
