"""What the server added to the runner: stop token ids that skip leading markers, logprob
events, logit bias, an output parser, scoring without generation (Brio)."""
from __future__ import annotations

import numpy as np
import pytest

import coli
from coli.chat_format import FORMATS, OutputParser
from coli.runner import Runner
from coli.sampling import SamplingParams, logprobs
from coli.scheduler import Finished, PromptLogprobs, ReasoningDelta, Started, TextDelta, TokenLogprob, Usage

WAIT = 120
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=1)


@pytest.fixture
def runner(model):
    r = Runner(model, kv_slots=2, persist=False, notice=lambda t: None)
    yield r
    r.close()


def ids(model, text):
    return model.tokenizer.encode(text)


def greedy_tokens(model, prompt, n):
    """The reference: greedy tokens from full forward passes."""
    out = list(prompt)
    for _ in range(n):
        out.append(int(np.argmax(model.forward(out)[-1])))
    return out[len(prompt):]


def test_logprob_events_match_the_model(model, runner):
    prompt = ids(model, "w3 w17 w42")
    evs = list(runner.submit(prompt, max_tokens=5, sampling=GREEDY, logprobs=3).events(WAIT))
    lps = [e for e in evs if isinstance(e, TokenLogprob)]
    toks = greedy_tokens(model, prompt, 5)
    assert [e.token for e in lps] == toks
    seq = list(prompt)
    for e, t in zip(lps, toks):
        ref = logprobs(model.forward(seq)[-1])
        assert e.logprob == pytest.approx(float(ref[t]), abs=1e-4)
        assert [i for i, _ in e.top] == list(np.argsort(-ref, kind="stable")[:3])
        seq.append(t)
    # each logprob event comes before the text of its token
    kinds = [type(e) for e in evs if isinstance(e, (TokenLogprob, TextDelta))]
    assert kinds[0] is TokenLogprob


def test_logit_bias_steers_sampling(model, runner):
    prompt = ids(model, "w1 w2")
    target = 77
    res = runner.submit(prompt, max_tokens=4, sampling=GREEDY, logit_bias={target: 100.0}).result(WAIT)
    assert res.text == " ".join([f"w{target}"] * 4)


def test_stop_token_ids_skip_leading_markers(model, runner):
    prompt = ids(model, "w5 w6")
    first, second = greedy_tokens(model, prompt, 2)
    # the first generated token is a "marker": skipped while nothing was written, so generation goes on
    r = runner.submit(prompt, max_tokens=6, sampling=GREEDY, stop_token_ids=[first]).result(WAIT)
    assert r.usage.completion_tokens > 1
    # once text was written, the marker ends the turn
    r = runner.submit(prompt, max_tokens=6, sampling=GREEDY, stop_token_ids=[second]).result(WAIT)
    assert r.text == f"w{first}" and r.finish_reason == "stop"


def test_parser_hook_and_finish_reason(model, runner):
    prompt = ids(model, "w5 w6")
    first, second = greedy_tokens(model, prompt, 2)
    fmt = FORMATS["qwen"]
    # a parser that starts inside a reasoning block: everything before the end is reasoning
    h = runner.submit(prompt, max_tokens=3, sampling=GREEDY, parser=OutputParser(fmt, in_reasoning=True))
    evs = list(h.events(WAIT))
    assert not [e for e in evs if isinstance(e, TextDelta)]
    assert "".join(e.text for e in evs if isinstance(e, ReasoningDelta)).startswith(f"w{first}")
    assert isinstance(evs[-1], Finished) and evs[-1].finish_reason == "length"


def test_score_reads_prompt_logprobs_and_reuses_the_prefix(model, runner):
    prefix = ids(model, "w1 w2 w3 w4 w5 w6")
    endings = [ids(model, "w7 w8"), ids(model, "w7 w9 w10"), ids(model, "w100")]
    slot, got = None, []
    for e in endings:
        evs = list(runner.score(prefix + e, len(prefix), cache_slot=slot).events(WAIT))
        started = next(x for x in evs if isinstance(x, Started))
        usage = next(x for x in evs if isinstance(x, Usage))
        if slot is not None:
            assert started.cached_tokens == len(prefix) - 1  # the prefix was not computed again
        slot = started.slot
        assert usage.completion_tokens == 0
        got.append(next(x for x in evs if isinstance(x, PromptLogprobs)).logprobs)
    for e, lp in zip(endings, got):
        ref = logprobs(model.forward(prefix + e))
        want = [float(ref[len(prefix) - 1 + j, t]) for j, t in enumerate(e)]
        assert lp == pytest.approx(want, abs=1e-4)
    with pytest.raises(coli.errors.InvalidRequestError):
        runner.score(prefix, len(prefix))


def test_score_and_generation_share_steps(model, runner):
    """A scoring request batched with a decoding one: both get the right numbers."""
    prompt = ids(model, "w9 w8 w7")
    prefix, ending = ids(model, "w1 w2 w3"), ids(model, "w4 w5")
    # references first: the engine is not to be called from two threads at once
    ref = logprobs(model.forward(prefix + ending))
    want_text = " ".join(f"w{t}" for t in greedy_tokens(model, prompt, 12))
    gen = runner.submit(prompt, max_tokens=12, sampling=GREEDY)
    events = gen.events(WAIT)
    assert isinstance(next(events), Started)
    lp = next(x for x in runner.score(prefix + ending, len(prefix)).events(WAIT) if isinstance(x, PromptLogprobs))
    assert lp.logprobs == pytest.approx([float(ref[2, ending[0]]), float(ref[3, ending[1]])], abs=1e-4)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == want_text
