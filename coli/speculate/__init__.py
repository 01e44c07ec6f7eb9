"""Speculative decoding: draft tokens, verify them in one multi-token step, keep what the
target model itself would have produced, and stop when it does not pay.

The runner calls four things (see coli/runner.py), nothing else:

    spec = Speculator.create(runner, mode, draft_model)   # at start
    spec.extend(plan)            # after schedule(): draft tokens onto decoding entries
    spec.observe(plan, seconds)  # after the engine step: the cost model learns t(M)
    spec.verify(req, seq, rows, sample) -> SeqOutput      # an entry with drafts: which to keep

A decoding entry [next] becomes [next, d1..dk]; the engine returns a logits row per token;
``verify`` samples each row with the request's own sampler while it matches the draft
(coli.speculate.verify); the scheduler keeps the KV of the accepted tokens only (the slot
history is cut back, the runner truncates the cache to it on the next step), so prefix
reuse and KV persistence see exactly what decoding without speculation would have left.

Draft sources: ``ngram`` (prompt lookup, coli.speculate.ngram; its index is in C,
coli/speculate/_lookup.pyx; always available),
``draft`` (a small model with the same tokenizer, coli.speculate.draft_model), ``mtp``
(the next-token layers of DeepSeek-V3 / GLM-4.5 checkpoints, coli.speculate.mtp, chained
on its own output for several drafts). ``auto`` takes the best available source and drafts
per request only while the cost model (coli.speculate.cost) says a verification step's
expected yield is worth its cost; a named source always drafts (k chosen by the cost
model, at least 1). ``off``: never.

How ``auto`` learns a request's acceptance without paying for it: prompt lookup costs
nothing to consult, so while it is not drafting it keeps a *shadow* draft (what it would
have proposed) and checks it against the tokens the model actually emits; the acceptance
those checks give decides when drafting starts, and no verification step is spent on a
request whose output does not repeat. Sources that cost a forward pass to consult (a
draft model, MTP) cannot shadow for free: they probe with a short draft, rarely, and
back off exponentially (16, 32, ... up to 256 steps) while probes fail. Before any step
of more than one token is measured, the cost model assumes each extra token costs what
the model's structure says it reads: for a mixture of experts, the experts a new token
routes to (all of them when experts stream from disk).

What ``auto`` costs where it does not draft (most free generation): per step and request,
one call into the C index (it takes the new tokens and finds no earlier occurrence of the
context's suffix), a few attribute reads, and one step in TIME_PLAIN_EVERY timed for the
cost model (the thread's CPU clock is a system call). Shadow checks, the cost model and
the acceptance counts run only after a match. A request that does not speculate (``off``,
constrained, scoring) costs one attribute read.
"""
from __future__ import annotations

import os
import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace

from coli.errors import InvalidRequestError
from coli.scheduler.core import ScheduledSeq
from coli.speculate.cost import Acceptance, StepCosts, best_k, expected_tokens, floor_slope, prior_slope
from coli.speculate.metrics import SpeculativeMetrics
from coli.speculate._lookup import NgramIndex
from coli.speculate.verify import accept_run

MODES = ("auto", "off", "ngram", "mtp", "draft")
ENV = "COLI_SPECULATIVE"
MAX_K = 16  # draft tokens per verification at most
MIN_GAIN = 1.03  # auto: the expected speed-up a verification must promise
# ... with experts streamed from disk: a verification also reads experts that evict ones the
# next steps need, a cost no step time shows
MIN_GAIN_STREAMED = 1.15
PROBE_AFTER = 16  # auto, switched off: steps until the next trial verification (doubles, up to MAX_BACKOFF)
MAX_BACKOFF = 256
TIME_PLAIN_EVERY = 8  # steps without drafts: one in this many is timed for the cost model (a system call each)
SHADOW_K = 4  # auto, prompt lookup: tokens of a shadow draft checked against the output
# prompt lookup's acceptance is kept per class of its match's length: 2, 3, 4, 5-7, 8-11, 12+
# tokens. The length says much of how long the copy runs (SmolLM2-135M rewriting a function:
# drafts from 2- and 3-token matches kept 1.5 tokens on average, from 5-7 7-8, from 10+ all 16),
# and finer classes let each learn its own rate (against three classes 2-3, 4-7, 8+, SmolLM2
# int8 at one thread, CPU time: "fix a typo" 2.19x -> 2.32x, the rewrite unchanged at 1.6x)
MATCH_CLASSES = (3, 4, 5, 8, 12)  # the first length of each class after the first
# ... each class's acceptance before any check (accepted, rejected): a short match waits for
# evidence, a long one is trusted sooner (where extra tokens are cheap: at once)
SHADOW_PRIORS = tuple((0.5 + 0.5 * c, 1.0) for c in range(len(MATCH_CLASSES) + 1))


