"""int4 and int8 matrices repacked into 4-row tiles (QMatrix.pack, coli/weights/packing.py):
the same values read back; int4 on AVX-512 VNNI the very bits of the row layout's multi-token
tiles, on AVX2 (and AVX-512 without VNNI) the NumPy twin's values with a token's bits
independent of its batch and the token-lane GEMM's bits unchanged; int8 on AVX2 and AVX-512
VNNI the very bits of the row layout at every token count; and a loaded model whose dense layers are packed gives
the logits of the unpacked one. Every path this machine has runs this file
(test_every_path_passes_the_packing_tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import coli
from coli import synthetic
from coli._engine import dispatch
from coli._engine import kernels as K
from coli.errors import InvalidRequestError
from coli.quant import dequantize, quantize, reference_qlinear
from coli.weights.packing import dense_matrices, huge_buffer, pack_dense
from tests.conftest import make_hf_model, require_path
from tests.test_errors import assert_one_line_error, coli_cli

PACKS = quantize(np.ones((4, 32), np.float32), "int4").packed_bytes > 0
needs_tiles = pytest.mark.skipif(not PACKS, reason=f"the {K.simd_name()} path computes int4 on rows "
                                 "(the AVX2 and AVX-512 paths have the packed tiles)")
PACKS8 = quantize(np.ones((4, 32), np.float32), "int8").packed_bytes > 0
needs_tiles8 = pytest.mark.skipif(not PACKS8, reason=f"the {K.simd_name()} path computes int8 on rows "
                                  "(the AVX2 and AVX-512 VNNI paths have the packed int8 tiles)")
# AVX-512 VNNI: the packed tile is the row layout's multi-token tile, operation for operation
EXACT = K.simd_name() == "avx512vnni" or (K.simd_name() == "native" and dispatch.NEEDS["avx512vnni"] <= dispatch.cpu_features())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMM_MIN = 64  # AVX2: from this many tokens the token-lane GEMM (simd_q.h, COLI_Q4GEMM8_MIN)
# rows and columns: multiples of 4 and 128 and not, under one group, one short last step
SHAPES = [(576, 576), (64, 100), (37, 576), (19, 33), (130, 1000), (8, 64), (5, 96), (3, 7)]


def _scratch(M, cols):
    kp = K.padded(cols)
    return np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32)


def _refuses_bad_buffers(put, n):
    """put (QMatrix.pack or move_rows) refuses a buffer off a 64-byte boundary and one of the
    wrong size; returns a right one, n zeroed bytes on a 64-byte boundary."""
    raw = np.zeros(n + 128, np.uint8)
    start = -raw.ctypes.data % 64
    with pytest.raises(ValueError, match="64-byte boundary"):
        put(raw[start + 1: start + 1 + n])
    with pytest.raises(ValueError, match=f"{n} contiguous uint8 bytes"):
        put(raw[start: start + n - 64])
    return raw[start: start + n]


def _pair(rng, rows, cols, fmt):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.2, 3, (rows, 1))).astype(np.float32)
    a, b = quantize(w, fmt), quantize(w, fmt)
    assert b.pack() and b.packed and not a.packed
    return a, b


@needs_tiles
@pytest.mark.parametrize("fmt", ["int4", "int4s"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_a_packed_matrix_reads_back_the_same_values(fmt, rows, cols):
    a, b = _pair(np.random.default_rng(rows * cols), rows, cols, fmt)
    assert np.array_equal(b.data, a.data) and np.array_equal(b.scales, a.scales)
    assert (b.mins is None) if fmt == "int4s" else np.array_equal(b.mins, a.mins)
    assert np.array_equal(dequantize(b), dequantize(a))
    # a tile is exactly its 4 rows' bytes: only rows past a multiple of 4 are padding
    per_group = 80 if fmt == "int4" else 72
    assert b.nbytes == -(-rows // 4) * (K.padded(cols) // 32) * per_group
    ids = np.array([0, rows - 1, rows // 2, rows - 1], np.int32)
    ea, eb = np.empty((4, cols), np.float32), np.empty((4, cols), np.float32)
    K.embed_rows(ids, a, ea, 0.5)
    K.embed_rows(ids, b, eb, 0.5)
    assert np.array_equal(ea, eb)


@needs_tiles
@pytest.mark.parametrize("fmt", ["int4", "int4s"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_packed_tiles_give_the_bits_of_the_row_tiles(fmt, rows, cols):
    """AVX-512 VNNI: rows in whole tiles of 4 get the very bits of the row layout's multi-token
    tiles, at every token count (alone, batched, in a verification); the rows past them (the
    plain tiles in the row layout) within float rounding of it. Every path: the NumPy twin's
    values, a token's bits the same alone and in a batch, and (AVX2) the token-lane GEMM of a
    long call the same bits from the tiles as from the rows."""
    rng = np.random.default_rng(rows + cols)
    a, b = _pair(rng, rows, cols, fmt)
    whole = rows // 4 * 4 if EXACT else 0
    for M in (1, 2, 3, 5, 8, 9, 17, GEMM_MIN, GEMM_MIN + 9):
        x = rng.standard_normal((M, cols)).astype(np.float32)
        ya, yb = np.empty((M, rows), np.float32), np.empty((M, rows), np.float32)
        K.qlinear(x, a, ya, None, *_scratch(M, cols))
        K.qlinear(x, b, yb, None, *_scratch(M, cols))
        np.testing.assert_array_equal(yb[:, :whole], ya[:, :whole])
        if M >= GEMM_MIN and not EXACT:
            np.testing.assert_array_equal(yb, ya)
        ref = reference_qlinear(x, a)
        np.testing.assert_allclose(yb, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        if M < GEMM_MIN:
            one = np.empty((1, rows), np.float32)
            K.qlinear(x[-1:], b, one, None, *_scratch(1, cols))
            np.testing.assert_array_equal(one[0], yb[-1])  # a token's bits do not depend on its batch


@pytest.mark.parametrize("fmt", ["int4", "int4s", "int8"])
def test_the_stream_prefetch_setting_changes_no_bits(fmt):
    """set_stream_prefetch (a one-token packed int4 tile's prefetches: both, into L1 only,
    none; int8 tiles keep theirs) changes only speed: every setting gives the same bits, for
    one token and for several, over a matrix of whole and short steps and rows past a multiple
    of 4; out-of-range settings clamp to the nearest."""
    if not quantize(np.ones((4, 32), np.float32), fmt).packed_bytes:
        pytest.skip(f"the {K.simd_name()} path keeps {fmt} matrices in rows")
    rng = np.random.default_rng(11)
    _, b = _pair(rng, 130, 1000, fmt)
    before = K.get_stream_prefetch()
    assert before == dispatch.stream_prefetch()  # this CPU's default (or COLI_STREAM_PREFETCH)
    try:
        for M in (1, 4, 9):
            x = rng.standard_normal((M, 1000)).astype(np.float32)
            outs = []
            for mode in (2, 1, 0):
                K.set_stream_prefetch(mode)
                assert K.get_stream_prefetch() == mode
                y = np.empty((M, 130), np.float32)
                K.qlinear(x, b, y, None, *_scratch(M, 1000))
                outs.append(y)
            for mode, y in zip((1, 0), outs[1:]):
                np.testing.assert_array_equal(y, outs[0], err_msg=f"{M} tokens, setting {mode}")
            ref = reference_qlinear(x, b)
            np.testing.assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        K.set_stream_prefetch(7)
        assert K.get_stream_prefetch() == 2
        K.set_stream_prefetch(-1)
        assert K.get_stream_prefetch() == 0
    finally:
        K.set_stream_prefetch(before)


@needs_tiles8
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_a_packed_int8_matrix_reads_back_and_gives_the_bits_of_the_rows(rows, cols):
    """int8: the tile holds the registers the row layout's tile makes (AVX2: the 4 rows'
    groups transposed together; AVX-512 VNNI: each row's chunks transposed), and the prefill
    tiles read the same bytes, so every token count (one-token decode, a batch, a
    verification, a prefill) gets the very bits of the rows."""
    rng = np.random.default_rng(rows * cols + 1)
    a, b = _pair(rng, rows, cols, "int8")
    assert np.array_equal(b.data, a.data) and np.array_equal(b.scales, a.scales) and b.mins is None
    assert np.array_equal(dequantize(b), dequantize(a))
    # 34 bytes per row and group, as in rows: only rows past a multiple of 4 and an odd last
    # group of each tile are padding
    assert b.nbytes == -(-rows // 4) * -(-K.padded(cols) // 64) * 4 * 2 * 34
    ids = np.array([0, rows - 1, rows // 2, rows - 1], np.int32)
    ea, eb = np.empty((4, cols), np.float32), np.empty((4, cols), np.float32)
    K.embed_rows(ids, a, ea, 0.5)
    K.embed_rows(ids, b, eb, 0.5)
    assert np.array_equal(ea, eb)
    for M in (1, 2, 3, 5, 6, 8, 9, 17, 64, 73):  # the x-tiles below 9 tokens, the row-lane tiles from 9
        x = rng.standard_normal((M, cols)).astype(np.float32)
        ya, yb = np.empty((M, rows), np.float32), np.empty((M, rows), np.float32)
        K.qlinear(x, a, ya, None, *_scratch(M, cols))
        K.qlinear(x, b, yb, None, *_scratch(M, cols))
        np.testing.assert_array_equal(yb, ya)
        ref = reference_qlinear(x, a)
        np.testing.assert_allclose(yb, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _gated_pairs(pairs, bias, x):
    """qlinear_many's gate and up outputs (bias on the gate, the gated activation) for the row
    matrices (key 0) and the packed ones (key 1) of two _pair results."""
    M, I = x.shape[0], pairs[0][0].rows
    out = {}
    for k in (0, 1):
        g, u = np.empty((M, I), np.float32), np.empty((M, I), np.float32)
        K.qlinear_many(x, (pairs[0][k], pairs[1][k]), (g, u), (bias, None), *_scratch(M, x.shape[1]), 0)
        out[k] = g, u
    return out


@needs_tiles8
def test_packed_int8_in_grouped_calls_with_biases_and_the_gated_activation():
    rng = np.random.default_rng(8)
    H, I = 96, 130
    pairs = [_pair(rng, I, H, "int8") for _ in range(2)]
    bias = rng.standard_normal(I).astype(np.float32)
    for M in (1, 5, 12):
        out = _gated_pairs(pairs, bias, rng.standard_normal((M, H)).astype(np.float32))
        for ra, rb in zip(out[0], out[1]):
            np.testing.assert_array_equal(rb, ra)


@needs_tiles
def test_grouped_calls_biases_and_the_gated_activation_on_packed_matrices():
    rng = np.random.default_rng(3)
    H, I, M = 96, 130, 5
    pairs = [_pair(rng, I, H, "int4") for _ in range(2)]
    bias = rng.standard_normal(I).astype(np.float32)
    out = _gated_pairs(pairs, bias, rng.standard_normal((M, H)).astype(np.float32))
    whole = I // 4 * 4 if EXACT else 0
    for ra, rb in zip(out[0], out[1]):
        np.testing.assert_array_equal(rb[:, :whole], ra[:, :whole])
        np.testing.assert_allclose(rb, ra, rtol=1e-4, atol=1e-5 * np.abs(ra).max())


@needs_tiles
def test_a_long_call_runs_in_chunks_of_tokens_with_the_same_bits():
    rng = np.random.default_rng(4)
    a, b = _pair(rng, 64, 576, "int4")
    M = 40
    x = rng.standard_normal((M, 576)).astype(np.float32)
    whole, chunked = np.empty((M, 64), np.float32), np.empty((M, 64), np.float32)
    K.qlinear(x, b, whole, None, *_scratch(M, 576))
    try:
        K.set_xe_max_bytes(4096)  # a few tokens' arranged activations at a time
        K.qlinear(x, b, chunked, None, *_scratch(M, 576))
        K.set_xe_max_bytes(0)  # "never arrange": a packed matrix still needs them, 8 tokens at a time
        K.qlinear(x, b, whole, None, *_scratch(M, 576))
    finally:
        K.set_xe_max_bytes(16 << 20)
    np.testing.assert_array_equal(chunked, whole)


@needs_tiles
def test_pack_checks_its_buffer_and_what_has_no_tiles_stays_in_rows():
    rng = np.random.default_rng(5)
    m = quantize(rng.standard_normal((8, 64)).astype(np.float32), "int4")
    buf = _refuses_bad_buffers(m.pack, m.packed_bytes)
    assert not m.packed
    assert m.pack(buf) and m.packed and m.packed_bytes == 0 and not m.pack()
    assert buf.any()  # it lives in the caller's buffer
    for fmt in ("f32", "bf16", "int8"):
        other = quantize(rng.standard_normal((8, 64)).astype(np.float32), fmt)
        if fmt == "int8" and PACKS8:
            continue  # (its own tests below)
        assert other.packed_bytes == 0 and not other.pack()


def test_the_huge_page_arena_is_aligned_and_zeroed():
    buf = huge_buffer(3 << 20)
    assert buf.nbytes == 3 << 20 and buf.ctypes.data % (2 << 20) == 0 and not buf.any()
    buf[-1] = 7  # writable


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4s", "int4"])
@pytest.mark.parametrize("rows,cols", [(37, 576), (19, 33), (8, 64)])
def test_rows_moved_into_a_buffer_keep_their_values_and_results(fmt, rows, cols):
    """QMatrix.move_rows: the row arrays copied whole into the caller's buffer, each on a
    64-byte boundary; the values and every kernel's results (one token, a batch, the
    embedding rows) the very bits they were."""
    rng = np.random.default_rng(rows + cols)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.2, 3, (rows, 1))).astype(np.float32)
    a, b = quantize(w, fmt), quantize(w, fmt)
    if b.packed_bytes:  # a path that repacks this format holds tiles, not rows, at load
        assert b.pack()
        with pytest.raises(ValueError, match="packed"):
            b.move_rows(np.zeros(64, np.uint8))
        return
    assert b.rows_bytes == sum(-(-x.nbytes // 64) * 64 for x in a.arrays() if x is not None)
    buf = _refuses_bad_buffers(b.move_rows, b.rows_bytes)
    b.move_rows(buf)
    for x, y in zip(a.arrays(), b.arrays()):
        assert (x is None) == (y is None)
        if x is not None:
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8)) and np.shares_memory(y, buf)
            assert y.ctypes.data % 64 == 0
    for M in (1, 3, 9):
        x = rng.standard_normal((M, cols)).astype(np.float32)
        ya, yb = np.empty((M, rows), np.float32), np.empty((M, rows), np.float32)
        K.qlinear(x, a, ya, None, *_scratch(M, cols))
        K.qlinear(x, b, yb, None, *_scratch(M, cols))
        np.testing.assert_array_equal(yb, ya)
    ids = np.array([0, rows - 1, rows // 2], np.int32)
    ea, eb = np.empty((3, cols), np.float32), np.empty((3, cols), np.float32)
    K.embed_rows(ids, a, ea)
    K.embed_rows(ids, b, eb)
    np.testing.assert_array_equal(eb, ea)
    buf[:] = 0  # the matrix reads the buffer, nothing else
    assert not K.embed_rows(ids, b, eb) and not eb.any()


def test_an_experts_rows_are_not_moved():
    rng = np.random.default_rng(6)
    gate, up = (quantize(rng.standard_normal((8, 64)).astype(np.float32), "f32") for _ in range(2))
    down = quantize(rng.standard_normal((64, 8)).astype(np.float32), "f32")
    table = K.ExpertTable(1, 64, 8, K.FORMATS["f32"])
    table.set(0, gate, up, down)
    with pytest.raises(ValueError, match="ExpertTable"):
        gate.move_rows(np.zeros(gate.rows_bytes, np.uint8))


@pytest.mark.parametrize("quant", ["f32", "int8", "int4"])
def test_rows_a_path_keeps_move_into_the_huge_page_arena_with_the_same_logits(odd_llama, monkeypatch, quant):
    """pack_dense: the dense matrices this path computes on as rows (with huge pages) move into
    the arena beside the packed ones, out of the checkpoint's mapping, and the logits keep
    their bits; a second call finds nothing to do; without huge pages the rows stay."""
    from coli.weights.packing import _in_huge_buffer, _mapped_file

    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(odd_llama, threads=2, quant=quant)
    mats = dense_matrices(rows.engine.model)
    assert not any(m.packed or _in_huge_buffer(m) for m in mats)
    monkeypatch.delenv("COLI_PACK")
    tiles = sum(m.packed_bytes for m in mats)
    assert pack_dense(rows.engine.model, huge=False) == tiles
    assert not any(_in_huge_buffer(m) for m in mats)
    want = _steps(rows)  # (tiles may sum in another order than rows: compared above)
    kept = [m for m in mats if not m.packed]
    assert pack_dense(rows.engine.model, huge=True) == sum(m.rows_bytes for m in kept)
    assert all(_in_huge_buffer(m) and _mapped_file(m.arrays()[0]) is None for m in kept)
    assert pack_dense(rows.engine.model, huge=True) == 0
    for r, p in zip(want, _steps(rows)):
        np.testing.assert_array_equal(p, r)


def test_a_converted_models_head_leaves_the_file_mapping_where_huge_pages_are(tmp_path):
    """Loaded as a user loads it: every dense matrix in tiles or in the arena, none read
    from the checkpoint's 4 KB pages (where the kernel gives huge pages)."""
    from coli.weights.packing import _in_huge_buffer, huge_pages

    if not huge_pages():
        pytest.skip("this kernel gives no transparent huge pages (the rows stay in the file mapping)")
    d = synthetic.write_converted("tiny", tmp_path / "tiny-int8", "int8", seed=2)
    m = coli.load(d, threads=2)
    mats = dense_matrices(m.engine.model)
    assert mats and all(x.packed or _in_huge_buffer(x) for x in mats)


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """A seeded llama whose projections have rows and columns that are no multiple of 4 / 128."""
    out = tmp_path_factory.mktemp("packing") / "llama-odd"
    make_hf_model("llama", out, seed=3, hidden_size=72, intermediate_size=98, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=163, attention_bias=True)
    return out


