"""The extra error of loading K-quant and IQ GGUF weights into coli's formats, measured on real
trained weights with ggml's own quantizers (docs/MODELS.md, BENCHMARKS.md).

    python benchmarks/gguf_kquant_error.py /path/to/libggml-base.so [MODEL_DIR]

coli reads these types by dequantizing them (gguf.quants) and quantizing the values to a coli
format (by default the closest: int8 for 5-6 bits, int4 for 4 bits and below). For every matrix
of MODEL_DIR (default: coli's built-in model, trained, bf16) this quantizes the weights W to
each type T with ggml's own ``ggml_quantize_chunk`` (llama.cpp's quantizer, called through
ctypes from a libggml-base build, e.g. the one llama-cpp-python builds), dequantizes them (the
GGUF's values G), quantizes G with coli, and prints relative RMS errors over all matrices:

    T's own error    |G - W| / |W|        (what the GGUF file already lost)
    coli's extra     |coli(G) - G| / |G|  (what loading into a coli format adds)
    total            |coli(G) - W| / |W|

K-quants need rows that are multiples of 256: each matrix is cut into rows of 768 values
(whole 32-groups of its own rows; the built-in model's rows are 192 or 384 long).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from coli.quant import dequantize, quantize
from coli.weights.gguf import closest_format
from coli.weights.safetensors import Checkpoint

TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"]
ROW = 768


def ggml_quantize(lib, qtype, w: np.ndarray) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    out = np.zeros((rows, cols // block * size), dtype=np.uint8)
    src = np.ascontiguousarray(w, dtype=np.float32)
    lib.ggml_quantize_init(int(qtype))
    n = lib.ggml_quantize_chunk(int(qtype), src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                0, rows, cols, None)
    assert n == out.nbytes, (n, out.nbytes)
    return out


def main() -> None:
    import gguf

    lib = ctypes.CDLL(sys.argv[1])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    model = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[1] / "coli" / "default_model"
    ck = Checkpoint(model)
    mats = [ck.f32(n) for n in ck.names() if len(ck.shape(n)) == 2 and ck.shape(n)[1] % 32 == 0]
    w = np.concatenate([m.reshape(-1) for m in mats])
    w = w[: len(w) // ROW * ROW].reshape(-1, ROW)
    print(f"{model.name}: {w.size / 1e6:.2f}M weights of {len(mats)} matrices, rows of {ROW}\n")
    print("| GGUF type | its own error | coli format | coli's extra error | total | extra with --quant int8 |")
    print("|---|---|---|---|---|---|")
    norm_w = np.linalg.norm(w)
    for name in TYPES:
        qt = getattr(gguf.GGMLQuantizationType, name)
        if lib.ggml_quantize_requires_imatrix(int(qt)):
            continue
        g = gguf.quants.dequantize(ggml_quantize(lib, qt, w), qt).astype(np.float32)
        own = np.linalg.norm(g - w) / norm_w
        fmt = closest_format(name)
        row = [f"{name}", f"{own:.2%}", fmt]
        c = dequantize(quantize(g, fmt))
        row += [f"{np.linalg.norm(c - g) / np.linalg.norm(g):.2%}", f"{np.linalg.norm(c - w) / norm_w:.2%}"]
        c8 = dequantize(quantize(g, "int8"))
        row.append(f"{np.linalg.norm(c8 - g) / np.linalg.norm(g):.2%}")
        print("| " + " | ".join(row) + " |", flush=True)
    for fmt in ("int8", "int4", "int4s"):  # coli's own formats straight from W, for scale
        c = dequantize(quantize(w, fmt))
        print(f"| (none: coli {fmt} from the bf16 weights) | - | {fmt} | - | {np.linalg.norm(c - w) / norm_w:.2%} | - |")


if __name__ == "__main__":
    main()
