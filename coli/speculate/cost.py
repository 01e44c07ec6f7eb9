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

from collections import deque

PRIOR_SLOPE = 0.35  # before any measurement: each extra token in a step costs this much of a 1-token step
STREAMED_PRIOR_SLOPE = 0.8  # ... when experts stream from disk: each token may need experts read for it alone
WINDOW = 15  # recent steps per size that the median is taken over
MIN_SAMPLES = 3  # steps of one size before its own mean is trusted over the fitted line
REFRESH = 16  # observations between recomputations of the cost table
DECAY = 0.85  # per verification: older outcomes fade, so a request's acceptance can change
# a step of m tokens timed above SPIKE x m one-token steps is not its cost but a stall (a thread
# descheduled at a barrier on a busy machine, a first call's allocations): ignored
SPIKE = 2.0
# observations after which a sample is forgotten: a size measured while the machine was busy
# would otherwise look dear for as long as it is not tried again, and a dear size is not tried
# again (a forgotten size falls back to the line through the fresh ones, then the prior)
HORIZON = 400


def _low(q) -> float:
    """A step size's cost: the lower quartile of its recent steps. Contention only ever adds
    time (a core taken away, a thread spinning at a barrier while its partner waits for one),
    so on a shared machine the low end is the step's own cost; on a quiet one it is the median."""
    s = sorted(q)
    return s[(len(s) - 1) // 4]


class StepCosts:
    """Seconds of a decode step by its tokens M: the lower quartile of the last WINDOW steps
    of each size (robust to the spikes a shared machine adds to some steps), of those within
    the last HORIZON observations and not stalls (see ``_sized``)."""

    def __init__(self, window: int = WINDOW, prior_slope: float = PRIOR_SLOPE, floor_slope: float = 0.0):
        self.samples: dict[int, deque[tuple[int, float]]] = {}  # size -> (observation number, seconds)
        self._n = 0  # observations so far
        self.window, self.prior_slope, self.floor_slope = window, prior_slope, floor_slope
        self._known: dict[int, float] = {}  # t(m) computed since the last observation
        self._fit: tuple[float, float] | None = None
        self._clean: dict[int, list[float]] | None = None  # _sized(), as of the last recomputation
        self._seen = 0  # observations since t(m) was last computed

    def _sized(self) -> dict[int, list[float]]:
        """Each size's samples of the last HORIZON observations, without the stalls: once
        one-token steps are known (t1, their lower quartile), a sample of m tokens above
        SPIKE x m x t1 says nothing of what m tokens cost (no step of m tokens costs more than
        m one-token steps, bar overheads), so it is left out; it would otherwise hold t(m) up
        for as long as m is not tried again, and a size that looks too dear is not tried again."""
        old = self._n - HORIZON
        fresh = {m: [x for n, x in q if n > old] for m, q in self.samples.items()}
        q1 = fresh.get(1)
        t1 = _low(q1) if q1 is not None and len(q1) >= MIN_SAMPLES else None
        out = {}
        for m, q in fresh.items():
            kept = q if t1 is None or m == 1 else [x for x in q if x <= SPIKE * m * t1]
            if kept:
                out[m] = kept
        return out

    @property
    def mean(self) -> dict[int, float]:
        return {m: _low(q) for m, q in self._sized().items()}

    @property
    def count(self) -> dict[int, int]:
        return {m: len(q) for m, q in self._sized().items()}

    def observe(self, m: int, seconds: float) -> None:
        q = self.samples.get(m)
        if q is None:
            q = self.samples[m] = deque(maxlen=self.window)
        self._n += 1
        q.append((self._n, seconds))
        self._seen += 1
        # t(m) is computed again after a new size, while a size gathers its first samples, or
        # every REFRESH steps: the costs change slowly, and decode steps come every millisecond
        if len(q) <= MIN_SAMPLES or self._seen >= REFRESH:
            self._known.clear()
            self._fit = self._clean = None
            self._seen = 0

    def __call__(self, m: int) -> float:
        """t(m): the cost of steps of m tokens once there are MIN_SAMPLES of them, else a
        straight line fitted to the sizes measured so far (each weighted by its count, up
        to 10), so one noisy step of a new size neither locks k in nor out; with one size
        known, the line through it with the prior slope; with none, the prior relative costs.
        A longer step is never taken to cost less than a shorter one, nor less than
        ``floor_slope`` of a 1-token step per extra token (a mixture of experts reads each
        token's own experts: measurements that say otherwise are noise, or steps timed
        while an expert cache warmed). Beyond twice the largest size measured the line grows at least at the prior slope, so
        k climbs to sizes whose cost is known (doubling) rather than jumping on an extrapolation."""
        t = self._known.get(m)
        if t is None:
            if self._clean is None:
                self._clean = self._sized()
            q = self._clean.get(m)
            if q is not None and len(q) >= MIN_SAMPLES:
                t = _low(q)
            else:
                if self._fit is None:
                    self._fit = self._line()
                a, b = self._fit
                top = 2 * max(self._clean, default=1)
                if m <= top:
                    t = max(1e-9, a + b * (m - 1))
                else:  # past twice the largest size measured: a step may grow faster than the small ones
                    # suggest (a GEMM's tile runs out, the LM head's rows add up), so not below the prior
                    t = max(1e-9, a + b * (top - 1)) + (m - top) * max(b, self.prior_slope * a)
            if m > 1:  # a longer step never costs less than a shorter one, nor than its floor
                t = max(t, self(m - 1), self(1) * (1.0 + self.floor_slope * (m - 1)))
            self._known[m] = t
        return t

    def _line(self) -> tuple[float, float]:
        """(t(1), slope) of the weighted least-squares line through the measured means."""
        pts = [(x - 1.0, _low(q), float(min(len(q), 10))) for x, q in self._clean.items()]
        if not pts:
            return 1.0, self.prior_slope
        if len(pts) == 1:
            (x, t, _), = pts
            t1 = t / (1.0 + self.prior_slope * x)
            return t1, self.prior_slope * t1
        w = sum(p[2] for p in pts)
        mx = sum(p[0] * p[2] for p in pts) / w
        mt = sum(p[1] * p[2] for p in pts) / w
        var = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
        slope = max(0.0, sum(p[2] * (p[0] - mx) * (p[1] - mt) for p in pts) / var)
        return max(1e-9, mt - slope * mx), slope


class Acceptance:
    """One request's draft acceptance: decayed counts of accepted draft tokens and of
    rejections (a verification stops at its first rejected token)."""

    def __init__(self, prior_accepted: float = 2.0, prior_rejected: float = 1.0):
        self.accepted, self.rejected = prior_accepted, prior_rejected
        self.drafted_total = self.accepted_total = self.steps = 0

    @property
    def rate(self) -> float:
        """The chance that a draft token is accepted, given the ones before it were."""
        return self.accepted / (self.accepted + self.rejected)

    def learn(self, accepted: int, rejected: bool) -> None:
        """One verification's outcome (or a shadow draft's, checked against the output)."""
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1 if rejected else 0)

    def record(self, drafted: int, accepted: int, rejected: bool) -> None:
        self.learn(accepted, rejected)
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
        elif k >= best + 3:  # the gain peaks once: three sizes past the best, stop looking
            break
    return best, gain