def _steps(model):
    eng = model.engine
    a, b = eng.new_cache(64), eng.new_cache(64)
    out = [eng.step([(a, list(range(3, 20)))], all_logits=[True])[0].copy()]
    out += [eng.step([(a, [t])])[0].copy() for t in (5, 9, 30)]
    eng.step([(b, list(range(7, 15)))])
    out += [r.copy() for r in eng.step([(a, [11, 12, 13]), (b, [4])], all_logits=[True, False])]
    return out


@needs_tiles
@pytest.mark.parametrize("quant,head", [("int4", None), ("int4s", "int4s"), ("int4", "int4")])
def test_a_model_with_packed_layers_gives_the_unpacked_logits(odd_llama, monkeypatch, quant, head):
    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(odd_llama, threads=2, quant=quant, head_quant=head)
    assert not any(m.packed for m in dense_matrices(rows.engine.model))
    monkeypatch.delenv("COLI_PACK")
    packed = coli.load(odd_llama, threads=2, quant=quant, head_quant=head)
    net = packed.engine.model
    mats = dense_matrices(net)
    assert all(m.packed for m in mats if m.format in ("int4", "int4s")) and any(m.packed for m in mats)
    assert net.layers[0].attn.q_proj.mat.packed and net.layers[1].mlp.down.mat.packed
    # the tied table (embedding rows read from tiles); the default head is int8, packed on AVX2
    assert net.lm_head.mat.packed == (head is not None or PACKS8)
    # The rows past a multiple of 4 (and, off AVX-512 VNNI, every row) sum in another float
    # order than the row layout's tiles; the next layer's int8 activation rounding can turn such
    # a last-bit difference into one step of a group's grid, so the logits agree to the size of
    # that step, not to float rounding (the kernels' own agreement is tested above).
    for r, p in zip(_steps(rows), _steps(packed)):
        np.testing.assert_allclose(p, r, rtol=0, atol=0.05 * np.abs(r).max())
    assert packed.engine.resident_bytes()["dense"] == rows.engine.resident_bytes()["dense"] + sum(
        m.nbytes - quantize(np.zeros((m.rows, m.cols), np.float32), m.format).nbytes for m in mats if m.packed)


