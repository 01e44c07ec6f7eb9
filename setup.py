"""Only builds the Cython engine; all metadata lives in pyproject.toml.

Environment switches:
  COLI_PORTABLE=1      build without -march=native (a binary that runs on any x86-64)
  COLI_CYTHON_DEBUG=1  bounds and wraparound checks on, -O0 -g (slow; for debugging kernels)
"""
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("COLI_CYTHON_DEBUG") == "1"
portable = os.environ.get("COLI_PORTABLE") == "1"

compile_args = ["-fopenmp", "-O0" if debug else "-O3", "-std=c11"]
if debug:
    compile_args.append("-g")
if not portable and sys.platform != "darwin":
    compile_args.append("-march=native")
link_args = ["-fopenmp"]

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "nonecheck": False,
}

extensions = [
    Extension(
        "coli._engine.kernels",
        ["coli/_engine/kernels.pyx"],
        include_dirs=[np.get_include(), "coli/_engine"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
