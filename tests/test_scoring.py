"""Batched closed-set scoring (coli.scoring): the same log-probabilities as full forward
passes, in a few steps, whatever the lanes' budget, with the slot's cache left as it was."""
from __future__ import annotations

import numpy as np
import pytest

import coli
from coli.sampling import logprobs
from coli.scoring import BranchScorer, Question


@pytest.fixture(scope="module")
def model(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=1)


def ids(model, text):
    return model.tokenizer.encode(text)


def want(model, before, option):
    lp = logprobs(model.forward(list(before) + list(option)))
    return [float(lp[len(before) - 1 + j, t]) for j, t in enumerate(option)]


def test_score_options_matches_forward(model):
    prefix = ids(model, "w1 w2 w3 w4")
    options = [ids(model, "w5"), ids(model, "w6 w7"), ids(model, "w6 w8 w9"), ids(model, "w6 w7 w10")]
    got = model.score_options(prefix, options)
    for o, lp in zip(options, got):
        assert lp == pytest.approx(want(model, prefix, o), abs=1e-4)


@pytest.mark.parametrize("budget", [1, 2**16, 2**28])  # 1 byte: a lane per step; then a few; then all at once
def test_questions_as_branches_in_waves(model, budget):
    eng = model.engine
    state = ids(model, "w11 w12 w13 w14 w15")
    cache = eng.new_cache()
    last = eng.step([(cache, state)])[0].copy()
    held = (cache.k[:, :len(state)].copy(), list(cache.tokens))
    qs = [Question.of(ids(model, "w20 w21"), [ids(model, "w1 w2"), ids(model, "w3"), ids(model, "w1 w4")]),
          Question.of((), [ids(model, "w5 w6 w7"), ids(model, "w8")]),
          Question.of(ids(model, "w22"), [ids(model, "w9 w9"), ids(model, "w10")])]
    scorer = BranchScorer(eng, kv_budget=budget)
    r = scorer.run(cache, last, qs)
    for q, res in zip(qs, r.logprobs):
        for o, lp in zip(q.options, res):
            assert lp == pytest.approx(want(model, state + list(q.ids), o), abs=1e-4)
    # the prefix's own cache is only read
    assert cache.tokens == held[1] and np.array_equal(cache.k[:, :len(state)], held[0])
    if budget == 2**28:  # one step for the question texts, one for every longer option
        assert r.steps == 2
    # the same request again gives the same numbers, bit for bit
    assert scorer.run(cache, last, qs).logprobs == r.logprobs


def test_options_need_tokens(model):
    with pytest.raises(coli.errors.InvalidRequestError):
        Question.of([1], [[2], []])
