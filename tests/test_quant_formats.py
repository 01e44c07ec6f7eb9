"""The weight formats' quantizers (coli/quant.py): int4 (asymmetric groups with a scale and a
min, error-minimising rounding) against int4s (symmetric, llama.cpp's Q4_0 scheme), and
converted directories of format version 1 read under today's names."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import coli
from coli import synthetic
from coli.errors import ModelLoadError
from coli._engine import kernels as K
from coli.quant import dequantize, quantize, quantize_int4

RNG = np.random.default_rng(7)


@pytest.fixture(params=[1], ids=["1thread"], autouse=True)
def one_thread(request):
    K.set_num_threads(1)
    yield
    K.set_num_threads(2)


def _weights(kind, shape=(64, 320)):
    if kind == "normal":
        return RNG.standard_normal(shape).astype(np.float32) * 0.05
    if kind == "skewed":  # a group's values mostly on one side (what symmetric groups waste range on)
        return (np.abs(RNG.standard_normal(shape)) * 0.05 + 0.01).astype(np.float32)
    return (RNG.standard_t(3, shape) * 0.03).astype(np.float32)  # heavy tails


@pytest.mark.parametrize("kind", ["normal", "skewed", "heavy"])
def test_int4_is_far_more_faithful_than_int4s(kind):
    w = _weights(kind)
    e4 = np.sqrt(((dequantize(quantize(w, "int4")) - w) ** 2).mean())
    e4s = np.sqrt(((dequantize(quantize(w, "int4s")) - w) ** 2).mean())
    # an extra min per group buys most where groups are lopsided or have outliers
    assert e4 < {"normal": 0.85, "skewed": 0.6, "heavy": 0.8}[kind] * e4s, (e4, e4s)


def test_int4_codes_scales_and_mins_are_what_dequantize_reads():
    w = _weights("normal", (5, 100))  # a partial last group
    q, d, m = quantize_int4(w)
    assert q.shape == (5, 64) and d.shape == m.shape == (5, 4) and d.dtype == m.dtype == np.float16
    codes = np.concatenate([q.reshape(5, 4, 16) & 15, q.reshape(5, 4, 16) >> 4], axis=-1).astype(np.float32)
    want = (codes * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]).reshape(5, -1)[:, :100]
    mat = quantize(w, "int4")
    np.testing.assert_array_equal(dequantize(mat), want)
    assert mat.nbytes * 8 / w.size <= 5.0 * 128 / 100 + 1e-9  # 5 bits per weight, padding aside
    # every weight within one step of its group's grid (clipping at the ends is chosen by the fit)
    err = np.abs(want - w).reshape(5, -1)
    assert np.all(err <= np.repeat(np.abs(d.astype(np.float32)), 32, axis=1)[:, :100] * 1.01 + 1e-6)


def test_int4_constant_and_zero_groups():
    w = np.zeros((2, 64), np.float32)
    w[1, :32] = 0.25
    np.testing.assert_allclose(dequantize(quantize(w, "int4")), w, atol=1e-3)


def test_int4_kernels_match_the_twin_on_skewed_weights():
    """Mins far from zero: the kernels' min term (activation sums times mins) must be exact."""
    from coli.quant import reference_qlinear

    w = _weights("skewed", (37, 300)) + 0.5
    x = RNG.standard_normal((6, 300)).astype(np.float32)
    m = quantize(w, "int4")
    kp = K.padded(300)
    for M in (1, 2, 5, 6):
        out = np.empty((M, 37), np.float32)
        K.qlinear(x[:M], m, out, None, np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                  np.empty((M, kp // 32), np.int32))
        np.testing.assert_allclose(out, reference_qlinear(x[:M], m), atol=2e-3, rtol=1e-4)


def test_version_1_directories_read_int4_as_int4s(tmp_path):
    """Format version 1 called today's int4s "int4"; such a directory loads unchanged."""
    d = synthetic.write_converted("tiny", tmp_path / "v2", "int4s", seed=1)
    ids = [1, 5, 9, 2, 7]
    want = coli.load(d).forward(ids)
    old = tmp_path / "v1"
    shutil.copytree(d, old)
    man = json.loads((old / "coli.json").read_text())
    assert man["version"] == 3 and man["quant"] == "int4s"
    text = json.dumps(dict(man, version=1)).replace('"int4s"', '"int4"')
    (old / "coli.json").write_text(text)
    m = coli.load(old)
    assert m.weights.quant == "int4s"
    np.testing.assert_array_equal(m.forward(ids), want)


def test_version_2_directories_load_unchanged(tmp_path):
    """Version 2 is version 3 without column scales: it loads as written; a version this
    coli does not know is refused with what to do."""
    d = synthetic.write_converted("tiny", tmp_path / "v3", "int4", seed=1)
    ids = [1, 5, 9, 2, 7]
    want = coli.load(d).forward(ids)
    man = json.loads((d / "coli.json").read_text())
    (d / "coli.json").write_text(json.dumps(dict(man, version=2)))
    np.testing.assert_array_equal(coli.load(d).forward(ids), want)
    (d / "coli.json").write_text(json.dumps(dict(man, version=4)))
    with pytest.raises(ModelLoadError, match="version 4 is not supported.*convert the model again"):
        coli.load(d)


# ---- int8 weights take int16 activations (coli/_engine/simd_q16.h) ----------------------

@pytest.mark.parametrize("M,K_", [(1, 7), (2, 32), (3, 64), (2, 70), (1, 96), (4, 608), (2, 1055)])
def test_int16_activations_match_the_twin(M, K_):
    """Whole groups (the SIMD paths), a partial last group, pairs of groups and an odd last
    group in the kernels' order; ties round to even; an all-zero group gives zeros, scale 0."""
    from coli._engine import reference as R

    x = (RNG.standard_normal((M, K_)) * 4).astype(np.float32)
    if K_ >= 32:
        x[0, :32] = np.concatenate([[-32767.0], np.arange(31) - 14.5])  # scale 1: ties at the halves
    if K_ >= 64:
        x[-1, 32:64] = 0.0
    kp = K.padded(K_)
    q, d = np.full((M, kp), 99, np.int16), np.empty((M, kp // 32), np.float32)
    K.quantize_rows16(x, q, d)
    rq, rd = R.quantize_activations16(x)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(d, rd)
    # the order is a permutation of whole halves: dequantized, the activations come back
    back = R.dequantize_activations16(q, d, K_)
    assert np.all(np.abs(back - x) <= np.repeat(d, 32, axis=1)[:, :K_] * 0.5 + 1e-6 * np.abs(x))


@pytest.mark.parametrize("K_", [32, 64, 96, 100, 480, 608, 1000])
def test_int8_tiles_match_the_twin(K_):
    """Every tile shape (1-4 tokens x 1-4 rows, and the 4 x 4 loop around them), pairs of
    groups and an odd last group, against the float64 twin on the same int16 activations."""
    from coli.quant import reference_qlinear

    w = _weights("heavy", (11, K_))
    m = quantize(w, "int8")
    kp = K.padded(K_)
    x = RNG.standard_normal((9, K_)).astype(np.float32)
    for M in (1, 2, 3, 4, 5, 9):
        out = np.empty((M, 11), np.float32)
        K.qlinear(x[:M], m, out, None, np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                  np.empty((M, kp // 32), np.int32))
        np.testing.assert_allclose(out, reference_qlinear(x[:M], m), atol=2e-5, rtol=1e-5)


def test_int8_activation_rounding_is_within_int16_steps():
    """With int16 activations the product differs from the f32-activation product of the same
    int8 weights by at most half an activation step per value (max|x| / 65534 per group) times
    |w|: ~1/256 of what int8 activations allowed, and what int8 activations would fail."""
    K_ = 640
    w = _weights("normal", (24, K_))
    m = quantize(w, "int8")
    wd = dequantize(m).astype(np.float64)
    x = (RNG.standard_t(3, (5, K_)) * 2).astype(np.float32)  # heavy tails: groups of mixed size
    kp = K.padded(K_)
    out = np.empty((5, 24), np.float32)
    K.qlinear(x, m, out, None, np.empty((5, kp), np.int8), np.empty((5, kp // 32), np.float32),
              np.empty((5, kp // 32), np.int32))
    exact = x.astype(np.float64) @ wd.T
    amax = np.abs(x.reshape(5, -1, 32)).max(-1)  # (5, groups)
    half_step = np.repeat(amax / 65534.0, 32, axis=1)  # (5, K)
    bound = half_step @ np.abs(wd).T + 1e-5 * np.abs(exact) + 1e-6
    assert np.all(np.abs(out - exact) <= bound)
    half_step8 = np.repeat(amax / 254.0, 32, axis=1)
    assert np.abs(out - exact).max() < 0.05 * (half_step8 @ np.abs(wd).T).max()


def test_int8_prefill_and_decode_agree():
    """A prompt in one pass (4 x 4 tiles) and token by token (1 x 4 tiles) take the same
    int16 activations: their logits agree to float rounding."""
    model = coli.load(quant="int8", threads=1)  # the built-in model
    eng = model.engine
    ids = list(range(3, 14))
    whole = model.forward(ids)
    cache = eng.new_cache()
    steps = [eng.step([(cache, [t])])[0].copy() for t in ids]
    np.testing.assert_allclose(np.stack(steps), whole, atol=2e-4 * np.abs(whole).max(), rtol=0)
