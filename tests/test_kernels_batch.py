"""The multi-token quantized tiles (several tokens against the same weight rows: batched
decode, speculative verification, MoE experts with several tokens) against the NumPy twin.

On AVX-512 VNNI these take 4 weight rows interleaved in registers and the activations
arranged once per call (coli_expand_act); the shapes below hit every edge of that: token
counts below, at and past a tile (8), rows left over after the last 4, and a last step of
1, 2 or 3 groups (int4) or a lone group (int8), including a partial last group. Other paths
run the same tests through their own tiles (tests/test_simd_dispatch.py forces each)."""
from __future__ import annotations

import numpy as np
import pytest

from coli._engine import kernels as K
from coli.quant import quantize, reference_qlinear

RNG = np.random.default_rng(2026)
FMTS = ["int4", "int4s", "int8"]


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"], autouse=True)
def threads(request):
    K.set_num_threads(request.param)
    K.set_small_work(0)  # with 2 threads even these small shapes split over the team
    yield request.param
    K.set_num_threads(2)
    K.set_small_work(1 << 15)


def _scratch(M, K_):
    kp = K.padded(K_)
    return np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32)


def _qlinear(x, m):
    out = np.full((len(x), m.rows), np.nan, np.float32)
    K.qlinear(x, m, out, None, *_scratch(len(x), m.cols))
    return out


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M", [2, 3, 4, 5, 7, 8, 9, 16, 19])
@pytest.mark.parametrize("N,K_", [(4, 128), (13, 160), (6, 192), (9, 224), (8, 576), (7, 1055), (5, 32), (11, 96),
                                  (3, 64), (10, 480), (6, 288)])
