"""The ARM (NEON) kernels, tested on an x86 machine: tests/native/kernel_driver.c, which
runs the engine's C kernels (coli/_engine/simd.h, simd_q.h, simd_q_neon.h, simd_q16.h,
simd_q16_neon.h) without Python, is cross-compiled with Debian's aarch64 toolchain for each
ARM path setup.py builds (neon: armv8-a; neondot: +dotprod, sdot; neoni8mm: +i8mm, smmla;
and the plain-C scalar module) and run under qemu-user, and its answers are compared with
the NumPy twins (the int8 GEMM's bit for bit with the plain-C tile's order). The same
driver is also compiled for this machine, so the harness itself is checked everywhere.

Needs: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user (the ARM cases
skip with that message otherwise)."""
from __future__ import annotations

import ast
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest

from coli._engine import dispatch
from coli._engine import reference as R
from coli.quant import dequantize, quantize, quantize_activations, reference_qlinear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "native", "kernel_driver.c")
ENGINE = os.path.join(ROOT, "coli", "_engine")
CROSS = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT_LIBC = "/usr/aarch64-linux-gnu/lib/libc.a"  # libc6-dev-arm64-cross: the drivers link statically
ENABLE = "apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user to enable"
CODES = {"f32": 0, "bf16": 1, "int8": 2, "int4s": 3, "int4": 4}
TOL = dict(atol=2e-5, rtol=2e-5)
QTOL = dict(atol=1e-4, rtol=1e-4)

