"""``--pin auto``: seed the expert cache's pinned hot set from the model's expert atlas.

Learned pinning (``.coli_usage``) knows only what this installation has run so far; a
fresh one knows nothing and pins nothing useful. The atlas measured every expert on a
labelled corpus, so its routing counts are a prior: the store ranks experts by their
share of routings in ``.coli_usage`` plus their share in the atlas (``ExpertStore``'s
``pin_prior``), pinning the best within the pin budget. See BENCHMARKS.md for how it
compares with learned pinning.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from coli.errors import InvalidRequestError


def pin_prior(model_dir: str | Path) -> list[np.ndarray]:
    """Per MoE layer (model order): each expert's routing count in the atlas."""
    from coli.atlas import find_atlas
    from coli.kv.store import model_fingerprint

    doc, where = find_atlas(model_dir, model_fingerprint(model_dir))
    if doc is None:
        raise InvalidRequestError(f"--pin auto needs the model's expert atlas ({where}); "
                                  f"make it with: coli atlas --model {model_dir}")
    return [np.array([e["count"] for e in layer["experts"]], np.float64) for layer in doc["layers"]]