@needs_tiles8
@pytest.mark.parametrize("head", [None, "int8"])
def test_a_model_with_packed_int8_layers_gives_the_very_logits(odd_llama, monkeypatch, head):
    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(odd_llama, threads=2, quant="int8", head_quant=head)
    assert not any(m.packed for m in dense_matrices(rows.engine.model))
    monkeypatch.delenv("COLI_PACK")
    packed = coli.load(odd_llama, threads=2, quant="int8", head_quant=head)
    mats = dense_matrices(packed.engine.model)
    assert all(m.packed for m in mats if m.format == "int8") and packed.engine.model.layers[1].mlp.up.mat.packed
    for r, p in zip(_steps(rows), _steps(packed)):
        np.testing.assert_array_equal(p, r)


@needs_tiles
@pytest.mark.skipif(not EXACT, reason="the packed tiles sum as the row layout's only on AVX-512 VNNI")
def test_whole_tiles_give_identical_logits_on_a_converted_model(tmp_path, monkeypatch):
    """Every dimension a multiple of 4: the packed model's logits are the very bits."""
    d = synthetic.write_converted("tiny", tmp_path / "tiny-int4", "int4", seed=1)
    monkeypatch.setenv("COLI_PACK", "off")
    rows = coli.load(d, threads=2)
    monkeypatch.setenv("COLI_PACK", "on")
    packed = coli.load(d, threads=2)
    assert pack_dense(packed.engine.model) == 0  # already packed: nothing more to do
    assert any(m.packed for m in dense_matrices(packed.engine.model))
    for r, p in zip(_steps(rows), _steps(packed)):
        np.testing.assert_array_equal(p, r)
    # the norms were copied out of the file mapping (reading them must not map the rows back in)
    net, dense = packed.engine.model, packed.weights._dense
    assert not np.shares_memory(net.norm, dense) and not np.shares_memory(net.layers[0].input_norm, dense)
    assert np.shares_memory(net.embed.data, dense)  # (an int8 table stays mapped)


