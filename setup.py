"""Only builds the Cython engine (and prompt lookup's index, coli/speculate/_lookup.pyx);
all metadata lives in pyproject.toml.

The kernels (coli/_engine/kernels.pyx and its SIMD headers) are compiled once per SIMD
path, each into its own extension module coli._engine._kernels_<path>:

  avx512vnni  AVX-512 F/BW/DQ/VL + VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4/5)
  avx512      AVX-512 F/BW/DQ/VL without VNNI (Skylake-SP/X)
  avx2vnni    AVX2 + FMA + F16C + AVX-VNNI: the avx2 kernels with vpdpbusd / vpdpwssd for
              their integer dot products (Alder Lake and later Intel cores without AVX-512)
  avx2        AVX2 + FMA + F16C (Haswell and later, Zen 1-3)
  scalar      the platform's baseline in plain C (any x86-64; the only path on other CPUs)

and on 64-bit ARM (Linux aarch64, macOS arm64):

  neoni8mm    armv8.2-a + dotprod + i8mm: sdot and smmla (Graviton 3/4, Apple M2 and later)
  neondot     armv8.2-a + dotprod: sdot (Graviton 2, Apple M1, Ampere Altra, Cortex-A76/A55)
  neon        armv8-a: NEON only (Cortex-A72/A53: Raspberry Pi 4, Graviton 1)
  scalar      plain C (-DCOLI_NO_NEON), for comparisons

A path whose flags this compiler does not know (an old GCC and +i8mm or -mavxvnni) is left
out with a warning.

coli/_engine/kernels.py picks one at import time from CPUID (coli/_engine/_cpu.pyx), so one
build runs at its best on every CPU; COLI_SIMD=<path> forces one (README.md, Building). A
coli/_engine/kernels.<suffix> left by a build from before these per-path modules would be
imported in place of kernels.py: build_ext deletes it (in the tree and the build directory).

Environment switches:
  COLI_NATIVE=1        one module instead, compiled with -march=native (the fastest code for
                       this very CPU, which may crash on another one); its path is "native"
  COLI_SIMD_TARGETS    comma-separated subset of the paths above to build (quicker builds
                       while working on the kernels); scalar is always built
  COLI_CYTHON_DEBUG=1  bounds and wraparound checks on, -O0 -g (slow; for debugging kernels)
  COLI_OPENMP=0        build without OpenMP even when the compiler has it

OpenMP: -fopenmp is tried first, then Apple clang's `-Xpreprocessor -fopenmp -lomp` (libomp
from Homebrew: `brew install libomp`, with its include and lib directories in CPPFLAGS and
LDFLAGS); when neither compiles, the kernels are built single-threaded (prange runs as a
plain loop) and a warning says so.
"""
import glob
import os
import platform
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

debug = os.environ.get("COLI_CYTHON_DEBUG") == "1"
native = os.environ.get("COLI_NATIVE") == "1"
x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
arm64 = platform.machine().lower() in ("aarch64", "arm64")

_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
TARGETS = {  # path -> compiler flags; best first
    "avx512vnni": _AVX512 + ["-mavx512vnni"],
    "avx512": _AVX512,
    "avx2vnni": _AVX2 + ["-mavxvnni"],
    "avx2": _AVX2,
    "scalar": [],
}
ARM_TARGETS = {  # the same for 64-bit ARM (tests/test_neon_qemu.py builds these for qemu)
    "neoni8mm": ["-march=armv8.2-a+dotprod+i8mm"],
    "neondot": ["-march=armv8.2-a+dotprod"],
    "neon": ["-march=armv8-a"],
    "scalar": ["-DCOLI_NO_NEON"],
}
if native:
    targets = {"native": ["-march=native"] if x86 else ["-mcpu=native"]}
elif x86 or arm64:
    table = TARGETS if x86 else ARM_TARGETS
    wanted = os.environ.get("COLI_SIMD_TARGETS")
    names = [t.strip() for t in wanted.split(",") if t.strip()] if wanted else list(table)
    unknown = [t for t in names if t not in table]
    if unknown:
        sys.exit(f"COLI_SIMD_TARGETS: unknown path {', '.join(unknown)}; choose from {', '.join(table)}")
    targets = {t: table[t] for t in table if t in names or t == "scalar"}
else:
    targets = {"scalar": []}

# -ffp-contract=off: no implicit fused multiply-adds (GCC already has none under -std=c11; clang
# would fuse the plain-C tiles' a + b * c and differ from GCC builds in the last bit)
base_args = ["-O0" if debug else "-O3", "-std=c11", "-ffp-contract=off"] + (["-g"] if debug else [])

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "nonecheck": False,
}

_OMP_PROBE = """#include <omp.h>
int main(void) { int n = 0;
#pragma omp parallel reduction(+:n)
n += 1;
return n > 0 && omp_pause_resource_all(omp_pause_soft) == 0 ? 0 : 1; }
"""


def _openmp_flags(compiler):
    """(compile args, link args) that give OpenMP with this compiler, or None."""
    if os.environ.get("COLI_OPENMP") == "0":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp_probe.c")
        with open(src, "w") as f:
            f.write(_OMP_PROBE)
        for cflags, lflags in ((["-fopenmp"], ["-fopenmp"]), (["-Xpreprocessor", "-fopenmp"], ["-lomp"])):
            try:
                objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
                compiler.link_executable(objs, "omp_probe", output_dir=tmp, extra_postargs=lflags)
                return cflags, lflags
            except Exception:  # CompileError, LinkError: try the next spelling
                continue
    return None


