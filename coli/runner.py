"""The runner: one scheduler driving one engine from a background thread.

    runner = Runner(coli.load(path), kv_slots=4)
    handle = runner.submit(model.prompt_ids(messages), max_tokens=128, cache_slot=1)
    async for event in handle:          # or: for event in handle  /  handle.result()
        ...                             # Started, TextDelta..., Profile, Usage, Finished | Error
    handle.cancel()                     # from anywhere: the slot is free within one step
    runner.close()

Each loop turn is ``schedule() -> engine.step -> sample, detokenize, stop strings
-> update_from_output``; the turn's events wake their asyncio readers together when
it ends (``coli.scheduler.stream.batched_delivery``). The runner owns the KV caches
(one per slot), restores them from disk at start and saves a slot whenever a request
releases it. Front ends render prompts to token ids themselves (``Model.prompt_ids``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coli.engine import Engine, KVCache, available_memory, release_threads
from coli.errors import InvalidRequestError
from coli.grammar import hook as grammar
from coli.kv.format import Layout
from coli.kv.store import KVStore, default_state_dir, model_fingerprint, weight_format
from coli.metrics import SchedulerMetrics
from coli.sampling import Sampler, SamplingParams, logprobs as log_softmax
from coli.scheduler.core import Request, Scheduler, SchedulerConfig, SeqOutput, Status, StepPlan
from coli.scheduler.events import (ContextLengthExceededError, Error, Finished, GrammarDeadEndError, Profile,
                                   PromptLogprobs, Routing, Started, TextDelta, TokenLogprob, Usage)
from coli.scheduler.stream import RequestHandle, batched_delivery
from coli.speculate import Speculator
from coli.stops import StopMatcher
from coli.tokenizer import IncrementalDetokenizer

log = logging.getLogger("coli")
KV_MEMORY_FRACTION = 0.5  # of the memory available at start that the KV slots may fill


def kv_bytes_per_token(engine: Engine) -> int:
    probe = engine.new_cache(1)
    return (probe.k.shape[0] * (probe.k.shape[2] + probe.v.shape[2])) * probe.k.itemsize


def plan_context(engine: Engine, kv_slots: int, requested: int | None = None,
                 available: int | None = None) -> tuple[int, str]:
    """The context per slot and a sentence saying why: ``requested`` (--ctx) or the
    model's, at most the model's, and by default at most what KV_MEMORY_FRACTION of
    the available memory holds for every slot at once."""
    model_max = engine.max_context
    per_token = kv_bytes_per_token(engine)
    available = available_memory() if available is None else available
    fits = None if available is None else max(2, int(available * KV_MEMORY_FRACTION) // (per_token * kv_slots))
    if requested is not None:
        if requested < 2:
            raise InvalidRequestError(f"--ctx must be at least 2 tokens, got {requested}")
        ctx, why = min(requested, model_max), "as asked (--ctx)"
        if requested > model_max:
            why = f"--ctx {requested} is more than the model's {model_max}"
        elif fits is not None and requested > fits:
            why = f"as asked (--ctx); warning: {kv_slots} slot(s) of it may not fit in memory (about {fits} would)"
    elif fits is not None and fits < model_max:
        budget = _gib(available * KV_MEMORY_FRACTION)
        ctx, why = fits, f"the model's {model_max} capped to what {budget} of memory holds"
    else:
        ctx, why = model_max, "the model's"
    note = (f"context: {ctx} tokens per KV slot, {why}; {kv_slots} slot(s) use up to "
            f"{_gib(ctx * per_token * kv_slots)} ({per_token} bytes per token)")
    return ctx, note


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


# the engine's StepStats attribute -> the Profile field it adds to (where the engine measures it)
PHASES = {"attention": "attention_seconds", "expert_matmul": "expert_matmul_seconds",
          "dense_mlp": "dense_mlp_seconds", "lm_head": "lm_head_seconds", "io_wait": "io_wait_seconds",
          "disk": "disk_seconds", "experts_needed": "experts_needed", "experts_hit": "experts_hit",
          "bytes_read": "bytes_read"}


@dataclass(eq=False)
class _Generation:
    """The runner's side of one request (``Request.payload``)."""

    handle: RequestHandle
    sampler: Sampler
    stops: StopMatcher
    detok: IncrementalDetokenizer
    routing: bool
    parser: object | None = None  # turns text into events (coli.chat_format.OutputParser)
    stop_ids: frozenset[int] = frozenset()  # role markers: stop, unless no text came yet
    logprobs: int | None = None  # None: off; n: the sampled token's logprob and the n likeliest
    bias: tuple[np.ndarray, np.ndarray] | None = None  # (ids, values) added to the logits
    score_from: int | None = None  # a scoring request: logprobs of prompt[score_from:], no generation
    guided: grammar.GuidedState | None = None  # a constraint (coli.grammar): masks and forced tokens
    branches: tuple | None = None  # a batched scoring request: coli.scoring.Questions read after the prompt
    scores: list[float] = field(default_factory=list)
    speculative: str | None = None  # this request's --speculative override (coli.speculate)
    speculation: object = None  # coli.speculate's state for it, from its first decode step (False: none)
    draft_tokens: int = 0  # speculative tokens verified
    accepted_tokens: int = 0  # ... and accepted
    text_seen: bool = False  # non-whitespace text was produced
    generated: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES.values(), 0))


