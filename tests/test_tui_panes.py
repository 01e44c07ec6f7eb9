"""The routing and profiling panes' data models and renderings, with deterministic stats.

Snapshots live in tests/snapshots/; after an intended change, rewrite them with
COLI_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_tui_panes.py and review the diff."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from coli.scheduler.events import Profile, Usage
from coli.tui.grid import (DECAY, TIER_DISK, TIER_PINNED, TIER_RAM, ExpertGrid, Flash, cell_rgb, decode, encode,
                           heat_bucket, layer_tiers, tier_counts)
from coli.tui.stats import History, TurnStats, bar_widths
from coli.tui.widgets import NO_EXPERTS, render_profile, render_routing

SNAPSHOTS = Path(__file__).parent / "snapshots"


def grid(seq=1) -> ExpertGrid:
    tiers = np.array([[2, 2, 1, 1, 1, 0, 0, 0], [2, 1, 1, 1, 0, 0, 0, 0]], np.uint8)
    heat = np.array([[9, 8, 7, 5, 3, 1, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], np.uint8)
    routed = np.zeros((2, 8), bool)
    routed[0, [0, 3]] = routed[1, [7, 2]] = True
    return ExpertGrid(tiers, heat, routed, seq)


def turn() -> TurnStats:
    return TurnStats(2.0, io_wait=0.5, expert_matmul=0.7, attention=0.4, lm_head=0.1, prompt_tokens=12,
                     completion_tokens=30, decode_seconds=1.5, ttft=0.25, experts_needed=40, experts_hit=30)


def check_snapshot(name: str, text) -> None:
    got = text.markup + "\n"
    path = SNAPSHOTS / name
    if os.environ.get("COLI_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got, encoding="utf-8")
    assert path.exists(), f"no snapshot {path}: run with COLI_UPDATE_SNAPSHOTS=1"
    assert got == path.read_text(encoding="utf-8"), f"{name} changed; COLI_UPDATE_SNAPSHOTS=1 rewrites it"


# -- the grid ---------------------------------------------------------------------------------


def test_heat_is_a_log2_bucket():
    assert heat_bucket([0, 1, 2, 3, 4, 7, 8, 2**40, 2**62]).tolist() == \
        [0, 1, 2, 2, 3, 3, 4, 41, 63]


def test_encoding_round_trips_and_matches_the_server_layout():
    g = grid(seq=17)
    body = encode(g)
    assert (body["rows"], body["cols"], body["seq"]) == (2, 8, 17)
    back = decode(body)
    assert np.array_equal(back.tiers, g.tiers) and np.array_equal(back.heat, g.heat)
    assert np.array_equal(back.routed, g.routed) and back.seq == 17
    import base64

    cells = np.frombuffer(base64.b64decode(body["cells"]), np.uint8).reshape(2, 8)
    assert cells[0, 0] == (TIER_PINNED << 6 | 9) and cells[0, 5] == (TIER_DISK << 6 | 1)
    bits = np.frombuffer(base64.b64decode(body["routed"]), np.uint8)
    assert bits[0] == 0b1001  # experts 0 and 3 of layer 0, little-endian bits
    with pytest.raises(ValueError):
        decode({**body, "rows": 3})


def test_an_empty_grid_encodes():
    empty = ExpertGrid(np.zeros((0, 0), np.uint8), np.zeros((0, 0), np.uint8), np.zeros((0, 0), bool))
    assert decode(encode(empty)).empty


def test_tiers_of_a_streamed_layer():
    class Streamed:
        streamed = True
        slot_of = np.array([0, -1, 1, 2, -1])
        pinned = np.array([True, False, False])

    class Resident:
        streamed = False

    assert layer_tiers(Streamed(), 5).tolist() == [TIER_PINNED, TIER_DISK, TIER_RAM, TIER_RAM, TIER_DISK]
    assert layer_tiers(Resident(), 3).tolist() == [TIER_RAM] * 3
    assert tier_counts(grid()) == {"disk": 7, "RAM": 6, "pinned": 3}


def test_flash_jumps_on_routing_and_decays_per_step():
    f = Flash()
    g = grid(seq=1)
    v = f.update(g)
    assert v[0, 0] == 1.0 and v[0, 1] == 0.0
    quiet = ExpertGrid(g.tiers, g.heat, np.zeros_like(g.routed), seq=3)  # two steps later, nothing routed
    v = f.update(quiet)
    assert v[0, 0] == pytest.approx(DECAY ** 2)
    v = f.update(quiet, idle_decay=0.5)  # no new step: fades with time only
    assert v[0, 0] == pytest.approx(DECAY ** 2 * 0.5)
    routed_again = ExpertGrid(g.tiers, g.heat, g.routed, seq=4)
    assert f.update(routed_again)[0, 3] == 1.0


def test_cell_colour_tier_heat_flash():
    assert cell_rgb(TIER_RAM, 8, 8, 0.0) == (40, 220, 90)  # the hottest: the tier's full colour
    cold = cell_rgb(TIER_RAM, 0, 8, 0.0)
    assert all(c < h for c, h in zip(cold, (40, 220, 90)) if h)
    assert cell_rgb(TIER_DISK, 3, 8, 1.0) == (255, 255, 255)
    assert cell_rgb(TIER_PINNED, 8, 8, 0.0) != cell_rgb(TIER_RAM, 8, 8, 0.0)


# -- the profile ------------------------------------------------------------------------------


def test_turn_from_events_and_from_the_server():
    p = Profile(0.5, 1.5, 31, 12, 30, attention_seconds=0.4, expert_matmul_seconds=0.7, lm_head_seconds=0.1,
                io_wait_seconds=0.5, experts_needed=40, experts_hit=30)
    t = TurnStats.from_events(p, Usage(12, 30, 4, 0.0), ttft=0.25)
    assert t.seconds == 2.0 and t.other == pytest.approx(0.3)
    assert t.tokens_per_second == 20.0 and t.hit_rate == 0.75 and t.cached_tokens == 4
    s = TurnStats.from_server({"io_wait_seconds": 0.5, "expert_matmul_seconds": 0.7, "attention_seconds": 0.4,
                               "dense_mlp_seconds": 0.1, "lm_head_seconds": 0.1, "other_seconds": 0.2,
                               "completion_tokens": 30, "tokens_per_second": 20.0, "experts_needed": 4,
                               "experts_hit": 4})
    assert s.seconds == pytest.approx(2.0) and s.other == pytest.approx(0.3)
    assert s.tokens_per_second == pytest.approx(20.0) and s.hit_rate == 1.0


def test_bar_widths_add_up():
    t = turn()
    for width in (1, 7, 40, 101):
        cells = bar_widths(t, width)
        assert sum(cells) == width
    assert bar_widths(t, 40) == [10, 14, 8, 2, 6]
    assert bar_widths(TurnStats(0.0), 40) == [0, 0, 0, 0, 0]


def test_history_keeps_the_last_30():
    h = History()
    for i in range(45):
        h.add(TurnStats(1.0, completion_tokens=i, decode_seconds=1.0))
    assert len(h.speeds()) == 30 and h.speeds()[0] == 15.0 and h.last.completion_tokens == 44


# -- snapshots ------------------------------------------------------------------------------------


def test_routing_pane_snapshot():
    g = grid()
    f = Flash()
    f.update(g)
    check_snapshot("routing_pane.txt", render_routing(g, f.value, width=40))


def test_routing_pane_wraps_wide_layers():
    rows, cols = 2, 64
    g = ExpertGrid(np.ones((rows, cols), np.uint8), np.zeros((rows, cols), np.uint8), np.zeros((rows, cols), bool))
    lines = render_routing(g, None, width=36).plain.splitlines()
    assert lines[0].startswith("L0 ") and lines[1].startswith("   ") and lines[2].startswith("L1 ")
    assert len(lines) == 4 and all(len(line) <= 36 for line in lines)
    assert render_routing(None).plain == NO_EXPERTS


def test_routing_pane_packs_two_layers_a_row_when_short_of_room():
    rows, cols = 5, 8
    g = ExpertGrid(np.ones((rows, cols), np.uint8), np.arange(rows * cols).reshape(rows, cols).astype(np.uint8) % 64,
                   np.zeros((rows, cols), bool))
    assert len(render_routing(g, None, width=40, max_lines=5).plain.splitlines()) == 5  # fits: one layer a row
    text = render_routing(g, None, width=40, max_lines=4)
    lines = text.plain.splitlines()
    assert [line.split()[0] for line in lines] == ["L0", "L2", "L4"] and lines[0].count("▀") == 8
    styles = {str(span.style) for span in text.spans}
    assert any(" on #" in st for st in styles)  # the lower layer is the background colour


def test_compact_profile_legend():
    lines = render_profile(turn(), width=36, compact=True).plain.splitlines()
    assert len(lines) == 4 and all(len(line) <= 36 for line in lines)
    assert "I/O 25%" in lines[1] and "other 15%" in lines[2]


def test_profile_pane_snapshot():
    check_snapshot("profile_pane.txt", render_profile(turn(), width=40))
