"""The expert atlas: what each expert of a MoE model does, measured on a corpus.

    import coli
    from coli import atlas
    model = coli.load(path)
    doc = atlas.make(model, atlas.read_corpus())      # the experts.json document
    atlas.save(doc, atlas.atlas_path(model.path, doc["model"]["fingerprint"]))

``coli atlas`` (coli/cli/atlas.py) is the command; ``GET /experts/atlas`` serves the
document and the dashboard's Brain → Explore draws it. The format is in docs/ATLAS.md.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from coli.atlas.corpus import DEFAULT_CORPUS, Passage, corpus_digest, read_corpus
from coli.atlas.document import ATLAS_FILE, ATLAS_FORMAT, ATLAS_VERSION, atlas_path, find_atlas, load, save
from coli.atlas.measure import Recorder, measure, tokenize

__all__ = ["ATLAS_FILE", "ATLAS_FORMAT", "ATLAS_VERSION", "DEFAULT_CORPUS", "Passage", "Recorder", "atlas_path",
           "find_atlas", "load", "make", "model_info", "read_corpus", "region_grid", "save"]


def region_grid(doc: dict):
    """(rows, cols) int array of each expert's region index (-1: none) and the region names,
    from an experts.json document (the TUI's routing pane labels cells with it)."""
    import numpy as np

    m = doc["model"]
    grid = np.full((int(m["moe_layer_count"]), int(m["experts_per_layer"])), -1, np.int64)
    for i, r in enumerate(doc["regions"]):
        for layer, expert in r["experts"]:
            if 0 <= layer < grid.shape[0] and 0 <= expert < grid.shape[1]:
                grid[layer, expert] = i
    return grid, [r["name"] for r in doc["regions"]]


def model_info(model) -> dict:
    """The model facts an atlas is keyed by (fingerprint) and drawn with."""
    from coli.kv.store import model_fingerprint, weight_format

    net = model.engine.model
    moe_ids = [i for i, layer in enumerate(net.layers) if layer.mlp in net.moe_layers]
    return {"fingerprint": model_fingerprint(model.path), "path": str(Path(model.path).resolve()),
            "model_type": model.config.model_type, "quant": weight_format(model), "moe_layers": moe_ids}


def make(model, passages: list[Passage], *, corpus_name: str = "default", n_regions: int = 10,
         max_tokens: int = 256, batch_tokens: int = 1024, state: str | Path | None = None,
         on_step: Callable | None = None, info: dict | None = None, checkpoint_seconds: float = 30.0) -> dict:
    """Measure ``passages`` on ``model`` and return the experts.json document.

    ``state``: a file to checkpoint into and resume from (removed when done); a state
    made for another model, corpus or settings is ignored. ``on_step(recorder,
    total_passages)`` reports progress."""
    info = info or model_info(model)
    moes = model.engine.model.moe_layers
    from coli.errors import InvalidRequestError

    if not moes:
        raise InvalidRequestError(f"{model.path}: this model has no MoE layers: there are no experts to map")
    L, E, k, V = len(moes), moes[0].E, moes[0].k, model.config.vocab_size
    categories = sorted({p.category for p in passages if p.category is not None})
    digest = corpus_digest(passages)
    meta = {"fingerprint": info["fingerprint"], "quant": info["quant"], "corpus": digest,
            "max_tokens": max_tokens, "shape": [L, E, k, V]}
    rec = None
    state = Path(state) if state is not None else None
    if state is not None and state.is_file():
        rec = Recorder.load(state, L, E, k, V, meta)
    if rec is None:
        rec = Recorder(L, E, k, V, categories)
    token_ids = tokenize(model, passages, max_tokens)
    total = len(passages)
    measure(model, passages, token_ids, rec, batch_tokens=batch_tokens,
            on_step=(lambda r: on_step(r, total)) if on_step else None,
            checkpoint=(lambda r: r.save(state, meta)) if state is not None else None,
            checkpoint_seconds=checkpoint_seconds)
    from coli.atlas import document

    doc = document.build(rec, tokenizer=model.tokenizer, token_ids=token_ids, passages=passages, model_info=info,
                         corpus_info={"name": corpus_name, "digest": digest, "passages": len(passages),
                                      "max_tokens": max_tokens},
                         n_regions=n_regions)
    if state is not None:
        state.unlink(missing_ok=True)
    return doc
