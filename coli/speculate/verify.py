"""Verification: which draft tokens the target model accepts.

The runner verifies a draft by sampling each position of one multi-token step in order
with the request's own sampler (its penalties, bias, temperature and seeded RNG), and
accepting while the sampled token equals the draft's: ``accept_run``. For a drafter whose
proposal is one token (n-gram lookup, a greedy draft model: a point mass q = 1 at d),
this *is* speculative rejection sampling: the draft d is accepted with probability
min(1, p(d) / q(d)) = p(d), and a rejection's token is distributed as the residual
max(0, p - q) normalized = p without d. With greedy sampling every pick is the argmax,
so the output is token for token what decoding without speculation gives; with a seeded
sampler each emitted token consumes the RNG exactly as plain decoding does, so the same
seed gives the same text as well (the logits of a multi-token step equal the one-token
step's up to float rounding).

``rejection_sample`` is the general rule, for a drafter that samples from a distribution q.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from coli.scheduler.core import SeqOutput


def accept_run(draft: Sequence[int], rows: np.ndarray, pick: Callable[[np.ndarray], SeqOutput]) -> tuple[SeqOutput, bool]:
    """Pick a token from each logits row (len(draft) + 1 rows) in order while it equals the
    draft's token at that position. Returns the step's SeqOutput (``accepted``: the draft
    tokens accepted; ``token``: the next one) and whether a draft token was rejected.
    ``pick(row)`` is the request's own sampling (end of turn, stop strings and text
    included): a finish or an error ends the run where it happens."""
    accepted: list[int] = []
    out = SeqOutput(error="no rows to verify")
    for j in range(len(draft) + 1):
        out = pick(rows[j])
        if out.error is not None or out.token is None or out.finish_reason is not None:
            break
        if j < len(draft) and out.token == draft[j]:
            accepted.append(out.token)
            continue
        return SeqOutput(out.token, accepted=tuple(accepted)), j < len(draft)
    rejected = j < len(draft) and out.token != draft[j]  # (an end of turn or error where a draft token was)
    return SeqOutput(out.token, out.finish_reason, out.error, tuple(accepted)), rejected


def rejection_sample(p: np.ndarray, q: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[int, bool]:
    """Speculative sampling of one position (Leviathan et al. 2023, Chen et al. 2023): the
    draft token, drawn from q, is kept with probability min(1, p/q); otherwise a token is
    drawn from max(0, p - q) normalized. The result is distributed as p. p, q: (V,)
    probabilities. Returns (token, accepted)."""
    pd, qd = float(p[draft]), float(q[draft])
    if qd > 0.0 and rng.random() * qd < pd:
        return int(draft), True
    residual = np.maximum(p.astype(np.float64) - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p == q: a rejection cannot happen; guard against rounding
        residual, total = p.astype(np.float64), float(p.sum())
    return int(np.searchsorted(np.cumsum(residual), rng.random() * total, side="right")), False
