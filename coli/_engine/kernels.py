"""The engine's kernels for this CPU, chosen once, at import.

setup.py compiles coli/_engine/kernels.pyx once per SIMD path into the modules
``coli._engine._kernels_<path>`` (avx512vnni, avx512, avx2vnni, avx2, scalar; or one ``native``
module with COLI_NATIVE=1). Importing ``coli._engine.kernels`` picks the best path that
both this CPU (CPUID, via coli._engine._cpu) and the build have, imports that module and
puts it in this module's place in ``sys.modules``: ``from coli._engine import kernels``
gets the compiled module itself, so nothing downstream changes and no call goes through
an extra layer. ``kernels.simd_name()`` says which path runs.

``COLI_SIMD=<path>`` forces a path (for tests and comparisons). A path this CPU cannot
run, or that this build lacks, is refused with SimdUnavailableError rather than crashing
on an illegal instruction later.
"""
import sys

from coli._engine import dispatch

sys.modules[__name__] = dispatch.load()
