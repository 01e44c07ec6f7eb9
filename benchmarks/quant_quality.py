"""How far each weight format moves a model from its f32 self.

    python benchmarks/quant_quality.py [--model DIR | --synthetic olmoe-mini] [--prompts 8] [--tokens 32]
    python benchmarks/quant_quality.py --model DIR --text FILE [--positions 1172] [--formats int8,int4,int4s]

For each format: the relative logit error ||q - f|| / ||f|| over all positions of the
prompts, the mean KL divergence KL(f || q) of the next-token distributions, how often
the top-1 token agrees, and how many greedy tokens agree before the first divergence
(continuing from the same prompts, --tokens steps).

With --text: one forward pass over the first --positions tokens of FILE per format, and
per format the mean KL(f32 || q) over every position, the top-1 agreement with f32, the
perplexity of the text and the bits per weight (the table of docs/QUANTIZATION.md).

With --text and --llama-gguf SRC (a GGUF of the same model; --model must be its f32 HF
directory, e.g. from benchmarks/hf_from_gguf.py SRC): llama.cpp's formats side by side.
SRC is dequantized to an F32 GGUF (the same float weights coli reads), quantized with
llama.cpp's own quantizer to each of --llama-types, and run over the same token ids
(llama-cpp-python must be importable, e.g. PYTHONPATH=/work/llama/site-native); KL is
always against coli's f32 logits, and the llama.cpp F32 row shows how far the two engines'
f32 logits are apart to begin with (benchmarks/llamacpp_quality.py).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import coli
from coli.api import resolve_model_path
from coli import synthetic


def _softmax_log(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def greedy(model, ids, n):
    eng = model.engine
    cache = eng.new_cache()
    logits = eng.step([(cache, ids)])
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits[0])))
        logits = eng.step([(cache, out[-1:])])
    return out


def measure(path, prompts, tokens, formats, head_quant=None):
    ref = coli.load(path, quant="f32")
    refs = [ref.forward(p) for p in prompts]
    ref_greedy = [greedy(ref, p, tokens) for p in prompts]
    rows = []
    for fmt in formats:
        m = coli.load(path, quant=fmt, head_quant=head_quant)
        num = den = kl = top1 = n = agree = 0.0
        for p, r, rg in zip(prompts, refs, ref_greedy):
            q = m.forward(p)
            num += float(((q - r) ** 2).sum())
            den += float((r ** 2).sum())
            lr, lq = _softmax_log(r), _softmax_log(q)
            kl += float((np.exp(lr) * (lr - lq)).sum())
            top1 += float((q.argmax(-1) == r.argmax(-1)).sum())
            n += len(p)
            g = greedy(m, p, tokens)
            agree += next((i for i, (a, b) in enumerate(zip(g, rg)) if a != b), tokens)
        rows.append({"format": fmt, "head": m.weights.head_quant, "rel_logit_error": (num / den) ** 0.5,
                     "mean_kl": kl / n, "top1_agreement": top1 / n,
                     "greedy_tokens_before_divergence": agree / len(prompts)})
    return rows


def _kl(v: float) -> str:
    return f"{v:.4f}" if v >= 1e-4 or v == 0 else f"{v:.1e}"


def _bits(model) -> float:
    """Bytes of the model's weights, experts included (norms and routers, f32 in every
    format, are a rounding error here); against the f32 model's: bits per weight."""
    return float(sum(model.engine.resident_bytes().values()))


def _row(engine, fmt, head, ref, q, nxt, bits):
    q = _softmax_log(q)
    return {"engine": engine, "format": fmt, "head": head, "bits_per_weight": bits,
            "mean_kl": float((np.exp(ref[:-1]) * (ref[:-1] - q[:-1])).sum(-1).mean()),
            "top1_agreement": float((q.argmax(-1) == ref.argmax(-1)).mean()),
            "perplexity": float(np.exp(-q[np.arange(len(nxt)), nxt].mean()))}


