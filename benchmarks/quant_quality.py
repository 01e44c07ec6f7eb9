"""How far each weight format moves a model from its f32 self.

    python benchmarks/quant_quality.py [--model DIR | --synthetic olmoe-mini] [--prompts 8] [--tokens 32]
    python benchmarks/quant_quality.py --model DIR --text FILE [--positions 1172] [--formats int8,int4,int4s]
    python benchmarks/quant_quality.py --split-corpus DIR   # calibration.jsonl / eval.jsonl, disjoint
    python benchmarks/quant_quality.py [--text DIR/eval.jsonl] --calibration DIR/calibration.jsonl

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

A --text FILE ending in .jsonl is one sequence per line ({"text": ...}), up to --positions
tokens in all. With --calibration FILE (or "default", the coli atlas corpus), each int4
format also gets a "+cal" row: the model converted with `coli convert --calibration FILE`
(GPTQ against the calibration statistics, docs/QUANTIZATION.md) into a temporary directory.
--split-corpus DIR writes the atlas corpus as two disjoint files: calibration.jsonl (its
even lines, less every line that names a word of the 8 prompts below) and eval.jsonl (its
odd lines), so that calibration never sees the text it is judged on.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

import coli
from coli.api import resolve_model_path
from coli import synthetic


def _softmax_log(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


PROMPTS = ["What does 'ocean' mean?", "Give a synonym for 'big'.", "What is a kind of 'tree'?",
           "What does 'harbor' mean?", "What is 'oak' a kind of?", "What does 'quick' mean?",
           "Give a synonym for 'happy'.", "What does 'mountain' mean?"]
PROMPT_WORDS = ("ocean", "big", "tree", "harbor", "oak", "quick", "happy", "mountain")


def split_corpus(out: Path) -> tuple[Path, Path]:
    """The atlas corpus as calibration.jsonl (even lines, none naming a prompt word) and
    eval.jsonl (odd lines) under ``out``."""
    from coli import calibration

    lines = calibration.default_texts()
    out.mkdir(parents=True, exist_ok=True)
    cal = [t for i, t in enumerate(lines) if i % 2 == 0 and not any(w in t.lower() for w in PROMPT_WORDS)]
    ev = [t for i, t in enumerate(lines) if i % 2 == 1]
    for name, texts in (("calibration.jsonl", cal), ("eval.jsonl", ev)):
        (out / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return out / "calibration.jsonl", out / "eval.jsonl"


class _Calibrated:
    """``load(fmt, head)``: coli.load of the model converted with calibration into a
    temporary directory (one per format pair), for the "+cal" rows."""

    def __init__(self, path, texts, threads):
        self.path, self.texts, self.threads = path, texts, threads
        self.tmp = Path(tempfile.mkdtemp(prefix="coli-quant-quality-"))
        self.stats = None

    def load(self, fmt, head):
        import time

        from coli.calibration import collect
        from coli.weights.convert import convert

        if self.stats is None:  # once for every format pair
            t0 = time.perf_counter()
            self.stats = collect(self.path, self.texts, threads=self.threads)
            print(f"calibration: {len(self.texts)} texts in {time.perf_counter() - t0:.0f} s", flush=True)
        out = convert(self.path, self.tmp / f"{fmt}-{head or 'default'}", fmt, head_quant=head, calibration=self.stats)
        return coli.load(out, threads=self.threads)

    def close(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def greedy(model, ids, n):
    eng = model.engine
    cache = eng.new_cache()
    logits = eng.step([(cache, ids)])
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits[0])))
        logits = eng.step([(cache, out[-1:])])
    return out


def measure(path, prompts, tokens, formats, head_quant=None, calibrated=None):
    ref = coli.load(path, quant="f32")
    refs = [ref.forward(p) for p in prompts]
    ref_greedy = [greedy(ref, p, tokens) for p in prompts]
    rows = []
    for fmt in formats:
        cal = fmt.endswith("+cal")
        fmt = fmt.removesuffix("+cal")
        m = calibrated.load(fmt, head_quant) if cal else coli.load(path, quant=fmt, head_quant=head_quant)
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
        rows.append({"format": fmt + ("+cal" if cal else ""), "head": m.weights.head_quant,
                     "rel_logit_error": (num / den) ** 0.5,
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


def _forward(model_or_fn, seqs):
    """Logits of each sequence, concatenated: (sum of lengths, vocab)."""
    f = model_or_fn.forward if hasattr(model_or_fn, "forward") else model_or_fn
    return np.concatenate([f(s) for s in seqs])


def _row_seqs(engine, fmt, head, refs, logits, seqs, bits):
    """_row over several sequences: every position but each sequence's last."""
    keep = np.concatenate([np.arange(len(s) - 1) + o for s, o in zip(seqs, np.cumsum([0] + [len(s) for s in seqs]))])
    nxt = np.concatenate([s[1:] for s in seqs]).astype(np.int64)
    ref = refs[keep]
    q = _softmax_log(logits)[keep]
    return {"engine": engine, "format": fmt, "head": head, "bits_per_weight": bits,
            "mean_kl": float((np.exp(ref) * (ref - q)).sum(-1).mean()),
            "top1_agreement": float((q.argmax(-1) == ref.argmax(-1)).mean()),
            "perplexity": float(np.exp(-q[np.arange(len(nxt)), nxt].mean()))}