def test_the_switch(monkeypatch, tmp_path):
    with pytest.raises(InvalidRequestError, match="COLI_PACK='sometimes' must be 1"):
        pack_dense(None, {"COLI_PACK": "sometimes"})
    assert pack_dense(None, {"COLI_PACK": "0"}) == 0
    monkeypatch.setenv("COLI_PACK", "sometimes")
    r = coli_cli("run", "-n", "2", "hi")
    assert_one_line_error(r, "COLI_PACK='sometimes' must be 1 (on, the default) or 0 (off)")


@pytest.mark.parametrize("path", [p for p in dispatch.PATHS if p != "scalar"])
def test_every_path_passes_the_packing_tests(path):
    """This file, forced onto each SIMD path the CPU and the build have (in a process of its own)."""
    if path == K.simd_name() or os.environ.get("COLI_SIMD"):
        pytest.skip("this process runs the file on its own path")
    require_path(path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_packing.py",
                        "-k", "not every_path and not the_switch"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "COLI_SIMD": path})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


def test_dropping_the_rows_file_pages_keeps_their_bytes(tmp_path):
    """After packing, a converted model's rows are unmapped from the process (their pages stay
    in the page cache): reading them again gives the same bytes; arrays in anonymous memory
    are never touched."""
    import mmap

    from coli.weights.packing import drop_file_pages

    data = np.random.default_rng(6).integers(0, 255, 3 * mmap.PAGESIZE + 100, dtype=np.uint8)
    f = tmp_path / "rows.bin"
    f.write_bytes(data.tobytes())
    mm = np.memmap(f, dtype=np.uint8, mode="r")
    view = mm[10:].view(np.uint8).reshape(-1, 2)  # as converted.py's views: slice, view, reshape
    assert drop_file_pages([view]) == (3 * mmap.PAGESIZE + 90) // mmap.PAGESIZE * mmap.PAGESIZE - mmap.PAGESIZE
    assert np.array_equal(np.asarray(mm), data) and np.array_equal(view.ravel(), data[10:])
    anon = data.copy()
    assert drop_file_pages([anon, None]) == 0 and np.array_equal(anon, data)


