"""The router's catalog: the worker registry and the prefix index, in memory or in SQLite.

By default both live in memory. With ``--state-dir DIR`` they are also written to
``DIR/cluster.sqlite`` (write-through), so a restarted router knows which workers exist and
which prefix blocks each held; a worker whose incarnation (``epoch``) changed since is
reset on its first heartbeat.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from coli.cluster.index import DEFAULT_BLOCK, PrefixIndex

SCHEMA = """
CREATE TABLE IF NOT EXISTS workers (name TEXT PRIMARY KEY, epoch TEXT, info TEXT, state TEXT, updated REAL);
CREATE TABLE IF NOT EXISTS blocks (worker TEXT, hash TEXT, PRIMARY KEY (worker, hash));
CREATE TABLE IF NOT EXISTS seqs (worker TEXT PRIMARY KEY, seq INTEGER);
"""


class Catalog:
    def __init__(self, state_dir: str | Path | None = None, block: int = DEFAULT_BLOCK):
        self.index = PrefixIndex(block)
        self.workers: dict[str, dict] = {}  # name -> {"epoch", "info", "state"}
        self._lock = threading.Lock()
        self.path = None
        self._db = None
        if state_dir is not None:
            self.path = Path(state_dir) / "cluster.sqlite"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.executescript(SCHEMA)
            self._load()

    def _load(self) -> None:
        db = self._db
        for name, epoch, info, state in db.execute("SELECT name, epoch, info, state FROM workers"):
            self.workers[name] = {"epoch": epoch, "info": json.loads(info or "{}"), "state": state}
        for worker, h in db.execute("SELECT worker, hash FROM blocks"):
            self.index._store(worker, [h])
        for worker, seq in db.execute("SELECT worker, seq FROM seqs"):
            self.index.seq[worker] = seq

    # -- the registry ----------------------------------------------------------------------------

    def register(self, name: str, epoch: str, info: dict) -> None:
        """A worker answered; a new incarnation starts with an empty index."""
        with self._lock:
            old = self.workers.get(name)
            if old is not None and old.get("epoch") != epoch:
                self._drop(name)
            self.workers[name] = {"epoch": epoch, "info": info, "state": "up"}
            if self._db is not None:
                self._db.execute("INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?)",
                                 (name, epoch, json.dumps(info), "up", time.time()))

    def mark_down(self, name: str) -> None:
        """The worker died or stopped answering: it leaves the routing table, its entries go."""
        with self._lock:
            w = self.workers.get(name)
            if w is not None:
                w["state"] = "down"
                w["epoch"] = None
            self._drop(name)
            if self._db is not None:
                self._db.execute("UPDATE workers SET state = 'down', epoch = NULL, updated = ? WHERE name = ?",
                                 (time.time(), name))

    def epoch(self, name: str) -> str | None:
        w = self.workers.get(name)
        return None if w is None else w.get("epoch")

    # -- the index -------------------------------------------------------------------------------

    def apply(self, worker: str, seq: int, stored: Iterable[str], evicted: Iterable[str]) -> bool:
        stored, evicted = list(stored), list(evicted)
        with self._lock:
            ok = self.index.apply(worker, seq, stored, evicted)
            if ok and self._db is not None:
                self._persist(worker, stored, evicted, seq)
            return ok

    def replace(self, worker: str, seq: int, held: Iterable[str]) -> bool:
        held = set(held)
        with self._lock:
            before = set(self.index.blocks.get(worker, ()))
            ok = self.index.replace(worker, seq, held)
            if ok and self._db is not None:
                self._persist(worker, held - before, before - held, seq)
            return ok

    def match(self, tokens, workers) -> dict[str, int]:
        with self._lock:
            return self.index.match(tokens, workers)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return self.index.counts()

    def _drop(self, name: str) -> None:
        self.index.drop(name)
        if self._db is not None:
            self._db.execute("DELETE FROM blocks WHERE worker = ?", (name,))
            self._db.execute("DELETE FROM seqs WHERE worker = ?", (name,))

    def _persist(self, worker: str, stored, evicted, seq: int) -> None:
        db = self._db
        db.execute("BEGIN")
        db.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?)", [(worker, h) for h in stored])
        db.executemany("DELETE FROM blocks WHERE worker = ? AND hash = ?", [(worker, h) for h in evicted])
        db.execute("INSERT OR REPLACE INTO seqs VALUES (?, ?)", (worker, seq))
        db.execute("COMMIT")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