def floor_slope(net, streamed: bool = False) -> float:
    """The least a mixture of experts' extra token can cost (see StepCosts): 3/4 of the
    prior; 0 for a dense model, whose extra tokens may be nearly free where it is bound by
    memory bandwidth."""
    return 0.75 * prior_slope(net, streamed) if getattr(net, "moe_layers", None) else 0.0


def prior_slope(net, streamed: bool = False) -> float:
    """The cost of each extra token in a step, relative to a 1-token step, before any is
    measured. Dense weights are read once for every token of a step (PRIOR_SLOPE: the extra
    arithmetic); a mixture of experts reads, for each extra token, the experts it routes
    to that the others did not, about (1 - k/E) of a token's own (k of E experts). Their
    share is the routed experts' part of the weights one token reads. With experts
    streamed from disk those reads dominate: at least STREAMED_PRIOR_SLOPE."""
    moes = getattr(net, "moe_layers", None) or []
    if not moes:
        return PRIOR_SLOPE
    cfg = net.cfg
    H = cfg.hidden_size
    routed = sum(m.k * 3 * H * m.inter for m in moes)
    dense = (len(net.layers) - len(moes)) * 3 * H * max(cfg.intermediate_size, 0)
    other = len(net.layers) * 4 * H * H + cfg.vocab_size * H + dense
    share = routed / (routed + other)
    fresh = sum(1.0 - m.k / m.E for m in moes) / len(moes)
    slope = PRIOR_SLOPE * (1.0 - share) + fresh * share
    return max(slope, STREAMED_PRIOR_SLOPE) if streamed else slope
