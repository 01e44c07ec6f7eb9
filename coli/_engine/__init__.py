"""The engine's compiled kernels (kernels.pyx, one module per SIMD path, chosen at import by
kernels.py and dispatch.py) and their NumPy twins (reference.py).

A compiled ``kernels.<suffix>`` here (the single module of builds from before run-time
dispatch, left by an old in-place build) would be imported in place of kernels.py: no
choice of path, and whatever kernels that old build had. setup.py deletes such files when it
builds; if one is here all the same, importing the engine warns.
"""
import importlib.machinery
import os
import warnings


def stale_kernels(directory: str = os.path.dirname(os.path.abspath(__file__))) -> list[str]:
    """The compiled modules named ``kernels`` in ``directory``, which shadow kernels.py."""
    return sorted(p for p in (os.path.join(directory, "kernels" + s) for s in importlib.machinery.EXTENSION_SUFFIXES)
                  if os.path.exists(p))


for _stale in stale_kernels():
    warnings.warn(f"{_stale}: a kernels module left by an old build is imported in place of coli/_engine/kernels.py "
                  f"(no run-time choice of SIMD path); delete it, or rebuild (python setup.py build_ext --inplace, "
                  f"pip install -e .), which deletes it", RuntimeWarning, stacklevel=2)
