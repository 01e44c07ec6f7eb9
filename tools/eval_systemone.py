#!/usr/bin/env python3
"""Accuracy and calibration of /v1/systemone answers on a labelled WordNet set.

The built-in model was trained on WordNet (tools/train_default_model.py), holding out 5%
of synsets. This builds typed questions from the *held-out* synsets only (seeded, so the
set is the same every run) and answers each through coli.server.systemone.evaluate:

- noul:   "Is 'W' a kind of H?" — H W's hypernym (yes) or another noun's hypernym (no);
- choice: "Which word is a synonym for 'W'?" — W's synset-mate among 4 random lemmas;
- score:  "How common is the word 'W'?" — rare / uncommon / common / very common, the
          gold level from W's SemCor tag count (cntlist.rev: 0, 1–4, 5–49, 50+).

Reports accuracy per type (and chance), expected calibration error (10 equal-width bins
of the predicted outcome's probability) and a reliability table.

    apt-get install wordnet-base
    python tools/eval_systemone.py [--model DIR] [--per-type 80] [--threads 2] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_default_model import SEED, is_heldout, load_usage, load_wordnet  # noqa: E402

LEVELS = ["rare", "uncommon", "common", "very common"]


def level_of(count: int) -> int:
    return 0 if count == 0 else 1 if count < 5 else 2 if count < 50 else 3


def build(per_type: int):
    synsets, _ = load_wordnet()
    by_pos, _ = load_usage()
    rng = random.Random(SEED + 19)
    single = lambda w: w.isalpha() and " " not in w  # noqa: E731
    held = sorted(k for k in synsets if is_heldout(k))
    rng.shuffle(held)
    nouns = [k for k in synsets if k[0] == "n" and synsets[k]["hyper"]]
    lemmas = sorted({w for s in synsets.values() for w in s["words"] if single(w)})
    items = []
    noul = choice = score = 0
    for key in held:
        s = synsets[key]
        words = [w for w in s["words"] if single(w)]
        if not words:
            continue
        w = words[0]
        if noul < per_type and key[0] == "n" and s["hyper"] and s["hyper"][0] in synsets:
            hyper = synsets[s["hyper"][0]]["words"][0]
            yes = noul % 2 == 0
            if not yes:
                other = synsets[rng.choice(nouns)]
                h2 = synsets.get(other["hyper"][0], {"words": [hyper]})["words"][0]
                if h2 == hyper:
                    continue
                hyper = h2
            items.append(("noul", w, {"type": "noul", "instructions": f"Is '{w}' a kind of {hyper}?"}, yes))
            noul += 1
        elif choice < per_type and len(words) >= 2:
            gold = words[1]
            options = {gold}
            while len(options) < 5:
                x = rng.choice(lemmas)
                if x not in s["words"]:
                    options.add(x)
            options = sorted(options)
            rng.shuffle(options)
            items.append(("choice", w, {"type": "choice", "instructions": f"Which word is a synonym for '{w}'?",
                                        "criteria": {o: None for o in options}}, gold))
            choice += 1
        elif score < per_type:
            count = sum(by_pos.get(w, {}).values())
            items.append(("score", w, {"type": "score", "instructions": f"How common is the word '{w}'?",
                                       "criteria": LEVELS}, level_of(count)))
            score += 1
        if min(noul, choice, score) >= per_type:
            break
    return items


def outcome(kind: str, a: dict, gold):
    """(correct, the predicted outcome's probability)."""
    if kind == "noul":
        yes = a["noul"] >= 0.5
        return yes == gold, max(a["noul"], 1 - a["noul"])
    p = a["probabilities"]
    best = max(p, key=p.get)
    return (best == gold if kind == "choice" else int(best) == gold), p[best]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--per-type", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import coli
    from coli.runner import Runner
    from coli.server import Server, ServerConfig
    from coli.server.systemone import evaluate

    items = build(args.per_type)
    model = coli.load(args.model, threads=args.threads)
    runner = Runner(model, kv_slots=1, persist=False, notice=lambda t: None)
    server = Server(model, runner, ServerConfig())
    results = []
    try:
        for kind, w, q, gold in items:
            reply, _ = asyncio.run(evaluate(server, {"state": f"The word '{w}'.", "questions": {"q": q}}))
            ok, conf = outcome(kind, reply["answers"]["q"], gold)
            results.append((kind, ok, conf))
    finally:
        runner.close()
    chance = {"noul": 0.5, "choice": 0.2, "score": None}
    golds = [g for k, _, _, g in items if k == "score"]
    chance["score"] = max(golds.count(i) for i in range(len(LEVELS))) / len(golds) if golds else None
    report = {"model": str(model.path), "questions": len(results), "per_type": {}, "bins": []}
    for kind in ("noul", "choice", "score"):
        rs = [r for r in results if r[0] == kind]
        report["per_type"][kind] = {"n": len(rs), "accuracy": sum(r[1] for r in rs) / len(rs),
                                    "chance": chance[kind], "ece": ece(rs)[0]}
    report["ece"], report["bins"] = ece(results)
    report["accuracy"] = sum(r[1] for r in results) / len(results)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"model {report['model']}: {report['questions']} questions, accuracy {report['accuracy']:.3f}, "
          f"ECE {report['ece']:.3f}\n")
    print("| type | n | accuracy | chance (majority) | ECE |\n|---|---|---|---|---|")
    for kind, r in report["per_type"].items():
        print(f"| {kind} | {r['n']} | {r['accuracy']:.3f} | {r['chance']:.3f} | {r['ece']:.3f} |")
    print("\n| confidence bin | n | mean confidence | accuracy |\n|---|---|---|---|")
    for b in report["bins"]:
        if b["n"]:
            print(f"| {b['lo']:.1f}–{b['hi']:.1f} | {b['n']} | {b['confidence']:.3f} | {b['accuracy']:.3f} |")


def ece(results, bins: int = 10):
    """Expected calibration error over equal-width bins of the predicted outcome's probability."""
    table, total = [], 0.0
    for i in range(bins):
        lo, hi = i / bins, (i + 1) / bins
        rs = [r for r in results if lo <= r[2] < hi or (i == bins - 1 and r[2] == 1.0)]
        conf = sum(r[2] for r in rs) / len(rs) if rs else 0.0
        acc = sum(r[1] for r in rs) / len(rs) if rs else 0.0
        total += len(rs) / max(1, len(results)) * abs(acc - conf)
        table.append({"lo": lo, "hi": hi, "n": len(rs), "confidence": conf, "accuracy": acc})
    return total, table


if __name__ == "__main__":
    main()
