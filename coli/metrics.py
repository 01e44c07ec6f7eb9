"""The scheduler's Prometheus series, on a registry of their own.

Names, types and meanings are the spec's (shared/spec/colibri-api.md, "Prometheus
metrics"); every histogram uses the spec's buckets. The scheduler feeds these as
things happen, so collecting them never calls the engine or takes a slot. Beyond the
spec, the prefix cache and KV usage are exposed too:

    colibri_scheduler_prompt_tokens_total   counter  prompt tokens of admitted requests
    colibri_scheduler_cached_tokens_total   counter  of those, tokens whose KV was reused
    colibri_scheduler_prefix_hits_total     counter  admitted requests that reused any KV
    colibri_scheduler_kv_tokens             gauge    tokens held in all KV slots
    colibri_scheduler_kv_capacity_tokens    gauge    slots x context: what the slots can hold

The server serves ``metrics.registry`` (``prometheus_client.generate_latest``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "colibri_scheduler_"
BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, float("inf"))


class SchedulerMetrics:
    """One scheduler's series; ``registry`` is a fresh CollectorRegistry unless given."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, registry=r)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, registry=r)

        def histogram(name, doc):
            return Histogram(PREFIX + name, doc, buckets=BUCKETS, registry=r)

        self.active = gauge("active", "Admitted requests")
        self.queued = gauge("queued", "Requests waiting for a KV slot")
        self.capacity = gauge("capacity", "KV slot capacity")
        self.max_queue = gauge("max_queue", "Queue limit")
        self.admitted_total = counter("admitted", "Requests admitted to a KV slot")
        self.completed_total = counter("completed", "Admitted requests that returned normally")
        self.failed_total = counter("failed", "Admitted requests that raised an error, excluding ClientCancelled")
        self.rejected_total = counter("rejected", "Queue-full refusals")
        self.timed_out_total = counter("timed_out", "Queue timeouts")
        self.cancelled_total = counter("cancelled", "Cancellations detected before admission or during admitted work")
        self.queue_wait_seconds = histogram("queue_wait_seconds", "Wait until admission, for admitted requests only")
        self.slot_duration_seconds = histogram(
            "slot_duration_seconds", "Slot occupancy until completion, failure, or cancellation")
        self.first_output_seconds = histogram(
            "first_output_seconds", "Engine-call start to first nonempty text or tool-output callback")
        self.engine_call_seconds = histogram(
            "engine_call_seconds", "Duration of each finished engine generation call, including failure/cancellation")
        self.prompt_tokens_total = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.cached_tokens_total = counter("cached_tokens", "Prompt tokens whose KV was reused from a slot")
        self.prefix_hits_total = counter("prefix_hits", "Admitted requests that reused cached KV")
        self.kv_tokens = gauge("kv_tokens", "Tokens held in all KV slots")
        self.kv_capacity_tokens = gauge("kv_capacity_tokens", "Tokens all KV slots can hold (slots x context)")

    def value(self, name: str, labels: dict | None = None) -> float | None:
        """A sample's current value by its full name (e.g. ``colibri_scheduler_admitted_total``)."""
        return self.registry.get_sample_value(name, labels or {})
