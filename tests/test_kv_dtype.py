"""The KV cache's precision (--kv-cache-dtype, COLI_KV_CACHE_DTYPE): f16 by default, f32 on
request; every layer of an engine stores one dtype, what reads and writes the cache follows
it, and what sizes memory counts its bytes. (The kernels: tests/test_kernels.py; logits
against transformers: tests/test_models.py; the state file: tests/test_kv_persist.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import coli
from coli.errors import InvalidRequestError
from coli.plan import make_plan
from coli.runner import kv_bytes_per_token
from tests.conftest import prompt_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_is_f16_and_the_environment_or_the_option_chooses(hf_models, monkeypatch):
    d = hf_models("qwen3")
    monkeypatch.delenv("COLI_KV_CACHE_DTYPE", raising=False)
    assert coli.load(d, threads=1).engine.kv_cache_dtype == "f16"
    assert coli.load(d, threads=1, kv_cache_dtype="F32").engine.kv_cache_dtype == "f32"
    monkeypatch.setenv("COLI_KV_CACHE_DTYPE", "f32")
    eng = coli.load(d, threads=1).engine
    assert eng.kv_cache_dtype == "f32" and eng.new_cache().k.dtype == np.float32
    with pytest.raises(InvalidRequestError, match="unknown KV cache dtype 'q8_0': use f16 or f32"):
        coli.load(d, threads=1, kv_cache_dtype="q8_0")


def test_f16_halves_the_bytes_everything_that_sizes_memory_counts(hf_models):
    d = hf_models("qwen3")
    f16, f32 = (coli.load(d, threads=1, kv_cache_dtype=t).engine for t in ("f16", "f32"))
    assert 2 * kv_bytes_per_token(f16) == kv_bytes_per_token(f32)
    assert 2 * f16.new_cache(32).nbytes == f32.new_cache(32).nbytes
    plans = [make_plan(d, ctx=512, kv_cache_dtype=t) for t in ("f16", "f32")]
    assert plans[0].kv_per_token == kv_bytes_per_token(f16) and 2 * plans[0].kv == plans[1].kv


def test_a_step_refuses_a_cache_of_another_dtype(hf_models):
    """An engine writes its own dtype's rows: a cache of the other would be overrun or
    misread, so it is refused before any kernel runs."""
    d = hf_models("qwen3")
    f16, f32 = (coli.load(d, threads=1, kv_cache_dtype=t).engine for t in ("f16", "f32"))
    for eng, other in ((f16, f32), (f32, f16)):
        cache = other.new_cache()
        with pytest.raises(ValueError, match="use new_cache"):
            eng.step([(cache, prompt_ids(4))])
        assert len(cache) == 0 and not cache.k.any()


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_f16_decode_equals_recompute_and_batching(name, hf_models):
    """With an f16 cache the usual identities hold: the rows of one prefill equal those of
    decoding token by token (both read the rounded cache), alone or beside another sequence."""
    model = coli.load(hf_models(name), threads=2)
    eng = model.engine
    ids, other = prompt_ids(12), prompt_ids(7, seed=3)
    cache = eng.new_cache(capacity=4)
    full = eng.step([(cache, ids)], all_logits=True).copy()
    one, two, mate = eng.new_cache(), eng.new_cache(), eng.new_cache()
    eng.step([(one, ids[:5])])
    eng.step([(two, ids[:5]), (mate, other)])
    alone = [eng.step([(one, [t])])[0].copy() for t in ids[5:]]
    together = [eng.step([(two, [t]), (mate, [t])])[0].copy() for t in ids[5:]]
    np.testing.assert_allclose(np.stack(alone), full[5:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.stack(together), np.stack(alone), atol=1e-5, rtol=0)


def test_cli_rejects_a_bad_dtype_in_one_line_and_bench_reports_it():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "coli.cli", "run", "--kv-cache-dtype", "f64", "hi"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "f64" in r.stderr and "Traceback" not in r.stderr
    outs = {}
    for t in ("f16", "f32"):
        r = subprocess.run([sys.executable, "-m", "coli.cli", "bench", "--synthetic", "tiny", "--prompt-tokens", "16",
                            "--gen-tokens", "4", "--repeats", "1", "--kv-cache-dtype", t, "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        outs[t] = json.loads(r.stdout)
        assert outs[t]["kv_cache_dtype"] == t
    assert 2 * outs["f16"]["kv_bytes_per_token"] == outs["f32"]["kv_bytes_per_token"]
    assert 2 * outs["f16"]["kv_bytes_read_per_token"] == outs["f32"]["kv_bytes_read_per_token"]


def test_heads_wider_than_f16_attention_reads_get_an_f32_cache_and_the_plan_counts_it(tmp_path):
    """Heads of more than 576 values (none known) are beyond what an f16 cache's attention
    widens: the engine stores f32 instead, and `coli plan` counts the bytes it will hold."""
    from coli._engine import kernels as K
    from tests.conftest import make_hf_model

    hd = K.F16_HEAD_MAX + 64
    make_hf_model("llama", tmp_path, seed=0, hidden_size=2 * hd, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=hd, intermediate_size=32, num_hidden_layers=1)
    m = coli.load(tmp_path, threads=1)
    assert m.engine.kv_cache_dtype == "f32" and m.engine.new_cache(4).k.dtype == np.float32
    assert make_plan(tmp_path).kv_per_token == kv_bytes_per_token(m.engine) == 1 * 2 * 1 * hd * 4
    assert coli.load(tmp_path, threads=1, kv_cache_dtype="f32").engine.kv_cache_dtype == "f32"
