"""llama.cpp's side of benchmarks/quant_quality.py: the same weights in llama.cpp's own
formats, and its logits over the very token ids coli reads.

* ``f32_gguf(src, out)``: a GGUF with every tensor of ``src`` dequantized to F32
  (``gguf.quants.dequantize``; metadata and tokenizer copied), i.e. exactly the float
  weights that ``benchmarks/hf_from_gguf.py`` gives coli, so both engines start from one
  f32 model;
* ``quantize(f32, out, kind)``: llama.cpp's own quantizer (``llama_model_quantize``, with
  its per-tensor choices: e.g. Q4_0 keeps the tied embedding/output at Q8_0 when its
  rows are not a multiple of 256), kinds ``q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_m, q5_k_m``;
* ``logits(path, ids)``: llama.cpp's logits at every position of ``ids`` (fed as ids, so
  the tokens are identical to coli's by construction), f32 KV cache;
* ``bits_per_weight(path)``: the bits of the 2-D+ weight tensors per weight.

Needs ``pip install gguf`` and llama-cpp-python (``PYTHONPATH=/work/llama/site-native``
where it was built from source).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FTYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q4_k_m": 15, "q5_k_m": 17, "f32": 0}


def f32_gguf(src: str | Path, out: str | Path) -> Path:
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        val = 0 if f.name == "general.file_type" else f.contents()  # 0: all F32
        w.add_key_value(f.name, val, vt, sub_type=sub)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape([int(n) for n in reversed(t.shape)]), raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def quantize(f32: str | Path, out: str | Path, kind: str, threads: int = 2) -> Path:
    import ctypes

    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPES[kind]
    p.nthread = threads
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize {kind} failed")
    return Path(out)


def logits(path: str | Path, ids: list[int], threads: int = 2) -> np.ndarray:
    """(len(ids), vocab) float32 logits of llama.cpp at every position."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, n_gpu_layers=0, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def bits_per_weight(path: str | Path) -> tuple[float, dict]:
    """(bits per weight of the 2-D+ tensors, {type name: count of such tensors})."""
    import gguf

    r = gguf.GGUFReader(str(path))
    bits = n = 0
    kinds: dict[str, int] = {}
    for t in r.tensors:
        if len(t.shape) < 2:
            continue
        bits += int(t.n_bytes) * 8
        n += int(t.n_elements)
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    return bits / n, kinds
