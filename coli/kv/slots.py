"""KV slots as the scheduler sees them: a token history, an owner, a recency stamp.

The arrays behind a slot (its ``KVCache``) live with the runner; here a slot is the
list of token ids whose keys and values that cache holds, so prefix matching and
slot choice are plain Python and testable without a model.
"""
from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from coli.api import common_prefix

MAX_SLOTS = 16


@dataclass(eq=False)
class Slot:
    index: int
    tokens: list[int] = field(default_factory=list)  # the history its KV cache holds
    owner: object | None = None  # the request holding the slot, if any
    last_used: int = 0  # a logical clock: larger is more recent
    saving: bool = False  # released between steps, its KV not yet handed to the saver: not free yet

    @property
    def free(self) -> bool:
        return self.owner is None and not self.saving

    def reusable(self, prompt: Sequence[int]) -> int:
        """Prompt tokens whose KV this slot already holds. At least one prompt token is
        always recomputed: the logits of the last one pick the first new token."""
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)


class SlotTable:
    def __init__(self, n: int):
        if not 1 <= n <= MAX_SLOTS:
            raise ValueError(f"kv slots must be 1..{MAX_SLOTS}, got {n}")
        self.slots = [Slot(i) for i in range(n)]
        self._clock = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def __iter__(self):
        return iter(self.slots)

    def touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.last_used = self._clock

    def choose(self, prompt: Sequence[int], reserved: Container[int] = ()) -> Slot | None:
        """The free, unreserved slot with the longest reusable prefix of ``prompt``;
        among equals (and when nothing matches), the least recently used."""
        best, best_key = None, None
        for s in self.slots:
            if not s.free or s.index in reserved:
                continue
            key = (-s.reusable(prompt), s.last_used, s.index)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def held_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.slots)
