"""Batched closed-set scoring: many continuations of one shared prefix, in a few steps.

A request of this kind is a tree of token sequences. Its root, the shared prefix (a
Brio context, a /v1/systemone ``state``), lives in a KV slot like any prompt, so a
later request with the same prefix reuses it. Each *question* is a branch of the
prefix (its own tokens, possibly none), and each *option* (outcome) a branch of its
question; what is wanted is the log-probability of every option token given
everything before it on its path.

How the branches are computed (``BranchScorer.run``), with the engine's ordinary
M>1 step and no kernel of its own:

1. Every question with tokens gets a *lane*: a scratch ``KVCache`` into which the
   prefix's keys and values are copied (a KV fork; attention reads each sequence's
   rows contiguously from its own cache, so sharing needs a copy). One step feeds
   every question's tokens, one entry per lane; the last row of each gives the
   distribution of every option's first token. A question without tokens reads
   it from the prefix's own last logits.
2. An option's last token is never fed: its probability is already known from the
   row before it. Options of one token (yes/no labels, score digits, most short
   names) therefore cost nothing more. For every longer option, its tokens but the
   last are fed in a lane forked from its question's lane (identical token
   prefixes share one lane), all of them in one step that returns every row.

Lanes are kept between requests in a pool bounded by ``kv_budget`` bytes; a request
needing more lanes than fit runs in waves, a step per wave. The slot's own cache is
only read: it still holds just the prefix afterwards. Results do not depend on
which other questions or options share the request (each path is the same tokens
at the same positions over the same prefix); the kernels compute each row alone,
so in practice they are bit-identical too.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coli.engine import Engine, KVCache
from coli.errors import InvalidRequestError

DEFAULT_KV_BUDGET = 256 * 2**20  # bytes of scratch KV the lanes may hold


@dataclass(frozen=True)
class Question:
    """A branch of the shared prefix: its tokens (may be empty) and its options' tokens
    (each at least one)."""

    ids: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, ids: Sequence[int], options: Sequence[Sequence[int]]) -> "Question":
        opts = tuple(tuple(int(t) for t in o) for o in options)
        if not opts or any(not o for o in opts):
            raise InvalidRequestError("every option needs at least one token")
        return cls(tuple(int(t) for t in ids), opts)

    @property
    def length(self) -> int:
        """Tokens on the longest path below the prefix."""
        return len(self.ids) + max(len(o) for o in self.options)


@dataclass(frozen=True)
class BranchLogprobs:
    """A batched scoring request's answer (``Runner.score_branches``): for each question,
    for each option, the log-probability of each of its tokens."""

    logprobs: tuple[tuple[tuple[float, ...], ...], ...]  # [question][option][token]
    steps: int = 0  # engine steps the branches took (the prefix's are not counted)
    tokens: int = 0  # tokens those steps fed


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)  # (V,)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def token_logprobs(row: np.ndarray, tokens: Sequence[int]) -> list[float]:
    """log_softmax(row)[tokens], without materialising the whole distribution in float64."""
    m = float(row.max())
    lse = m + float(np.log(np.exp(row - m, dtype=np.float64).sum()))
    return [float(row[t]) - lse for t in tokens]


class BranchScorer:
    """Runs the branches of batched scoring requests on one engine (see the module
    docstring); owns the scratch lanes. Not thread-safe: the engine's thread uses it."""

    def __init__(self, engine: Engine, kv_budget: int = DEFAULT_KV_BUDGET):
        self.engine, self.kv_budget = engine, kv_budget
        probe = engine.new_cache(1)
        self.bytes_per_token = probe.k.shape[0] * (probe.k.shape[2] + probe.v.shape[2]) * probe.k.itemsize
        self.lanes: list[KVCache] = []

    def run(self, cache: KVCache, last_logits: np.ndarray | None, questions: Sequence[Question]) -> BranchLogprobs:
        """Score ``questions`` after the prefix ``cache`` holds (only read). ``last_logits``
        (V,): the logits of the prefix's last token, needed when a question has no tokens."""
        P = len(cache)
        for q in questions:
            if P + q.length > self.engine.max_context:
                raise InvalidRequestError(f"context_length_exceeded: {P + q.length} tokens do not fit the context of "
                                          f"{self.engine.max_context}")
            if not q.ids and last_logits is None:
                raise InvalidRequestError("a question without tokens needs the prefix's last logits")
        out: list[list[tuple[float, ...] | None]] = [[None] * len(q.options) for q in questions]
        steps = tokens = 0
        base = None if last_logits is None else log_softmax(last_logits)
        # waves of questions: each question's lane stays while its options are scored
        order = list(range(len(questions)))
        while order:
            wave, used = [], 0
            for i in order:
                need = self._lane_bytes(P + questions[i].length)
                if wave and used + need > self.kv_budget // 2:
                    break
                wave.append(i)
                used += need
            order = order[len(wave):]
            s, t = self._wave(cache, base, [(i, questions[i]) for i in wave], out)
            steps, tokens = steps + s, tokens + t
        return BranchLogprobs(tuple(tuple(o) for o in out), steps, tokens)

    # -- internals --------------------------------------------------------------------------------

    def _wave(self, cache: KVCache, base, wave: list[tuple[int, Question]], out) -> tuple[int, int]:
        P, eng = len(cache), self.engine
        steps = tokens = 0
        qcache: dict[int, KVCache] = {}
        first: dict[int, np.ndarray] = {}  # question -> log-probabilities of its options' first tokens
        with_ids = [(i, q) for i, q in wave if q.ids]
        for j, (i, q) in enumerate(with_ids):
            qcache[i] = self._fork(j, cache, P, P + q.length)
        if with_ids:
            logits = eng.step([(qcache[i], list(q.ids)) for i, q in with_ids])  # (questions, V)
            steps, tokens = 1, sum(len(q.ids) for _, q in with_ids)
            for j, (i, _) in enumerate(with_ids):
                first[i] = log_softmax(logits[j])
        for i, q in wave:
            if not q.ids:
                qcache[i], first[i] = cache, base
        # options longer than one token: the distinct token prefixes to feed, per question, and
        # the last tokens read after each (the earlier ones are the path's own)
        lasts: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        for i, q in wave:
            for o in q.options:
                if len(o) > 1:
                    lasts.setdefault((i, o[:-1]), set()).add(o[-1])
        paths = list(lasts)
        rows: dict[tuple[int, tuple[int, ...]], dict] = {}  # path -> {(position, token): log-probability}
        free = len(with_ids)  # lanes 0.. hold the questions
        while paths:
            batch, used = [], 0
            for i, path in paths:
                n = len(qcache[i]) + len(path)
                need = self._lane_bytes(n)
                if batch and used + need > self.kv_budget // 2:
                    break
                batch.append((i, path))
                used += need
            paths = paths[len(batch):]
            entries = []
            for k, (i, path) in enumerate(batch):
                src = qcache[i]
                entries.append((self._fork(free + k, src, len(src), len(src) + len(path)), list(path)))
            logits = eng.step(entries, all_logits=True)  # (tokens of all paths, V)
            steps, tokens = steps + 1, tokens + len(logits)
            r = 0
            for i, path in batch:  # only the entries wanted: a row of a large vocabulary is big
                got = {}
                for k in range(len(path)):
                    wanted = [path[k + 1]] if k + 1 < len(path) else sorted(lasts[(i, path)])
                    got.update(((k, t), v) for t, v in zip(wanted, token_logprobs(logits[r + k], wanted)))
                rows[(i, path)] = got
                r += len(path)
        for i, q in wave:
            for k, o in enumerate(q.options):
                lp = [float(first[i][o[0]])]
                if len(o) > 1:
                    got = rows[(i, o[:-1])]
                    lp += [got[(j, o[j + 1])] for j in range(len(o) - 1)]
                out[i][k] = tuple(lp)
        return steps, tokens

    def _lane_bytes(self, n: int) -> int:
        return n * self.bytes_per_token

    def _fork(self, j: int, src: KVCache, n: int, capacity: int) -> KVCache:
        """Lane j, holding a copy of src's first n tokens, with room for ``capacity``."""
        while len(self.lanes) <= j:
            self.lanes.append(self.engine.new_cache(capacity))
        lane = self.lanes[j]
        lane.truncate(0)
        lane.reserve(capacity)
        lane.k[:, :n] = src.k[:, :n]
        lane.v[:, :n] = src.v[:, :n]
        lane.tokens = list(src.tokens[:n])
        return lane

    def trim(self) -> None:
        """Drop lanes past the budget (called between requests)."""
        total, keep = 0, []
        for lane in self.lanes:
            total += lane.nbytes
            if total > self.kv_budget:
                break
            keep.append(lane)
        self.lanes = keep


def score_options(engine: Engine, prefix: Sequence[int], options: Sequence[Sequence[int]],
                  scorer: BranchScorer | None = None, chunk: int = 256) -> list[tuple[float, ...]]:
    """Each option's per-token log-probabilities after ``prefix`` (at least one token),
    computed with a fresh cache: the prefix once, then the options in batched steps."""
    ids = [int(t) for t in prefix]
    if not ids:
        raise InvalidRequestError("score_options: the prefix is empty")
    scorer = scorer or BranchScorer(engine)
    cache = engine.new_cache(len(ids))
    logits = None
    for i in range(0, len(ids), chunk):
        logits = engine.step([(cache, ids[i:i + chunk])])
    result = scorer.run(cache, logits[0].copy(), [Question.of((), options)])
    return list(result.logprobs[0])
