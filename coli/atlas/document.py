"""``experts.json``: the atlas document, built from a Recorder (format in docs/ATLAS.md).

Where it lives (``atlas_path``): beside the model as ``experts.json`` when the model
directory is writable and is not the package's built-in model, else in
``$XDG_CACHE_HOME/coli/atlas/<fingerprint>/experts.json``. ``find_atlas`` looks in both
(and the built-in model ships its own). A file made for another model (its
fingerprint differs) is not used.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from coli.atlas import regions as R

ATLAS_FORMAT = "coli-atlas"
ATLAS_VERSION = 1
ATLAS_FILE = "experts.json"
TOP_TOKENS = 12
EXAMPLES = 4
PARTNERS = 4
CONTEXT_TOKENS = (10, 6)  # tokens shown left and right of an example's token


def cache_path(fingerprint: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "coli" / "atlas" / fingerprint / ATLAS_FILE


def atlas_path(model_dir: str | os.PathLike, fingerprint: str) -> Path:
    """Where ``coli atlas`` writes by default (see the module docstring)."""
    root = Path(model_dir).resolve()
    package = Path(__file__).resolve().parents[1]
    if os.access(root, os.W_OK) and package not in root.parents:
        return root / ATLAS_FILE
    return cache_path(fingerprint)


def find_atlas(model_dir: str | os.PathLike, fingerprint: str) -> tuple[dict | None, str]:
    """(the atlas of this model, or None, and a sentence saying where it was or was not)."""
    tried = []
    for path in (Path(model_dir) / ATLAS_FILE, cache_path(fingerprint)):
        if not path.is_file():
            tried.append(str(path))
            continue
        try:
            doc = load(path)
        except ValueError as e:
            tried.append(f"{path} ({e})")
            continue
        if doc["model"].get("fingerprint") != fingerprint:
            tried.append(f"{path} (made for another model)")
            continue
        return doc, str(path)
    return None, "no atlas in " + ", ".join(tried)


def load(path: str | os.PathLike) -> dict:
    """Read and check an experts.json; raises ValueError when it is not one we can read."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read it: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != ATLAS_FORMAT:
        raise ValueError(f"not a {ATLAS_FORMAT} document")
    if doc.get("version") != ATLAS_VERSION:
        raise ValueError(f"version {doc.get('version')!r}; this coli reads version {ATLAS_VERSION}")
    for key in ("model", "regions", "layers"):
        if key not in doc:
            raise ValueError(f"no {key!r}")
    return doc


