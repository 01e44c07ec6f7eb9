"""Speculation's Prometheus series, beside the scheduler's (same registry, same prefix):

    colibri_scheduler_speculative_steps_total           counter  verifications (a request's speculative step)
    colibri_scheduler_speculative_draft_tokens_total    counter  draft tokens verified
    colibri_scheduler_speculative_accepted_tokens_total counter  of those, accepted
    colibri_scheduler_speculative_tokens_per_step       histogram tokens a verification yielded (accepted + 1)
    colibri_scheduler_speculative_acceptance_ratio      gauge    accepted / drafted over recent verifications

acceptance = accepted_tokens_total / draft_tokens_total; mean tokens per speculative step =
tokens_per_step_sum / tokens_per_step_count.
"""
from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "colibri_scheduler_speculative_"
TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, float("inf"))
_ON: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> its SpeculativeMetrics


class SpeculativeMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.steps_total = Counter(PREFIX + "steps", "Speculative verifications (one request's step with drafts)",
                                   registry=registry)
        self.draft_tokens_total = Counter(PREFIX + "draft_tokens", "Draft tokens verified", registry=registry)
        self.accepted_tokens_total = Counter(PREFIX + "accepted_tokens", "Draft tokens accepted", registry=registry)
        self.tokens_per_step = Histogram(PREFIX + "tokens_per_step",
                                         "Tokens one speculative verification produced (accepted drafts + 1)",
                                         buckets=TOKEN_BUCKETS, registry=registry)
        self.acceptance_ratio = Gauge(PREFIX + "acceptance_ratio",
                                      "Accepted / drafted tokens, exponentially averaged over recent verifications",
                                      registry=registry)
        self._recent: float | None = None

    @classmethod
    def on(cls, registry: CollectorRegistry) -> SpeculativeMetrics:
        """The series on ``registry``, created once per registry."""
        m = _ON.get(registry)
        if m is None:
            m = _ON[registry] = cls(registry)
        return m

    def record(self, drafted: int, accepted: int, produced: int) -> None:
        self.steps_total.inc()
        self.draft_tokens_total.inc(drafted)
        self.accepted_tokens_total.inc(accepted)
        self.tokens_per_step.observe(produced)
        r = accepted / drafted if drafted else 0.0
        self._recent = r if self._recent is None else self._recent + 0.1 * (r - self._recent)
        self.acceptance_ratio.set(self._recent)
