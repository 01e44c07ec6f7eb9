"""The build (setup.py) where it differs from this machine's usual one.

macOS's Apple clang has no OpenMP unless libomp is installed; setup.py then builds the
kernels single-threaded. Debian's clang without libomp-dev is the same compiler situation:
the slow test here builds the engine with it (only the scalar path and one SIMD path, from
the C that Cython already wrote when present) and checks that the kernels import, report no
OpenMP and compute what their NumPy twins do. It also checks that the build deletes a
kernels module left by an old in-place build, which would shadow coli/_engine/kernels.py.

Needs clang (apt-get install clang) and Cython in this environment (pip install Cython);
the test skips with that message otherwise."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _copy_package(dst):
    """coli/ without compiled modules, caches or other paths' generated C; the generated C
    of the paths kept is copied with its times, so cythonize reuses it when it is current."""
    keep_c = {"_cpu.c", "_kernels_scalar.c", "_kernels_avx2.c", "_kernels_neon.c"}

    def ignore(d, names):
        out = {n for n in names if n == "__pycache__" or n.endswith((".so", ".pyd"))}
        if os.path.basename(d) == "_engine":
            out |= {n for n in names if n.endswith(".c") and n not in keep_c}
        return out

    shutil.copytree(os.path.join(ROOT, "coli"), os.path.join(dst, "coli"), ignore=ignore, copy_function=shutil.copy2)
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy2(os.path.join(ROOT, f), dst)


def test_a_stale_kernels_module_warns_at_import(tmp_path):
    """A compiled kernels.<suffix> next to kernels.py is what Python imports instead of it:
    coli._engine warns, naming the file and the fix."""
    pkg = tmp_path / "coli" / "_engine"
    pkg.mkdir(parents=True)
    shutil.copy2(os.path.join(ROOT, "coli", "__init__.py"), tmp_path / "coli")
    shutil.copy2(os.path.join(ROOT, "coli", "_engine", "__init__.py"), pkg)
    code = "import coli._engine"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    ok = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, capture_output=True,
                        text=True, cwd=tmp_path, timeout=60)
    assert ok.returncode == 0, ok.stderr
    (pkg / f"kernels{SUFFIX}").write_bytes(b"")
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, capture_output=True,
                       text=True, cwd=tmp_path, timeout=60)
    assert r.returncode != 0 and f"kernels{SUFFIX}" in r.stderr and "in place of coli/_engine/kernels.py" in r.stderr


CHECK = r"""
import os, sys
import numpy as np
import coli
assert coli.__file__.startswith(sys.argv[1]), coli.__file__
from coli._engine import kernels as K
from coli.quant import quantize, reference_qlinear
assert K.simd_name() == sys.argv[2], K.simd_name()
assert not K.has_openmp()
rng = np.random.default_rng(5)
for fmt in ("f32", "bf16", "int8", "int4", "int4s"):
    for M, N, Kc in ((1, 5, 32), (3, 17, 100), (6, 9, 300)):
        x = rng.standard_normal((M, Kc)).astype(np.float32)
        m = quantize((0.2 * rng.standard_normal((N, Kc))).astype(np.float32), fmt)
        kp = K.padded(Kc)
        out = np.empty((M, N), np.float32)
        K.qlinear(x, m, out, None, np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                  np.empty((M, kp // 32), np.int32))
        np.testing.assert_allclose(out, reference_qlinear(x, m), atol=1e-4, rtol=1e-4, err_msg=f"{fmt} {M}x{N}x{Kc}")
print("ok", K.simd_name())
"""


def test_clang_without_openmp_builds_working_kernels(tmp_path):
    """CC=clang with no OpenMP (Debian's clang without libomp-dev, like Apple clang without
    libomp; COLI_OPENMP=0 when this clang has it): setup.py warns and builds single-threaded
    kernels that compute correctly on each path built; a stale kernels module, in the tree and
    in the build directory, is gone after the build."""
    if shutil.which("clang") is None:
        pytest.skip("no clang: apt-get install clang to enable")
    if importlib.util.find_spec("Cython") is None:  # pip's isolated build had it, this venv may not
        pytest.skip("no Cython in this environment (setup.py needs it): pip install 'Cython>=3.0' to enable")
    arm = platform.machine().lower() in ("aarch64", "arm64")
    simd = "neon" if arm else "avx2"
    if not arm:
        from coli._engine import dispatch

        if not {"avx2", "fma", "f16c"} <= dispatch.cpu_features():
            simd = None  # only the scalar path is built, and checked
    _copy_package(tmp_path)
    stale = [tmp_path / "coli" / "_engine" / f"kernels{SUFFIX}",
             tmp_path / "build" / "lib" / "coli" / "_engine" / f"kernels{SUFFIX}"]
    for s in stale:
        s.parent.mkdir(parents=True, exist_ok=True)
        s.write_bytes(b"")
    env = dict(os.environ, CC="clang", LDSHARED="clang -shared", COLI_SIMD_TARGETS=simd or "scalar",
               PYTHONPATH=str(tmp_path))
    probe = subprocess.run(["clang", "-fopenmp", "-x", "c", "-", "-o", os.devnull], input="#include <omp.h>\n"
                           "int main(void) { return omp_get_max_threads() < 0; }\n", capture_output=True, text=True)
    if probe.returncode == 0:  # this clang has OpenMP: build as if it had not
        env["COLI_OPENMP"] = "0"
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--build-lib", "build/lib",
                        "--build-temp", "build/temp"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "no OpenMP with this compiler" in r.stdout + r.stderr
    assert not any(s.exists() for s in stale)
    for path in ["scalar"] + ([simd] if simd else []):
        c = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path), path], cwd=tmp_path,
                           env=dict(env, COLI_SIMD=path), capture_output=True, text=True, timeout=300)
        assert c.returncode == 0 and c.stdout.startswith("ok"), (c.stdout + c.stderr)[-4000:]