def _setup_arm_targets():
    """setup.py's ARM_TARGETS (path -> compiler flags): the tests build what setup.py builds."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ARM_TARGETS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no ARM_TARGETS")


ARM = _setup_arm_targets()
# name -> (compiler, flags, qemu -cpu model or None for this machine, expected simd name,
#          expected build bits: 1 sdot, 2 smmla, 4 NEON)
TARGETS = {
    "host": ("cc", [], None, None, 0),
    "host-avx2": ("cc", ["-mavx2", "-mfma", "-mf16c"], None, "avx2", 0),
    "neon": (CROSS, ARM["neon"], "cortex-a53", "neon", 4),
    "neondot": (CROSS, ARM["neondot"], "max", "neon", 5),
    "neoni8mm": (CROSS, ARM["neoni8mm"], "max", "neon", 7),
    "arm-scalar": (CROSS, ARM["scalar"], "max", "scalar", 0),
    # clang, the compiler family of macOS (Apple clang): its arm_neon.h is its own
    "neon-clang": ("clang", ["--target=aarch64-linux-gnu"] + ARM["neon"], "cortex-a53", "neon", 4),
    "neoni8mm-clang": ("clang", ["--target=aarch64-linux-gnu"] + ARM["neoni8mm"], "max", "neon", 7),
}


def _missing(name):
    cc, _, cpu, _, _ = TARGETS[name]
    if cpu is None:
        if shutil.which(cc) is None:
            return f"no C compiler ({cc}) on this machine"
        if name == "host-avx2" and not {"avx2", "fma", "f16c"} <= dispatch.cpu_features():
            return "this CPU lacks AVX2+FMA+F16C"
        return None
    if shutil.which(CROSS) is None or shutil.which(QEMU) is None or not os.path.exists(SYSROOT_LIBC):
        return f"no {CROSS} / {QEMU} / static aarch64 libc: {ENABLE}"
    if shutil.which(cc) is None:
        return f"no {cc} (apt-get install clang to enable)"
    return None


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_driver")


_built = {}


def driver(name, build_dir):
    """The path of the driver compiled for target ``name`` (compiled once per session)."""
    why = _missing(name)
    if why:
        pytest.skip(why)
    if name not in _built:
        cc, flags, cpu, _, _ = TARGETS[name]
        exe = str(build_dir / f"kernel_driver_{name}")
        cmd = [cc, "-O2", "-std=c11", "-Wall", "-Werror", f"-I{ENGINE}", DRIVER, "-o", exe, "-lm"] + flags
        if cpu is not None:
            cmd.append("-static")  # qemu-aarch64 then needs no sysroot for the loader
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        _built[name] = exe
    return _built[name]


def run(name, build_dir, requests: bytes) -> bytes:
    exe = driver(name, build_dir)
    cpu = TARGETS[name][2]
    cmd = [exe] if cpu is None else [QEMU, "-cpu", cpu, exe]
    r = subprocess.run(cmd, input=requests, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return r.stdout


def _to_f16(x):
    with np.errstate(over="ignore"):  # past 65520 is meant to overflow to inf
        return x.astype(np.float16)


def header(op, ints=(), floats=()):
    ints, floats = list(ints) + [0] * (7 - len(ints)), list(floats) + [0.0] * (4 - len(floats))
    return struct.pack("<8i4f", op, *ints, *floats)


class Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, dtype, *shape):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out = np.frombuffer(self.data, dtype, count=int(np.prod(shape)), offset=self.at).reshape(shape)
        self.at += n
        return out

    def done(self):
        assert self.at == len(self.data), f"{len(self.data) - self.at} bytes of output left"


RNG = np.random.default_rng(20)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def mat_bytes(m) -> bytes:
    out = np.ascontiguousarray(m.data).tobytes()
    if m.scales is not None:
        out += np.ascontiguousarray(m.scales).tobytes()
    if m.mins is not None:
        out += np.ascontiguousarray(m.mins).tobytes()
    return out


def mat_dims(m):
    ldd = 0 if m.scales is None else m.scales.shape[1]
    return m.data.shape[1], ldd


# M tokens, N rows, K columns, rows per call (callers split N across threads): tile edges
# (M, N not multiples of 4 or 2), K not a multiple of 32, of the vector width, or of the
# 4-group step of the min term; one K past 256 (bf16 panels are widened in chunks of 256).
GEMM_SHAPES = [(1, 13, 100, 0), (2, 6, 40, 0), (3, 9, 64, 5), (4, 8, 96, 0), (5, 7, 33, 3), (8, 12, 256, 0),
               (7, 11, 161, 6), (1, 1, 1, 0), (6, 10, 300, 4), (3, 5, 200, 2)]
# the targets whose int8-weight tiles do the scalar tile's float operations in its order
# (simd_q16.h's plain C, simd_q16_neon.h): their outputs equal R.qlinear16_in_order's bits
IN_ORDER = {"host", "neon", "neondot", "neoni8mm", "arm-scalar", "neon-clang", "neoni8mm-clang"}


def ties(M, K, top):
    """Activations whose quantization hits round-half-to-even: each group's max |x| is ``top``
    (the int16 or int8 code range, so 1 / scale is 1) and its other values end in .5; the last
    row is zeros (scale 0)."""
    x = (RNG.integers(-top, top, (M, K)) + 0.5).astype(np.float32)
    x[:, ::32] = top
    x[-1] = 0.0
    return x
TOKEN_SHAPES = [(37, 19, 70, 0), (8, 8, 300, 0), (70, 10, 40, 4), (1, 3, 5, 0)]
ATTEND_SHAPES = [(4, 2, 64, 64, 37, 0.0), (3, 1, 18, 10, 5, 5.0), (2, 2, 128, 128, 130, 0.0), (1, 1, 7, 3, 1, 0.0),
                 (4, 1, 32, 32, 70, 0.0), (6, 2, 16, 24, 20, 0.0)]  # the last two: f16 keys widened in registers
ATTEND_TILES = [(9, 3, 64, 64, 150, 16), (10, 2, 40, 24, 70, 5), (2, 1, 18, 18, 9, 9)]  # (nh, nkv, hd, vd, T, rows)


def cases():
    """(request bytes, checker(reader)) for every case, in order."""
    out = []

    for fmt in CODES:
        shapes = [(M, N, K, split, None) for M, N, K, split in GEMM_SHAPES]
        if fmt in ("int8", "int4s"):  # their activations: int16 groups, int8 groups
            shapes += [(5, 6, 200, 0, ties(5, 200, 32767 if fmt == "int8" else 127))]
        for M, N, K, split, x in shapes:
            x, w = rand(M, K) if x is None else x, rand(N, K)
            m = quantize(w, fmt)
            ldw, ldd = mat_dims(m)
            req = header(1, (CODES[fmt], M, N, K, ldw, ldd, split)) + x.tobytes() + mat_bytes(m)

            def check(rd, target, x=x, m=m, M=M, N=N, K=K, fmt=fmt):
                if fmt == "int8":  # int16 activations, as the engine gives int8 weights
                    q, qd = R.quantize_activations16(x)
                    np.testing.assert_array_equal(rd.take(np.int16, *q.shape), q)
                    np.testing.assert_array_equal(rd.take(np.float32, *qd.shape), qd)
                elif fmt not in ("f32", "bf16"):
                    q, qd, qs = quantize_activations(x)
                    np.testing.assert_array_equal(rd.take(np.int8, *q.shape), q)
                    np.testing.assert_array_equal(rd.take(np.float32, *qd.shape), qd)
                    np.testing.assert_array_equal(rd.take(np.int32, *qs.shape), qs)
                y = rd.take(np.float32, M, N)
                np.testing.assert_allclose(y, reference_qlinear(x, m), **(TOL if fmt in ("f32", "bf16") else QTOL),
                                           err_msg=f"gemm {fmt} M={M} N={N} K={K}")
                if fmt == "int8" and target in IN_ORDER:  # the same bits whatever the tile and M
                    np.testing.assert_array_equal(y, R.qlinear16_in_order(q, qd, m.data, m.scales),
                                                  err_msg=f"gemm int8 M={M} N={N} K={K}: not the scalar tile's bits")
            out.append((req, check))

        if fmt not in ("f32", "bf16"):
            w = rand(5, 70)
            m = quantize(w, fmt)
            ldw, ldd = mat_dims(m)
            req = header(4, (CODES[fmt], 5, 70, ldw, ldd)) + mat_bytes(m)
            out.append((req, lambda rd, target, m=m: np.testing.assert_array_equal(rd.take(np.float32, 5, 70), dequantize(m))))

    for fmt in ("f32", "bf16"):
        for M, N, K, split in TOKEN_SHAPES:
            x, w = rand(M, K), rand(N, K)
            m = quantize(w, fmt)
            req = header(2, (CODES[fmt], M, N, K, m.data.shape[1], 0, split)) + x.tobytes() + mat_bytes(m)

            def check(rd, target, x=x, m=m, M=M, N=N, K=K, fmt=fmt):
                np.testing.assert_allclose(rd.take(np.float32, M, N), R.linear(x, dequantize(m)), **TOL,
                                           err_msg=f"token panels {fmt} M={M} N={N} K={K}")
            out.append((req, check))

    for half in (0, 1):  # float32 caches, and f16 ones (widened as they are read)
        for nh, nkv, hd, vd, T, softcap in ATTEND_SHAPES:
            q, k, v = rand(nh, hd), rand(T, nkv, hd), rand(T, nkv, vd)
            if half:
                k, v = k.astype(np.float16), v.astype(np.float16)
            scale = hd ** -0.5
            req = header(3, (nh, nkv, hd, vd, T, half), (scale, softcap)) + q.tobytes() + k.tobytes() + v.tobytes()

            def check(rd, target, q=q, k=k, v=v, nh=nh, nkv=nkv, hd=hd, vd=vd, T=T, scale=scale, softcap=softcap,
                      half=half):
                ref = R.attention(q.reshape(1, -1), [k.astype(np.float32)], [v.astype(np.float32)], np.array([T - 1]),
                                  nh, nkv, hd, vd, scale, 0, softcap)
                np.testing.assert_allclose(rd.take(np.float32, nh * vd), ref[0], **TOL,
                                           err_msg=f"attend nh={nh} nkv={nkv} hd={hd} vd={vd} T={T} half={half}")
            out.append((req, check))
        for nh, nkv, hd, vd, T, R_ in ATTEND_TILES:  # a prefill tile: the last R_ rows together, then alone
            q, k, v = rand(R_, nh * hd), rand(T, nkv, hd), rand(T, nkv, vd)
            if half:
                k, v = k.astype(np.float16), v.astype(np.float16)
            req = header(3, (nh, nkv, hd, vd, T, half, R_), (0.3, 0.0)) + q.tobytes() + k.tobytes() + v.tobytes()

            def check(rd, target, q=q, k=k, v=v, nh=nh, nkv=nkv, hd=hd, vd=vd, T=T, R_=R_, half=half):
                tile, alone = rd.take(np.float32, R_, nh * vd), rd.take(np.float32, R_, nh * vd)
                what = f"attend tile nh={nh} nkv={nkv} hd={hd} vd={vd} T={T} rows={R_} half={half}"
                np.testing.assert_array_equal(tile, alone, err_msg=what)
                ref = R.attention(q, [k.astype(np.float32)] * R_, [v.astype(np.float32)] * R_,
                                  np.arange(T - R_, T), nh, nkv, hd, vd, 0.3)
                np.testing.assert_allclose(tile, ref, **TOL, err_msg=what)
            out.append((req, check))

    x = rand(301) * np.float32(3.0)
    x[:12] = [0.0, -0.0, np.inf, 65504, 65520, 70000, 2 ** -14, 2 ** -24, 2 ** -25, 3 * 2 ** -25, 1 + 2 ** -11, 1e-9]
    req = header(6, (len(x),)) + x.tobytes()
    out.append((req, lambda rd, target, x=x: np.testing.assert_array_equal(
        rd.take(np.uint16, len(x)), _to_f16(x).view(np.uint16), err_msg="f32 -> f16 rounding")))

    for n in (1, 4, 37, 64):
        x, y = rand(n), rand(n)
        req = header(5, (n,), (0.5, -1.5)) + x.tobytes() + y.tobytes()

        def check(rd, target, x=x, y=y, n=n):
            np.testing.assert_allclose(rd.take(np.float32, 1)[0], np.dot(x.astype(np.float64), y), **TOL)
            np.testing.assert_allclose(rd.take(np.float32, n), y * 0.5 + x * -1.5, **TOL)
        out.append((req, check))
    return out


CASES = cases()


@pytest.mark.parametrize("name", list(TARGETS))
def test_kernels_match_the_numpy_twins(name, build_dir):
    """Every kernel the engine calls (quantized GEMM tiles of each format and its activation
    quantization, the bf16 / f32 token-panel GEMM, attention, dequantization, dot) on the
    target, against NumPy, over odd shapes."""
    rd = Reader(run(name, build_dir, b"".join(req for req, _ in CASES)))
    for _, check in CASES:
        check(rd, name)
    rd.done()


@pytest.mark.parametrize("name", [t for t in TARGETS if TARGETS[t][2] is not None])
def test_the_target_builds_and_detects_what_it_should(name, build_dir):
    """The module for each ARM path compiles the code it is meant to (sdot / smmla / NEON or
    plain C), and the run-time feature detection (cpu_arm.h, used by dispatch) reads the
    emulated CPU: a Cortex-A53 has NEON only, qemu's "max" CPU also sdot and smmla."""
    rd = Reader(run(name, build_dir, header(0)))
    simd = rd.take(np.uint8, 16).tobytes().split(b"\0")[0].decode()
    features, bits = rd.take(np.int32, 2)
    rd.done()
    _, _, cpu, want_simd, want_bits = TARGETS[name]
    assert simd == want_simd and bits == want_bits
    assert features == (1 if cpu == "cortex-a53" else 7)
    got = {n for i, n in enumerate(("asimd", "asimddp", "i8mm")) if features >> i & 1}
    path = name.replace("-clang", "")
    assert dispatch.NEEDS[path if path in dispatch.NEEDS else "scalar"] <= got


