"""`.coli_usage`: how often each expert of each MoE layer has been routed to.

A small JSON file beside a converted model (or in the user's cache directory when
the model directory is read-only). It is loaded at start to choose the pinned hot
set, grows as the model runs, and is rewritten atomically (temp file + rename), so
a crash leaves the old or the new counts, never a torn file. A file written for
another model (different fingerprint) or shape is ignored with a warning.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

USAGE_FILE = ".coli_usage"
USAGE_FORMAT = "coli-usage"
USAGE_VERSION = 1


def state_dir(model_dir: Path, fingerprint: str) -> Path:
    """Beside the model when it is writable, else ~/.cache/coli/state/<fingerprint>."""
    if os.access(model_dir, os.W_OK):
        return model_dir
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coli" / "state" / fingerprint[:16]
    base.mkdir(parents=True, exist_ok=True)
    return base


class Usage:
    """Routing counts: one int64 row per MoE layer, keyed by the layer's name."""

    def __init__(self, path: Path, fingerprint: str, layers: dict[str, int]):
        self.path, self.fingerprint = path, fingerprint
        self.counts = {name: np.zeros(n, dtype=np.int64) for name, n in layers.items()}
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            d = json.loads(self.path.read_text())
            if d.get("format") != USAGE_FORMAT or d.get("version") != USAGE_VERSION:
                raise ValueError("unknown format or version")
            if d.get("model") != self.fingerprint:
                raise ValueError("written for another model")
            rows = {k: np.asarray(v, dtype=np.int64) for k, v in d["layers"].items()}
            if set(rows) != set(self.counts) or any(rows[k].shape != self.counts[k].shape for k in rows):
                raise ValueError("layer shapes differ")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"warning: ignoring {self.path}: {e}", file=sys.stderr)
            return
        self.counts = rows

    def add(self, layer: str, counts: np.ndarray) -> None:
        self.counts[layer] += counts

    def save(self) -> None:
        d = {"format": USAGE_FORMAT, "version": USAGE_VERSION, "model": self.fingerprint,
             "layers": {k: v.tolist() for k, v in self.counts.items()}}
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(d))
            tmp.replace(self.path)
        except OSError as e:
            print(f"warning: cannot save {self.path}: {e.strerror}", file=sys.stderr)
