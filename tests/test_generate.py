"""Model.generate: greedy equals the argmax loop, seeds reproduce, stops and limits hold,
and a reused cache changes nothing but the work done."""
from __future__ import annotations

import numpy as np
import pytest

import coli
from coli.errors import InvalidRequestError


@pytest.fixture(scope="module")
def model(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=2)


PROMPT = "w3 w17 w42 w99 w5 w8"


def test_greedy_generate_equals_argmax_loop(model):
    ids = model.tokenizer.encode(PROMPT)
    cache = model.engine.new_cache()
    logits = model.engine.step([(cache, ids)])
    toks = []
    for _ in range(12):
        toks.append(int(np.argmax(logits[0])))
        logits = model.engine.step([(cache, toks[-1:])])
    text = "".join(model.generate(PROMPT, raw=True, max_tokens=12, temperature=0))
    assert text == model.tokenizer.decode(toks)


def test_seed_reproduces_sampling(model):
    kw = dict(raw=True, max_tokens=16, temperature=1.0, top_p=0.95)
    a = "".join(model.generate(PROMPT, seed=7, **kw))
    b = "".join(model.generate(PROMPT, seed=7, **kw))
    others = {"".join(model.generate(PROMPT, seed=s, **kw)) for s in range(8, 12)}
    assert a == b
    assert others - {a}, "different seeds should give different samples"


def test_max_tokens_is_a_ceiling(model):
    pieces = list(model.generate(PROMPT, raw=True, max_tokens=3, temperature=0))
    assert len(model.tokenizer.encode("".join(pieces))) == 3


def test_stop_string_ends_and_is_removed(model):
    full = "".join(model.generate(PROMPT, raw=True, max_tokens=12, temperature=0))
    words = full.split()
    stop = " " + words[4]  # the fifth word, which spans its own token
    got = "".join(model.generate(PROMPT, raw=True, max_tokens=12, temperature=0, stop=[stop]))
    assert got == full[: full.index(stop)]


def test_context_limit(hf_models):
    m = coli.load(hf_models("qwen3_moe"), max_context=8)
    with pytest.raises(InvalidRequestError, match="context_length_exceeded"):
        list(m.generate("w1 " * 9, raw=True, max_tokens=2))
    # a prompt that fits gets its budget clamped to the room left
    out = "".join(m.generate("w1 w2 w3 w4 w5", raw=True, max_tokens=50, temperature=0))
    assert len(m.tokenizer.encode(out)) == 3


def test_reused_cache_gives_same_answer(model):
    cache = model.engine.new_cache()
    first = "".join(model.generate(PROMPT, raw=True, max_tokens=6, temperature=0, cache=cache))
    follow = PROMPT + " " + first + " w11 w12"
    cold = "".join(model.generate(follow, raw=True, max_tokens=6, temperature=0))
    warm = "".join(model.generate(follow, raw=True, max_tokens=6, temperature=0, cache=cache))
    assert warm == cold


def test_bad_sampling_values(model):
    with pytest.raises(InvalidRequestError):
        model.generate(PROMPT, temperature=-1)
    with pytest.raises(InvalidRequestError):
        model.generate(PROMPT, max_tokens=0)
