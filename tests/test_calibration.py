"""Calibrated int4 (coli/calibration.py, coli.quant.gptq_int4): the statistics are the
inputs' E[x x^T] (checked against NumPy), GPTQ lowers the output error it is asked to,
and `coli convert --calibration` refuses what it cannot do."""
from __future__ import annotations

import json

import numpy as np
import pytest

import coli
from coli import calibration as cal
from coli.errors import InvalidRequestError
from coli.quant import dequantize, gptq_int4, quantize, quantize_int4
from coli.weights.convert import convert
from coli.weights.safetensors import Checkpoint
from tests.conftest import make_hf_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
TEXTS = ["the quick brown fox jumps over the lazy dog", "a b c d e f g h i j k l m n o p", "0 1 2 3 4 5 6 7 8 9"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal") / "hf"
    make_hf_model("qwen3_moe", d, num_hidden_layers=2, **MOE)
    return d


def _correlated(rng, n, k):
    """n inputs of width k with a mean, uneven scales and correlated columns (as activations are)."""
    return (rng.standard_normal((n, k)) @ rng.standard_normal((k, k)) * 0.3 + 2 * rng.standard_normal(k)) \
        * np.exp(rng.standard_normal(k))


def _out_err(m, w, h):
    e = dequantize(m).astype(np.float64) - w
    return float(np.einsum("nk,kl,nl->", e, h, e))


def test_statistics_are_the_inputs_second_moments(src):
    """Layer 0's q/k/v see rmsnorm(embedding) * input_layernorm: E[x x^T] from NumPy."""
    stats = cal.collect(src, TEXTS)
    tok = coli.load(src).tokenizer
    ids = np.concatenate([tok.encode(t) for t in TEXTS])
    ck = Checkpoint(src)
    H = ck.f32("model.embed_tokens.weight", None).shape[1]
    e = ck.f32("model.embed_tokens.weight", None)[ids].astype(np.float64)  # (T, H)
    g = ck.f32("model.layers.0.input_layernorm.weight", (H,))
    x = e / np.sqrt((e ** 2).mean(-1, keepdims=True) + 1e-6) * g  # (T, H)
    want = x.T @ x / len(x)
    for p in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_allclose(stats[f"model.layers.0.self_attn.{p}.weight"], want, rtol=2e-4, atol=1e-6)
    # every dense matrix and every expert a token reached has an entry; the head and embedding none
    assert "model.embed_tokens.weight" not in stats and "lm_head.weight" not in stats
    assert {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)} <= set(stats)
    experts = [k for k in stats if ".experts." in k]
    assert experts and all(stats[k].shape == ((48, 48) if k.endswith("down_proj.weight") else (H, H))
                           for k in experts)
    for k in experts:  # gate and up read the same tokens
        if k.endswith("gate_proj.weight"):
            np.testing.assert_array_equal(stats[k], stats[k.replace("gate_proj", "up_proj")])
    diag = cal.collect(src, TEXTS, full_max=16)  # wider than 16: the diagonal only
    key = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_allclose(diag[key], np.diag(stats[key]), rtol=1e-5)


def test_gptq_with_an_identity_hessian_is_plain_int4():
    w = np.random.default_rng(0).standard_normal((37, 70)).astype(np.float32)
    for a, b in zip(gptq_int4(w, np.eye(70), refits=0), quantize_int4(w)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_gptq_lowers_the_output_error(kind):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((256, 128)) if kind == "normal" else rng.standard_t(2, (256, 128))).astype(np.float32)
    x = _correlated(rng, 2000, 128)
    h = x.T @ x / len(x)
    plain, imp, gq = quantize(w, "int4"), quantize(w, "int4", np.diag(h)), quantize(w, "int4", h)
    assert _out_err(gq, w, h) < 0.7 * _out_err(plain, w, h)
    assert _out_err(imp, w, h) < _out_err(plain, w, h)


def test_gptq_ignores_columns_that_saw_no_input():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    x = _correlated(rng, 500, 64)
    x[:, 5] = 0.0
    h = x.T @ x / len(x)
    m = quantize(w, "int4", h)
    deq = dequantize(m)
    assert np.isfinite(deq).all()
    assert np.abs(deq[:, 5] - w[:, 5]).max() < 0.35  # kept (rounded), not zeroed: |w| reaches ~3 here
    with pytest.raises(ValueError, match="hessian has shape"):
        gptq_int4(w, h[:32, :32])


