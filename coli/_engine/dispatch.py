"""Which SIMD path of the kernels runs here (see coli/_engine/kernels.py and setup.py).

setup.py compiles coli/_engine/kernels.pyx once per path into ``coli._engine._kernels_<path>``.
``choose`` picks the best path that both this CPU (CPUID and XGETBV on x86; HWCAP or sysctl on
64-bit ARM: coli._engine._cpu) and the build have; ``COLI_SIMD=<path>`` forces one, and a path this CPU cannot run or the build lacks is
refused with SimdUnavailableError instead of crashing on an illegal instruction later.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

from coli.errors import ColiError

# best first; what each path's code executes besides the platform's baseline (x86-64, or
# 64-bit ARM for the neon* paths: NEON (asimd), sdot (asimddp), smmla (i8mm))
PATHS = ("avx512vnni", "avx512", "avx2vnni", "avx2", "neoni8mm", "neondot", "neon", "scalar")
NEEDS = {
    "avx512vnni": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl",
                             "avx512vnni"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    "avx2vnni": frozenset({"avx2", "fma", "f16c", "avxvnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "neoni8mm": frozenset({"asimd", "asimddp", "i8mm"}),
    "neondot": frozenset({"asimd", "asimddp"}),
    "neon": frozenset({"asimd"}),
    "scalar": frozenset(),
}
ENV = "COLI_SIMD"


class SimdUnavailableError(ColiError, ImportError):
    """COLI_SIMD names a path that this CPU cannot run or this build does not have."""


def built() -> list[str]:
    """The paths this installation has modules for, best first ("native" first when built so)."""
    names = ("native",) + PATHS
    return [p for p in names if importlib.util.find_spec(f"coli._engine._kernels_{p}") is not None]


def cpu_features() -> frozenset:
    from coli._engine import _cpu

    return _cpu.features()


def runnable(features: frozenset | None = None) -> list[str]:
    """The paths this CPU can run and this build has, best first. A native build runs only
    on the CPU it was built for, so it is taken as runnable here."""
    features = cpu_features() if features is None else features
    return [p for p in built() if p == "native" or NEEDS[p] <= features]


def choose(forced: str | None = None, features: frozenset | None = None) -> str:
    """The path to use: ``forced`` (COLI_SIMD's value) when set, else the best runnable."""
    features = cpu_features() if features is None else features
    have = built()
    if forced:
        forced = forced.strip().lower()
        if forced not in ("native",) + PATHS:
            raise SimdUnavailableError(f"{ENV}={forced!r}: unknown SIMD path; choose one of: {', '.join(PATHS)}")
        if forced not in have:
            raise SimdUnavailableError(f"{ENV}={forced}: this build has no {forced} kernels "
                                       f"(built: {', '.join(have) or 'none'}; see setup.py)")
        missing = sorted(NEEDS.get(forced, frozenset()) - features)
        if missing:
            raise SimdUnavailableError(f"{ENV}={forced}: this CPU lacks {', '.join(missing)}; "
                                       f"it can run: {', '.join(runnable(features))}")
        return forced
    ok = runnable(features)
    if not ok:
        raise SimdUnavailableError("no kernel module is built (looked for coli._engine._kernels_<path>); "
                                   "run: pip install -e .")
    return ok[0]


PREFETCH_ENV = "COLI_STREAM_PREFETCH"


def stream_prefetch(vendor: str | None = None) -> int:
    """The one-token packed int4 tiles' stream prefetches for this CPU
    (kernels.set_stream_prefetch): COLI_STREAM_PREFETCH when set (0 none, 1 into L1 only, 2
    into L2 and L1), else none on AMD and both elsewhere. On a Zen 4 a one-stream decode step
    took 1.06-1.26x as long with them at 2 threads and 1.13-1.38x at 1 (BENCHMARKS.md, the
    thirty-seventh session); on Intel Xeons the L2 ones made decode 5-10% faster (the
    twenty-sixth)."""
    raw = os.environ.get(PREFETCH_ENV, "")
    if raw.strip():
        if raw.strip() not in ("0", "1", "2"):
            raise SimdUnavailableError(f"{PREFETCH_ENV}={raw!r}: choose 0 (no prefetch), 1 (into L1 only) "
                                       "or 2 (into L2 and L1)")
        return int(raw)
    if vendor is None:
        from coli._engine import _cpu

        vendor = _cpu.vendor()
    return 0 if vendor == "AuthenticAMD" else 2


def load(forced: str | None = None):
    """The kernel module of the chosen path (COLI_SIMD's when ``forced`` is None), with this
    CPU's stream prefetches set (``stream_prefetch``)."""
    path = choose(os.environ.get(ENV) if forced is None else forced)
    module = importlib.import_module(f"coli._engine._kernels_{path}")
    module.set_stream_prefetch(stream_prefetch())
    return module