@needs_tiles
def test_an_expert_is_never_packed_and_arrays_unpack_once():
    rng = np.random.default_rng(7)
    gate, up = (quantize(rng.standard_normal((8, 64)).astype(np.float32), "int4") for _ in range(2))
    down = quantize(rng.standard_normal((64, 8)).astype(np.float32), "int4")
    K.ExpertTable(1, 64, 8, K.FORMATS["int4"]).set(0, gate, up, down)
    with pytest.raises(ValueError, match="ExpertTable"):
        gate.pack()  # the table copied its row pointers
    m = quantize(rng.standard_normal((12, 96)).astype(np.float32), "int4")
    rows = tuple(a.copy() for a in m.arrays())
    m.pack()
    assert all(np.array_equal(a, b) for a, b in zip(m.arrays(), rows))


def _packed_copy(m):
    """A packed QMatrix over copies of m's rows (m itself may sit in a table)."""
    data, scales, mins = (None if a is None else a.copy() for a in m.arrays())
    q = K.QMatrix(m.fmt, data, scales, m.rows, m.cols, mins)
    assert q.pack()
    return q


EXPERT_SHAPES = {"int8": [(1, 4, 2, 64, 96), (3, 5, 2, 72, 50), (9, 6, 3, 33, 17), (20, 8, 2, 130, 98), (40, 4, 2, 64, 36),
                          (80, 3, 2, 64, 40)],
                 # int4 experts are packed with rows a multiple of 4 (whole tiles); columns any. The
                 # last: experts of 50 tokens or more in a call of 80 (AVX2's token-lane GEMM)
                 "int4": [(1, 4, 2, 64, 96), (3, 5, 2, 72, 52), (9, 6, 3, 36, 20), (20, 8, 2, 132, 100), (40, 4, 2, 68, 36),
                          (80, 3, 2, 64, 40)]}


