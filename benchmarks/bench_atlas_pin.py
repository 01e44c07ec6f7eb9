"""Pinning the expert cache's hot set from the expert atlas (--pin auto) vs learned pinning.

    python benchmarks/bench_atlas_pin.py [--model DIR] [--budget-frac 0.6] [--threads 1]

On a converted (int4) copy of the model (default: the built-in one), experts stream
from disk under a RAM budget (--budget-frac of the experts' bytes; half of it pinned).
The workload is real text: the built-in model's kind of question ("What does 'x' mean?")
about words that are not in the atlas's corpus. Four configurations, each from the same
state:

- no pinning (pin 0);
- learned pinning: .coli_usage filled first by a warm-up over *other* questions of the
  same kind (the installation has seen this user's text before);
- atlas pinning (--pin auto) on a fresh installation (no .coli_usage): the hot set comes
  from the atlas, measured on coli's general corpus;
- both: the warm-up's .coli_usage plus the atlas.

Reported per configuration: expert hit rate, expert bytes read per token, decode tok/s.
Hit rate and bytes are deterministic; tok/s depends on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import coli
from coli import atlas as A
from coli.api import DEFAULT_MODEL_DIR
from coli.experts.usage import USAGE_FILE
from coli.weights.convert import convert

WORKLOAD = ["anchor", "basket", "candle", "desk", "engine", "feather", "glove", "hammer", "jacket", "kettle",
            "ladder", "mirror", "needle", "pencil", "pillow", "rabbit", "saddle", "ticket", "tunnel", "violin"]
WARMUP = ["apple", "button", "castle", "dragon", "eagle", "fountain", "garlic", "helmet", "island", "jungle",
          "lemon", "marble", "napkin", "oyster", "parrot", "quilt", "rocket", "spoon", "tiger", "wagon"]


def ask(model, words, max_tokens):
    for w in words:
        for _ in model.generate(f"What does '{w}' mean?", max_tokens=max_tokens):
            pass


def measure(conv: Path, label: str, words, a, **load) -> dict:
    m = coli.load(conv, threads=a.threads, **load)
    try:
        t0 = m.engine.totals
        base = (t0.tokens, t0.experts_needed, t0.experts_hit, t0.bytes_read)
        start = time.perf_counter()
        ask(m, words, a.max_tokens)
        wall = time.perf_counter() - start
        t = m.engine.totals
        tokens, needed, hit, read = (t.tokens - base[0], t.experts_needed - base[1], t.experts_hit - base[2],
                                     t.bytes_read - base[3])
        pinned = m.engine.resident_bytes()["pinned"]
    finally:
        m.close()
    return {"config": label, "hit_rate": round(hit / needed, 4) if needed else 1.0,
            "KB_read_per_token": round(read / tokens / 1e3, 2), "tokens": tokens, "tok_s": round(tokens / wall, 1),
            "pinned_KB": round(pinned / 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--budget-frac", type=float, default=0.6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="coli-atlas-pin-"))
    try:
        conv = convert(a.model, work / "int4", "int4", force=True)
        m = coli.load(conv, threads=a.threads)
        A.save(A.make(m, A.read_corpus()), conv / A.ATLAS_FILE)
        total = m.engine.weights.store.total_bytes
        m.close()
        usage = conv / USAGE_FILE
        usage.unlink(missing_ok=True)
        budget = int(total * a.budget_frac)
        rows = [measure(conv, "no pinning", WORKLOAD, a, ram_budget=budget, pin=0)]
        usage.unlink(missing_ok=True)
        rows.append(measure(conv, "atlas pinning (--pin auto), fresh install", WORKLOAD, a, ram_budget=budget,
                            pin="auto"))
        usage.unlink(missing_ok=True)
        measure(conv, "warm-up", WARMUP, a, ram_budget=budget, pin=0)  # fills .coli_usage
        learned = usage.read_bytes()
        rows.append(measure(conv, "learned pinning (.coli_usage)", WORKLOAD, a, ram_budget=budget))
        usage.write_bytes(learned)
        rows.append(measure(conv, "learned + atlas (--pin auto)", WORKLOAD, a, ram_budget=budget, pin="auto"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"model": a.model, "experts_KB": round(total / 1e3, 1), "budget_KB": round(budget / 1e3, 1),
           "threads": a.threads, "rows": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{a.model}: experts {out['experts_KB']} KB, budget {out['budget_KB']} KB (half pinned), "
          f"{len(WORKLOAD)} questions, {a.threads} thread(s)")
    print(f"{'config':44} {'hit rate':>9} {'KB read/tok':>12} {'tok/s':>7} {'pinned KB':>10}")
    for r in rows:
        print(f"{r['config']:44} {r['hit_rate']:9.1%} {r['KB_read_per_token']:12.2f} {r['tok_s']:7.1f} "
              f"{r['pinned_KB']:10.1f}")


if __name__ == "__main__":
    main()
