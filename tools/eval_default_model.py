#!/usr/bin/env python3
"""Evaluate colibri's built-in default model on held-out WordNet synsets.

    python tools/eval_default_model.py [--model coli/default_model] [--overlap-n 200]

Rebuilds the exact held-out split used by tools/train_default_model.py (seeded hash of
synset pos+offset, 5%), then prints:
  * held-out loss / perplexity on assistant tokens of 2000 held-out exchanges,
  * overlap: share of 200 held-out "What does 'X' mean?" questions whose greedy answer's
    first 5 content words (non-stopwords) share at least one word with the true gloss,
  * how many of those greedy answers stopped at <|im_end|>,
  * common words: for a fixed list of 30 everyday words (COMMON_WORDS), whether the greedy
    answer to "What does '<w>' mean?" overlaps (first 5 content words) / starts with the
    gloss of the word's most frequent sense (cntlist.rev usage counts),
  * a few sample greedy answers.
Needs /usr/share/wordnet (apt-get install wordnet-base).
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_default_model import evaluate_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "coli" / "default_model"))
    ap.add_argument("--overlap-n", type=int, default=200)
    ap.add_argument("--common-only", action="store_true", help="only the common-word check (fast)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    metrics = evaluate_dir(Path(args.model), n_overlap=args.overlap_n, common_only=args.common_only)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
