"""Speculation measured: the same prompts through a Runner without and with it.

``compare(model, prompts, mode)`` decodes each prompt greedily twice (speculation off,
then ``mode``) and reports decode tok/s both ways, the acceptance rate, the mean tokens
per decode step, and whether the texts are identical (they must be). Decode time is the
request's wall time from its Started event to its Finished one minus its prefill
seconds, so the runner's own per-step work (drafting, verification) is counted. On a
machine shared with other work the wall time mostly measures waiting for a core, so the
runner thread's CPU time over the same span is reported too (``*_cpu``; with one compute
thread it is all of the request's work: drafting, engine steps, verification).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from coli.sampling import SamplingParams
from coli.scheduler.events import Profile


def _one(runner, prompt: list[int], max_tokens: int, speculative: str | None = None) -> dict:
    h = runner.submit(prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0), speculative=speculative)
    clock = time.pthread_getcpuclockid(runner._thread.ident)
    c = h.result(600, timings=True, cpu_clock=lambda: time.clock_gettime(clock))
    prof, t = c.profile, c.timings
    seconds = max(1e-9, t.finished - t.started - prof.prefill_seconds)
    decode_steps = max(1, prof.steps - _prefill_steps(prof, runner))  # (the last prefill step samples too)
    return dict(text=c.text, tokens=c.usage.completion_tokens, seconds=seconds,
                cpu=max(1e-9, t.finished_cpu - t.started_cpu), steps=decode_steps,
                drafted=prof.draft_tokens, accepted=prof.accepted_tokens)


def _prefill_steps(prof: Profile, runner) -> int:
    return -(-prof.prefill_tokens // runner.config.prefill_chunk) if prof.prefill_tokens else 0


def compare(model, prompts: Sequence[Sequence[int]], mode: str = "auto", *, max_tokens: int = 64,
            draft_model=None, repeats: int = 1) -> dict:
    """Greedy decoding of every prompt without and with speculation ``mode`` (medians of
    ``repeats`` rounds; each round runs both, alternating, after a warm-up request), through
    one runner whose baseline requests switch speculation off."""
    from coli.runner import Runner

    runs = {"off": [], "on": []}
    texts = {"off": [], "on": []}
    # One runner, speculation switched off per request for the baseline (one cost model, one
    # compute thread). Two live runners, each keeping an OpenMP team, once made both sides
    # 2-3.5x slower at 2 threads on 2 cores and inflated the speed-up (libgomp sleeps at its
    # barriers while its threads outnumber the cores); runners now retire their workers when
    # idle (coli.threads.ComputeThreads), but one runner needs no such care.
    with Runner(model, persist=False, speculative=mode, draft_model=draft_model) as runner:
        _one(runner, list(prompts[0]), 4, "off")
        _one(runner, list(prompts[0]), 4)
        for r in range(repeats):
            for p in prompts:
                for name, spec in (("off", "off"), ("on", None)):
                    res = _one(runner, list(p), max_tokens, spec)
                    runs[name].append(res)
                    if r == 0:
                        texts[name].append(res["text"])

    def rate(name: str, key: str = "seconds") -> float:
        return statistics.median(x["tokens"] / x[key] for x in runs[name])

    on_runs = runs["on"]
    drafted = sum(x["drafted"] for x in on_runs)
    accepted = sum(x["accepted"] for x in on_runs)
    steps = sum(x["steps"] for x in on_runs)  # decode steps: each yields 1 + its accepted drafts
    off_tok_s, on_tok_s = rate("off"), rate("on")
    off_cpu, on_cpu = rate("off", "cpu"), rate("on", "cpu")
    return dict(mode=mode, prompts=len(prompts), max_tokens=max_tokens, repeats=repeats,
                decode_tok_s_without=off_tok_s, decode_tok_s_with=on_tok_s, speedup=on_tok_s / off_tok_s,
                tok_per_cpu_s_without=off_cpu, tok_per_cpu_s_with=on_cpu, speedup_cpu=on_cpu / off_cpu,
                acceptance_rate=accepted / drafted if drafted else 0.0, draft_tokens=drafted,
                accepted_tokens=accepted, tokens_per_step=1.0 + accepted / steps if steps else 0.0,
                identical=texts["off"] == texts["on"])