def measure_text(path, ids, formats, llama_src=None, llama_types=(), workdir=None, threads=2):
    """KL(f32 || q), top-1 agreement, perplexity and bits per weight over one text, per
    (format, head) pair of coli and per llama.cpp type."""
    f32 = coli.load(path, quant="f32", threads=threads)
    ref_bits = _bits(f32)
    logits = f32.forward(ids)
    f32.close()
    nxt = np.asarray(ids[1:])
    ref = _softmax_log(logits)
    rows = [_row("coli", "f32", "f32", ref, logits, nxt, 32.0)]
    for spec in formats:
        fmt, _, head = spec.partition("/")
        m = coli.load(path, quant=fmt, head_quant=head or None, threads=threads)
        rows.append(_row("coli", fmt, m.weights.head_quant, ref, m.forward(ids), nxt, 32.0 * _bits(m) / ref_bits))
        m.close()
    if llama_src:
        import llamacpp_quality as L
        from pathlib import Path

        work = Path(workdir or Path(llama_src).parent)
        work.mkdir(parents=True, exist_ok=True)
        f32g = work / (Path(llama_src).stem + ".f32.gguf")
        if not f32g.exists():
            L.f32_gguf(llama_src, f32g)
        for kind in ("f32",) + tuple(llama_types):
            g = f32g if kind == "f32" else work / (Path(llama_src).stem + f".{kind}.gguf")
            if not g.exists():
                L.quantize(f32g, g, kind, threads)
            bits, kinds = L.bits_per_weight(g)
            types = "+".join(f"{k}x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
            rows.append(_row("llama.cpp", kind.upper(), types, ref, L.logits(g, ids, threads), nxt, bits))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--synthetic")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--text", help="measure KL / top-1 / perplexity over this text file")
    ap.add_argument("--positions", type=int, default=1172)
    ap.add_argument("--formats", default="int8,int4,int4s",
                    help="comma-separated formats, each optionally /HEAD (e.g. int4/int4)")
    ap.add_argument("--llama-gguf", help="with --text: a GGUF of the model, to run llama.cpp's formats side by side")
    ap.add_argument("--llama-types", default="q8_0,q4_0,q4_1,q5_0,q4_k_m",
                    help="llama.cpp types to quantize --llama-gguf's f32 weights to")
    ap.add_argument("--workdir", help="where the GGUFs for llama.cpp go (default: beside --llama-gguf)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.text:
        m = coli.load(a.model or resolve_model_path(None))
        ids = m.tokenizer.encode(open(a.text).read())[: a.positions]
        path = m.path
        m.close()
        rows = measure_text(path, ids, [f for f in a.formats.split(",") if f], a.llama_gguf,
                            [t for t in a.llama_types.split(",") if t], a.workdir, a.threads)
        if a.json:
            print(json.dumps({"model": str(path), "positions": len(ids), "rows": rows}, indent=1))
            return
        print(f"model {path}: {len(ids)} positions of {a.text}")
        print("| engine | format | head / tensor types | bits / weight | KL(f32 ‖ q) | top-1 agreement | perplexity |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['format']} | {r['head']} | {r['bits_per_weight']:.2f} | {_kl(r['mean_kl'])} | "
                  f"{r['top1_agreement']:.1%} | {r['perplexity']:.2f} |")
        return
    if a.synthetic:
        path = synthetic.cache_dir() / f"{a.synthetic}-hf-s0"
        if not (path / "config.json").exists():
            synthetic.write_hf(a.synthetic, path)
    else:
        path = a.model or resolve_model_path(None)
    m = coli.load(path)
    rng = np.random.default_rng(0)
    if a.model or not a.synthetic:  # real text for a real model
        texts = ["What does 'ocean' mean?", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
                 "What does 'harbor' mean?", "What is 'oak' a kind of?", "What does 'quick' mean?",
                 "Give a synonym for 'happy'.", "What does 'mountain' mean?"][: a.prompts]
        prompts = [m.prompt_ids(t) for t in texts]
    else:
        prompts = [rng.integers(2, m.config.vocab_size, a.prompt_tokens).tolist() for _ in range(a.prompts)]
    rows = measure(path, prompts, a.tokens, ["bf16", "int8", "int4", "int4s"])
    rows += [dict(r, format="int4 (head int4)") for r in measure(path, prompts, a.tokens, ["int4"], head_quant="int4")]
    if a.json:
        print(json.dumps({"model": str(path), "rows": rows}, indent=1))
        return
    print(f"model {path}: {len(prompts)} prompts, greedy continuation of {a.tokens} tokens")
    print("| format | head | relative logit error | mean KL(f32 ‖ q) | top-1 agreement | greedy tokens equal before divergence |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['head']} | {r['rel_logit_error']:.2%} | {r['mean_kl']:.4f} | "
              f"{r['top1_agreement']:.1%} | {r['greedy_tokens_before_divergence']:.1f} / {a.tokens} |")


if __name__ == "__main__":
    main()