def match_class(n: int) -> int:
    return bisect_right(MATCH_CLASSES, n)


def resolve_mode(mode: str | None, env=None, default: str = "auto") -> str:
    """``mode`` if given, else $COLI_SPECULATIVE, else ``default``; InvalidRequestError if unknown.
    (Front ends default to auto; a Runner built in code defaults to off.)"""
    env = os.environ if env is None else env
    m = mode if mode is not None else (env.get(ENV) or default)
    if m not in MODES:
        where = "--speculative" if mode is not None else f"{ENV}={m!r}:"
        raise InvalidRequestError(f"{where} must be one of {', '.join(MODES)}, got {m!r}")
    return m


@dataclass(eq=False)
class _State:
    """One request's speculation: its source, acceptance, and the auto switch."""

    source: str  # "ngram", "draft" or "mtp"
    adaptive: bool  # auto: may switch itself off
    ctx: list[int] | None  # a draft model or MTP: prompt + output so far (the drafter's context)
    seen: int = 0  # ... the request's generated tokens already in ctx
    lookup: NgramIndex | None = None  # prompt lookup: the context and its index (it keeps its own ``seen``)
    accs: dict[int, Acceptance] = field(default_factory=dict)  # by class of prompt lookup's match length
    cls: int = 0  # the class of the draft (or shadow draft) now out
    shadow: list[int] = field(default_factory=list)  # auto, prompt lookup not drafting: what it would have drafted
    shadow_at: int = 0  # ... for the context positions from here on
    off_until: int = 0  # auto: no drafts before this step
    backoff: int = PROBE_AFTER
    probing: bool = False

    @property
    def acc(self) -> Acceptance:
        """The acceptance of drafts like the one now out (prompt lookup: by its match's length:
        a long match follows the passage being copied, a short one is a guess)."""
        a = self.accs.get(self.cls)
        if a is None:
            a = self.accs[self.cls] = Acceptance(*SHADOW_PRIORS[self.cls]) if self.adaptive and self.source == "ngram" \
                else Acceptance()
        return a