class Runner:
    """A model served by one scheduler; see the module docstring.

    ``kv_slots``, ``max_queue``, ``queue_timeout``: None reads COLI_KV_SLOTS,
    COLI_MAX_QUEUE, COLI_QUEUE_TIMEOUT, then the defaults (1, 8, 300 s). ``ctx``:
    None is the model's context capped to memory (see ``plan_context``).
    ``persist``: save and restore slots in ``kv_dir`` (default: see
    ``coli.kv.store``). ``notice(text)`` receives the start-up lines (the context
    chosen, KV files ignored); by default they go to the ``coli`` logger."""

    def __init__(self, model, *, kv_slots: int | None = None, max_queue: int | None = None,
                 queue_timeout: float | None = None, ctx: int | None = None, prefill_chunk: int = 256,
                 kv_dir: str | Path | None = None, persist: bool = True, metrics: SchedulerMetrics | None = None,
                 notice: Callable[[str], None] | None = None, fold_forced: bool = True,
                 speculative: str | None = None, draft_model=None):
        self.model, self.engine, self.tokenizer = model, model.engine, model.tokenizer
        self.notice = notice or log.info
        base = SchedulerConfig.from_env(kv_slots=kv_slots, max_queue=max_queue, queue_timeout=queue_timeout)
        self.ctx, self.context_note = plan_context(self.engine, base.kv_slots, ctx)
        self.notice(self.context_note)
        self.config = SchedulerConfig(kv_slots=base.kv_slots, max_queue=base.max_queue,
                                      queue_timeout=base.queue_timeout, ctx=self.ctx, prefill_chunk=prefill_chunk)
        self.caches: list[KVCache] = [self.engine.new_cache() for _ in range(self.config.kv_slots)]
        self.store = self._open_store(kv_dir) if persist else None
        histories = self._restore()
        self.metrics = metrics or SchedulerMetrics()
        self.steps = 0  # engine steps run (front ends use it to tell what changed)
        # constraints (coli.grammar): forced tokens fed in one multi-token step, masks computed meanwhile
        self.fold_forced = fold_forced
        self.grammar_stats = grammar.GrammarStats()
        self._masks = grammar.MaskWorker()
        self._vocabulary = None
        self._scorer = None  # coli.scoring.BranchScorer, made on the first batched scoring request
        self.scheduler = Scheduler(self.config, metrics=self.metrics, listener=self._on_change, histories=histories)
        self.scheduler.hold_released = self.store is not None  # a slot freed between steps is saved first
        # speculative decoding (coli.speculate): drafts appended to decoding entries, verified in _step
        self.speculator = Speculator.create(self, speculative, draft_model)
        self._thread = threading.Thread(target=self._loop, name="coli-runner", daemon=True)
        self._team = False  # the runner thread holds OpenMP workers (it has stepped since it last retired them)
        # The kernels run on the runner's thread from now on: retire the OpenMP workers this
        # thread started (loading runs kernels), or libgomp, counting more threads than cores,
        # stops spin-waiting between parallel regions and a decode step takes twice as long.
        release_threads()
        self._thread.start()

    # -- the front-end API -----------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: str | Sequence[str] | None = None, cache_slot: int | None = None, routing: bool = False,
               request_id: str | None = None, ignore_leading_stop: bool = False,
               stop_token_ids: Collection[int] = (), logprobs: int | None = None,
               logit_bias: Mapping[int, float] | None = None, parser=None, constraint=None,
               speculative: str | None = None) -> RequestHandle:
        """Queue a generation for prompt token ids; returns its handle at once.

        Raises (before any event) InvalidRequestError for bad input,
        ContextLengthExceededError, QueueFullError or SchedulerClosedError.
        ``sampling`` defaults to the model's generation_config.json (greedy unless it
        samples); ``routing`` adds a Routing event per step with the experts chosen.

        ``ignore_leading_stop``: stop strings before any non-whitespace text are dropped
        instead of ending it. ``stop_token_ids`` end the generation like the model's
        end-of-turn tokens, except before the first non-whitespace text (a template's role
        marker written first is skipped). ``logprobs``: put a TokenLogprob event with the
        ``logprobs`` likeliest alternatives before each token's text. ``logit_bias``:
        added to those token ids' logits before sampling. ``parser``: an object with
        ``push(text) -> events``, ``finish() -> events``, ``done`` (stop now) and
        ``finish_reason(reason)``, e.g. coli.chat_format.OutputParser, that turns the text
        into reasoning, text and tool-call events. ``constraint``: a coli.grammar.Constraint
        the answer must match (token masks before sampling, forced tokens fed at once; raises
        its GrammarError when it does not compile). ``speculative``: this request's
        coli.speculate mode ("auto", "off", "ngram", "draft", "mtp"; None: the runner's)"""
        ids = self._check_prompt(prompt)
        self.speculator.check_request(speculative)
        if sampling is None:
            sampling = self.model.sampling_params()
        sampling.validate()
        vocab = self.model.config.vocab_size
        if logprobs is not None and not 0 <= int(logprobs) <= vocab:
            raise InvalidRequestError(f"logprobs must be from 0 to {vocab}, got {logprobs!r}")
        bias = None
        if logit_bias:
            keys = np.fromiter((int(k) for k in logit_bias), dtype=np.int64, count=len(logit_bias))
            if keys.min() < 0 or keys.max() >= vocab:
                raise InvalidRequestError(f"logit_bias: token ids must lie in 0..{vocab - 1}")
            bias = (keys, np.fromiter((float(v) for v in logit_bias.values()), dtype=np.float32, count=len(keys)))
        guided = None if constraint is None else grammar.GuidedState(grammar.Guide(constraint, self.vocabulary))
        req = Request(ids, int(max_tokens), cache_slot)
        if request_id is not None:
            req.request_id = request_id
        handle = RequestHandle(req, self.scheduler.cancel)
        req.payload = _Generation(handle, Sampler(sampling), StopMatcher(stop, ignore_leading_stop),
                                  IncrementalDetokenizer(self.tokenizer), routing, parser=parser,
                                  stop_ids=frozenset(int(t) for t in stop_token_ids), logprobs=logprobs, bias=bias,
                                  guided=guided, speculative=speculative)
        self.scheduler.add_request(req)
        return handle

    @property
    def vocabulary(self):
        """The model's vocabulary as coli.grammar sees it (built on first use)."""
        if isinstance(self._vocabulary, grammar.GrammarError):  # tried once: the tokenizer cannot be used
            raise self._vocabulary
        if self._vocabulary is None:
            try:
                self._vocabulary = grammar.Vocabulary.of(self.model)
            except grammar.GrammarError as e:
                self._vocabulary = e
                raise
        return self._vocabulary

    def score(self, prompt: Sequence[int], start: int, *, cache_slot: int | None = None,
              request_id: str | None = None) -> RequestHandle:
        """Read the log-probability of each of ``prompt[start:]`` given the tokens before
        it, generating nothing: the handle yields Started, PromptLogprobs, Profile, Usage
        (0 completion tokens), Finished. A slot holding ``prompt[:start]`` is reused, so
        scoring several endings of one prefix in one slot computes the prefix once.
        Raises like ``submit``."""
        ids = self._check_prompt(prompt)
        if not 1 <= start < len(ids):
            raise InvalidRequestError(f"score: start must be from 1 to {len(ids) - 1}, got {start}")
        req = Request(ids, 1, cache_slot, reuse_limit=start - 1)  # the logits at start-1 score ids[start]
        if request_id is not None:
            req.request_id = request_id
        handle = RequestHandle(req, self.scheduler.cancel)
        req.payload = _Generation(handle, Sampler(SamplingParams(temperature=0)), StopMatcher(),
                                  IncrementalDetokenizer(self.tokenizer), False, score_from=start)
        self.scheduler.add_request(req)
        return handle

    def score_branches(self, prefix: Sequence[int], questions: Sequence, *, cache_slot: int | None = None,
                       request_id: str | None = None) -> RequestHandle:
        """Batched closed-set scoring (``coli.scoring``): ``prefix`` goes through a KV slot
        like a prompt (reused from, and left in, the slot); then every ``Question``'s options
        are read after it in a few batched steps. The handle yields Started, BranchLogprobs,
        Profile, Usage (0 completion tokens), Finished. Raises like ``submit``."""
        ids = self._check_prompt(prefix)
        if not questions:
            raise InvalidRequestError("score_branches: give at least one question")
        longest = max(q.length for q in questions)
        if len(ids) + longest > self.ctx:
            raise ContextLengthExceededError(f"context_length_exceeded: {len(ids) + longest} tokens do not fit "
                                             f"the context of {self.ctx}")
        req = Request(ids, 1, cache_slot)
        if request_id is not None:
            req.request_id = request_id
        handle = RequestHandle(req, self.scheduler.cancel)
        req.payload = _Generation(handle, Sampler(SamplingParams(temperature=0)), StopMatcher(),
                                  IncrementalDetokenizer(self.tokenizer), False, branches=tuple(questions))
        self.scheduler.add_request(req)
        return handle

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"a prompt token id is outside the vocabulary (0..{vocab - 1})")
        return ids

    def generate(self, prompt: Sequence[int], **kwargs) -> Iterator[str]:
        """Blocking text pieces of one request (``submit``'s arguments); raises its error."""
        handle = self.submit(prompt, **kwargs)
        try:
            for ev in handle:
                if isinstance(ev, TextDelta):
                    yield ev.text
                elif isinstance(ev, Error):
                    raise ev.exception()
        finally:
            handle.cancel()  # a no-op once it finished; frees the slot if the reader left early

    def close(self, timeout: float | None = 60.0) -> None:
        """Cancel what runs or waits, stop the engine thread, write pending KV state."""
        self.scheduler.close()
        self._thread.join(timeout)
        self._masks.close()
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- persistence -----------------------------------------------------------------------------

    def _open_store(self, kv_dir) -> KVStore | None:
        path = getattr(self.model, "path", None)
        if path is None:
            return None
        fingerprint = model_fingerprint(path)
        probe = self.engine.new_cache(1)
        layout = Layout(fingerprint, probe.k.shape[0], probe.k.shape[2], probe.v.shape[2], str(probe.k.dtype),
                        weight_format(self.model))
        directory = Path(kv_dir) if kv_dir is not None else default_state_dir(path, fingerprint)
        store = KVStore(directory, layout, model_path=str(Path(path).resolve()), notice=self.notice)
        return store if store.enabled else None

    def _restore(self) -> dict[int, list[int]]:
        histories = {}
        if self.store is None:
            return histories
        for i, cache in enumerate(self.caches):
            state = self.store.restore(i)
            if state is None or not state.tokens:
                continue
            n = min(len(state.tokens), self.ctx)
            cache.reserve(n)
            cache.k[:, :n] = state.k[:, :n]
            cache.v[:, :n] = state.v[:, :n]
            cache.tokens = state.tokens[:n]
            histories[i] = cache.tokens
        return histories

    def _save(self, ended: list[Request]) -> None:
        if self.store is None:
            return
        for i in sorted({r.slot for r in ended if r.slot is not None}):
            tokens = self.scheduler.slot_history(i)
            cache, n = self.caches[i], len(tokens)
            if cache.tokens[:n] != tokens:  # never save KV that does not belong to the tokens
                self.notice(f"not saving KV slot {i}: its cache and history disagree")
                continue
            self.store.save(i, tokens, cache.k[:, :n].copy(), cache.v[:, :n].copy())

    def _save_released(self) -> None:
        """Save the slots of requests cancelled between steps (they wait, unavailable to
        other requests, until this hands them back)."""
        released = self.scheduler.take_released()
        if released:
            try:
                self._save(released)
            finally:
                self.scheduler.saved(released)

    # -- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        sched = self.scheduler
        try:
            while True:
                self._save_released()
                plan = sched.schedule()
                if plan and self.speculator is not None:
                    self.speculator.extend(plan)  # draft tokens onto decoding entries
                if not plan:
                    if sched.closed:
                        self._save_released()  # (the slots close() just freed)
                        return
                    if self._team:  # out of work: retire this thread's OpenMP workers while idle, so
                        # another thread computing meanwhile (a second runner, Model.generate) is the
                        # only team and keeps spinning (coli.threads.ComputeThreads); ~0.1 ms to restart
                        release_threads()
                        self._team = False
                    sched.wait_for_work(timeout=1.0)
                    continue
                self._team = True
                with batched_delivery():  # the step's events wake each asyncio loop once, after it
                    try:
                        ended = self._step(plan)
                    except Exception as e:  # the engine failed: the requests of this step fail, others go on
                        log.exception("engine step failed")
                        ended = sched.fail_step(plan, f"{type(e).__name__}: {e}")
                self._save(ended)
        except BaseException as e:  # a bug in the loop itself: no request may wait forever
            log.exception("the runner stopped")
            sched.abort(f"the runner stopped: {type(e).__name__}: {e}")

    def _step(self, plan: StepPlan) -> list[Request]:
        entries = []
        for s in plan.seqs:
            cache = self.caches[s.slot]
            if len(cache) < s.start:
                raise RuntimeError(f"slot {s.slot}: the cache holds {len(cache)} tokens, the plan needs {s.start}")
            cache.truncate(s.start)
            entries.append((cache, s.tokens))
        # a scoring request needs the logits of every scored position, not only the last
        scoring = any(s.request.payload.score_from is not None
                      and s.start + len(s.tokens) >= s.request.payload.score_from for s in plan.seqs)
        every = [scoring or s.draft > 0 for s in plan.seqs]  # entries that get a logits row per token
        t0 = time.perf_counter()
        self._masks.start(grammar.due(plan))  # constrained sequences' masks, while the engine runs
        try:
            logits = self.engine.step(entries, all_logits=every if any(every) else False)  # (rows, vocab)
        finally:
            self._masks.wait()
        seconds = time.perf_counter() - t0
        self.steps += 1
        if self.speculator is not None:
            self.speculator.observe(plan, seconds)
        stats = self.engine.last
        routed = stats.routed
        phases = {field_: getattr(stats, attr, 0) for attr, field_ in PHASES.items()}
        picks = None if any(every) else _greedy_picks(plan, logits)
        outputs, row, lrow, branching = {}, 0, 0, []  # row: the step's token rows; lrow: its logits rows
        for i, s in enumerate(plan.seqs):
            req, g = s.request, s.request.payload
            g.steps += 1
            for k, x in phases.items():
                g.phases[k] += x
            if req.prefilling:
                g.prefill_seconds += seconds
                g.prefill_tokens += len(s.tokens)
            else:
                g.decode_seconds += seconds
                g.decode_tokens += len(s.tokens) - s.draft  # accepted drafts are added by the speculator
            if g.routing and routed:
                experts = tuple(tuple(tuple(int(e) for e in r) for r in layer[row: row + len(s.tokens)])
                                for layer in routed)
                g.handle.put(Routing(plan.step, experts))
            nrows = len(s.tokens) if every[i] else 1
            last = lrow + nrows - 1
            if g.score_from is not None and scoring:
                self._score(req, s, logits[lrow: lrow + nrows])
            row += len(s.tokens)
            if s.sample and not req.cancel_requested and g.branches is not None:
                branching.append((req, logits[last].copy()))  # run after this loop: it steps the engine
            elif s.sample and not req.cancel_requested:
                if s.draft:  # speculative: each row picks a token, as many as match the draft
                    outputs[req.request_id] = self.speculator.verify(req, s, logits[lrow: lrow + nrows], self._sample)
                else:
                    outputs[req.request_id] = (SeqOutput(None, "stop") if g.score_from is not None else
                                               self._sample(req, logits[last], None if picks is None else picks[i]))
            lrow += nrows
        for req, last_logits in branching:
            outputs[req.request_id] = self._branches(req, last_logits)
        return self.scheduler.update_from_output(plan, outputs)

    def _branches(self, req: Request, last_logits: np.ndarray) -> SeqOutput:
        """A batched scoring request's prefix is in its slot: score its branches (coli.scoring)."""
        from coli.scoring import BranchScorer

        g = req.payload
        if self._scorer is None:
            self._scorer = BranchScorer(self.engine)
        try:
            result = self._scorer.run(self.caches[req.slot], last_logits, g.branches)
        except Exception as e:
            return SeqOutput(error=f"scoring failed: {e}")
        finally:
            self._scorer.trim()
        self.steps += result.steps
        g.steps += result.steps
        g.prefill_tokens += result.tokens
        g.handle.put(result)
        return SeqOutput(None, "stop")

    def _score(self, req: Request, s, rows) -> None:
        """Log-probabilities of the prompt tokens that ``rows`` (the logits of s.tokens) predict."""
        g, prompt = req.payload, req.prompt
        for j in range(len(s.tokens)):
            pos = s.start + j  # this row predicts prompt[pos + 1]
            if g.score_from - 1 <= pos < len(prompt) - 1:
                x = rows[j].astype(np.float64)  # (V,)
                m = x.max()
                g.scores.append(float(x[prompt[pos + 1]] - m - np.log(np.exp(x - m).sum())))

    def _sample(self, req: Request, logits, tok: int | None = None) -> SeqOutput:
        """The request's next token from its logits row (V,), or ``tok`` when the step already
        picked it (``_greedy_picks``, logit_bias included); then end of turn, logprobs, text
        and stop strings."""
        g = req.payload
        raw, forced = logits, ()
        if g.guided is not None:  # a constraint picks (coli.grammar): the batch's argmax ignored its mask
            try:
                tok, forced, raw = grammar.pick(g.guided, g.sampler, logits, g.generated, g.bias,
                                                req.max_tokens - req.generated, self.model.eos_ids,
                                                self.fold_forced, self.grammar_stats, g.logprobs is not None)
            except grammar.DeadEnd as e:
                return SeqOutput(error=GrammarDeadEndError(str(e)))
        elif tok is None:
            if g.bias is not None:
                logits = logits.copy()
                logits[g.bias[0]] += g.bias[1]
            try:
                tok = g.sampler.sample(logits, g.generated)
            except Exception as e:
                return SeqOutput(error=f"sampling failed: {e}")
        if tok in self.model.eos_ids:
            return SeqOutput(None, "stop")
        if tok in g.stop_ids and g.text_seen:
            return SeqOutput(None, "stop")
        stopped = self._take(req, tok, raw)
        taken = []  # forced tokens: taken like sampled ones, fed together in the next step
        for t in forced:
            if stopped:
                break
            stopped = self._take(req, t, None)
            taken.append(t)
        if g.guided is not None and grammar.finished(g.guided):
            stopped = True  # the grammar allows only end of turn now: no step for it
        return SeqOutput(tok, "stop" if stopped else None, forced=tuple(taken))

    def _take(self, req: Request, tok: int, raw) -> bool:
        """Append a picked token: logprobs (``raw``: its logits; None: forced, probability 1),
        text, stop strings, parser. True when the request stops here."""
        g = req.payload
        g.generated.append(tok)
        if g.logprobs is not None:
            g.handle.put(_token_logprob(raw, tok, g.logprobs) if raw is not None
                         else TokenLogprob(int(tok), 0.0, ((int(tok), 0.0),) if g.logprobs else ()))
        piece = g.detok.push(tok)
        if piece:  # the spec's first output is observed before stop filtering
            self.scheduler.note_first_output(req)
        text, stopped = g.stops.push(piece)
        self._emit(g, text)
        return stopped or (g.parser is not None and g.parser.done)

    @staticmethod
    def _emit(g: _Generation, text: str) -> None:
        if not text:
            return
        if not g.text_seen and text.strip():
            g.text_seen = True
        if g.parser is None:
            g.handle.put(TextDelta(text))
        else:
            for ev in g.parser.push(text):
                g.handle.put(ev)

    def _on_change(self, req: Request) -> None:
        """The scheduler admitted or ended ``req`` (called under its lock)."""
        g: _Generation = req.payload
        put = g.handle.put
        if req.status is Status.RUNNING:
            put(Started(req.slot, len(req.prompt), req.cached_tokens, req.queue_wait, req.max_tokens))
        elif req.status is Status.COMPLETED:
            piece = g.detok.flush()
            if piece:
                self.scheduler.note_first_output(req)
            text, _ = g.stops.push(piece)
            self._emit(g, text + g.stops.flush())
            reason = req.finish_reason
            if g.parser is not None:
                for ev in g.parser.finish():
                    put(ev)
                reason = g.parser.finish_reason(reason)
            if g.score_from is not None:
                put(PromptLogprobs(tuple(g.scores)))
            if g.guided is not None:
                self.grammar_stats.add(g.guided.guide)
            put(Profile(g.prefill_seconds, g.decode_seconds, g.steps, g.prefill_tokens, g.decode_tokens, **g.phases,
                        draft_tokens=g.draft_tokens, accepted_tokens=g.accepted_tokens))
            put(Usage(len(req.prompt), req.generated, req.cached_tokens, req.queue_wait))
            put(Finished(reason, g.stops.stopped))
        elif req.error is not None:
            put(Error(req.error.code, str(req.error)))


