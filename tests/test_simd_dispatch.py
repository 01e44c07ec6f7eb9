"""Run-time SIMD dispatch: one build carries the kernels for every path (setup.py), the
best one the CPU has is chosen at import, and COLI_SIMD forces one. Every path this
machine can run passes the kernel parity tests (tests/test_kernels.py, against the NumPy
twins) in a process of its own; paths the CPU lacks are skipped with a message."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coli._engine import dispatch
from coli._engine import kernels as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FEATURES = dispatch.cpu_features()


def _env(**extra):
    env = dict(os.environ)
    env.pop("COLI_SIMD", None)
    env.update(extra)
    return env


def test_default_is_the_best_path_cpu_and_build_have():
    assert K.simd_name() == dispatch.choose(None)
    assert K.simd_name() == dispatch.runnable()[0]
    want = next(p for p in dispatch.PATHS if dispatch.NEEDS[p] <= FEATURES and p in dispatch.built())
    assert dispatch.choose(None) in (want, "native")


def test_choice_follows_the_features():
    built = dispatch.built()
    avx2 = frozenset({"avx", "avx2", "fma", "f16c"})
    if "avx2" in built:
        assert dispatch.choose(None, avx2) in ("avx2", "native")
    if "avx2vnni" in built:  # Alder Lake and later cores without AVX-512
        assert dispatch.choose(None, avx2 | {"avxvnni"}) in ("avx2vnni", "native")
    if "avx512vnni" in built:
        assert dispatch.choose(None, dispatch.NEEDS["avx512vnni"]) in ("avx512vnni", "native")
        assert dispatch.choose(None, dispatch.NEEDS["avx512vnni"] | {"avxvnni"}) in ("avx512vnni", "native")
    assert dispatch.choose(None, frozenset()) in ("scalar", "native")
    assert dispatch.runnable(frozenset())[-1] == "scalar"


@pytest.mark.parametrize("path", ["avx512vnni", "avx512", "avx2vnni", "avx2"])
def test_a_path_the_cpu_lacks_is_refused(path):
    if path not in dispatch.built():
        pytest.skip(f"this build has no {path} kernels")
    lacking = dispatch.NEEDS[path] - {{"avx2": "avx2", "avx2vnni": "avxvnni"}.get(path, "avx512bw")}
    with pytest.raises(dispatch.SimdUnavailableError, match=f"COLI_SIMD={path}: this CPU lacks"):
        dispatch.choose(path, lacking)
    with pytest.raises(dispatch.SimdUnavailableError, match="unknown SIMD path"):
        dispatch.choose("avx1024", FEATURES)


def test_cli_refuses_a_bad_path_in_one_line():
    r = subprocess.run([sys.executable, "-m", "coli.cli", "bench", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=_env(COLI_SIMD="avx1024"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "COLI_SIMD='avx1024': unknown SIMD path" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_stream_prefetch_default_follows_the_vendor_and_the_variable(monkeypatch):
    """The packed tiles' stream prefetches: none on AMD, both elsewhere, COLI_STREAM_PREFETCH
    over either; every imported path starts with this CPU's setting; a bad value is refused,
    and by the CLI in one line."""
    monkeypatch.delenv("COLI_STREAM_PREFETCH", raising=False)
    assert dispatch.stream_prefetch("AuthenticAMD") == 0
    assert dispatch.stream_prefetch("GenuineIntel") == 2
    assert dispatch.stream_prefetch("") == 2  # ARM and others (their tiles have no such prefetch)
    for value in ("0", "1", "2"):
        monkeypatch.setenv("COLI_STREAM_PREFETCH", value)
        assert dispatch.stream_prefetch("AuthenticAMD") == dispatch.stream_prefetch("GenuineIntel") == int(value)
    for bad in ("3", "on", "-1"):
        monkeypatch.setenv("COLI_STREAM_PREFETCH", bad)
        with pytest.raises(dispatch.SimdUnavailableError, match="COLI_STREAM_PREFETCH=.*choose 0"):
            dispatch.stream_prefetch("GenuineIntel")
    for value, want in ((None, None), ("1", 1)):  # None: unset, this CPU's vendor decides
        env = _env()
        env.pop("COLI_STREAM_PREFETCH", None)
        if value is not None:
            env["COLI_STREAM_PREFETCH"] = value
        r = subprocess.run([sys.executable, "-c", "from coli._engine import kernels as K, _cpu; "
                            "print(K.get_stream_prefetch(), _cpu.vendor())"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        got, _, vendor = r.stdout.strip().partition(" ")
        assert int(got) == (want if want is not None else 0 if vendor == "AuthenticAMD" else 2)
    r = subprocess.run([sys.executable, "-m", "coli.cli", "bench", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=_env(COLI_STREAM_PREFETCH="7"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "COLI_STREAM_PREFETCH='7'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("path", dispatch.PATHS)
def test_every_path_passes_the_kernel_parity_tests(path):
    """The same installed build, forced onto each path: loads, reports the path, and passes
    every kernel's NumPy-twin test (one thread; thread independence is tested on the default
    path by tests/test_kernels.py itself)."""
    if path not in dispatch.built():
        pytest.skip(f"this build has no {path} kernels (see COLI_SIMD_TARGETS in setup.py)")
    missing = sorted(dispatch.NEEDS[path] - FEATURES)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {path} path cannot run here")
    env = _env(COLI_SIMD=path)
    r = subprocess.run([sys.executable, "-c", "from coli._engine import kernels as K; print(K.simd_name())"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == path
    if path == K.simd_name():
        return  # tests/test_kernels.py runs in this very process on it
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "1thread",
                        "tests/test_kernels.py", "tests/test_kernels_batch.py", "tests/test_quant_formats.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


def test_coli_bench_reports_the_forced_path():
    """`coli bench` says which SIMD path ran (so does /health's hardware.simd, from the same
    kernels.simd_name())."""
    import json

    path = "avx2" if "avx2" in dispatch.runnable() else "scalar"
    r = subprocess.run([sys.executable, "-m", "coli.cli", "bench", "--synthetic", "tiny", "-q", "int4", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(COLI_SIMD=path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["simd"] == path and out["quant"] == "int4"


def test_avx2vnni_gives_the_bits_of_avx2():
    """The avx2vnni path is the avx2 kernels with vpdpbusd / vpdpwssd in place of
    vpmaddubsw / vpmaddwd + vpaddd: the same exact integer sums, so a model's logits (int8
    and int4, prefill, decode and a verification of several tokens) are the very bits."""
    for path in ("avx2", "avx2vnni"):
        if path not in dispatch.built():
            pytest.skip(f"this build has no {path} kernels (see COLI_SIMD_TARGETS in setup.py)")
        missing = sorted(dispatch.NEEDS[path] - FEATURES)
        if missing:
            pytest.skip(f"this CPU lacks {', '.join(missing)}: the {path} path cannot run here")
    code = """if 1:
        import sys, numpy as np, coli
        from coli import synthetic
        from coli._engine import kernels as K
        d = synthetic.write_hf("tiny", sys.argv[2])
        out = []
        for quant in ("int8", "int4"):  # 70 prompt tokens: int4's token-lane GEMM too (64 and up)
            eng = coli.load(d, threads=2, quant=quant).engine
            c = eng.new_cache(128)
            out.append(eng.step([(c, list(range(2, 72)))], all_logits=[True])[0].copy())
            out += [eng.step([(c, [t])])[0].copy() for t in (5, 9)]
            out.append(eng.step([(c, [3, 4, 5, 6])], all_logits=[True])[0].copy())
        np.save(sys.argv[1], np.concatenate([o.ravel() for o in out]))
        print(K.simd_name())
    """
    import tempfile

    import numpy as np

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("avx2", "avx2vnni"):
            f = os.path.join(tmp, f"{path}.npy")
            r = subprocess.run([sys.executable, "-c", code, f, os.path.join(tmp, f"hf-{path}")], cwd=ROOT, capture_output=True, text=True,
                               timeout=300, env=_env(COLI_SIMD=path))
            assert r.returncode == 0 and r.stdout.split()[-1] == path, r.stderr[-3000:]
            got[path] = np.load(f)
    np.testing.assert_array_equal(got["avx2vnni"], got["avx2"])