_ARM_PROBE = """#include <arm_neon.h>
int main(void) { int32x4_t a = vdupq_n_s32(0); int8x16_t b = vdupq_n_s8(1);
#if defined(__ARM_FEATURE_MATMUL_INT8)
a = vmmlaq_s32(a, b, b);
#endif
#if defined(__ARM_FEATURE_DOTPROD)
a = vdotq_s32(a, b, b);
#endif
return vgetq_lane_s32(a, 0) == 12345; }
"""


_VNNI_PROBE = """#include <immintrin.h>
int main(void) { __m256i a = _mm256_setzero_si256();
a = _mm256_dpbusd_avx_epi32(a, a, a);
return _mm256_extract_epi32(_mm256_dpwssd_avx_epi32(a, a, a), 0) == 12345; }
"""


def _flags_work(compiler, flags, probe=_ARM_PROBE):
    """Whether this compiler builds the probe (NEON and the sdot / smmla the flags promise, or
    x86's AVX-VNNI) with flags."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(probe)
        try:
            compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            return True
        except Exception:  # CompileError
            return False


def _remove_stale_kernels(*package_dirs):
    """Deletes the compiled coli/_engine/kernels.<suffix> of builds from before run-time
    dispatch, in the source tree and in the build directory: Python would import it in place
    of kernels.py (coli/_engine/__init__.py warns when it finds one)."""
    for d in package_dirs:
        for pattern in ("kernels.so", "kernels.*.so", "kernels.pyd", "kernels.*.pyd"):  # any Python's
            for old in glob.glob(os.path.join(d, "coli", "_engine", pattern)):
                print(f"coli: removing {old}, a kernels module of an old build that shadows kernels.py")
                os.remove(old)


class BuildExt(build_ext):
    """Removes stale kernels modules, adds OpenMP flags when the compiler has OpenMP (see the
    module docstring)."""

    def run(self):
        _remove_stale_kernels(".", self.build_lib)  # setup.py runs from its directory (the paths below)
        super().run()

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # the per-path modules compile side by side
            self.parallel = min(4, os.cpu_count() or 1)

    def build_extensions(self):
        if arm64 and not native:  # a compiler too old for a path's -march leaves it out
            keep = []
            for ext in self.extensions:
                path = ext.name.rsplit("_kernels_", 1)[-1]
                if path in ARM_TARGETS and path != "scalar" and not _flags_work(self.compiler, ARM_TARGETS[path]):
                    self.warn(f"coli: this compiler does not take {' '.join(ARM_TARGETS[path])}; "
                              f"the {path} kernels are not built")
                    continue
                keep.append(ext)
            self.extensions = keep
        if x86 and not native and any(e.name.endswith("_kernels_avx2vnni") for e in self.extensions):
            if not _flags_work(self.compiler, TARGETS["avx2vnni"], _VNNI_PROBE):  # GCC < 11, clang < 12
                self.warn("coli: this compiler does not take -mavxvnni; the avx2vnni kernels are not built")
                self.extensions = [e for e in self.extensions if not e.name.endswith("_kernels_avx2vnni")]
        omp = _openmp_flags(self.compiler)
        if omp is None:
            self.warn("coli: no OpenMP with this compiler; the kernels are built single-threaded "
                      "(on macOS: brew install libomp, see README.md, Building)")
        for ext in self.extensions:
            if omp is not None and ext.name.startswith("coli._engine._kernels_"):
                ext.extra_compile_args = list(ext.extra_compile_args) + omp[0]
                ext.extra_link_args = list(ext.extra_link_args) + omp[1]
        super().build_extensions()


def _kernels(path, flags):
    return Extension(
        f"coli._engine._kernels_{path}",
        [f"coli/_engine/_kernels_{path}.pyx"],
        include_dirs=[np.get_include(), "coli/_engine"],
        depends=sorted(glob.glob("coli/_engine/*.h")),  # simd_q_neon.h etc. are included from C
        extra_compile_args=base_args + flags,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), ("COLI_SIMD_PATH", f'"{path}"')],
    )


# Each path's module is a one-line stub that includes kernels.pyx (Cython names a module
# after its file); they are written here, next to kernels.pyx, and are not tracked.
for _path in targets:
    _stub = f"coli/_engine/_kernels_{_path}.pyx"
    _text = f'# generated by setup.py: the kernels for the {_path} path\ninclude "kernels.pyx"\n'
    if not os.path.exists(_stub) or open(_stub).read() != _text:
        with open(_stub, "w") as _f:
            _f.write(_text)

extensions = [_kernels(p, f) for p, f in targets.items()]
extensions.append(Extension("coli._engine._cpu", ["coli/_engine/_cpu.pyx"], include_dirs=["coli/_engine"],
                            depends=["coli/_engine/cpu_arm.h"], extra_compile_args=base_args))
# prompt lookup's index (coli.speculate): per-step bookkeeping of speculative decoding, in C
extensions.append(Extension("coli.speculate._lookup", ["coli/speculate/_lookup.pyx"], extra_compile_args=base_args))

setup(ext_modules=cythonize(extensions, compiler_directives=directives, nthreads=min(4, os.cpu_count() or 1)),
      cmdclass={"build_ext": BuildExt})