def test_a_dotprod_module_does_not_run_on_a_cpu_without_sdot(build_dir):
    """What dispatch guards against: the neondot code really uses sdot (SIGILL on a
    Cortex-A53), so choosing it needs the asimddp feature."""
    exe = driver("neondot", build_dir)
    case = next(req for req, _ in CASES if struct.unpack_from("<2i", req)[:2] == (1, CODES["int4s"]))
    r = subprocess.run([QEMU, "-cpu", "cortex-a53", exe], input=case, capture_output=True, timeout=120)
    assert r.returncode != 0

    def best(features):
        return next(p for p in dispatch.PATHS if p in ARM and dispatch.NEEDS[p] <= features)

    assert best(frozenset({"asimd"})) == "neon"
    assert best(frozenset({"asimd", "asimddp"})) == "neondot"
    assert best(frozenset({"asimd", "asimddp", "i8mm"})) == "neoni8mm"
    assert best(frozenset()) == "scalar"


def test_setup_builds_every_arm_path_dispatch_knows():
    assert list(ARM) == [p for p in dispatch.PATHS if p.startswith("neon")] + ["scalar"]


@pytest.mark.parametrize("path", ["neon", "neoni8mm"])
def test_the_whole_kernels_module_compiles_for_arm(path, tmp_path):
    """The Cython module around the kernels (kernels.pyx, quant.pxi: the C that Cython wrote
    for this build) compiles for aarch64 with OpenMP, as setup.py would build it there (at
    -O0, COLI_CYTHON_DEBUG's level; this machine's Python headers, which are LP64 like
    aarch64's). Catches x86-only code outside the SIMD headers' guarded regions."""
    import sysconfig

    why = _missing(path)
    if why:
        pytest.skip(why)
    generated = sorted(f for f in os.listdir(ENGINE) if f.startswith("_kernels_") and f.endswith(".c"))
    if not generated:
        pytest.skip("no Cython-generated coli/_engine/_kernels_*.c (run: python setup.py build_ext --inplace)")
    for src, flags in ((generated[0], ARM[path] + ["-fopenmp"]), ("_cpu.c", [])):
        if not os.path.exists(os.path.join(ENGINE, src)):
            continue
        cmd = [CROSS, "-O0", "-std=c11", "-fPIC", "-Werror=implicit-function-declaration",
               f"-I{sysconfig.get_paths()['include']}", f"-I{np.get_include()}", f"-I{ENGINE}",
               "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION", f'-DCOLI_SIMD_PATH="{path}"',
               "-c", os.path.join(ENGINE, src), "-o", str(tmp_path / "out.o")] + flags
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
