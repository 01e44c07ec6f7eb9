"""The runner's side of a constraint: pick one sequence's next tokens under its grammar.

``GuidedState`` rides on the runner's per-request payload; ``pick`` is what the runner
calls instead of plain sampling. The runner then treats the picked token and the forced
tokens after it like sampled ones (end of turn, logprobs, detokenizer, stop strings,
parser) and hands the forced ones to the scheduler to feed in the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coli.grammar.constraint import Constraint, GrammarError, Vocabulary  # noqa: F401 (the runner's names)
from coli.grammar.guide import DeadEnd, Guide, MaskWorker  # noqa: F401
from coli.sampling import Sampler


@dataclass
class GuidedState:
    guide: Guide
    queue: list[int] = field(default_factory=list)  # forced tokens still to feed, one per step (folding off)


@dataclass
class GrammarStats:
    """Totals over a runner's life (coli bench reads them)."""

    mask_seconds: float = 0.0  # computing masks (mostly on the worker thread, overlapping the engine)
    masks: int = 0
    sampled: int = 0  # constrained tokens picked from a mask
    forced: int = 0  # constrained tokens the grammar forced (never sampled)
    folded: int = 0  # forced tokens fed in a step with others (each one an engine step saved)

    def add(self, guide: Guide) -> None:
        self.mask_seconds += guide.mask_seconds
        self.masks += guide.masks


def pick(state: GuidedState, sampler: Sampler, logits: np.ndarray, generated: list[int],
         bias: tuple[np.ndarray, np.ndarray] | None, room: int, eos_ids, fold: bool,
         stats: GrammarStats | None = None, logprobs: bool = True) -> tuple[int, list[int], np.ndarray | None]:
    """(token, forced tokens after it, the masked logits its logprob comes from — None for
    a forced token, or without ``logprobs``). ``room``: tokens the request may still
    generate. Raises DeadEnd."""
    guide = state.guide
    if state.queue:  # folding off: a forced token, fed on its own step
        return state.queue.pop(0), [], None
    guide.check_alive()
    lead = guide.take_forced(room) if guide.consumed == 0 else []  # the answer opens with forced text
    if lead:
        tok, rest, masked = lead[0], lead[1:], None
    else:
        x = logits
        if bias is not None:
            x = logits.copy()
            x[bias[0]] += bias[1]
        ok = guide.allowed()[: logits.shape[-1]]
        if not ok.any():
            raise DeadEnd(guide._dead_end())
        try:
            tok = sampler.sample(x, generated, allowed=ok)
        except ValueError as e:
            raise DeadEnd(f"sampling under the constraint failed: {e}") from None
        masked = np.where(ok, logits, np.float32(-np.inf)) if logprobs else None
        if stats is not None:
            stats.sampled += 1
        if tok in eos_ids:
            return tok, [], masked
        guide.consume(tok)
        rest = guide.take_forced(room - 1)
    if stats is not None:
        stats.forced += len(rest) + (1 if lead else 0)
        if fold:
            stats.folded += len(rest)
    if not fold:
        state.queue, rest = rest, []
    return tok, rest, masked


def due(plan) -> list[Guide]:
    """The guides whose masks a step's sampling entries will need (a StepPlan's)."""
    out = []
    for s in plan.seqs:
        g = s.request.payload.guided if s.sample else None
        if g is not None and not g.queue:
            out.append(g.guide)
    return out


def finished(state: GuidedState) -> bool:
    """The grammar is complete and nothing is queued: the answer ends here (no step for
    the end-of-turn token)."""
    return not state.queue and state.guide.done
