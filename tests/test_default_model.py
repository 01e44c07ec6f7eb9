"""The built-in model: it loads through the normal path, agrees with transformers, answers
held-out words with a finished turn, and is what `coli run` uses when given no model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import coli
from coli.api import DEFAULT_MODEL_DIR

# Common nouns whose first noun sense is in the 5% of synsets held out of training
# (tools/train_default_model.py: is_heldout(("n", offset)) with the script's seed).
HELD_OUT = ["river", "horse", "memory", "danger", "culture"]


@pytest.fixture(scope="module")
def model():
    return coli.load(threads=2)


def test_default_model_is_a_shipped_moe(model):
    assert model.path == DEFAULT_MODEL_DIR
    assert model.config.num_experts >= 8 and model.config.num_experts_per_tok == 2
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir() if f.is_file())
    assert size <= 20 * 1024 * 1024


def test_logits_match_transformers(model):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ids = model.prompt_ids("What does 'ocean' mean?")
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(model.forward(ids) - want).max() <= 1e-4


@pytest.mark.parametrize("word", HELD_OUT)
def test_held_out_words_get_a_finished_answer(model, word):
    """Greedy: a non-empty answer that ends with the end-of-turn token, not the token limit."""
    ids = model.prompt_ids(f"What does '{word}' mean?")
    cache = model.engine.new_cache()
    logits = model.engine.step([(cache, ids)])
    out = []
    for _ in range(64):
        tok = int(np.argmax(logits[0]))
        if tok in model.eos_ids:
            break
        out.append(tok)
        logits = model.engine.step([(cache, [tok])])
    else:
        pytest.fail(f"no end-of-turn within 64 tokens for {word!r}")
    assert model.tokenizer.decode(out).strip()


def test_installed_coli_run_answers_from_a_pipe(tmp_path):
    """The installed command, no --model, no COLI_MODEL: the built-in model answers."""
    exe = Path(sys.executable).with_name("coli")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "coli.cli"]
    env = {k: v for k, v in os.environ.items() if k != "COLI_MODEL"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    r = subprocess.run(cmd + ["run", "--no-kv-persist"], input="What does 'ocean' mean?\n", capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "Traceback" not in r.stderr


def test_int8_stays_within_the_documented_tolerance():
    """docs/QUANTIZATION.md: on the built-in model over the definition prompts of
    benchmarks/quant_quality.py, int8's relative logit error is <= 6.5% and its top-1
    token agrees with f32's at >= 97% of positions."""
    texts = ["What does 'ocean' mean?", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
             "What does 'harbor' mean?", "What is 'oak' a kind of?", "What does 'quick' mean?",
             "Give a synonym for 'happy'.", "What does 'mountain' mean?"]
    f32, q8 = coli.load(threads=2), coli.load(threads=2, quant="int8")
    num = den = 0.0
    same = total = 0
    for t in texts:
        ids = f32.prompt_ids(t)
        r, q = f32.forward(ids), q8.forward(ids)
        num += float(((q - r) ** 2).sum())
        den += float((r ** 2).sum())
        same += int((r.argmax(-1) == q.argmax(-1)).sum())
        total += len(r)
    assert (num / den) ** 0.5 <= 0.065
    assert same / total >= 0.97
