"""KV files an attacker (or an accident) can plant: symlinks at the temporary name and at
the lock, a FIFO or a directory named like a slot file; and a save that keeps failing is
said once. Real files, real FIFOs, a real background writer."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from coli.kv.format import KVFileError, Layout, read_header, read_state, slot_file
from coli.kv.store import LOCK_NAME, KVStore

LAYOUT = Layout("f" * 32, n_layers=2, k_width=4, v_width=4)


def state(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return ([int(t) for t in rng.integers(0, 100, n)], rng.standard_normal((2, n, 4), dtype=np.float32),
            rng.standard_normal((2, n, 4), dtype=np.float32))


def test_a_symlink_at_the_old_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    kv = tmp_path / "kv"
    kv.mkdir()
    store = KVStore(kv, LAYOUT)  # planted while the server runs (start-up clears stale names)
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # the predictable names the writer used
        (kv / f".coli_kv.tmp-{pid}").symlink_to(victim)
    store.save(0, *state(5))
    assert store.flush(30)
    store.close()
    assert victim.read_text() == "precious"
    assert read_state(slot_file(kv, 0), LAYOUT).tokens == state(5)[0]


def test_a_dangling_lock_symlink_is_never_created_through(tmp_path):
    target = tmp_path / "created-by-the-server"
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / LOCK_NAME).symlink_to(target)
    notes = []
    store = KVStore(kv, LAYOUT, notice=notes.append)
    assert not store.enabled and not target.exists()
    assert len(notes) == 1 and "symbolic link" in notes[0]


def _in_thread(fn, seconds=30):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "it hung"
    return out["value"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_slot_file_that_is_not_a_regular_file_is_skipped_with_a_warning(tmp_path, kind):
    path = slot_file(tmp_path, 0)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        real = tmp_path / "elsewhere"
        from coli.kv.format import write_state

        write_state(real, LAYOUT, *state(3))
        path.symlink_to(real)
    notes = []
    store = KVStore(tmp_path, LAYOUT, notice=notes.append)
    try:
        assert _in_thread(lambda: store.restore(0)) is None
    finally:
        store.close()
    assert len(notes) == 1 and "not a regular file" in notes[0]


def test_reading_a_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def read():
        try:
            read_header(fifo)
        except KVFileError as e:
            return str(e)

    assert _in_thread(read) == "it is not a regular file"


def test_a_save_that_keeps_failing_is_said_once(tmp_path):
    notes = []
    store = KVStore(tmp_path, LAYOUT, notice=notes.append)
    slot_file(tmp_path, 0).mkdir()  # every save of slot 0 now fails the same way
    for n in (3, 4, 5):
        store.save(0, *state(n))
        assert store.flush(30)
    assert len(notes) == 1 and "could not save KV slot 0" in notes[0]
    slot_file(tmp_path, 0).rmdir()
    store.save(0, *state(6))
    assert store.flush(30)
    store.close()
    assert len(notes) == 2 and "again" in notes[1]
    assert read_state(slot_file(tmp_path, 0), LAYOUT).tokens == state(6)[0]
