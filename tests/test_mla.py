"""DeepSeek-V3's compressed MLA cache, and the newer architectures through the
quantized and streamed paths."""
from __future__ import annotations

import json

import numpy as np
import pytest

import coli
from coli.config import ModelConfig
from coli.models.mla import cache_bytes_per_token
from coli.weights.convert import convert
from tests.conftest import ARCHS, make_hf_model, prompt_ids


def test_mla_cache_holds_only_latent_and_rope_key(hf_models):
    d = hf_models("deepseek_v3")
    m = coli.load(d)
    cfg = json.loads((d / "config.json").read_text())
    cache = m.engine.new_cache()
    m.engine.step([(cache, prompt_ids(5))])
    per_token = (cache.k.shape[2] + cache.v.shape[2]) * cache.k.itemsize * cache.k.shape[0]
    want = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * cfg["num_hidden_layers"] * 2  # f16, the default
    assert per_token == want == cache_bytes_per_token(m.config, 2)[0]


def test_mla_saving_at_deepseek_v3_dimensions():
    from transformers import DeepseekV3Config

    cfg = ModelConfig.from_dict(DeepseekV3Config().to_dict())  # the real V3 shape: 61 layers, 128 heads
    compressed, expanded = cache_bytes_per_token(cfg)
    assert compressed == (512 + 64) * 61 * 4
    assert expanded / compressed >= 50


def test_bench_reports_kv_bytes_against_expanded(hf_models):
    from coli import bench

    m = coli.load(hf_models("deepseek_v3"))
    r = bench.run(m, prompt_tokens=8, gen_tokens=2, repeats=1)
    assert r.kv_bytes_per_token == cache_bytes_per_token(m.config, 2)[0]
    assert r.kv_bytes_per_token_expanded == cache_bytes_per_token(m.config, 2)[1] > r.kv_bytes_per_token


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("q", ["int8", "int4"])
def test_quantized_streaming_equals_resident(name, q, tmp_path):
    mt, ov = ARCHS[name]
    src = tmp_path / "hf"
    make_hf_model(mt, src, **{**ov, "num_hidden_layers": 4})
    dst = convert(src, tmp_path / q, q)
    experts = json.loads((dst / "coli.json").read_text())["experts"]["bytes"]
    resident = coli.load(dst)
    streamed = coli.load(dst, ram_budget=experts // 3, pin=0)
    assert not streamed.weights.store.resident
    ids = prompt_ids(18)
    np.testing.assert_array_equal(streamed.forward(ids), resident.forward(ids))
    a = "".join(resident.generate("w4 w8 w15", raw=True, max_tokens=24, temperature=0))
    b = "".join(streamed.generate("w4 w8 w15", raw=True, max_tokens=24, temperature=0))
    assert a == b
    assert streamed.engine.totals.bytes_read > 0
    # and the quantized model still tracks the f32 one (a broken format lands near 1.0; random
    # routers flip experts under rounding, so the bound is loose)
    f32 = coli.load(src).forward(ids)
    rel = np.linalg.norm(resident.forward(ids) - f32) / np.linalg.norm(f32)
    assert rel < (0.15 if q == "int8" else 0.6)