def _expert_tables(rng, fmt, E, H, I):
    rows, tiles = K.ExpertTable(E, H, I, K.FORMATS[fmt]), K.ExpertTable(E, H, I, K.FORMATS[fmt])
    for e in range(E):
        mats = [quantize((rng.standard_normal(s) * 0.3).astype(np.float32), fmt) for s in ((I, H), (I, H), (H, I))]
        rows.set(e, *mats)
        tiles.set(e, *(_packed_copy(m) for m in mats))
    assert all(m.packed for e in range(E) for m in tiles.get(e))
    return rows, tiles


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4s"])
@pytest.mark.parametrize("shape", range(6))
@pytest.mark.parametrize("act", [0, 1])
def test_packed_experts_give_the_bits_of_their_rows(fmt, shape, act):
    """moe_experts over experts held in tiles gives the very bits of the same experts in rows:
    one token, several per expert, the row-lane tiles (9 and more), rows and columns no
    multiple of 4 or of a group (int8), and the rows computed in two calls of half the
    experts each (as a streamed layer computes them, combine on the last call only)."""
    if fmt == "int8" and not PACKS8:
        pytest.skip(f"the {K.simd_name()} path computes int8 on rows (the AVX2 and AVX-512 VNNI paths pack int8)")
    if fmt != "int8" and not PACKS:
        pytest.skip(f"the {K.simd_name()} path keeps int4 experts in rows (the AVX2 and AVX-512 paths pack them)")
    M, E, k, H, I = EXPERT_SHAPES["int8" if fmt == "int8" else "int4"][shape]
    rng = np.random.default_rng(M * 100 + H)
    x = rng.standard_normal((M, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, size=k, replace=False) for _ in range(M)]).astype(np.int32)
    w = rng.random((M, k)).astype(np.float32)
    rows, tiles = _expert_tables(rng, fmt, E, H, I)
    outs = []
    for table in (rows, tiles):
        out, counts = np.full((M, H), np.nan, np.float32), np.zeros(E, np.int64)
        K.moe_experts(x, idx, w, table, out, K.MoEScratch(M, k, E, H, I), counts, act)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])
    assert np.isfinite(outs[0]).all()
    half = (np.arange(E) < E // 2).astype(np.uint8)
    out, counts, scratch = np.full((M, H), np.nan, np.float32), np.zeros(E, np.int64), K.MoEScratch(M, k, E, H, I)
    K.moe_experts(x, idx, w, rows, out, scratch, counts, act, active=half, combine=False)
    K.moe_experts(x, idx, w, rows, out, scratch, counts, act, active=1 - half)
    np.testing.assert_array_equal(out, outs[1])


@needs_tiles  # (a path with int4 tiles packs resident int4 experts)
def test_a_tokens_int4_expert_bits_do_not_depend_on_its_call():
    """Every call arranges int4 experts' activations: a token gets the same bits alone
    (decoding), beside tokens routed elsewhere, and beside tokens on its experts (in calls
    below the size from which AVX2 takes its token-lane GEMM), in rows and in tiles."""
    E, k, H, I = 6, 2, 64, 36
    rng = np.random.default_rng(5)
    rows, tiles = _expert_tables(rng, "int4", E, H, I)
    x = rng.standard_normal((7, H)).astype(np.float32)
    idx = np.array([[0, 1], [2, 3], [0, 1], [4, 5], [0, 2], [1, 3], [5, 4]], np.int32)
    w = rng.random((7, k)).astype(np.float32)
    for table in (rows, tiles):
        whole = np.empty((7, H), np.float32)
        K.moe_experts(x, idx, w, table, whole, K.MoEScratch(7, k, E, H, I), np.zeros(E, np.int64), 0)
        for m in range(7):
            one = np.empty((1, H), np.float32)
            K.moe_experts(x[m:m + 1], idx[m:m + 1], w[m:m + 1], table, one, K.MoEScratch(1, k, E, H, I),
                          np.zeros(E, np.int64), 0)
            np.testing.assert_array_equal(one[0], whole[m])


@needs_tiles
def test_a_table_takes_packed_int4_experts_only_where_their_bits_are_the_rows():
    rng = np.random.default_rng(9)
    for rows in (8, 6):
        gate = _packed_copy(quantize(rng.standard_normal((rows, 64)).astype(np.float32), "int4"))
        up = quantize(rng.standard_normal((rows, 64)).astype(np.float32), "int4")
        down = quantize(rng.standard_normal((64, rows)).astype(np.float32), "int4")
        table = K.ExpertTable(1, 64, rows, K.FORMATS["int4"])
        if PACKS and rows % 4 == 0:
            table.set(0, gate, up, down)
            assert table.get(0)[0].packed
        else:
            with pytest.raises(ValueError, match="packed int4.*only in whole tiles of 4 rows"):
                table.set(0, gate, up, down)


@pytest.fixture(scope="module")
def moes(tmp_path_factory):
    """Two seeded qwen3_moe checkpoints converted to int8: "whole", every expert dimension a
    multiple of 64 (the tiles take the rows' room); "odd", rows and columns no multiple of 4
    (the tiles take more)."""
    from coli.weights.convert import convert

    out = {}
    for name, (hidden, inter) in {"whole": (128, 64), "odd": (72, 50)}.items():
        d = tmp_path_factory.mktemp(f"packing-moe-{name}")
        make_hf_model("qwen3_moe", d / "hf", seed=4, hidden_size=hidden, num_hidden_layers=2, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=inter, norm_topk_prob=True)
        out[name] = (d / "hf", convert(d / "hf", d / "int8", "int8"))
    return out


def _experts(model):
    return [m for moe in model.engine.model.moe_layers for e in range(moe.table.n_experts) for m in moe.table.get(e)]


@needs_tiles8
@pytest.mark.parametrize("shape", ["whole", "odd"])
def test_resident_int8_experts_are_packed_with_the_same_logits(moes, monkeypatch, shape):
    """A converted model read whole: its experts' tiles take the place of their rows in the
    buffer experts.bin was read into where they fit (no second copy), else the rows' pages are
    given back; the rows read back unchanged, and the logits are the very bits of the unpacked
    model's."""
    from coli.weights.packing import pack_experts

    conv = moes[shape][1]
    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(conv, threads=2)
    assert rows.weights.store.resident and not any(m.packed for m in _experts(rows))
    monkeypatch.delenv("COLI_PACK")
    packed = coli.load(conv, threads=2)
    assert all(m.packed for m in _experts(packed))
    assert pack_experts(packed.engine.model) == 0  # done once
    for r, p in zip(_steps(rows), _steps(packed)):
        np.testing.assert_array_equal(p, r)
    store = packed.weights.store
    file = np.fromfile(store.path, np.uint8)
    tiles = sum(m.nbytes for m in _experts(packed))
    if shape == "whole":
        assert tiles <= store.total_bytes
        assert not np.array_equal(store._all, file)  # the buffer now holds tiles
    else:
        assert tiles > store.total_bytes
        assert not store._all[4096:-4096].any()  # its pages were given back (they read as zeros)
    for a, b in zip(_experts(rows), _experts(packed)):
        assert all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays()) if x is not None)


