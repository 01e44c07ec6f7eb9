"""KV slot persistence: the file format round-trips, every kind of bad file is ignored
with one warning, a process killed with SIGKILL at random moments while saving leaves a
valid old or new state, a restarted runner reuses its prefix, another model's state is
never reused, and `coli kv inspect` reports it all."""
from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import coli
from coli.kv.format import Layout, read_state, slot_file, write_state
from coli.kv.store import KVStore, default_state_dir, model_fingerprint
from coli.runner import Runner
from coli.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = Layout("f" * 32, n_layers=3, k_width=8, v_width=8)
WAIT = 120


def state(n: int, seed: int, layout: Layout = LAYOUT):
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(0, 1000, n)]
    k = rng.standard_normal((layout.n_layers, n, layout.k_width), dtype=np.float32)  # (L, n, kw)
    v = rng.standard_normal((layout.n_layers, n, layout.v_width), dtype=np.float32)  # (L, n, vw)
    return toks, k, v


def restore(directory, layout=LAYOUT, slot=0):
    notes = []
    store = KVStore(directory, layout, notice=notes.append)
    try:
        return store.restore(slot), notes
    finally:
        store.close()


# -- the format ------------------------------------------------------------------------------------


def test_round_trip(tmp_path):
    toks, k, v = state(37, 1)
    write_state(slot_file(tmp_path, 2), LAYOUT, toks, k, v, slot=2, model_path="/m")
    got = read_state(tmp_path / ".coli_kv.2", LAYOUT)
    assert got.tokens == toks and np.array_equal(got.k, k) and np.array_equal(got.v, v)
    assert got.header["tokens"] == 37 and got.header["slot"] == 2 and got.header["model_path"] == "/m"
    assert [p.name for p in tmp_path.iterdir()] == [".coli_kv.2"]  # no temporary file left behind


def test_file_starts_with_magic_version_and_header(tmp_path):
    toks, k, v = state(5, 1)
    write_state(tmp_path / ".coli_kv", LAYOUT, toks, k, v)
    data = (tmp_path / ".coli_kv").read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", data)
    header = json.loads(data[16 : 16 + hlen])
    assert (magic, version) == (b"COLI_KV\n", 1) and data.endswith(b"END\n")
    assert header["fingerprint"] == LAYOUT.fingerprint and header["dtype"] == "float32"
    assert len(data) == 16 + hlen + 4 * 5 * (1 + 3 * 16) + 8


def test_f16_cache_round_trips_bit_for_bit_at_half_the_size(tmp_path):
    """An f16 cache (the default) is saved as float16: the same bits back, 2 bytes a value."""
    layout = Layout(LAYOUT.fingerprint, 3, 8, 8, dtype="float16")
    toks, k, v = state(5, 1)
    k, v = k.astype(np.float16), v.astype(np.float16)
    write_state(tmp_path / ".coli_kv", layout, toks, k, v)
    data = (tmp_path / ".coli_kv").read_bytes()
    hlen = struct.unpack_from("<8sII", data)[2]
    header = json.loads(data[16 : 16 + hlen])
    assert header["dtype"] == "float16" and header["layout"].startswith("tokens:int32[n] k:float16[")
    assert len(data) == 16 + hlen + 4 * 5 + 2 * 5 * 3 * 16 + 8
    got = read_state(tmp_path / ".coli_kv", layout)
    assert got.k.dtype == np.float16 and got.tokens == toks
    assert np.array_equal(got.k.view(np.uint16), k.view(np.uint16)) and np.array_equal(got.v.view(np.uint16),
                                                                                      v.view(np.uint16))


def test_state_of_the_other_kv_dtype_is_ignored(tmp_path):
    """A cache saved at f32 is not reused by an f16 engine (nor the reverse): the engine would
    not have computed those values. One notice, and the slot starts empty."""
    f16 = Layout(LAYOUT.fingerprint, 3, 8, 8, dtype="float16")
    toks, k, v = state(10, 3)
    write_state(tmp_path / ".coli_kv", LAYOUT, toks, k, v)
    got, notes = restore(tmp_path, f16)
    assert got is None and len(notes) == 1 and "dtype is 'float32'" in notes[0], notes
    write_state(tmp_path / ".coli_kv", f16, toks, k.astype(np.float16), v.astype(np.float16))
    got, notes = restore(tmp_path, LAYOUT)
    assert got is None and len(notes) == 1 and "dtype is 'float16'" in notes[0], notes
    assert restore(tmp_path, f16)[0].tokens == toks


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


