"""Fenced token streams: the router accepts only the next index of the active assignment.

Every attempt to serve a request on a worker is an *assignment* with its own id. Each
message a worker sends for it carries ``(assignment_id, index)`` with a zero-based index
counting that assignment's messages. ``StreamFence`` is the router's side of one request:
it accepts a message only if it belongs to the active assignment and carries exactly the
next index. Everything else is dropped and counted by reason:

    duplicate   the index was already accepted (a redelivery)
    reordered   the index is ahead of the next one (a message before it is missing)
    stale       another assignment's message (an abandoned attempt, a retried worker)
    late        any message after the request has ended

A new assignment (a retry) may only begin while nothing has reached the client; after
the first delivered delta the request can only end (shared/spec/serving-boundary.md,
"Streaming safety").
"""
from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field

REASONS = ("duplicate", "reordered", "stale", "late")


def new_assignment_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Message:
    """What crosses the wire for one assignment: an event (coli.scheduler.events) or, for
    the terminal one, also the worker's KV events since its last report."""

    assignment: str
    index: int
    event: object
    kv: tuple = ()  # ((seq, stored_hashes, evicted_hashes), ...) on terminal messages


class RetryAfterDelivery(RuntimeError):
    """A new assignment was asked for after output reached the client."""


@dataclass
class StreamFence:
    """The router's view of one request's stream (see the module docstring)."""

    active: str | None = None
    worker: str | None = None
    next_index: int = 0
    delivered: int = 0  # deltas that reached the client, over all assignments
    closed: bool = False
    assignments: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reason -> count

    def assign(self, assignment: str, worker: str | None = None) -> None:
        """Begin an assignment (the first, or a retry before any delivered delta)."""
        if self.closed:
            raise RuntimeError("the stream has ended")
        if self.delivered:
            raise RetryAfterDelivery("output already reached the client; the stream cannot move to another worker")
        self.active, self.worker, self.next_index = assignment, worker, 0
        self.assignments.append(assignment)

    def check(self, assignment: str, index: int) -> str | None:
        """None if (assignment, index) is the next message to accept, else the drop reason."""
        if self.closed:
            return "late"
        if assignment != self.active:
            return "stale"
        if index < self.next_index:
            return "duplicate"
        if index > self.next_index:
            return "reordered"
        return None

    def accept(self, assignment: str, index: int) -> bool:
        """Accept the message (advancing the index) or drop and count it."""
        reason = self.check(assignment, index)
        if reason is not None:
            self.dropped[reason] += 1
            return False
        self.next_index += 1
        return True

    def delivered_delta(self) -> None:
        """A text, reasoning or tool-call delta was passed to the client."""
        self.delivered += 1

    def close(self) -> None:
        self.closed = True
        self.active = None
