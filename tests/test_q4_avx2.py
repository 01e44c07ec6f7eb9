"""The AVX2 int4/int4s kernels (coli/_engine/simd_q.h: the one-token tile COLI_Q4GEMV256 and
the several-token GEMM coli_q4gemm8 with its interleaved activations) against the NumPy twin
(coli.quant.reference_qlinear), over shapes that cross every block edge: odd groups (the
one-group tail), short scale chunks (fewer than 8 groups), K chunks of 16 groups, row blocks
of 4 and 64, token blocks of 8 and super-blocks of 32, and token counts on both sides of the
GEMM's threshold. Each SIMD path this machine has runs the same tests in a process of its
own (forced with COLI_SIMD); the AVX2 code runs on the avx2 and avx512 paths."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from coli._engine import dispatch
from coli._engine import kernels as K
from coli.quant import quantize, reference_qlinear
from tests.conftest import require_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [  # M tokens, N rows, K columns
    (1, 4, 32), (1, 7, 33), (1, 5, 1055), (1, 9, 256), (1, 3, 480), (1, 66, 736),
    (5, 9, 100), (6, 7, 160), (7, 13, 544), (8, 4, 32), (9, 70, 1055), (16, 17, 512),
    (17, 65, 2080), (33, 5, 96), (40, 130, 608), (64, 8, 1024), (70, 13, 544), (97, 66, 1055),
]  # from 64 tokens on, AVX2 takes the token-lane GEMM (COLI_Q4GEMM8_MIN)


def _scratch(M, K_):
    kp = K.padded(K_)
    return np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    K.set_num_threads(request.param)
    K.set_small_work(0)  # with 2 threads, even the small shapes take the parallel path
    yield request.param
    K.set_num_threads(2)
    K.set_small_work(1 << 15)


@pytest.mark.parametrize("fmt", ["int4", "int4s"])
@pytest.mark.parametrize("M,N,K_", SHAPES)
def test_int4_matches_the_twin(threads, fmt, M, N, K_):
    rng = np.random.default_rng(M * 1000 + N + K_)
    x = rng.standard_normal((M, K_)).astype(np.float32)
    x[0, : min(K_, 40)] *= 30.0  # one outlier group: its activations use the full int8 range
    w = (rng.standard_normal((N, K_)) * 0.2 + (0.05 if fmt == "int4" else 0.0)).astype(np.float32)
    m = quantize(w, fmt)
    out = np.full((M, N), np.nan, np.float32)
    K.qlinear(x, m, out, None, *_scratch(M, K_))
    ref = reference_qlinear(x, m)
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int4", "int4s"])
def test_extreme_nibbles_do_not_saturate(threads, fmt):
    """Every weight at nibble 15 and every activation at +-127: the int16 sums of the maddubs
    chains are at their largest (16 products of 15 x 127 = 30480) and must not saturate."""
    M, N, K_ = 72, 6, 256  # enough tokens for the AVX2 GEMM
    w = np.ones((N, K_), np.float32)
    w[1] = -1.0
    m = quantize(w, fmt)
    m.data[:] = 0xFF
    x = np.full((M, K_), 1.0, np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    out = np.empty((M, N), np.float32)
    K.qlinear(x, m, out, None, *_scratch(M, K_))
    np.testing.assert_allclose(out, reference_qlinear(x, m), rtol=1e-5, atol=1e-3)


def test_one_token_of_a_block_equals_the_token_alone(threads):
    """Token t of a several-token call equals a call with token t alone, to float rounding (the
    GEMM and the GEMV tile sum in different orders)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 1000)).astype(np.float32)
    m = quantize((rng.standard_normal((37, 1000)) * 0.1).astype(np.float32), "int4")
    many = np.empty((12, 37), np.float32)
    K.qlinear(x, m, many, None, *_scratch(12, 1000))
    for t in (0, 7, 11):
        one = np.empty((1, 37), np.float32)
        K.qlinear(x[t:t + 1], m, one, None, *_scratch(1, 1000))
        np.testing.assert_allclose(many[t], one[0], rtol=1e-5, atol=1e-5 * np.abs(one).max())


@pytest.mark.parametrize("path", dispatch.PATHS)
def test_every_path(path):
    """This file's tests on each SIMD path, forced, in a process of its own (1 thread)."""
    if os.environ.get("COLI_SIMD"):
        pytest.skip("already running under a forced path")
    require_path(path)
    env = dict(os.environ, COLI_SIMD=path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k",
                        "1thread and not test_every_path", __file__],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