CORRUPTIONS = {
    "truncated": lambda d: d[:-100],
    "one flipped byte in the keys": lambda d: _flip(d, len(d) - 200),
    "one flipped byte in the tokens": lambda d: _flip(d, len(d) - 8 - 4 * 3 * 16 * 10 - 10),
    "bad magic": lambda d: b"XOLI_KV\n" + d[8:],
    "another format version": lambda d: d[:8] + struct.pack("<I", 99) + d[12:],
    "garbage": lambda d: os.urandom(len(d)),
    "empty": lambda d: b"",
    "extra bytes": lambda d: d + b"\0",
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_bad_file_is_ignored_with_one_warning(tmp_path, kind):
    toks, k, v = state(10, 3)
    write_state(tmp_path / ".coli_kv", LAYOUT, toks, k, v)
    f = tmp_path / ".coli_kv"
    f.write_bytes(CORRUPTIONS[kind](f.read_bytes()))
    got, notes = restore(tmp_path)
    assert got is None
    assert len(notes) == 1 and str(f) in notes[0], notes


@pytest.mark.parametrize("other", [Layout("0" * 32, 3, 8, 8), Layout(LAYOUT.fingerprint, 4, 8, 8),
                                   Layout(LAYOUT.fingerprint, 3, 8, 16),
                                   Layout(LAYOUT.fingerprint, 3, 8, 8, weight_format="int4/int8")])
def test_state_of_another_model_or_shape_is_ignored(tmp_path, other):
    toks, k, v = state(10, 3, other)
    write_state(tmp_path / ".coli_kv", other, toks, k, v)  # a valid file, checksum and all
    got, notes = restore(tmp_path)
    assert got is None and len(notes) == 1


def test_second_process_on_a_directory_runs_without_persistence(tmp_path):
    notes = []
    first = KVStore(tmp_path, LAYOUT)
    second = KVStore(tmp_path, LAYOUT, notice=notes.append)
    assert first.enabled and not second.enabled and "another coli process" in notes[0]
    first.close()
    assert KVStore(tmp_path, LAYOUT).enabled


def test_store_writes_in_the_background_and_skips_unchanged_slots(tmp_path):
    store = KVStore(tmp_path, LAYOUT)
    toks, k, v = state(12, 4)
    store.save(1, toks, k, v)
    assert store.flush(WAIT)
    before = (tmp_path / ".coli_kv.1").stat().st_mtime_ns
    store.save(1, toks, k, v)  # the same history: nothing to write
    store.close()
    assert (tmp_path / ".coli_kv.1").stat().st_mtime_ns == before
    got, notes = restore(tmp_path, slot=1)
    assert got.tokens == toks and not notes


# -- SIGKILL while saving -----------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from coli.kv.format import Layout
    from coli.kv.store import KVStore
    layout = Layout("f" * 32, 4, 256, 256)
    states = []
    for n, seed in ((300, 1), (200, 2)):
        rng = np.random.default_rng(seed)
        states.append(([int(t) for t in rng.integers(0, 1000, n)],
                       rng.standard_normal((4, n, 256), dtype=np.float32),
                       rng.standard_normal((4, n, 256), dtype=np.float32)))
    store = KVStore(sys.argv[1], layout)
    print("go", flush=True)
    i = 0
    while True:
        toks, k, v = states[i % 2]
        store.save(0, toks, k, v)
        store.flush()
        i += 1
""")


def test_sigkill_at_random_moments_leaves_the_old_or_the_new_state(tmp_path):
    layout = Layout("f" * 32, 4, 256, 256)
    expected = {}
    for n, seed in ((300, 1), (200, 2)):
        rng = np.random.default_rng(seed)
        expected[n] = ([int(t) for t in rng.integers(0, 1000, n)], rng.standard_normal((4, n, 256), dtype=np.float32),
                       rng.standard_normal((4, n, 256), dtype=np.float32))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rnd = random.Random(1234)
    seen = {"none": 0, 300: 0, 200: 0}
    for _ in range(30):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env,
                                 cwd=ROOT)
        try:
            assert child.stdout.readline() == b"go\n"
            try:
                child.wait(rnd.uniform(0.0, 0.08))  # it never exits by itself: this is the random moment
            except subprocess.TimeoutExpired:
                pass
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(WAIT)
            child.stdout.close()
        got, notes = restore(tmp_path, layout)
        assert notes == [], notes  # never a corrupt file: the old state or the new one
        assert not list(tmp_path.glob("*.tmp-*"))  # a killed writer's temporary file is cleaned up
        if got is None:
            seen["none"] += 1
            continue
        toks, k, v = expected[len(got.tokens)]
        assert got.tokens == toks and np.array_equal(got.k, k) and np.array_equal(got.v, v)
        seen[len(got.tokens)] += 1
    assert seen[300] + seen[200] > 0, seen


# -- where state lives, fingerprints ----------------------------------------------------------------


def test_state_dir_is_the_model_dir_when_writable_else_the_cache(tmp_path, monkeypatch, hf_models):
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text("{}")
    assert default_state_dir(own, "abc") == own.resolve()
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "config.json").symlink_to(own / "config.json")  # how a Hugging Face cache snapshot looks
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_state_dir(snap, "abc") == tmp_path / "cache" / "coli" / "kv" / "abc"
    packaged = Path(coli.__file__).parent / "default_model"
    assert default_state_dir(packaged, "abc") == tmp_path / "cache" / "coli" / "kv" / "abc"


def test_fingerprint_follows_config_and_weights(tmp_path, hf_models):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(hf_models("qwen3_moe"), d)
    fp = model_fingerprint(d)
    assert fp == model_fingerprint(hf_models("qwen3_moe")) and len(fp) == 32
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 1  # one bit of one weight
    w.write_bytes(bytes(data))
    assert model_fingerprint(d) != fp


def test_fingerprint_of_a_large_file_samples_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    header = b'{"__metadata__":{}}'
    blob = bytearray(struct.pack("<Q", len(header)) + header + bytes(3 << 20))
    (tmp_path / "model.safetensors").write_bytes(bytes(blob))
    fp = model_fingerprint(tmp_path)
    blob[len(blob) // 2] ^= 1  # inside the middle sample
    (tmp_path / "model.safetensors").write_bytes(bytes(blob))
    assert model_fingerprint(tmp_path) != fp


# -- a real model across restarts --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(hf_models):
    return coli.load(hf_models("qwen3_moe"), threads=1)


GREEDY = SamplingParams(temperature=0)


def test_restart_reuses_the_saved_prefix(model, tmp_path):
    turn1 = model.tokenizer.encode("w3 w17 w42 w99 w5 w8")
    with Runner(model, kv_slots=2, kv_dir=tmp_path) as r:
        first = r.submit(turn1, max_tokens=6, sampling=GREEDY, cache_slot=1).result(timeout=WAIT)
    assert (tmp_path / ".coli_kv.1").is_file() and not (tmp_path / ".coli_kv").exists()
    turn2 = turn1 + model.tokenizer.encode(first.text + " w11 w12")
    notes = []
    with Runner(model, kv_slots=2, kv_dir=tmp_path, notice=notes.append) as r:
        assert r.scheduler.slot_history(1) == turn1 + model.tokenizer.encode(first.text)[:-1]
        warm = r.submit(turn2, max_tokens=6, sampling=GREEDY).result(timeout=WAIT)  # any slot: the match wins
    with Runner(model, persist=False) as r:
        cold = r.submit(turn2, max_tokens=6, sampling=GREEDY).result(timeout=WAIT)
    assert warm.started.slot == 1 and warm.usage.cached_tokens == len(turn1) + 5
    assert cold.usage.cached_tokens == 0 and warm.text == cold.text
    assert not any("ignoring" in n for n in notes)


@pytest.mark.parametrize("how", ["shutdown", "client left", "client left, another waiting"])
def test_a_request_stopped_between_two_steps_still_saves_its_slot(model, tmp_path, how):
    """A request cancelled while no step computes it (a shutdown's close(), or its client
    leaving) gives its slot back at once, outside any step: its KV is saved all the same (it
    once was not: a signal between two steps left no .coli_kv), and before a request waiting
    for that slot may overwrite it. The engine thread is held between two steps, before it
    plans the next, while the request is stopped."""
    prompt = model.tokenizer.encode("w1 w2 w3 w4 w5 w6")
    r = Runner(model, kv_slots=1, kv_dir=tmp_path)
    sched, handles, saves = r.scheduler, [], []
    between, go = threading.Event(), threading.Event()
    plan, save = sched.schedule, r.store.save

    def held_schedule():
        if handles and handles[0].request.generated >= 3 and not between.is_set():
            between.set()
            go.wait(WAIT)
        return plan()

    def spied_save(slot, tokens, k, v):
        saves.append(list(tokens))
        save(slot, tokens, k, v)

    sched.schedule, r.store.save = held_schedule, spied_save
    try:
        handles.append(r.submit(prompt, max_tokens=200, sampling=GREEDY))
        assert between.wait(WAIT)
        waiter = None
        if how.endswith("waiting"):  # queued for the one slot, which it takes the moment it is free
            waiter = r.submit(model.tokenizer.encode("w9 w8 w7"), max_tokens=4, sampling=GREEDY)
        sched.close() if how == "shutdown" else handles[0].cancel()
        assert handles[0].request.status.terminal and handles[0].request.generated == 3  # released now
        go.set()
        if waiter is not None:
            waiter.result(timeout=WAIT)
        elif how == "client left":
            for _ in range(2000):  # the engine thread saves it without another request
                if (tmp_path / ".coli_kv").is_file() and r.store.flush(0.01):
                    break
                time.sleep(0.005)
            assert (tmp_path / ".coli_kv").is_file()
    finally:
        go.set()
        r.close()
    assert saves and saves[0][: len(prompt)] == prompt and len(saves[0]) >= len(prompt) + 2, saves
    if how != "client left, another waiting":
        state = read_state(tmp_path / ".coli_kv")
        assert state.tokens == saves[0]


def test_state_from_another_model_is_ignored(model, tmp_path, hf_models):
    from conftest import ARCHS, make_hf_model

    mt, ov = ARCHS["qwen3_moe"]
    make_hf_model(mt, tmp_path / "other", seed=1, **ov)  # same shapes, other weights
    other = coli.load(tmp_path / "other", threads=1)
    prompt = model.tokenizer.encode("w1 w2 w3 w4 w5")
    kv = tmp_path / "kv"
    with Runner(model, kv_dir=kv) as r:
        r.submit(prompt, max_tokens=3, sampling=GREEDY).result(timeout=WAIT)
    notes = []
    with Runner(other, kv_dir=kv, notice=notes.append) as r:
        res = r.submit(prompt, max_tokens=3, sampling=GREEDY).result(timeout=WAIT)
    assert res.usage.cached_tokens == 0
    assert len([n for n in notes if "another model" in n]) == 1


def test_state_computed_with_other_weight_formats_is_ignored(model, hf_models, tmp_path):
    prompt = model.tokenizer.encode("w1 w2 w3 w4 w5")
    with Runner(model, kv_dir=tmp_path) as r:
        r.submit(prompt, max_tokens=3, sampling=GREEDY).result(timeout=WAIT)
    int8 = coli.load(hf_models("qwen3_moe"), threads=1, quant="int8")
    notes = []
    with Runner(int8, kv_dir=tmp_path, notice=notes.append) as r:
        res = r.submit(prompt, max_tokens=3, sampling=GREEDY).result(timeout=WAIT)
    assert res.usage.cached_tokens == 0
    assert len([n for n in notes if "'f32' weights" in n]) == 1, notes


def test_corrupt_state_does_not_stop_the_runner(model, tmp_path):
    (tmp_path / ".coli_kv").write_bytes(b"COLI_KV\n" + os.urandom(200))
    notes = []
    with Runner(model, kv_dir=tmp_path, notice=notes.append) as r:
        res = r.submit(model.tokenizer.encode("w1 w2"), max_tokens=2, sampling=GREEDY).result(timeout=WAIT)
    assert res.usage.cached_tokens == 0 and len([n for n in notes if "ignoring" in n]) == 1
    assert read_state(tmp_path / ".coli_kv").tokens[:2] == model.tokenizer.encode("w1 w2")  # replaced by a good one


def test_no_persist_writes_nothing(model, tmp_path):
    with Runner(model, kv_dir=tmp_path, persist=False) as r:
        r.submit(model.tokenizer.encode("w1 w2"), max_tokens=2, sampling=GREEDY).result(timeout=WAIT)
    assert list(tmp_path.iterdir()) == []


# -- coli kv inspect --------------------------------------------------------------------------------


def coli_kv(*args):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "coli.cli", "kv", "inspect", *args], capture_output=True, text=True,
                          env=env, timeout=WAIT, cwd=ROOT)


@pytest.fixture(scope="module")
def saved(model, hf_models, tmp_path_factory):
    """A state directory with slots 0 and 2 saved by the tiny model."""
    d = tmp_path_factory.mktemp("kvstate")
    with Runner(model, kv_slots=3, kv_dir=d) as r:
        for slot, text in ((0, "w1 w2 w3 w4"), (2, " ".join(f"w{i}" for i in range(40, 70)))):
            r.submit(model.tokenizer.encode(text), max_tokens=3, sampling=GREEDY, cache_slot=slot).result(timeout=WAIT)
    return d


def test_inspect_json(saved, hf_models):
    r = coli_kv("--kv-dir", str(saved), "--model", str(hf_models("qwen3_moe")), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["slot"] for row in rows] == [0, 2]
    a, b = rows
    assert a["tokens"] == 4 + 2 and a["valid"] and a["fingerprint_match"] is True
    assert a["bytes"] == (saved / ".coli_kv").stat().st_size and a["bytes_per_token"] == a["bytes"] / 6
    assert a["head"].startswith("w1 w2 w3 w4") and a["saved_at"] > 0
    assert b["head"].startswith("w40 w41") and len(b["head"]) <= 40 and len(b["tail"]) <= 40
    assert b["tail"].endswith(" ".join(model_tail(saved / ".coli_kv.2", hf_models)))


def model_tail(path, hf_models):
    from coli.tokenizer import Tokenizer

    toks = read_state(path).tokens
    return Tokenizer.from_dir(hf_models("qwen3_moe")).decode(toks[-2:]).split()


def test_inspect_table_uses_the_model_recorded_in_the_file(saved):
    r = coli_kv("--kv-dir", str(saved))
    assert r.returncode == 0, r.stderr
    assert "match" in r.stdout and "w1 w2 w3 w4" in r.stdout and "w40 w41" in r.stdout


def test_inspect_reports_a_bad_file_in_a_directory(saved, tmp_path):
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(saved, d)
    f = d / ".coli_kv.2"
    f.write_bytes(f.read_bytes()[:-10])
    rows = json.loads(coli_kv("--kv-dir", str(d), "--json").stdout)
    assert [row["valid"] for row in rows] == [True, False] and "truncated" in rows[1]["problem"]


def test_inspect_model_of_another_fingerprint(saved, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    rows = json.loads(coli_kv("--kv-dir", str(saved), "--model", str(other), "--json").stdout)
    assert all(row["fingerprint_match"] is False for row in rows)
    assert all(row["head"][0].isdigit() for row in rows)  # token ids, not another tokenizer's text


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_inspect_bad_input(saved, tmp_path):
    assert_one_line_error(coli_kv(str(tmp_path / "nope")), "no such file")
    assert_one_line_error(coli_kv("--kv-dir", str(tmp_path / "nope")), "no such directory")
    assert_one_line_error(coli_kv(str(saved / ".coli_kv"), "--kv-dir", str(saved)), "not both")
    empty = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "coli.cli", "kv", "inspect", "--json"], capture_output=True, text=True,
                       env={**os.environ, "XDG_CACHE_HOME": str(empty)}, timeout=WAIT, cwd=ROOT)
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr  # the built-in model, which saved nothing
    bad = tmp_path / ".coli_kv"
    bad.write_bytes(b"hello")
    assert_one_line_error(coli_kv(str(bad)), "too short")
    assert_one_line_error(coli_kv("--model", str(tmp_path)), "not a model directory")