def measure_text(path, ids, formats, llama_src=None, llama_types=(), workdir=None, threads=2, calibrated=None):
    """KL(f32 || q), top-1 agreement, perplexity and bits per weight over one text (``ids``:
    a list of token ids, or a list of such sequences), per (format, head) pair of coli and
    per llama.cpp type; a format ending in "+cal" loads through ``calibrated``."""
    seqs = ids if ids and isinstance(ids[0], list) else [ids]
    f32 = coli.load(path, quant="f32", threads=threads)
    ref_bits = _bits(f32)
    logits = _forward(f32, seqs)
    f32.close()
    ref = _softmax_log(logits)
    rows = [_row_seqs("coli", "f32", "f32", ref, logits, seqs, 32.0)]
    for spec in formats:
        fmt, _, head = spec.partition("/")
        cal = fmt.endswith("+cal")
        fmt = fmt.removesuffix("+cal")
        m = calibrated.load(fmt, head or None) if cal else coli.load(path, quant=fmt, head_quant=head or None,
                                                                      threads=threads)
        rows.append(_row_seqs("coli", fmt + ("+cal" if cal else ""), m.weights.head_quant, ref, _forward(m, seqs), seqs,
                              32.0 * _bits(m) / ref_bits))
        m.close()
    if llama_src:
        if len(seqs) != 1:
            raise SystemExit("--llama-gguf takes one text, not a .jsonl of several")
        ids, nxt = seqs[0], np.asarray(seqs[0][1:])
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


def synthetic_path(name):
    path = synthetic.cache_dir() / f"{name}-hf-s0"
    if not (path / "config.json").exists():
        synthetic.write_hf(name, path)
    return path


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
    ap.add_argument("--calibration", help="calibration text (.jsonl or plain; 'default': the atlas corpus): "
                                          "each int4 format also gets a +cal row (coli convert --calibration)")
    ap.add_argument("--split-corpus", metavar="DIR", help="write DIR/calibration.jsonl and DIR/eval.jsonl and exit")
    a = ap.parse_args()
    if a.split_corpus:
        for f in split_corpus(Path(a.split_corpus)):
            print(f"wrote {f}")
        return
    formats = [f for f in a.formats.split(",") if f]
    calibrated = None
    if a.calibration:
        from coli import calibration

        texts = calibration.default_texts() if a.calibration == "default" else calibration.read_texts(a.calibration)
        import atexit

        calibrated = _Calibrated(a.model or synthetic_path(a.synthetic) if a.synthetic else
                                 (a.model or resolve_model_path(None)), texts, a.threads)
        atexit.register(calibrated.close)
        formats += [f.replace("int4", "int4+cal", 1) for f in formats if f.partition("/")[0] == "int4"]
    if a.text:
        m = coli.load(a.model or resolve_model_path(None))
        if a.text.endswith(".jsonl"):
            from coli import calibration

            ids, left = [], a.positions
            for t in calibration.read_texts(a.text):
                s = m.tokenizer.encode(t)[:left]
                if len(s) > 1:
                    ids.append(s)
                    left -= len(s)
                if left < 2:
                    break
        else:
            ids = m.tokenizer.encode(open(a.text).read())[: a.positions]
        path = m.path
        m.close()
        rows = measure_text(path, ids, formats, a.llama_gguf,
                            [t for t in a.llama_types.split(",") if t], a.workdir, a.threads, calibrated)
        if a.json:
            print(json.dumps({"model": str(path), "positions": len(ids), "rows": rows}, indent=1))
            return
        n = sum(map(len, ids)) if ids and isinstance(ids[0], list) else len(ids)
        print(f"model {path}: {n} positions of {a.text}" + (f", calibration {a.calibration}" if a.calibration else ""))
        print("| engine | format | head / tensor types | bits / weight | KL(f32 ‖ q) | top-1 agreement | perplexity |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['format']} | {r['head']} | {r['bits_per_weight']:.2f} | {_kl(r['mean_kl'])} | "
                  f"{r['top1_agreement']:.1%} | {r['perplexity']:.2f} |")
        return
    if a.synthetic:
        path = synthetic_path(a.synthetic)
    else:
        path = a.model or resolve_model_path(None)
    m = coli.load(path)
    rng = np.random.default_rng(0)
    if a.model or not a.synthetic:  # real text for a real model
        texts = PROMPTS[: a.prompts]
        prompts = [m.prompt_ids(t) for t in texts]
    else:
        prompts = [rng.integers(2, m.config.vocab_size, a.prompt_tokens).tolist() for _ in range(a.prompts)]
    extra = ["int4+cal"] if calibrated else []
    rows = measure(path, prompts, a.tokens, ["bf16", "int8", "int4", "int4s"] + extra, calibrated=calibrated)
    rows += [dict(r, format=f"{r['format']} (head int4)")
             for r in measure(path, prompts, a.tokens, ["int4"] + extra, head_quant="int4", calibrated=calibrated)]
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