def save(doc: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def build(rec, *, tokenizer, token_ids: list[list[int]], passages, model_info: dict, corpus_info: dict,
          n_regions: int = 10) -> dict:
    """The experts.json document of a finished Recorder."""
    L, E, k = rec.L, rec.E, rec.k
    piece = _Pieces(tokenizer)
    X = R.profiles(rec)
    used = rec.count.reshape(-1) > 0
    labels = np.full(L * E, -1, np.int64)
    k_regions = max(1, min(n_regions, int(used.sum()) // 2 or 1))
    if used.any():
        labels[used] = R.cluster(X[used], k_regions)
    # regions ordered by the routings they take, biggest first
    load_of = np.array([rec.count.reshape(-1)[labels == r].sum() for r in range(k_regions)])
    order = np.argsort(-load_of, kind="stable")
    rank = np.empty(k_regions, np.int64)
    rank[order] = np.arange(k_regions)
    labels[used] = rank[labels[used]]
    pos = R.layout(X[used], labels[used], k_regions) if used.any() else np.full((1, 2), 0.5)

    layers = []
    for l in range(L):
        experts = []
        for e in range(E):
            experts.append(_expert(rec, l, e, piece, token_ids, passages))
        layers.append({"layer": l, "decoder_layer": model_info["moe_layers"][l], "experts": experts})

    regs, slugs, names = [], set(), set()
    for r in range(k_regions):
        members = np.flatnonzero(labels == r)
        info = _region(rec, members, piece, names)
        slug = _unique(_slug(info["name"]) or f"region-{r}", slugs)
        regs.append({"id": slug, "index": r, **info, "x": round(float(pos[r, 0]), 4), "y": round(float(pos[r, 1]), 4)})
    for n, lab in enumerate(labels):
        layers[n // E]["experts"][n % E]["region"] = regs[lab]["id"] if lab >= 0 else None
    return {
        "format": ATLAS_FORMAT, "version": ATLAS_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {**model_info, "moe_layer_count": L, "experts_per_layer": E, "top_k": k},
        "corpus": {**corpus_info, "tokens": int(rec.tokens),
                   "categories": {c: int(n) for c, n in zip(rec.categories, rec.cat_tokens)}},
        "method": {"clustering": "k-means on the SVD embedding of token/category profiles (coli.atlas.regions)",
                   "regions": k_regions, "seed": R.SEED, "profile_tokens": R.PROFILE_TOKENS},
        "regions": regs,
        "layers": layers,
    }


class _Pieces:
    """Token ids -> their text (cached)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        s = self.cache.get(t)
        if s is None:
            s = self.cache[t] = self.tok.decode([int(t)], skip_special_tokens=False)
        return s

    def text(self, ids) -> str:
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=False) if len(ids) else ""


def _ranked_tokens(rec, counts: np.ndarray, tokens: np.ndarray, share_of_all: float, n: int):
    """Tokens ranked by count x log(lift): lift = the share of the token's routings that
    went here over the share of all routings that did (what is special about it, not
    just frequent). Falls back to raw counts when nothing stands out."""
    total = rec.token_total[tokens] * rec.k  # routings of each token in one layer
    share = counts / np.maximum(total, 1)
    lift = share / max(share_of_all, 1e-12)
    score = counts * np.log(np.maximum(lift, 1.0))
    score = np.where(counts >= 2, score, score * 0.25)
    order = np.lexsort((tokens, -counts, -score))
    if not (score > 0).any():
        order = np.lexsort((tokens, -counts))
    return order[:n], share, lift


def _expert(rec, l: int, e: int, piece: _Pieces, token_ids, passages) -> dict:
    E, V, k = rec.E, rec.V, rec.k
    n = int(rec.count[l, e])
    share_of_all = n / max(rec.tokens * k, 1)
    keys, counts, best = rec.tok.range((l * E + e) * V, (l * E + e + 1) * V)
    toks = keys % V
    top, share, lift = _ranked_tokens(rec, counts, toks, share_of_all, TOP_TOKENS)
    top_tokens = [{"id": int(toks[i]), "token": piece(toks[i]), "count": int(counts[i]),
                   "share": round(float(share[i]), 4)} for i in top]
    examples = [_example(int(best[i]), piece, token_ids, passages) for i in top[:EXAMPLES]]
    cats = []
    if n and rec.cat_tokens.sum():
        p_cat = rec.cat_tokens / rec.cat_tokens.sum()
        for c in np.argsort(-rec.cat_count[l, e], kind="stable"):
            s = rec.cat_count[l, e, c] / n
            if s > 0 and p_cat[c] > 0:
                cats.append({"category": rec.categories[c], "share": round(float(s), 4),
                             "lift": round(float(s / p_cat[c]), 3)})
        cats.sort(key=lambda d: -d["lift"])
    return {
        "expert": e, "count": n,
        "frequency": round(n / max(rec.tokens, 1), 5),  # share of tokens routed here (a layer sums to k)
        "gate_mean": round(float(rec.gate_sum[l, e] / n), 4) if n else 0.0,
        "top_tokens": top_tokens, "examples": examples, "categories": cats[:4],
        "co_activation": _partners(rec.co[l, e], rec.count[l], n, rec.tokens),
        "next_layer": _partners(rec.co_next[l, e], rec.count[l + 1], n, rec.tokens) if l + 1 < rec.L else [],
    }


def _partners(row: np.ndarray, counts: np.ndarray, n: int, tokens: int) -> list[dict]:
    """The experts most often routed together with this one; lift = over independence."""
    out = []
    for j in np.argsort(-row, kind="stable")[:PARTNERS]:
        if row[j] <= 0:
            break
        expected = n * counts[j] / max(tokens, 1)
        out.append({"expert": int(j), "count": int(row[j]), "lift": round(float(row[j] / expected), 3) if expected else 0.0})
    return out


def _example(code: int, piece: _Pieces, token_ids, passages) -> dict:
    from coli.atlas.measure import occurrence

    gate, p, pos = occurrence(code)
    ids = token_ids[p]
    a, b = CONTEXT_TOKENS
    left = piece.text(ids[max(0, pos - a): pos])
    return {"left": ("…" if pos > a else "") + left, "token": piece(ids[pos]),
            "right": piece.text(ids[pos + 1: pos + 1 + b]) + ("…" if pos + 1 + b < len(ids) else ""),
            "category": passages[p].category, "gate": round(gate, 4), "passage": p}


def _region(rec, members: np.ndarray, piece: _Pieces, taken: set) -> dict:
    """A region's facts, name and description from its experts (indices l*E + e)."""
    E, V, k = rec.E, rec.V, rec.k
    n_routed = int(rec.count.reshape(-1)[members].sum())
    layers = sorted({int(m // E) for m in members})
    # the region's routings per token: summed over its experts
    keys, counts = [], []
    for m in members:
        kk, cc, _ = rec.tok.range(int(m) * V, (int(m) + 1) * V)
        keys.append(kk % V)
        counts.append(cc)
    toks = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    cnt = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    uniq, inv = np.unique(toks, return_inverse=True)
    summed = np.bincount(inv, weights=cnt).astype(np.int64) if len(uniq) else np.zeros(0, np.int64)
    share_of_all = n_routed / max(rec.tokens * k * len(layers), 1)
    # per layer the token routes k times; the region spans len(layers) layers
    total = rec.token_total[uniq] * k * max(len(layers), 1)
    share = summed / np.maximum(total, 1)
    lift = share / max(share_of_all, 1e-12)
    score = summed * np.log(np.maximum(lift, 1.0))
    order = np.lexsort((uniq, -summed, -score))[:TOP_TOKENS]
    top = [{"id": int(uniq[i]), "token": piece(uniq[i]), "count": int(summed[i]), "lift": round(float(lift[i]), 3)}
           for i in order]
    cats = []
    cat_counts = rec.cat_count.reshape(-1, len(rec.categories))[members].sum(0) if len(rec.categories) else []
    if len(rec.categories) and rec.cat_tokens.sum() and n_routed:
        p_cat = rec.cat_tokens / rec.cat_tokens.sum()
        for c in range(len(rec.categories)):
            s = cat_counts[c] / n_routed
            if s > 0 and p_cat[c] > 0:
                cats.append({"category": rec.categories[c], "share": round(float(s), 4),
                             "lift": round(float(s / p_cat[c]), 3)})
        cats.sort(key=lambda d: -d["lift"])
    name = _name(cats, top, taken)
    taken.add(name)
    experts = [[int(m // E), int(m % E)] for m in members]
    by_layer = {str(l): sum(1 for m in members if m // E == l) for l in layers}
    words = ", ".join(_quote(t["token"]) for t in top[:5]) or "nothing yet"
    cat_text = ", ".join(f"{c['category']} ({c['lift']:.1f}×)" for c in cats[:2] if c["lift"] > 1.05)
    span = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}–{layers[-1]}"
    part = n_routed / max(rec.tokens * k * rec.L, 1)
    pct = f"{part:.0%}" if part >= 0.01 else f"{part:.1%}"
    desc = (f"{len(members)} expert{'s' if len(members) != 1 else ''} in {span}, taking {pct} of all routings. "
            + (f"Prefers {cat_text}. " if cat_text else "")
            + f"Strongest tokens: {words}.")
    return {"name": name, "description": desc, "experts": experts, "layers": by_layer, "count": n_routed,
            "top_tokens": top, "categories": cats[:4]}


def _name(cats: list[dict], top: list[dict], taken: set | frozenset = frozenset()) -> str:
    """"<Category>: <what its tokens are>", e.g. "Numbers: digits", "Code: def · return"; by its
    words instead of their kind when another region already has the name."""
    lead = cats[0]["category"].capitalize() if cats and cats[0]["lift"] > 1.15 else None
    kind = _kind(top[:8])
    if kind is not None and (f"{lead}: {kind}" if lead else kind.capitalize()) in taken:
        kind = None
    if kind is None:
        words = []
        for t in sorted(top, key=lambda t: not _is_word(t["token"])):  # whole words first, stable
            w = t["token"].strip()
            if w and w not in words and any(ch.isalnum() for ch in w):
                words.append(w)
            if len(words) == 2:
                break
        kind = " · ".join(words) or "quiet"
    return f"{lead}: {kind}" if lead else kind[:1].upper() + kind[1:]


def _is_word(tok: str) -> bool:
    w = tok.strip()
    return len(w) >= 2 and w.isalpha() and (tok[:1] in " \u2581\u0120" or w[:1].isupper())


def _kind(top: list[dict]) -> str | None:
    """What most of these tokens (weighted by count) are, when one kind dominates."""
    total = sum(t["count"] for t in top)
    if not total:
        return None
    share = {"digits": 0, "punctuation": 0, "word pieces": 0, "whitespace": 0}
    for t in top:
        w = t["token"].strip()
        if not w:
            share["whitespace"] += t["count"]
        elif w.replace(".", "").replace(",", "").isdigit():
            share["digits"] += t["count"]
        elif not any(ch.isalnum() for ch in w):
            share["punctuation"] += t["count"]
        elif w.isalpha() and not _is_word(t["token"]) and len(w) <= 3:
            share["word pieces"] += t["count"]
    kind, n = max(share.items(), key=lambda kv: kv[1])
    return kind if n >= 0.5 * total else None


def _quote(s: str) -> str:
    return "“" + s.replace("\n", "⏎") + "”"


def _slug(name: str) -> str:
    out, dash = [], False
    for ch in name.lower():
        if ch.isascii() and ch.isalnum():
            out.append(ch)
            dash = False
        elif not dash and out:
            out.append("-")
            dash = True
    return "".join(out).strip("-")[:40]


def _unique(slug: str, seen: set) -> str:
    s, n = slug, 2
    while s in seen:
        s, n = f"{slug}-{n}", n + 1
    seen.add(s)
    return s
