"""Column scales (coli/colscale.py): an embedding table or LM head with a few large input
columns is stored as Q(W / s) with s beside it, and the model computes with
dequantize(Q) * s exactly where the table is used."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import coli
from coli import colscale
from coli.quant import dequantize, quantize, reference_qlinear
from coli.weights.convert import convert
from tests.conftest import make_hf_model, prompt_ids

RNG = np.random.default_rng(7)
WIDE = (3, 17, 40)  # the columns made large, as a model's few outlier dimensions are


def _outlier_matrix(rows=300, cols=96, factor=25.0):
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    w[:, list(WIDE)] *= factor
    return w


def _err(w, q, s=None):
    d = dequantize(q) * (1.0 if s is None else s)
    return float(np.linalg.norm(d - w) / np.linalg.norm(w))


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4s"])
def test_large_columns_get_scales_that_cut_the_error(fmt):
    w = _outlier_matrix()
    q, s = colscale.choose(w, fmt)
    assert s is not None and s.shape == (w.shape[1],) and s.dtype == np.float32
    others = np.setdiff1d(np.arange(w.shape[1]), WIDE)
    assert (s[list(WIDE)] > 1.5).all() and (s[others] == 1).all()  # only the wide columns are divided down
    plain = quantize(w, fmt)
    assert _err(w, q, s) < 0.6 * _err(w, plain)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4s"])
def test_a_matrix_on_its_grid_keeps_its_exact_rounding(fmt):
    """Weights that already sit on the format's grid (a GGUF's, say) gain nothing from scales:
    they are rounded as before, bit for bit."""
    w = dequantize(quantize(_outlier_matrix(), fmt))
    q, s = colscale.choose(w, fmt)
    assert s is None
    np.testing.assert_array_equal(q.data, quantize(w, fmt).data)
    np.testing.assert_array_equal(q.scales, quantize(w, fmt).scales)


def test_float_formats_and_plain_columns_get_none():
    w = _outlier_matrix()
    for fmt in ("f32", "bf16"):
        assert colscale.choose(w, fmt)[1] is None
    even = RNG.standard_normal((300, 96)).astype(np.float32)  # no column stands out
    assert colscale.choose(even, "int8")[1] is None
    wide = even.copy()
    wide[:, :8] *= 6.0  # wider columns, but under the outlier threshold (SmolLM2's widest: 6.3x)
    assert colscale.choose(wide, "int4")[1] is None


def _model(tmp_path, tied: bool, norm: float = 1 / 40):
    """A seeded llama whose embedding (and head) have 40x wider columns WIDE, where the final
    norm multiplies by ``norm`` (a trained model learns small ones there; the built-in
    model's are 0.16-0.5 against a median of 1.9)."""
    d = tmp_path / f"{'tied' if tied else 'untied'}-{norm}"
    make_hf_model("llama", d, seed=3, tie_word_embeddings=tied)
    f = d / "model.safetensors"
    t = load_file(f)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in t:
            t[name] = t[name].copy()
            t[name][:, list(WIDE)] *= 40.0
    t["model.norm.weight"] = t["model.norm.weight"].copy()
    t["model.norm.weight"][list(WIDE)] *= norm
    save_file(t, f, metadata={"format": "pt"})
    return d


def _kl(ref, q):
    lr = ref - ref.max(-1, keepdims=True)
    lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
    lq = q - q.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lr) * (lr - lq)).sum(-1).mean())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_model_uses_the_table_it_stands_for(tmp_path, tied):
    """The embedding rows and the head's product are those of dequantize(Q) * s."""
    d = _model(tmp_path, tied)
    m = coli.load(d, quant="int8")
    net = m.engine.model
    assert net.embed_cols is not None
    ids = np.array(prompt_ids(9), dtype=np.int32)
    x = np.zeros((len(ids), net.cfg.hidden_size), np.float32)
    net.embed_tokens(ids, x)
    table = dequantize(net.embed) * net.embed_cols
    np.testing.assert_allclose(x, table[ids] * net.embed_scale, rtol=1e-6, atol=1e-7)
    head = net.lm_head
    assert head.xscale is not None
    if tied:
        assert head.mat is net.embed and head.xscale is net.embed_cols
    h = RNG.standard_normal((3, net.cfg.hidden_size)).astype(np.float32)
    from coli.models.base import RunState

    out = np.zeros((3, net.cfg.vocab_size), np.float32)
    head(h, out, RunState())
    np.testing.assert_allclose(out, reference_qlinear(h * head.xscale, head.mat), rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_scales_bring_the_quantized_model_closer_to_f32(tmp_path, tied, monkeypatch):
    """With int8 layers, so that the head's rounding is what the KL divergence measures."""
    d = _model(tmp_path, tied)
    ids = prompt_ids(24)
    ref = coli.load(d, quant="f32").forward(ids)
    for fmt, head in (("int8", "int8"), ("int8", "int4"), ("int8", "int4s")):
        scaled = coli.load(d, quant=fmt, head_quant=head).forward(ids)
        with monkeypatch.context() as mp:
            mp.setattr(colscale, "ALPHAS", ())  # no candidate scales: the plain rounding
            plain = coli.load(d, quant=fmt, head_quant=head).forward(ids)
        assert _kl(ref, scaled) < 0.7 * _kl(ref, plain), head


def test_no_loss_where_the_head_reads_those_dimensions_large(tmp_path, monkeypatch):
    """Scaling moves rounding error onto the wide columns, which the head weighs by its
    inputs there: with the final norm keeping those dimensions large, whatever is chosen is
    still no worse than the plain rounding."""
    d = _model(tmp_path, tied=True, norm=1.0)
    ids = prompt_ids(24)
    ref = coli.load(d, quant="f32").forward(ids)
    for head in ("int8", "int4", "int4s"):
        chosen = coli.load(d, quant="int8", head_quant=head).forward(ids)
        with monkeypatch.context() as mp:
            mp.setattr(colscale, "ALPHAS", ())
            plain = coli.load(d, quant="int8", head_quant=head).forward(ids)
        assert _kl(ref, chosen) <= _kl(ref, plain) * 1.001, head


def test_converted_directories_carry_the_scales(tmp_path):
    d = _model(tmp_path, tied=True)
    out = convert(d, tmp_path / "conv", "int4", head_quant="int4")
    man = json.loads((out / "coli.json").read_text())
    assert man["version"] == 3
    assert "model.embed_tokens.weight.col_scale" in man["dense"]["tensors"]
    ids = prompt_ids(14)
    np.testing.assert_array_equal(coli.load(out).forward(ids), coli.load(d, quant="int4", head_quant="int4").forward(ids))