class Speculator:
    """One runner's speculation: per-request states (each on its request's payload, as
    ``speculation``), the step cost model shared by its requests, and the draft model's
    caches when there is one."""

    def __init__(self, runner, mode: str, draft=None, max_k: int = MAX_K, fixed_k: int | None = None):
        self.runner, self.mode, self.draft = runner, mode, draft
        self.max_k, self.fixed_k = max_k, fixed_k  # fixed_k: always that many drafts (tests)
        streamed = runner.engine.io_stats() is not None  # experts read from disk: extra tokens cost more
        self.min_gain = MIN_GAIN_STREAMED if streamed else MIN_GAIN
        net = runner.engine.model
        self.costs = StepCosts(prior_slope=prior_slope(net, streamed), floor_slope=floor_slope(net, streamed))
        self.metrics = SpeculativeMetrics.on(runner.metrics.registry)
        self.mtp = None  # coli.speculate.mtp.MTPSource when the checkpoint has MTP layers (and mode allows)
        self._step = 0
        self._cpu0: float | None = None  # the runner thread's CPU clock when the step's plan was drafted
        self._timed = True  # this step's time goes to the cost model

    @classmethod
    def create(cls, runner, mode: str | None = None, draft_model=None, **kw) -> Speculator:
        """The runner's speculator for ``mode`` (None: $COLI_SPECULATIVE, else off).
        ``draft_model``: a loaded coli.Model sharing the runner model's tokenizer."""
        from coli.speculate import mtp

        mode = resolve_mode(mode, default="off")
        draft = None
        if draft_model is not None:
            from coli.speculate.draft_model import DraftSource

            draft = DraftSource(runner.model, draft_model, runner.config.kv_slots)
        spec = cls(runner, mode, draft, **kw)
        if mode == "mtp" or (mode == "auto" and mtp.available(runner.model)):
            spec.mtp = mtp.MTPSource(runner.model, runner.config.kv_slots)
        spec.check_request(mode)
        return spec

    def check_request(self, mode: str | None) -> None:
        """InvalidRequestError unless ``mode`` (a request's override; None: the runner's) can run."""
        if mode is None:
            return
        if mode not in MODES:
            raise InvalidRequestError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "mtp" and self.mtp is None:
            raise InvalidRequestError("speculative mode 'mtp' is not available: the model has no multi-token-"
                                      "prediction layers loaded (a DeepSeek-V3 or GLM-4.5 checkpoint with "
                                      "num_nextn_predict_layers, served with --speculative mtp or auto)")
        if mode == "draft" and self.draft is None:
            raise InvalidRequestError("speculative mode 'draft' needs a draft model (--draft-model DIR)")

    # -- the runner's hooks ----------------------------------------------------------------------

    def extend(self, plan) -> None:
        """Append draft tokens to the plan's decoding entries (in place). Steps that
        prefill a prompt get none: the prompt's tokens dominate their cost. A step in
        which nothing is drafted costs a few attribute reads and one index lookup per
        request (its step is timed one in TIME_PLAIN_EVERY times)."""
        seqs = plan.seqs
        if self.mode == "off" and not any(s.request.payload.speculative for s in seqs):
            self._timed = False  # nothing in this step may speculate: no work at all
            return
        self._step += 1
        drafted = False
        try:
            for s in seqs:
                if s.draft or not s.sample or s.request.prefilling:  # no drafts this step
                    drafted = any(s.draft for s in seqs)
                    if not drafted and any(s.request.prefilling for s in seqs):
                        drafted = None  # a prefill step: the cost model does not learn from it
                    break
            else:
                drafted = self._draft(seqs)
        finally:
            # every step with drafts is timed, plain ones only now and then (their cost changes
            # slowly, and reading the thread's CPU clock is a system call)
            self._timed = drafted or (drafted is not None and (self._step % TIME_PLAIN_EVERY == 0 or self._step < 32))
            self._cpu0 = time.thread_time() if self._timed else None

    def _draft(self, seqs: list) -> bool:
        """Drafts onto a decode step's entries (``seqs``, in place); True when any got some."""
        m = len(seqs)
        drafted = False
        wanted = None  # [(index, state, k)]: draft-model and MTP requests, drafted together below
        for i, s in enumerate(seqs):
            req = s.request
            g = req.payload
            st = g.speculation
            if st is None:
                st = g.speculation = self._new_state(req)
            if not st or req.cancel_requested:
                continue
            lookup = st.lookup
            if lookup is not None:  # prompt lookup: its index takes the new tokens, then looks the suffix up
                if st.shadow:  # auto: a shadow draft is being checked against the output
                    if not lookup.take(g.generated):
                        continue
                    _check_shadow(st, lookup.tokens(st.shadow_at))
                    if st.shadow:
                        continue
                d = lookup.step(g.generated, self.max_k)  # None (the common case): no earlier occurrence
                if d is None:
                    continue
                limit = min(self.max_k, req.max_tokens - req.generated - 1, self.runner.ctx - s.start - 2)
                if limit < 1:
                    continue
                st.cls = match_class(lookup.match)
                k = self._choose(st, m, limit)  # a lookup costs next to nothing: look first, then decide
                if k:
                    seqs[i] = ScheduledSeq(req, s.slot, s.start, [*s.tokens, *d[:k]], s.sample, k)
                    m += k
                    drafted = True
                elif st.adaptive and self.fixed_k is None:
                    st.shadow, st.shadow_at = d[:min(SHADOW_K, limit)], len(lookup)
                continue
            gen = g.generated
            if len(gen) != st.seen:  # the tokens emitted since: onto the drafter's context
                st.ctx += gen[st.seen:]
                st.seen = len(gen)
            limit = min(self.max_k, req.max_tokens - req.generated - 1, self.runner.ctx - s.start - 2)
            if limit < 1 or (st.adaptive and self.fixed_k is None and self._step < st.off_until):
                continue
            k = self._choose(st, m, limit)
            if k:
                if wanted is None:
                    wanted = []
                wanted.append((i, st, k))
                m += k
        if wanted is None:
            return drafted
        for source in ("draft", "mtp"):
            batch = [(i, st, k) for i, st, k in wanted if st.source == source]
            if not batch:
                continue
            got = getattr(self, source).propose([(seqs[i].slot, st.ctx, k) for i, st, k in batch])
            for (i, st, k), d in zip(batch, got):
                if d:
                    s = seqs[i]
                    seqs[i] = replace(s, tokens=[*s.tokens, *d[:k]], draft=len(d[:k]))
                    drafted = True
        return drafted

    def observe(self, plan, seconds: float) -> None:
        """Learn the step time of a decode step of M tokens (prefill steps are not counted).
        The runner thread's CPU time since ``extend`` is used rather than the wall ``seconds``:
        on a busy machine the wall time mostly measures how long the thread waited for a core.
        (The kernels' other threads are not counted; the calling thread takes part in every
        parallel region, so its CPU time follows the step's length.) Time spent waiting for
        experts to arrive from disk is added: a verification step may read more of them."""
        if self.mtp is not None:
            self.mtp.capture(plan, self._may_use_mtp)  # the hidden states the MTP layer drafts from
        if not self._timed:
            return
        cpu = time.thread_time() - self._cpu0 if self._cpu0 is not None else seconds
        cpu += getattr(self.runner.engine.last, "io_wait", 0.0)
        m = 0
        for s in plan.seqs:
            if s.request.prefilling and not s.draft:
                return
            m += len(s.tokens)
        if m:
            self.costs.observe(m, cpu if cpu > 0 else seconds)

    def verify(self, req, s, rows, sample):
        """The SeqOutput of an entry with drafts: ``rows`` its logits (one per token),
        ``sample(req, row)`` the runner's own sampling of one row."""
        draft = s.tokens[len(s.tokens) - s.draft:]
        out, rejected = accept_run(draft, rows, lambda row: sample(req, row))
        n = len(out.accepted)
        st = req.payload.speculation
        if st:
            st.acc.record(s.draft, n, rejected)
        g = req.payload
        g.draft_tokens += s.draft
        g.accepted_tokens += n
        g.decode_tokens += n
        self.metrics.record(s.draft, n, n + (out.token is not None))
        return out

    # -- internals --------------------------------------------------------------------------------

    def _may_use_mtp(self, req) -> bool:
        g = req.payload
        return g.score_from is None and (g.speculative or self.mode) in ("auto", "mtp")

    def _new_state(self, req) -> _State | bool:
        """A request's speculation state, at its first decode step; False: it does not speculate."""
        g = req.payload
        mode = g.speculative or self.mode
        # constrained answers (coli.grammar) and batched scoring (coli.scoring) do not speculate:
        # their tokens come from a grammar's masks and forced runs, or are not generated at all
        if mode == "off" or g.score_from is not None or g.guided is not None or g.branches is not None:
            return False
        source = ("mtp" if mode == "mtp" or (mode == "auto" and self.mtp is not None) else
                  "draft" if mode == "draft" or (mode == "auto" and self.draft is not None) else "ngram")
        if source != "ngram":
            return _State(source, adaptive=mode == "auto", ctx=[*req.prompt, *g.generated], seen=len(g.generated))
        # the index starts with the prompt; its first step takes the output so far
        return _State(source, adaptive=mode == "auto", ctx=None, lookup=NgramIndex(req.prompt))

    def _choose(self, st: _State, m: int, limit: int) -> int:
        """Draft tokens for this request's next step (0: a plain step)."""
        if self.fixed_k is not None:
            return min(self.fixed_k, limit)
        if st.adaptive and self._step < st.off_until:
            return 0
        cost = 0.0 if st.source == "ngram" else getattr(self, st.source).seconds_per_token
        a = st.acc.rate
        if st.adaptive and st.source == "ngram" and \
                expected_tokens(a, limit) * self.costs(m) < self.min_gain * self.costs(m + 1):
            return 0  # no k pays (best_k's answer, sooner): t(m + k) >= t(m + 1), and fewer tokens come
        k, gain = best_k(a, self.costs, m, limit, cost)
        if not st.adaptive:
            return max(1, k)
        if st.source == "ngram":  # shadow drafts keep its acceptance current: no trials needed
            return k if gain >= self.min_gain else 0
        if k and gain >= self.min_gain:
            st.backoff, st.probing = PROBE_AFTER, False
            return k
        if st.off_until and not st.probing:  # the off period is over: one trial with a short draft
            st.probing = True
            return min(2, limit)
        if st.probing:  # the trial did not pay either: stay off twice as long
            st.backoff = min(st.backoff * 2, MAX_BACKOFF)
        st.probing, st.off_until = False, self._step + st.backoff
        return 0


def _check_shadow(st: _State, new: list[int]) -> None:
    """Score a pending shadow draft against ``new``, the tokens emitted since it was made,
    as a verification of it would have: accepted while they match, rejected at the first
    difference. Still pending while every emitted token matched and some are unchecked."""
    d = st.shadow
    n = 0
    while n < len(new) and n < len(d) and new[n] == d[n]:
        n += 1
    if n == len(d) or n < len(new):
        st.acc.learn(n, n < len(d))
        st.shadow = []