@needs_tiles8
def test_streamed_experts_keep_their_rows(moes):
    conv = moes["whole"][1]
    budget = json.loads((conv / "coli.json").read_text())["experts"]["bytes"] // 3
    streamed = coli.load(conv, threads=2, ram_budget=budget, pin=0)
    assert not streamed.weights.store.resident
    assert not any(m is not None and m.packed for m in _experts(streamed))
    resident = coli.load(conv, threads=2)
    ids = list(range(3, 40))
    np.testing.assert_array_equal(streamed.forward(ids), resident.forward(ids))


@needs_tiles8
@pytest.mark.parametrize("shape", ["whole", "odd"])
def test_int8_experts_quantized_at_load_are_packed_with_the_same_logits(moes, monkeypatch, shape):
    """Experts quantized from a Hugging Face checkpoint get a huge-page buffer of their own."""
    hf = moes[shape][0]
    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(hf, threads=2, quant="int8")
    monkeypatch.delenv("COLI_PACK")
    packed = coli.load(hf, threads=2, quant="int8")
    assert all(m.packed for m in _experts(packed)) and not any(m.packed for m in _experts(rows))
    for r, p in zip(_steps(rows), _steps(packed)):
        np.testing.assert_array_equal(p, r)
    int4 = coli.load(hf, threads=2, quant="int4")  # int4 experts: packed where their rows are a multiple of 4
    assert all(m.packed == (PACKS and shape == "whole") for m in _experts(int4))


