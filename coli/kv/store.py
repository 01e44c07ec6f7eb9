"""Where KV slot state lives on disk, and the thread that writes it.

The state directory is ``--kv-dir`` when given; else the model directory, when it
is writable and the model's own (not a Hugging Face cache snapshot of symlinks,
nor the model shipped inside the package); else
``$XDG_CACHE_HOME/coli/kv/<fingerprint>`` (``~/.cache/...`` by default).
One process at a time uses a directory: it holds an advisory lock on
``.coli_kv.lock`` there, and a second process runs without persistence.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from coli.kv.format import KVFileError, KVState, Layout, read_state, slot_file, write_state

log = logging.getLogger("coli.kv")
FINGERPRINT_SAMPLE = 64 * 1024  # bytes hashed at each sampled offset of a large weight file
FINGERPRINT_SAMPLES = 16
LOCK_NAME = ".coli_kv.lock"


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A short hash that changes when the weights or the config change.

    Hashes config.json, a converted directory's coli.json manifest, and per weight
    file (``*.safetensors``, ``*.bin``) its name and size plus the whole file when
    small, else 17 evenly spaced 64 KiB samples of it and, for safetensors, its JSON
    header (names, dtypes, shapes): cheap on a 100 GB checkpoint, and two
    checkpoints of one shape trained apart differ in every sample."""
    root = Path(model_dir)
    h = hashlib.sha256(b"coli-model-fingerprint-v1\0")
    if root.is_file():  # a GGUF: config, tokenizer and weights all in the file (and its split parts)
        from coli.weights.gguf import split_files

        files = split_files(root)
    else:
        h.update((root / "config.json").read_bytes())
        if (root / "coli.json").is_file():
            h.update(b"\0coli.json\0" + (root / "coli.json").read_bytes())
        files = sorted([*root.glob("*.safetensors"), *root.glob("*.bin")])
    for f in files:
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= FINGERPRINT_SAMPLES * FINGERPRINT_SAMPLE:
                h.update(fh.read())
                continue
            for i in range(FINGERPRINT_SAMPLES + 1):  # the first at 0, the last ending at the end
                fh.seek(i * (size - FINGERPRINT_SAMPLE) // FINGERPRINT_SAMPLES)
                h.update(fh.read(FINGERPRINT_SAMPLE))
            if f.suffix == ".safetensors":
                fh.seek(0)
                head = fh.read(8)
                if len(head) == 8:
                    h.update(fh.read(min(int.from_bytes(head, "little"), 100 << 20)))  # the whole JSON header
    return h.hexdigest()[:32]


def weight_format(model) -> str:
    """How a loaded model's weights compute ("f32", "int4/int8": linear layers / head):
    KV computed under one format is not reused under another."""
    w = getattr(model, "weights", None)
    quant, head = getattr(w, "quant", None) or "f32", getattr(w, "head_quant", None)
    return quant if head in (None, quant) else f"{quant}/{head}"


def default_state_dir(model_dir: str | os.PathLike, fingerprint: str) -> Path:
    root = Path(model_dir).resolve()
    package = Path(__file__).resolve().parents[1]
    own = (root.is_dir() and os.access(root, os.W_OK) and not (Path(model_dir) / "config.json").is_symlink()
           and package not in root.parents and root != package)
    if own:
        return root
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "coli" / "kv" / fingerprint


class KVStore:
    """Reads slot files at start and writes them in the background.

    ``save(slot, tokens, k, v)`` takes copies made by the caller and returns at
    once; a newer save of a slot replaces a pending older one. Bad files are
    skipped with one warning each (``notice``), never reused, never fatal."""

    def __init__(self, directory: str | os.PathLike, layout: Layout, *, model_path: str | None = None,
                 notice: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.layout = layout
        self.model_path = model_path
        self.notice = notice or log.warning
        self.enabled = True
        self._lock_fd: int | None = None
        self._pending: dict[int, tuple] = {}
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._saved: dict[int, list[int]] = {}  # what each slot's file holds, to skip rewriting it
        self._failing: int | None = None  # the errno saves fail with, said once
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # never through a symlink (a planted one would make us create or lock its target)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            why = "it is a symbolic link" if e.errno == errno.ELOOP else (e.strerror or e)
            self._disable(f"KV persistence is off: cannot use {self.directory / LOCK_NAME} ({why})")
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._disable(f"KV persistence is off: {self.directory / LOCK_NAME} is not a regular file")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self._disable(f"KV persistence is off: another coli process uses {self.directory}")
            return
        self._lock_fd = fd
        for stale in self.directory.glob(".coli_kv*.tmp-*"):  # left by a killed writer
            stale.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._writer, name="coli-kv-writer", daemon=True)
        self._thread.start()

    def _disable(self, message: str) -> None:
        self.enabled = False
        self.notice(message)

    def restore(self, slot: int) -> KVState | None:
        """The slot's saved state when its file exists and is valid for this model."""
        if not self.enabled:
            return None
        path = slot_file(self.directory, slot)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            return None
        except OSError as e:
            self.notice(f"ignoring KV state {path}: {e.strerror or e}")
            return None
        if not stat.S_ISREG(mode):  # a FIFO would hang the start, a symlink may point anywhere
            self.notice(f"ignoring KV state {path}: it is not a regular file")
            return None
        try:
            state = read_state(path, self.layout)
        except (KVFileError, OSError) as e:
            self.notice(f"ignoring KV state {path}: {e}")
            return None
        self._saved[slot] = state.tokens
        return state

    def save(self, slot: int, tokens: list[int], k: np.ndarray, v: np.ndarray) -> None:
        if not self.enabled or self._saved.get(slot) == tokens:
            return
        with self._cv:
            self._pending[slot] = (list(tokens), k, v)
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pending save is on disk; False on timeout."""
        if not self.enabled:
            return True
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self) -> None:
        if not self.enabled:
            return
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self.enabled = False

    def _writer(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                slot = next(iter(self._pending))
                tokens, k, v = self._pending.pop(slot)
                self._busy = True
            try:
                write_state(slot_file(self.directory, slot), self.layout, tokens, k, v, slot=slot,
                            model_path=self.model_path)
                self._saved[slot] = tokens
                if self._failing is not None:
                    self.notice(f"KV slots are saved to {self.directory} again")
                    self._failing = None
            except OSError as e:
                if self._failing != e.errno:  # once per condition (a full disk fails every save)
                    self.notice(f"could not save KV slot {slot} to {self.directory}: {e.strerror or e} (said "
                                "once until it changes)")
                    self._failing = e.errno
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