def test_multi_token_qlinear_matches_twin(fmt, M, N, K_):
    x, w = rand(M, K_), rand(N, K_, scale=0.2)
    m = quantize(w, fmt)
    np.testing.assert_allclose(_qlinear(x, m), reference_qlinear(x, m), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_each_token_of_a_batch_gets_its_own_result(fmt):
    """A batch is its tokens one by one: each row of a call of up to 17 tokens (a speculative
    verification) has exactly the bits of that token's one-token call, wherever it sits in
    the call's tiles (greedy speculative decoding is identical to plain decoding only so),
    and a token is not disturbed by the others (one huge row among small ones)."""
    for K_ in (608, 480):  # int8 on AVX-512 VNNI: chunks of 16 + 2 + 1 and 8 + 4 + 2 + 1 groups
        x, w = rand(17, K_), rand(21, K_, scale=0.2)
        x[3] *= 1e3
        m = quantize(w, fmt)
        ones = np.stack([_qlinear(x[i:i + 1].copy(), m)[0] for i in range(17)])
        for M in (2, 5, 8, 9, 17):
            np.testing.assert_array_equal(_qlinear(x[:M].copy(), m), ones[:M], err_msg=f"{M} tokens, K {K_}")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_a_long_call_runs_in_chunks_of_tokens_with_the_bits_of_one_call(fmt, packed):
    """A prompt's call whose activations outgrow L2 runs in chunks of tokens (the last one
    longer): every row has the bits the call has in one piece (and on AVX-512 VNNI, where every
    call takes the same tiles, the bits of that token's call alone); the same with a bias, and
    for gate and up with their activation (qlinear_many). 150 tokens chunk on AVX-512 VNNI;
    40 tokens with the smallest budget (chunks of 16 + 24) also on AVX2's packed int4 tiles."""
    K_ = 576
    w, w2 = rand(40, K_, scale=0.2), rand(40, K_, scale=0.2)
    bias = rand(40)
    m, m2 = quantize(w, fmt), quantize(w2, fmt)
    if packed and not (m.pack() and m2.pack()):
        pytest.skip(f"{K.simd_name()} keeps {fmt} matrices in rows")

    def calls(x):
        M = len(x)
        y, g, u = (np.full((M, 40), np.nan, np.float32) for _ in range(3))
        K.qlinear(x, m, y, bias, *_scratch(M, K_))
        K.qlinear_many(x, (m, m2), (g, u), (None, None), *_scratch(M, K_), act=0)
        return y, g

    for M, budgets in ((150, (1, 100000, 128 << 10)), (40, (1,))):
        x = rand(M, K_)
        try:
            K.set_xe_chunk_bytes(0)  # never in chunks
            whole = calls(x)
            outs = []
            for budget in budgets:  # the smallest chunks (16 tokens), then longer ones
                K.set_xe_chunk_bytes(budget)
                outs.append(calls(x))
        finally:
            K.set_xe_chunk_bytes(128 << 10)
        for got in outs:
            np.testing.assert_array_equal(got[0], whole[0], err_msg=f"{M} tokens")
            np.testing.assert_array_equal(got[1], whole[1], err_msg=f"{M} tokens, gate and up")
        if K.simd_name() != "avx512vnni":  # (AVX2's prefill GEMMs, from 6 or 64 tokens, sum in another order)
            continue
        for i in (0, 15, 16, 17, 31, 32, 39, 63, 64, 127, 149):
            if i < M:
                np.testing.assert_array_equal(calls(x[i:i + 1].copy())[0][0], whole[0][i], err_msg=f"token {i}")


def test_int8_rows_get_the_same_bits_in_any_row_tile():
    """int8 tiles take 4 rows at a time (AVX2: interleaved in registers, the rows past the
    last 4 in a tile that repeats the last one; AVX-512 VNNI: 4 rows for one token, 2 for
    two, else 1): a row's result has the same bits whichever tile and slot computes it, so
    dropping the first r rows shifts the rows' results."""
    for M in (1, 2, 9):
        x, w = rand(M, 416), rand(14, 416, scale=0.2)
        full = _qlinear(x, quantize(w, "int8"))
        for r in (1, 2, 3, 5):
            np.testing.assert_array_equal(_qlinear(x, quantize(w[r:].copy(), "int8")), full[:, r:],
                                          err_msg=f"{M} tokens, from row {r}")


def test_int8_prefill_tiles_give_each_token_its_own_bits():
    """From 9 tokens on, AVX2 takes the row-lane int8 tiles (8 rows per vector, blocks of 32
    groups and 64 tokens): a token still gets the bits of its one-token call, across a second
    K block with an odd last group (K 1055: 33 groups), a second token block (70 tokens) and
    rows past the last 8 (N 21)."""
    x, w = rand(70, 1055), rand(21, 1055, scale=0.2)
    x[40] *= 1e3
    m = quantize(w, "int8")
    ones = np.stack([_qlinear(x[i:i + 1].copy(), m)[0] for i in range(70)])
    for M in (6, 8, 9, 11, 64, 70):
        np.testing.assert_array_equal(_qlinear(x[:M].copy(), m), ones[:M], err_msg=f"{M} tokens")
    np.testing.assert_allclose(ones, reference_qlinear(x, m), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fmt", FMTS)
def test_extreme_codes_do_not_overflow(fmt):
    """Every weight at the end of its grid and every activation at +-127: the integer sums of
    a step stay exact."""
    K_ = 1024
    w = np.where(RNG.random((12, K_)) < 0.5, -1.0, 1.0).astype(np.float32)
    x = np.where(RNG.random((6, K_)) < 0.5, -3.0, 3.0).astype(np.float32)
    x[0] = 3.0
    w[0] = 1.0
    m = quantize(w, fmt)
    np.testing.assert_allclose(_qlinear(x, m), reference_qlinear(x, m), atol=1e-3, rtol=1e-5)


def _expert_table(fmt, E, H, I):
    """E random experts (gate, up, down) in ``fmt``."""
    table = K.ExpertTable(E, H, I, K.FORMATS[fmt])
    for e in range(E):
        table.set(e, quantize(rand(I, H, scale=0.2), fmt), quantize(rand(I, H, scale=0.2), fmt),
                  quantize(rand(H, I, scale=0.2), fmt))
    return table


def _moe(x, idx, w, table, E, I):
    """K.moe_experts over these tokens: (output (M, H), experts used)."""
    (M, H), k = x.shape, idx.shape[1]
    out = np.empty((M, H), np.float32)
    used = K.moe_experts(np.ascontiguousarray(x), np.ascontiguousarray(idx), np.ascontiguousarray(w), table, out,
                         K.MoEScratch(M, k, E, H, I), np.zeros(E, np.int64), 0)
    return out, used


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("M,H,I", [(6, 96, 80), (11, 160, 224)])
def test_moe_experts_with_several_tokens_each(fmt, M, H, I):
    """Every token routed to the same two of four experts (so each computes M tokens
    through the multi-token tiles), against the one-token-at-a-time result."""
    E, k = 4, 2
    table = _expert_table(fmt, E, H, I)
    x = rand(M, H)
    idx = np.tile(np.array([[2, 0]], np.int32), (M, 1))
    w = rand(M, k, scale=0.5)
    out, used = _moe(x, idx, w, table, E, I)
    assert used == 2
    for i in range(M):
        one, _ = _moe(x[i:i + 1], idx[i:i + 1], w[i:i + 1], table, E, I)
        np.testing.assert_allclose(out[i], one[0], rtol=1e-4, atol=1e-4 * float(np.abs(one).max()))


@pytest.mark.parametrize("fmt", FMTS)
def test_moe_prefill_experts_with_few_tokens_each(fmt):
    """A prefill-sized call (64 tokens, so AVX2's int4 experts take the token-lane GEMM from 6
    tokens on and int8's the row-lane tiles from 9) with experts of 1 to 64 tokens: each
    token's output against its one-token call."""
    E, k, H, I, M = 6, 2, 160, 96, 64
    table = _expert_table(fmt, E, H, I)
    x = rand(M, H)
    # experts 0 .. 5 get 64, 45, 7, 6, 5 and 1 tokens (a token's two experts differ)
    second = np.concatenate([np.repeat(np.array([2, 3, 4, 5, 1], np.int32), [7, 6, 5, 1, 21]),
                             np.full(24, 0, np.int32)])
    first = np.concatenate([np.zeros(40, np.int32), np.ones(24, np.int32)])
    idx = np.stack([first, second], 1).astype(np.int32)
    assert np.bincount(idx.ravel()).tolist() == [64, 45, 7, 6, 5, 1]
    assert (idx[:, 0] != idx[:, 1]).all()
    w = rand(M, k, scale=0.5)
    out, _ = _moe(x, idx, w, table, E, I)
    for i in range(M):
        one, _ = _moe(x[i:i + 1], idx[i:i + 1], w[i:i + 1], table, E, I)
        if fmt == "int8":
            np.testing.assert_array_equal(out[i], one[0], err_msg=f"token {i}")
        else:
            np.testing.assert_allclose(out[i], one[0], rtol=1e-4, atol=1e-4 * float(np.abs(one).max()))


@pytest.mark.parametrize("fmt", FMTS + ["f32", "bf16"])
@pytest.mark.parametrize("case", ["decode", "uneven", "one expert"])
def test_moe_experts_keep_their_bits_however_the_threads_split_them(fmt, case):
    """The experts' work items go to the threads in runs of about equal cost: any team size
    (more threads than items too) gives exactly the one-thread result, with experts of very
    different token counts."""
    E, H, I = 6, 160, 96
    if case == "decode":  # one token, two experts: few long items
        idx = np.array([[4, 1]], np.int32)
    elif case == "uneven":  # 24 tokens over experts of 20, 13, 8, 4, 2 and 1 tokens
        idx = np.stack([np.repeat(np.array([0, 1, 2], np.int32), [20, 3, 1]),
                        np.repeat(np.array([1, 2, 3, 4, 5], np.int32), [10, 7, 4, 2, 1])], 1)
        assert np.bincount(idx.ravel()).tolist() == [20, 13, 8, 4, 2, 1]
    else:  # every token to expert 3 alone
        idx = np.full((5, 1), 3, np.int32)
    table = _expert_table(fmt, E, H, I)
    x = rand(len(idx), H)
    w = rand(*idx.shape, scale=0.5)
    K.set_num_threads(1)
    ref, used = _moe(x, idx, w, table, E, I)
    assert used == len(np.unique(idx))
    for t in (2, 3, 5, 16):
        K.set_num_threads(t)
        out, _ = _moe(x, idx, w, table, E, I)
        np.testing.assert_array_equal(out, ref, err_msg=f"{t} threads")


def test_int8_experts_give_a_token_the_same_bits_alone_or_in_a_batch():
    """int8 experts: each token's MoE output has the bits of its one-token call (the int16
    activations and their arrangement are per row, so an expert's batch is its tokens)."""
    E, k, H, I = 4, 2, 160, 96
    table = _expert_table("int8", E, H, I)
    M = 11
    x = rand(M, H)
    idx = np.stack([RNG.permutation(E)[:k] for _ in range(M)]).astype(np.int32)
    idx[:6] = [3, 1]  # six tokens share two experts: tiles of several tokens
    w = rand(M, k, scale=0.5)
    out, _ = _moe(x, idx, w, table, E, I)
    for i in range(M):
        one, _ = _moe(x[i:i + 1], idx[i:i + 1], w[i:i + 1], table, E, I)
        np.testing.assert_array_equal(out[i], one[0], err_msg=f"token {i}")


@pytest.mark.parametrize("fmt", FMTS)
def test_calls_too_large_to_arrange_take_the_plain_tiles(fmt):
    """Past the arranged-activation budget (long prefill chunks) a call falls back to the
    plain tiles: the same results within float rounding, and both match the twin."""
    x, w = rand(12, 320), rand(10, 320, scale=0.2)
    m = quantize(w, fmt)
    arranged = _qlinear(x, m)
    K.set_xe_max_bytes(0)
    try:
        plain = _qlinear(x, m)
        E, H, I = 3, 96, 64
        table = _expert_table(fmt, E, H, I)
        xm, idx, wm = rand(5, H), np.tile(np.array([[1, 2]], np.int32), (5, 1)), rand(5, 2, scale=0.5)
        outs = []
        for budget in (0, 16 << 20):
            K.set_xe_max_bytes(budget)
            outs.append(_moe(xm, idx, wm, table, E, I)[0])
    finally:
        K.set_xe_max_bytes(16 << 20)
    ref = reference_qlinear(x, m)
    np.testing.assert_allclose(plain, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(arranged, plain, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", FMTS + ["f32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "tiles"])
def test_whole_experts_a_thread_give_the_phases_bits(fmt, packed, threads):
    """Decode-shaped calls (every active expert with as many tokens, a multiple of the threads
    in number) give each thread whole experts (set_moe_whole, moe_ways): exactly the bits of
    the two phases of row blocks, with the hidden activations quantized (and arranged) per
    expert; calls whose experts do not go round evenly, and one thread, keep the phases.
    Experts computed in groups (active, combine on the last) too."""
    E, H, I = 8, 160, 96
    table = K.ExpertTable(E, H, I, K.FORMATS[fmt])
    for e in range(E):
        trio = [quantize(rand(I, H, scale=0.2), fmt), quantize(rand(I, H, scale=0.2), fmt),
                quantize(rand(H, I, scale=0.2), fmt)]
        if packed and not all(m.packed_bytes for m in trio):
            pytest.skip(f"this SIMD path keeps {fmt} experts in rows")
        for m in trio if packed else ():
            m.pack()
        table.set(e, *trio)
    cases = {
        "one token, 4 experts": np.array([[6, 1, 3, 4]], np.int32),
        "two tokens, 4 experts, one each": np.array([[0, 5], [2, 7]], np.int32),
        "two tokens, 2 experts, two each": np.array([[1, 4], [4, 1]], np.int32),
        "uneven": np.array([[1, 2], [1, 3]], np.int32),  # 2, 1, 1 tokens: phases
        "3 experts": np.array([[0, 2, 5]], np.int32),  # not a multiple of 2 threads: phases
    }
    for name, idx in cases.items():
        x = rand(len(idx), H)
        w = rand(*idx.shape, scale=0.5)
        got = {}
        for on in (False, True):
            K.set_moe_whole(on)
            K.moe_ways(reset=True)
            got[on], used = _moe(x, idx, w, table, E, I)
            assert used == len(np.unique(idx))
            ways = K.moe_ways()
            whole = on and threads > 1 and name not in ("uneven", "3 experts")
            assert ways == {"whole": int(whole), "phases": int(not whole)}, (name, on)
        K.set_moe_whole(True)
        np.testing.assert_array_equal(got[True], got[False], err_msg=name)
    # experts in two groups, the outputs combined on the second call: the bits of one call
    idx = np.array([[0, 3, 5, 6]], np.int32)
    x, w = rand(1, H), rand(1, 4, scale=0.5)
    ref, _ = _moe(x, idx, w, table, E, I)
    half = np.zeros(E, np.uint8)
    half[[0, 6]] = 1
    out, scratch, counts = np.empty((1, H), np.float32), K.MoEScratch(1, 4, E, H, I), np.zeros(E, np.int64)
    K.moe_ways(reset=True)
    K.moe_experts(x, idx, w, table, out, scratch, counts, 0, active=half, combine=False)
    K.moe_experts(x, idx, w, table, out, scratch, counts, 0, active=1 - half)
    assert K.moe_ways()["whole"] == (2 if threads > 1 else 0)
    np.testing.assert_array_equal(out, ref)
