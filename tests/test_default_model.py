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


def _kl_sum(r, q):
    """Sum over positions of KL(softmax(r) || softmax(q)), logits (positions, vocab) in float64."""
    lr = r - r.max(-1, keepdims=True)
    lr -= np.log(np.exp(lr).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lr) * (lr - lq)).sum())


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
    exact = coli.load(threads=2, kv_cache_dtype="f32")  # the oracle's arithmetic: float32 keys and values
    assert np.abs(exact.forward(ids) - want).max() <= 1e-4
    assert np.abs(model.forward(ids) - want).max() <= 5e-3  # the default f16 cache: measured 2.8e-3


def greedy_answer(model, prompt, limit=64):
    """The greedy answer's text, or None when no end-of-turn comes within ``limit`` tokens."""
    cache = model.engine.new_cache()
    logits = model.engine.step([(cache, model.prompt_ids(prompt))])
    out = []
    for _ in range(limit):
        tok = int(np.argmax(logits[0]))
        if tok in model.eos_ids:
            return model.tokenizer.decode(out)
        out.append(tok)
        logits = model.engine.step([(cache, [tok])])
    return None


@pytest.mark.parametrize("word", HELD_OUT)
def test_held_out_words_get_a_finished_answer(model, word):
    """Greedy: a non-empty answer that ends with the end-of-turn token, not the token limit."""
    answer = greedy_answer(model, f"What does '{word}' mean?")
    assert answer is not None, f"no end-of-turn within 64 tokens for {word!r}"
    assert answer.strip()


def test_a_second_user_turn_gets_an_answer(model):
    """In a conversation (coli chat keeps the history), a definition question after an
    earlier exchange is answered like the same question asked alone, not with noise."""
    alone = greedy_answer(model, "What does 'house' mean?")
    history = [{"role": "user", "content": "Hello"},
               {"role": "assistant", "content": greedy_answer(model, "Hello")},
               {"role": "user", "content": "What does 'house' mean?"}]
    later = greedy_answer(model, history)
    assert alone and later is not None and len(later.split()) >= 3
    assert set(later.lower().split()) & set(alone.lower().split()) - {"a", "an", "the", "of"}


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
    benchmarks/quant_quality.py, int8's relative logit error is <= 2% and the mean
    KL(f32 || int8) of the next-token distributions <= 0.0015 (measured: 1.4%, 0.0009; before
    the embedding/head's column scales, 4.72% and 0.0060; with int8 activations, before int16
    ones, 4.99% and 0.0067)."""
    texts = ["What does 'ocean' mean?", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
             "What does 'harbor' mean?", "What is 'oak' a kind of?", "What does 'quick' mean?",
             "Give a synonym for 'happy'.", "What does 'mountain' mean?"]
    f32, q8 = coli.load(threads=2), coli.load(threads=2, quant="int8")
    num = den = kl = 0.0
    n = 0
    for t in texts:
        ids = f32.prompt_ids(t)
        r, q = f32.forward(ids).astype(np.float64), q8.forward(ids).astype(np.float64)
        num += float(((q - r) ** 2).sum())
        den += float((r ** 2).sum())
        kl += _kl_sum(r, q)
        n += len(r)
    assert (num / den) ** 0.5 <= 0.02
    assert kl / n <= 0.0015


CAL_KL = 0.080  # calibrated int4/int4, measured 0.0736 (docs/QUANTIZATION.md)
PROMPTS = ["What does 'ocean' mean?", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
           "What does 'harbor' mean?", "What is 'oak' a kind of?", "What does 'quick' mean?",
           "Give a synonym for 'happy'.", "What does 'mountain' mean?"]


def _exact(path=None, **kw):
    """The model with an f32 KV cache: the KL tolerances below measure the weight formats
    alone (the f16 cache's own effect is measured in docs/QUANTIZATION.md)."""
    return coli.load(path, threads=2, kv_cache_dtype="f32", **kw)


def _mean_kl(ref, model):
    """Mean KL(ref || model) over every position of PROMPTS (benchmarks/quant_quality.py's)."""
    kl = n = 0.0
    for t in PROMPTS:
        ids = ref.prompt_ids(t)
        r, q = ref.forward(ids).astype(np.float64), model.forward(ids).astype(np.float64)
        kl += _kl_sum(r, q)
        n += len(r)
    return kl / n


def test_int4_stays_within_the_documented_tolerance():
    """docs/QUANTIZATION.md: int4 with its int8 head, KL <= 0.037 (measured 0.0336; 0.0374
    before the embedding/head's column scales)."""
    assert _mean_kl(_exact(), _exact(quant="int4")) <= 0.037


def test_int4_with_a_4bit_head_within_the_issue_target():
    """docs/QUANTIZATION.md: int4 with a 4-bit head (5.0 bits per weight of the matrices), KL
    <= 0.085 (measured 0.0777; 0.1323 without the embedding/head's column scales)."""
    assert _mean_kl(_exact(), _exact(quant="int4", head_quant="int4")) <= 0.085


def test_calibrated_int4_with_a_4bit_head_beats_the_plain_fit(tmp_path):
    """docs/QUANTIZATION.md: int4 with a 4-bit head, converted with calibration on the atlas
    corpus's even lines that name none of the prompts' words (so calibration never sees the
    evaluated text): KL <= CAL_KL (measured 0.0736), under the plain fit's (0.0777)."""
    from coli import calibration as cal
    from coli.weights.convert import convert

    words = ("ocean", "big", "tree", "harbor", "oak", "quick", "happy", "mountain")
    texts = [t for i, t in enumerate(cal.default_texts()) if i % 2 == 0 and not any(w in t.lower() for w in words)]
    out = convert(DEFAULT_MODEL_DIR, tmp_path / "int4-cal", "int4", head_quant="int4", calibration=texts)
    ref = _exact()
    calibrated = _mean_kl(ref, _exact(out))
    assert calibrated <= CAL_KL
    assert calibrated < _mean_kl(ref, _exact(quant="int4", head_quant="int4"))