def test_calibration_files(tmp_path):
    j = tmp_path / "c.jsonl"
    j.write_text('{"text": "one"}\n\n{"text": "two", "category": "x"}\n')
    assert cal.read_texts(j) == ["one", "two"]
    t = tmp_path / "c.txt"
    t.write_text("some text\nover lines\n")
    assert cal.read_texts(t) == ["some text\nover lines\n"]
    assert len(cal.default_texts()) > 100
    bad = tmp_path / "bad.jsonl"
    for body, msg in (('{"text": "a"}\nnot json\n', "line 2"), ('{"txt": "a"}\n', "line 1"), ('{"text": 3}\n', "not a string"),
                      ("\n  \n", "holds no text")):
        bad.write_text(body)
        with pytest.raises(InvalidRequestError, match=msg):
            cal.read_texts(bad)
    with pytest.raises(InvalidRequestError, match="does not exist"):
        cal.read_texts(tmp_path / "missing.txt")


def test_convert_with_calibration(src, tmp_path):
    """The calibrated conversion loads, is int4, and differs from the plain one; formats
    that calibration cannot change are refused."""
    out = convert(src, tmp_path / "m", "int4", calibration=TEXTS)
    plain = convert(src, tmp_path / "p", "int4")
    assert json.loads((out / "coli.json").read_text())["quant"] == "int4"
    a, b = coli.load(out), coli.load(plain)
    ids = a.tokenizer.encode(TEXTS[0])
    la, lb = a.forward(ids), b.forward(ids)
    assert np.isfinite(la).all() and not np.array_equal(la, lb)
    with pytest.raises(InvalidRequestError, match="int4's rounding only"):
        convert(src, tmp_path / "q", "int8", calibration=TEXTS)


def test_cli_calibration_errors(src, tmp_path):
    from typer.testing import CliRunner

    from coli.cli.main import app

    r = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "x"), "--calibration", str(tmp_path / "no.txt")])
    assert r.exit_code != 0 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "y"), "-q", "int8", "--calibration", "default"])
    assert r.exit_code != 0 and "int4's rounding only" in r.output


def test_a_tied_table_gets_its_heads_statistics_blended_with_the_identity():
    """The built-in model ties its embedding and head: the table's entry is
    E[h h^T] + TIED_BLEND * mean(diag E[h h^T]) * I, so no eigenvalue is below that share."""
    from coli.api import DEFAULT_MODEL_DIR

    stats = cal.collect(DEFAULT_MODEL_DIR, TEXTS)
    h = stats["model.embed_tokens.weight"]
    assert h.shape == (192, 192)
    m = np.mean(np.diag(h)) / (1 + cal.TIED_BLEND)  # mean diagonal before the blend
    assert np.linalg.eigvalsh(h)[0] >= cal.TIED_BLEND * m - 1e-5 * m  # E[h h^T] is PSD (rank < 192 here)
    assert "lm_head.weight" not in stats


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_weighted_fit_and_refits_are_never_worse_per_group(kind):
    """_int4_fit's weighted error, group by group, is never above the plain min/max grid's,
    and its refits never raise it: on Gaussian and heavy-tailed (Student t, 2 dof) groups."""
    from coli.quant import _int4_fit

    rng = np.random.default_rng(3)
    g = (rng.standard_normal((4000, 32)) if kind == "normal" else rng.standard_t(2, (4000, 32))).astype(np.float32)
    a = np.exp(2 * rng.standard_normal((4000, 32))).astype(np.float32)  # importances over 4 decades

    def err(d, m):
        q = np.clip(np.rint((g - m) / np.where(d == 0, 1, d)), 0, 15)
        return (a * (d * q + m - g) ** 2).sum(-1)

    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    grid = err((hi - lo) / 15, lo)
    e0, e4 = err(*_int4_fit(g, a)), err(*_int4_fit(g, a, refits=4))
    assert (e0 <= grid * (1 + 1e-5)).all()
    assert (e4 <= e0 * (1 + 1e-5)).all() and e4.mean() < e0.mean()
