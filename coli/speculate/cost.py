"""When speculation pays: the engine's own step times by tokens per step, and each
request's acceptance rate.

A k-token draft verified in one step yields 1 + (accepted drafts) tokens. If each draft
token is accepted with probability a (given the ones before it were), the expected yield
is (1 - a^(k+1)) / (1 - a). The step costs t(M + k) instead of t(M), where M is the step's
tokens without drafts and t is measured here, per M, from the steps the runner ran (a
multi-token step on a CPU is not free: an int4 4-token block costs about 2.5 one-token
ones). A drafter that takes time itself (a draft model) adds its seconds per drafted token.
Speculating with k drafts pays when yield / relative cost > 1; the best k maximizes it.
"""
from __future__ import annotations

PRIOR_SLOPE = 0.35  # before any measurement: each extra token in a step costs this much of a 1-token step
DECAY = 0.85  # per verification: older outcomes fade, so a request's acceptance can change


class StepCosts:
    """Mean seconds of a step by its tokens M (decode steps only), as exponential averages."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.mean: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, m: int, seconds: float) -> None:
        old = self.mean.get(m)
        self.mean[m] = seconds if old is None else old + self.alpha * (seconds - old)
        self.count[m] = self.count.get(m, 0) + 1

    def __call__(self, m: int) -> float:
        """t(m): measured, else interpolated between measured sizes, else extrapolated with the
        measured slope (PRIOR_SLOPE of the smallest step where only one size is known)."""
        if m in self.mean:
            return self.mean[m]
        known = sorted(self.mean)
        if not known:
            return 1.0 + PRIOR_SLOPE * (m - 1)
        lo = [x for x in known if x < m]
        hi = [x for x in known if x > m]
        if lo and hi:
            a, b = lo[-1], hi[0]
            return self.mean[a] + (self.mean[b] - self.mean[a]) * (m - a) / (b - a)
        if len(known) >= 2:  # extrapolate with the slope of the two nearest sizes
            a, b = (known[-2], known[-1]) if lo else (known[0], known[1])
            slope = max(0.0, (self.mean[b] - self.mean[a]) / (b - a))
            base = b if lo else a
            return max(1e-9, self.mean[base] + slope * (m - base))
        (x,) = known
        t1 = self.mean[x] / (1.0 + PRIOR_SLOPE * (x - 1))
        return t1 * (1.0 + PRIOR_SLOPE * (m - 1))


class Acceptance:
    """One request's draft acceptance: decayed counts of accepted draft tokens and of
    rejections (a verification stops at its first rejected token)."""

    def __init__(self, prior_accepted: float = 1.0, prior_rejected: float = 1.0):
        self.accepted, self.rejected = prior_accepted, prior_rejected
        self.drafted_total = self.accepted_total = self.steps = 0

    @property
    def rate(self) -> float:
        """The chance that a draft token is accepted, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def record(self, drafted: int, accepted: int, rejected: bool) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1 if rejected else 0)
        self.drafted_total += drafted
        self.accepted_total += accepted
        self.steps += 1


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of k drafts yields when each is accepted with probability a."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, costs: StepCosts, m: int, limit: int, draft_seconds: float = 0.0) -> tuple[int, float]:
    """(k, gain): the number of drafts (0..limit) that maximizes tokens per second relative to a
    plain step of m tokens, and that gain (1.0 for k = 0). ``draft_seconds``: a drafter's cost
    per drafted token."""
    base = costs(m)
    best, gain = 0, 1.0
    for k in range(1, limit + 1):
        g = expected_tokens(a, k) * base / (costs(m + k) + k * draft_seconds)
        if g > gain:
            best, gain = k, g
    return best, gain