@needs_tiles  # (a path with int4 tiles packs resident int4 experts)
@pytest.mark.parametrize("fmt", ["int4", "int4s"])
def test_resident_int4_experts_are_packed_and_streamed_ones_give_their_logits(moes, monkeypatch, tmp_path, fmt):
    """A converted int4 model read whole packs its experts in place, and gives the very logits
    of the same model streamed (cache slots of rows), prefill and decode; on AVX-512 VNNI also
    those of the model with nothing packed (there the dense tiles give the rows' bits too; the
    AVX2 dense tiles round otherwise, and a router may then pick another expert: close)."""
    from coli.weights.convert import convert

    conv = convert(moes["whole"][0], tmp_path / fmt, fmt)
    monkeypatch.setenv("COLI_PACK", "0")
    rows = coli.load(conv, threads=2)
    monkeypatch.delenv("COLI_PACK")
    packed = coli.load(conv, threads=2)
    assert packed.weights.store.resident and all(m.packed for m in _experts(packed))
    assert not any(m.packed for m in _experts(rows))
    budget = json.loads((conv / "coli.json").read_text())["experts"]["bytes"] // 3
    streamed = coli.load(conv, threads=2, ram_budget=budget, pin=0)
    assert not streamed.weights.store.resident
    for r, p, s in zip(_steps(rows), _steps(packed), _steps(streamed)):
        np.testing.assert_array_equal(s, p)
        if EXACT:
            np.testing.assert_array_equal(p, r)
        else:
            np.testing.assert_allclose(p, r, rtol=0, atol=0.05 * np.abs(r).max())  # (as the dense test above)
