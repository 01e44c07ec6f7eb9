"""Every architecture against transformers, the correctness oracle: same logits
(fp32, max abs diff <= 1e-4) and the same greedy tokens through the KV cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import coli
from tests.conftest import ARCHS, make_hf_model, prompt_ids

TOL = 1e-4
GREEDY_STEPS = 24


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m, m(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(m, ids, n):
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def coli_greedy(model, ids, n):
    eng = model.engine
    cache = eng.new_cache()
    logits = eng.step([(cache, ids)])
    toks = []
    for _ in range(n):
        t = int(np.argmax(logits[0]))
        toks.append(t)
        logits = eng.step([(cache, [t])])
    return toks


@pytest.mark.parametrize("name", list(ARCHS))
def test_matches_transformers(name, hf_models):
    d = hf_models(name)
    ids = prompt_ids(16)
    ref_model, ref = hf_logits(d, ids)
    model = coli.load(d, threads=2)
    got = model.forward(ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= TOL, f"{name}: max |diff| {np.abs(got - ref).max():.2e}"
    assert coli_greedy(model, ids, GREEDY_STEPS) == hf_greedy(ref_model, ids, GREEDY_STEPS)


def test_incremental_decode_equals_recompute(hf_models):
    model = coli.load(hf_models("qwen3_moe"), threads=2)
    ids = prompt_ids(20)
    full = model.forward(ids)
    cache = model.engine.new_cache(capacity=4)  # forces the cache to grow on the way
    model.engine.step([(cache, ids[:7])])
    rows = [model.engine.step([(cache, [t])])[0].copy() for t in ids[7:]]
    np.testing.assert_allclose(np.stack(rows), full[7:], atol=1e-5, rtol=0)


def test_batched_decode_equals_separate(hf_models):
    """Several sequences in one step give what each gives alone."""
    model = coli.load(hf_models("olmoe"), threads=2)
    eng = model.engine
    prompts = [prompt_ids(n, seed=s) for n, s in ((5, 1), (9, 2), (13, 3))]
    caches = [eng.new_cache() for _ in prompts]
    eng.step([(c, p[:-1]) for c, p in zip(caches, prompts)])  # batched prefill of three sequences
    batched = eng.step([(c, p[-1:]) for c, p in zip(caches, prompts)]).copy()
    for p, row in zip(prompts, batched):
        np.testing.assert_allclose(row, model.forward(p)[-1], atol=1e-5, rtol=0)


def test_threads_do_not_change_results(hf_models):
    d = hf_models("mixtral")
    ids = prompt_ids(12)
    one = coli.load(d, threads=1).forward(ids)
    two = coli.load(d, threads=2).forward(ids)
    np.testing.assert_array_equal(one, two)


def test_one_token_step_builds_the_general_batch(hf_models):
    """Engine.step's shortcut for one sequence decoding one token: the Batch of the general
    path, with layer pointers that follow the cache when it grows."""
    eng = coli.load(hf_models("qwen3"), threads=2).engine
    cache = eng.new_cache(capacity=4)
    eng.step([(cache, prompt_ids(4))])
    cache.reserve(5)  # grows: new arrays
    fast, fast_rows = eng._one_token(cache, [7])
    slow, slow_rows = eng._batch([(cache, [7])], all_logits=False)
    for name in ("ids", "pos", "kptr", "vptr"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.flags.c_contiguous
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fast_rows, slow_rows)
    assert fast.kptr[1, 0] == cache.k[1].ctypes.data and fast.vptr[0, 0] == cache.v.ctypes.data


def test_kv_cache_is_cache_line_aligned_and_keeps_its_contents_when_it_grows(hf_models):
    eng = coli.load(hf_models("qwen3"), threads=1).engine
    cache = eng.new_cache(capacity=4)
    eng.step([(cache, prompt_ids(4))])
    before = cache.k[:, :4].copy(), cache.v[:, :4].copy()
    cache.reserve(9)
    for a in (cache.k, cache.v):
        assert a.ctypes.data % 64 == 0 and a.dtype == np.float32 and a.flags.c_contiguous and a.shape[1] == 16
    np.testing.assert_array_equal(cache.k[:, :4], before[0])
    np.testing.assert_array_equal(cache.v[:, :4], before[1])
    assert not cache.k[:, 4:].any()


def test_sharded_checkpoint(tmp_path):
    make_hf_model("qwen3_moe", tmp_path, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = prompt_ids(12)
    _, ref = hf_logits(tmp_path, ids)
    assert np.abs(coli.load(tmp_path).forward(ids) - ref).max() <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(tmp_path, dtype):
    """bf16 / f16 weights are widened to f32: same logits as transformers run in f32."""
    make_hf_model("llama", tmp_path, dtype=dtype, tie_word_embeddings=True)
    ids = prompt_ids(12)
    _, ref = hf_logits(tmp_path, ids)
    assert np.abs(coli.load(tmp_path).forward(ids) - ref).max() <= TOL
