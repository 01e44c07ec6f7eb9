"""The error a second quantization adds to a GGUF: the logits benchmarks/gguf_load.py saved at
each format against f32 (max abs diff, mean KL, top-1 agreement).

    python benchmarks/gguf_requant_error.py
"""
import os

import numpy as np

OUT = os.environ.get("OUT", "/tmp/gguf_bench")


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ref = np.load(f"{OUT}/logits-f32.npy").astype(np.float64)
    for q in ("bf16", "int8", "int4", "default"):
        try:
            got = np.load(f"{OUT}/logits-{q}.npy").astype(np.float64)
        except OSError:
            continue
        p, lq = log_softmax(ref), log_softmax(got)
        kl = (np.exp(p) * (p - lq)).sum(-1).mean()
        top1 = (ref.argmax(-1) == got.argmax(-1)).mean()
        print(f"{q}: max|dlogit| {np.abs(got - ref).max():.3f}  mean KL {kl:.4f} nats  "
              f"top-1 agreement {top1:.1%} over {len(ref)} positions")


if __name__ == "__main__":
    main()
