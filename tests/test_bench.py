"""`coli bench`: what it feeds the model while decoding, and its command line."""
from __future__ import annotations

import json

import numpy as np
import pytest

import coli
from coli import bench, synthetic
from tests.test_errors import assert_one_line_error, coli_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic.write_converted("tiny", tmp_path_factory.mktemp("bench") / "tiny-int4", "int4", seed=0)


def _fed_tokens(model, **kw):
    """Run bench.run and record every step's (tokens, argmax of the returned logits)."""
    eng, steps = model.engine, []
    real = eng.step

    def spy(entries, all_logits=False):
        logits = real(entries, all_logits)
        steps.append((list(entries[0][1]), int(np.argmax(logits[0]))))
        return logits

    eng.step = spy
    try:
        res = bench.run(model, **kw)
    finally:
        eng.step = real
    return res, steps


@pytest.mark.parametrize("decode", ["greedy", "random"])
def test_decode_input(tiny, decode):
    m = coli.load(tiny, threads=1)
    res, steps = _fed_tokens(m, prompt_tokens=6, gen_tokens=12, repeats=1, seed=5, decode=decode)
    m.close()
    assert res.decode == decode
    for r in range(2):  # warm-up repeat + the measured one: a prefill step, then one step per token
        run = steps[r * 13:(r + 1) * 13]
        assert len(run[0][0]) == 6 and all(len(toks) == 1 for toks, _ in run[1:])
        fed = [toks[0] for toks, _ in run[1:]]
        argmax = [a for _, a in run[:-1]]
        if decode == "greedy":
            assert fed == argmax  # each step feeds back the previous step's argmax
        else:
            assert fed[0] == argmax[0]  # the first token is the prompt's answer, then the continuation
            assert fed[1:] != argmax[1:] and len(set(fed)) > 6  # varied tokens, not the model's choice


def test_decode_mode_is_checked(tiny):
    m = coli.load(tiny, threads=1)
    with pytest.raises(ValueError, match="greedy, random"):
        bench.run(m, prompt_tokens=2, gen_tokens=2, repeats=1, decode="sampled")
    m.close()


def test_cli_random_decode_json(tiny):
    r = coli_cli("bench", "--model", str(tiny), "--decode", "random", "--prompt-tokens", "4", "--gen-tokens", "4",
                 "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["decode"] == "random" and out["runs"][0]["decode_tok_s"] > 0


def test_cli_rejects_unknown_decode_mode(tiny):
    assert_one_line_error(coli_cli("bench", "--model", str(tiny), "--decode", "sampled"), "--decode", "greedy, random")


def test_peak_rss_is_the_process_own(tmp_path):
    """A child started by spawn reports its own peak, not its parent's larger one."""
    import multiprocessing as mp

    big = np.ones(256 << 20, np.uint8)  # the parent touches 256 MiB
    with mp.get_context("spawn").Pool(1) as pool:
        child = pool.apply(bench.peak_rss_bytes)
    assert bench.peak_rss_bytes() >= big.nbytes
    assert child < big.nbytes
