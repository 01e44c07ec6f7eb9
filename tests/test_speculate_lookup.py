"""Prompt lookup's index (coli.speculate._lookup.NgramIndex, in C) proposes what its Python
twin (coli.speculate.ngram.NgramDrafter) and a from-scratch search both propose, token for
token, on random and on repetitive contexts growing one or several tokens at a time; and
the runner's per-step use of it (take, step, tokens) keeps the request's context."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coli.speculate._lookup import NgramIndex
from coli.speculate.ngram import NgramDrafter


def reference(ctx, k, max_n=16, min_n=2, candidates=8):
    """(draft, match): the definition, searched from scratch. Of the latest ``candidates``
    earlier occurrences of the context's last min_n tokens (positions p with ctx[p-min_n:p]
    equal to them, p < len(ctx)), the one whose match reaches furthest back (up to max_n,
    ties to the latest) is followed, repeating with its period past the end."""
    L = len(ctx)
    if k < 1 or L <= min_n:
        return [], 0
    suffix = ctx[L - min_n:]
    at = [p for p in range(min_n, L) if ctx[p - min_n:p] == suffix]
    best, best_n = 0, 0
    for p in reversed(at[-candidates:]):
        n = min_n
        while n < min(max_n, p) and ctx[p - 1 - n] == ctx[L - 1 - n]:
            n += 1
        if n > best_n:
            best, best_n = p, n
        if n == max_n:
            break
    if not best_n:
        return [], 0
    return [ctx[best + i % (L - best)] for i in range(k)], best_n


@st.composite
def contexts(draw):
    """A context (random, or a few passages repeated with edits) and how it arrives: a
    prompt, then chunks of output."""
    vocab = draw(st.sampled_from([2, 3, 7, 50_000, 2**31 - 1]))
    token = st.integers(0, vocab - 1)
    if draw(st.booleans()):
        ctx = draw(st.lists(token, max_size=160))
    else:  # repetitive: passages copied with changes, as a rewrite of a file would
        passages = draw(st.lists(st.lists(token, min_size=1, max_size=24), min_size=1, max_size=4))
        ctx = []
        for _ in range(draw(st.integers(1, 6))):
            part = list(draw(st.sampled_from(passages)))
            if part and draw(st.booleans()):
                part[draw(st.integers(0, len(part) - 1))] = draw(token)
            ctx += part
    prompt = draw(st.integers(0, len(ctx)))
    chunks = []
    at = prompt
    while at < len(ctx):
        n = draw(st.integers(1, 4))
        chunks.append(min(len(ctx), at + n))
        at = chunks[-1]
    return ctx, prompt, chunks


@settings(max_examples=300, deadline=None)
@given(contexts(), st.integers(1, 4), st.integers(0, 3), st.integers(1, 9), st.integers(0, 6))
def test_the_c_index_proposes_what_the_python_twin_and_the_definition_propose(case, min_n, extra, candidates, k):
    ctx, prompt, chunks = case
    max_n = min_n + extra
    twin = NgramDrafter(max_n, min_n, candidates)
    index = NgramIndex(ctx[:prompt], max_n, min_n, candidates)
    output = []  # the request's generated tokens, as the runner's payload holds them
    for end in [prompt, *chunks]:
        output += ctx[len(output) + prompt:end]
        got = index.step(output, k)
        want, match = reference(ctx[:end], k, max_n, min_n, candidates)
        assert (got or []) == want and index.match == match
        assert twin.propose(ctx[:end], k) == want and twin.match == match
        assert len(index) == end and index.seen == len(output)
    assert index.tokens() == ctx and index.tokens(prompt) == ctx[prompt:]


def test_a_long_context_grows_the_table_and_keeps_every_occurrence():
    rng = random.Random(3)
    ctx = [rng.randrange(40) for _ in range(6000)]  # 40**2 min-grams: every one recurs, the table grows
    ctx[5000:5100] = ctx[100:200]  # a passage copied: a long match far back
    index, twin = NgramIndex(ctx[:3000]), NgramDrafter()
    output, longest = [], 0
    for end in range(3000, len(ctx) + 1, 7):
        output += ctx[3000 + len(output):end]
        got = index.step(output, 5)
        want = twin.propose(ctx[:end], 5)
        assert (got or []) == want and index.match == twin.match
        longest = max(longest, index.match)
    assert longest == 16  # inside the copy
    assert reference(ctx[:5048], 6) == (ctx[148:154], 16)


def test_the_index_takes_only_new_output_and_says_none_without_a_match():
    index = NgramIndex([5, 6, 7, 8])
    out = [9]
    assert index.step(out, 3) is None and index.match == 0  # "8 9" never occurred
    out += [5, 6]
    assert index.take(out) == 2 and index.take(out) == 0  # each token once
    assert index.step(out, 3) == [7, 8, 9] and index.match == 2
    assert index.step(out, 0) is None and index.propose(0) == []
    assert index.tokens(4) == [9, 5, 6] and len(index) == 7
    with pytest.raises(ValueError):
        index.extend([-1])
    with pytest.raises(ValueError):
        NgramIndex([2**31])
    with pytest.raises(ValueError):
        NgramIndex(min_ngram=3, max_ngram=2)
