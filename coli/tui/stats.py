"""The profiling pane's and status line's data: one record per turn, and the split of
its time into the phases the issue names. Pure, so the panes can be tested with
deterministic numbers."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# (key, label, colour) in the order the bar draws them
PHASES = (("io_wait", "expert I/O wait", "#5a6eff"), ("expert_matmul", "expert matmul", "#28dc5a"),
          ("attention", "attention", "#ffaa00"), ("lm_head", "LM head", "#e040e0"), ("other", "other", "#808080"))
HISTORY = 30  # turns kept for the sparkline


@dataclass(frozen=True)
class TurnStats:
    """Where one answer's time went (seconds) and how fast it was."""

    seconds: float  # the engine's time for the turn (prefill + decode)
    io_wait: float = 0.0
    expert_matmul: float = 0.0
    attention: float = 0.0
    lm_head: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    decode_seconds: float = 0.0
    ttft: float | None = None  # seconds from sending to the first text
    experts_needed: int = 0
    experts_hit: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # ... and accepted

    @property
    def other(self) -> float:
        return max(0.0, self.seconds - self.io_wait - self.expert_matmul - self.attention - self.lm_head)

    @property
    def tokens_per_second(self) -> float | None:
        return self.completion_tokens / self.decode_seconds if self.decode_seconds > 0 else None

    @property
    def hit_rate(self) -> float | None:
        return self.experts_hit / self.experts_needed if self.experts_needed else None

    def split(self) -> list[tuple[str, str, str, float]]:
        """(key, label, colour, seconds) for each phase."""
        return [(k, label, colour, getattr(self, k)) for k, label, colour in PHASES]

    @classmethod
    def from_events(cls, profile, usage=None, ttft: float | None = None) -> TurnStats:
        """From a local request's Profile (and Usage) events."""
        return cls(seconds=profile.prefill_seconds + profile.decode_seconds, io_wait=profile.io_wait_seconds,
                   expert_matmul=profile.expert_matmul_seconds, attention=profile.attention_seconds,
                   lm_head=profile.lm_head_seconds,
                   prompt_tokens=usage.prompt_tokens if usage else profile.prefill_tokens,
                   cached_tokens=usage.cached_tokens if usage else 0,
                   completion_tokens=usage.completion_tokens if usage else profile.decode_tokens,
                   decode_seconds=profile.decode_seconds, ttft=ttft, experts_needed=profile.experts_needed,
                   experts_hit=profile.experts_hit, draft_tokens=getattr(profile, "draft_tokens", 0),
                   accepted_tokens=getattr(profile, "accepted_tokens", 0))

    @classmethod
    def from_server(cls, turn: dict, ttft: float | None = None) -> TurnStats:
        """From one entry of ``GET /profile``'s ``turns``."""
        g = lambda k: float(turn.get(k) or 0.0)  # noqa: E731
        tps = turn.get("tokens_per_second")
        done = int(turn.get("completion_tokens") or 0)
        named = g("io_wait_seconds") + g("expert_matmul_seconds") + g("attention_seconds") + g("lm_head_seconds")
        return cls(seconds=named + g("dense_mlp_seconds") + g("other_seconds"), io_wait=g("io_wait_seconds"),
                   expert_matmul=g("expert_matmul_seconds"), attention=g("attention_seconds"),
                   lm_head=g("lm_head_seconds"), prompt_tokens=int(turn.get("prompt_tokens") or 0),
                   cached_tokens=int(turn.get("cached_tokens") or 0), completion_tokens=done,
                   decode_seconds=done / tps if tps else 0.0, ttft=ttft,
                   experts_needed=int(turn.get("experts_needed") or 0), experts_hit=int(turn.get("experts_hit") or 0),
                   draft_tokens=int(turn.get("draft_tokens") or 0), accepted_tokens=int(turn.get("accepted_tokens") or 0))


def bar_widths(stats: TurnStats, width: int) -> list[int]:
    """Cells of a ``width``-wide bar for each phase: proportional, rounded so they sum to
    ``width`` (largest remainders first); all zero when the turn took no time."""
    secs = [s for *_, s in stats.split()]
    total = sum(secs)
    if total <= 0 or width <= 0:
        return [0] * len(secs)
    exact = [s / total * width for s in secs]
    cells = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - cells[i], reverse=True)[: width - sum(cells)]:
        cells[i] += 1
    return cells


class History:
    """The last HISTORY turns."""

    def __init__(self, size: int = HISTORY):
        self.turns: deque[TurnStats] = deque(maxlen=size)

    def add(self, turn: TurnStats) -> None:
        self.turns.append(turn)

    @property
    def last(self) -> TurnStats | None:
        return self.turns[-1] if self.turns else None

    def speeds(self) -> list[float]:
        """tok/s of the kept turns, oldest first (turns without decode count as 0)."""
        return [t.tokens_per_second or 0.0 for t in self.turns]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