def _greedy_picks(plan: StepPlan, logits: np.ndarray) -> list[int] | None:
    """Every entry's argmax, when each entry that samples is plain greedy: one pass over
    the step's logits (entries, V) picks what each Sampler.sample would. A request's
    logit_bias is added to its row for that pass and taken off again (the same float32
    sums as the biased copy that ``_sample`` makes, so the same pick; ``logits`` comes
    back unchanged for logprobs). None otherwise: each request samples its own row."""
    sampling = [s.request.payload for s in plan.seqs if s.sample]
    # (a constrained entry picks under its mask and ignores its argmax)
    if not sampling or not all(g.guided is not None or g.sampler.is_greedy for g in sampling):
        return None
    biased = [(i, g.bias) for i, s in enumerate(plan.seqs)
              if s.sample and (g := s.request.payload).guided is None and g.bias is not None]
    saved = [logits[i, ids].copy() for i, (ids, _) in biased]  # (n_ids,) each
    for i, (ids, values) in biased:
        logits[i, ids] += values
    try:
        return logits.argmax(axis=1).tolist()  # (entries,): ties go to the lowest id, as greedy()
    finally:
        for (i, (ids, _)), old in zip(biased, saved):
            logits[i, ids] = old


def _token_logprob(logits, tok: int, n: int) -> TokenLogprob:
    lp = log_softmax(logits)  # (V,)
    top = ()
    if n:
        best = np.argpartition(lp, len(lp) - n)[len(lp) - n:] if n < len(lp) else np.arange(len(lp))
        best = best[np.lexsort((best, -lp[best]))]  # most likely first, ties by id
        top = tuple((int(t), float(lp[t])) for t in best if lp[t] > -np.inf)  # (a constraint's mask: -inf)
    return TokenLogprob(int(tok), float(lp[tok]), top)
