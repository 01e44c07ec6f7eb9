"""`coli bench --constrained`: decode speed under a JSON schema vs unconstrained.

Three runs of the same ``batch`` requests (same prompts, seeds and lengths) through a
Runner: unconstrained (end of turn banned, as many tokens as the constrained answers
had), constrained with forced tokens fed one per step, and constrained with forced
tokens folded into multi-token steps (the default). Reported: decode tok/s of each,
the mask time per constrained token (computed on a worker thread while the engine runs
the step, so mostly hidden), the share of tokens the grammar forced, and the engine
steps saved by folding.

A synthetic model's word-level tokenizer cannot write JSON: ``text_tokenizer_dir`` gives
it a byte-level BPE tokenizer (a few thousand tokens, so masks are cheaper than with a
real 50k-150k vocabulary; the model's vocabulary past it is never allowed).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from coli.grammar.constraint import Constraint
from coli.sampling import SamplingParams

# nested objects, enums, arrays, bounded strings and numbers: an order as an API would want it
REALISTIC = {
    "type": "object", "additionalProperties": False,
    "required": ["order_id", "status", "customer", "items", "shipping", "notes"],
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email", "tier"],
                     "properties": {"name": {"type": "string", "maxLength": 24},
                                    "email": {"type": "string", "pattern": "^[a-z]{3,10}@[a-z]{3,8}\\.(com|org)$"},
                                    "tier": {"enum": ["free", "pro", "enterprise"]}}},
        "items": {"type": "array", "minItems": 3, "maxItems": 5, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "quantity", "unit_price", "category"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                           "unit_price": {"type": "number", "minimum": 0, "maximum": 1000},
                           "category": {"enum": ["books", "electronics", "garden", "toys", "food"]}}}},
        "shipping": {"type": "object", "additionalProperties": False, "required": ["method", "address"],
                     "properties": {"method": {"enum": ["standard", "express", "pickup"]},
                                    "address": {"type": "object", "additionalProperties": False,
                                                "required": ["street", "city", "country"],
                                                "properties": {"street": {"type": "string", "maxLength": 30},
                                                               "city": {"type": "string", "maxLength": 16},
                                                               "country": {"enum": ["FR", "DE", "JP", "US"]}}}}},
        "notes": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 20}},
    },
}

CORPUS = [json.dumps({"order_id": "ORD-123456", "status": "shipped", "customer": {
    "name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"}, "items": [
    {"sku": "ABC-1234", "quantity": 2, "unit_price": 19.99, "category": "books"}],
    "shipping": {"method": "express", "address": {"street": "1 Main Street", "city": "Paris", "country": "FR"}},
    "notes": ["leave at the door"]}),
    "The quick brown fox jumps over the lazy dog. Orders ship within two days.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ -_.,:;@{}[]\"'"] * 8


def text_tokenizer_dir(path: Path) -> Path:
    """``path`` (a model directory) with a byte-level BPE tokenizer instead of its own,
    as a sibling directory of links (written once)."""
    path = Path(path)
    out = path.with_name(path.name + "-bpe")
    if (out / "tokenizer.json").exists():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and not (tmp / f.name).exists():
            os.symlink(f.resolve(), tmp / f.name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": "<|endoftext|>"}))
    (tmp / "generation_config.json").unlink(missing_ok=True)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id("<|endoftext|>")}))
    tmp.rename(out)
    return out


def run(model, *, schema: dict | None = None, batch: int = 1, gen_tokens: int = 400, repeats: int = 2,
        prompt_tokens: int = 64, seed: int = 0) -> dict:
    """The three runs (see the module docstring), medians over ``repeats``; a dict of numbers."""
    from coli.runner import Runner
    from coli.scheduler import Finished, Profile, Usage

    schema = schema or REALISTIC
    constraint = Constraint.json_schema(schema, param="--schema")
    tok = model.tokenizer
    words = "Write the order as JSON. " * prompt_tokens
    ids = tok.encode(words, add_special_tokens=False)[:prompt_tokens]
    eos_ban = {int(t): -100.0 for t in model.eos_ids}

    def one(fold: bool, constrained: bool, lengths: list[int] | None, r: int):
        runner = Runner(model, kv_slots=batch, ctx=prompt_tokens + gen_tokens + 8, persist=False,
                        notice=lambda t: None, fold_forced=fold)
        try:
            handles = []
            with runner.scheduler.paused():
                for b in range(batch):
                    kw = dict(constraint=constraint) if constrained else dict(logit_bias=eos_ban)
                    handles.append(runner.submit(ids + [b + 2 + r], max_tokens=lengths[b] if lengths else gen_tokens,
                                                 sampling=SamplingParams(temperature=1.0, seed=seed + 97 * (r + 1) + b),
                                                 **kw))
            steps0 = runner.steps
            t0 = time.perf_counter()
            tokens, decode_s, finish = [], [], []
            for h in handles:
                for ev in h:
                    if isinstance(ev, Profile):
                        decode_s.append(ev.decode_seconds)
                    elif isinstance(ev, Usage):
                        tokens.append(ev.completion_tokens)
                    elif isinstance(ev, Finished):
                        finish.append(ev.finish_reason)
            wall = time.perf_counter() - t0
            return dict(tokens=tokens, decode_tok_s=sum(tokens) / max(max(decode_s), 1e-9), wall_s=wall,
                        steps=runner.steps - steps0, stats=runner.grammar_stats, finish=finish)
        finally:
            runner.close()

    one(True, True, None, -1)  # warm-up (compiles the grammar, faults the weights in)
    rows = {"unconstrained": [], "constrained": [], "constrained_folded": []}
    for r in range(repeats):
        folded = one(True, True, None, r)
        rows["constrained_folded"].append(folded)
        rows["constrained"].append(one(False, True, None, r))
        rows["unconstrained"].append(one(True, False, folded["tokens"], r))
    out = {"batch": batch, "repeats": repeats, "prompt_tokens": len(ids), "schema": "realistic order"
           if schema is REALISTIC else "given"}
    for name, runs in rows.items():
        out[name] = {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
                     "steps": statistics.median(x["steps"] for x in runs),
                     "tokens": statistics.median(sum(x["tokens"]) for x in runs)}
    fin = [f for x in rows["constrained_folded"] for f in x["finish"]]
    s = [x["stats"] for x in rows["constrained_folded"]]
    picked = sum(x.sampled + x.forced for x in s)
    out.update(
        finished=f"{fin.count('stop')}/{len(fin)} answers complete (the rest hit --gen-tokens)",
        mask_us_per_token=1e6 * sum(x.mask_seconds for x in s) / max(sum(x.masks for x in s), 1),
        forced_share=sum(x.forced for x in s) / max(picked, 1),
        steps_saved=statistics.median(x["steps"] for x in rows["constrained"])
        - out["constrained_folded"]["steps"],
        cost_vs_unconstrained=1 - out["constrained"]["decode_tok_s"] / out["unconstrained"]["decode_tok_s"],
        folded_vs_unconstrained=out["constrained_folded"]["decode_tok_s"] / out["unconstrained"]["decode_tok_s"],
    )
    return out
