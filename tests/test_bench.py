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


def test_kv_read_counts_the_positions_each_layer_attends():
    from types import SimpleNamespace as NS

    def model(*windows):
        layers = [NS(attn=NS(k_width=8, v_width=4, window=w)) for w in windows]
        return NS(engine=NS(model=NS(layers=layers), kv_cache_dtype=kv))

    for kv, b in (("f32", 4), ("f16", 2)):
        # a run of 4 tokens after 10: the steps attend 11, 12, 13, 14 positions (mean 12.5)
        assert bench.kv_bytes_read_per_token(model(0), 10, 4) == int(12 * b * 12.5)
        # a window of 12 caps the later steps: 11, 12, 12, 12 -> the ends' mean 11.5
        assert bench.kv_bytes_read_per_token(model(0, 12), 10, 4) == int(12 * b * 12.5 + 12 * b * 11.5)


def test_roofline_judges_each_run_against_its_own_probe(tiny):
    m = coli.load(tiny, threads=1)
    res = bench.run(m, prompt_tokens=8, gen_tokens=8, repeats=2)
    m.close()
    layers = m.engine.model.layers
    width = sum(l.attn.k_width + l.attn.v_width for l in layers) * 2  # f16 rows, the default
    assert res.kv_cache_dtype == "f16" and res.kv_bytes_read_per_token == int(width * (9 + 16) / 2)
    per_token = res.weight_bytes_per_token + res.kv_bytes_read_per_token
    for r in res.runs:
        assert r.bandwidth_bytes_s > 0
        assert r.roofline_fraction == pytest.approx(r.decode_tok_s * per_token / r.bandwidth_bytes_s)
    assert res.bandwidth_bytes_s == pytest.approx(np.median([r.bandwidth_bytes_s for r in res.runs]))
    assert res.roofline_tok_s == pytest.approx(res.bandwidth_bytes_s / per_token)
    # the probes' 1 GiB buffer is not the model's memory
    assert res.peak_rss_bytes < 1 << 30
