"""coli convert and the expert store: converted directories load to the same numbers,
streaming never changes results, and damaged or half-written output is refused."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import coli
from coli.errors import InvalidRequestError, ModelLoadError
from coli.weights.convert import convert
from tests.conftest import make_hf_model, prompt_ids
from tests.test_models import coli_greedy

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv") / "hf"
    make_hf_model("qwen3_moe", d, num_hidden_layers=3, **MOE)
    return d


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    out = {}
    for q in ("int8", "int4"):
        out[q] = convert(src, tmp_path_factory.mktemp("c") / f"m-{q}", q)
    return out


def expert_bytes(d: Path) -> int:
    return json.loads((d / "coli.json").read_text())["experts"]["bytes"]


@pytest.mark.parametrize("q", ["int8", "int4"])
def test_converted_equals_quantize_at_load(src, converted, q):
    ids = prompt_ids(14)
    a = coli.load(src, quant=q).forward(ids)
    b = coli.load(converted[q]).forward(ids)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("q", ["int8", "int4"])
def test_streaming_gives_resident_results(converted, q, prefetch):
    d = converted[q]
    resident = coli.load(d)
    assert resident.weights.store.resident
    budget = expert_bytes(d) // 4
    streamed = coli.load(d, ram_budget=budget, pin=0, prefetch=prefetch)
    store = streamed.weights.store
    assert not store.resident
    ids = prompt_ids(20)
    np.testing.assert_array_equal(streamed.forward(ids), resident.forward(ids))
    a = "".join(resident.generate("w3 w9 w27", raw=True, max_tokens=24, temperature=0))
    b = "".join(streamed.generate("w3 w9 w27", raw=True, max_tokens=24, temperature=0))
    assert a == b
    t = streamed.engine.totals
    assert t.bytes_read > 0 and t.hit_rate < 1.0
    st = store.stats  # every needed expert counted once: a hit, a prefetch hit or a miss
    assert st.hits + st.prefetch_hits + st.misses == st.needed
    assert (st.prefetch_issued > 0) == prefetch
    streamed.close()


def test_prefill_needing_more_experts_than_slots(converted):
    """A prefill whose tokens route to every expert of a layer is computed in groups."""
    d = converted["int4"]
    streamed = coli.load(d, ram_budget=expert_bytes(d) // 8, pin=0, prefetch=False)
    slots = min(s.slots for s in streamed.weights.store.layers.values())
    ids = prompt_ids(60, seed=5)
    assert slots < 8
    np.testing.assert_array_equal(streamed.forward(ids), coli.load(d).forward(ids))


def test_learned_pinning(converted, tmp_path):
    d = converted["int8"]
    m = coli.load(d, ram_budget=expert_bytes(d) // 2, pin=0)
    list(m.generate("w5 w6 w7", raw=True, max_tokens=16))
    m.close()  # writes .coli_usage
    usage = json.loads((d / ".coli_usage").read_text())
    assert usage["format"] == "coli-usage" and sum(map(sum, usage["layers"].values())) > 0
    pinned = coli.load(d, ram_budget=expert_bytes(d) // 2, pin=expert_bytes(d) // 4)
    assert pinned.engine.resident_bytes()["pinned"] > 0
    hot = {n: int(np.argmax(c)) for n, c in usage["layers"].items()}
    for name, e in hot.items():  # the most used expert of each layer is pinned
        layer = pinned.weights.store.layers[name]
        assert layer.pinned[layer.slot_of[e]]


def test_usage_from_another_model_is_ignored(converted, capfd):
    d = converted["int4"]
    (d / ".coli_usage").write_text(json.dumps({"format": "coli-usage", "version": 1, "model": "other", "layers": {}}))
    coli.load(d, ram_budget=expert_bytes(d) // 2)
    assert "another model" in capfd.readouterr().err


def test_refuses_to_overwrite_without_force(src, converted, tmp_path):
    with pytest.raises(InvalidRequestError, match="--force"):
        convert(src, converted["int8"], "int8")
    out = tmp_path / "x"
    convert(src, out, "int8")
    before = (out / "coli.json").read_text()
    convert(src, out, "int4", force=True)
    assert json.loads((out / "coli.json").read_text())["quant"] == "int4" and before != (out / "coli.json").read_text()
    r = subprocess.run([sys.executable, "-m", "coli.cli", "convert", str(src), str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "--force" in r.stderr and "Traceback" not in r.stderr


def test_wrong_quant_for_converted_dir(converted):
    with pytest.raises(ModelLoadError, match="converted to int8"):
        coli.load(converted["int8"], quant="int4")


def _copy(d: Path, tmp: Path) -> Path:
    import shutil

    out = tmp / "copy"
    shutil.copytree(d, out)
    return out


def test_tampered_dense_is_detected(converted, tmp_path):
    d = _copy(converted["int4"], tmp_path)
    f = d / "dense.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="dense.bin: checksum mismatch"):
        coli.load(d)


def test_truncated_experts_are_detected(converted, tmp_path):
    d = _copy(converted["int4"], tmp_path)
    f = d / "experts.bin"
    f.write_bytes(f.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match="experts.bin: truncated"):
        coli.load(d)


@pytest.mark.parametrize("streamed", [False, True])
def test_tampered_expert_is_detected(converted, tmp_path, streamed):
    d = _copy(converted["int8"], tmp_path)
    f = d / "experts.bin"
    data = bytearray(f.read_bytes())
    for i in range(0, len(data), 4096 * 3):
        data[i + 100] ^= 0x55  # every expert damaged
    f.write_bytes(bytes(data))
    if not streamed:
        with pytest.raises(ModelLoadError, match="checksum mismatch in expert"):
            coli.load(d)
    else:
        m = coli.load(d, ram_budget=expert_bytes(d) // 4, pin=0)
        with pytest.raises(ModelLoadError, match="checksum mismatch in expert"):
            m.forward(prompt_ids(8))


def test_interrupted_conversion_leaves_nothing_loadable(tmp_path):
    """kill -9 in the middle of a conversion: no destination, and the partial directory
    (hidden, named .partial) has no manifest, so it does not load."""
    src = tmp_path / "big"
    make_hf_model("qwen3_moe", src, num_hidden_layers=8, num_experts=64, num_experts_per_tok=2,
                  moe_intermediate_size=256, hidden_size=256)
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "coli.cli", "convert", str(src), str(dst), "-q", "int4"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    partial = []
    while time.monotonic() < deadline and not partial and p.poll() is None:
        partial = [x for x in tmp_path.glob(".out.partial-*") if (x / "experts.bin").exists()
                   and (x / "experts.bin").stat().st_size > 0]
        time.sleep(0.01)
    if p.poll() is not None:
        pytest.skip("conversion finished before it could be interrupted")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not dst.exists()
    assert partial and not (partial[0] / "coli.json").exists()
    with pytest.raises(ModelLoadError):
        coli.load(partial[0])


def test_olmoe_mini_streams_at_a_quarter_of_its_experts(tmp_path):
    """The issue's check at a realistic shape: olmoe-mini (int4, 32 experts top-4, hidden
    1024) with a RAM budget of 25% of its expert bytes decodes exactly the greedy tokens of
    the fully resident run, reading experts from disk and missing the cache sometimes."""
    from coli import synthetic

    d = synthetic.write_converted("olmoe-mini", tmp_path / "olmoe-mini-int4", "int4", seed=3)
    ids = list(range(100, 116))
    resident = coli.load(d, threads=2)
    want = coli_greedy(resident, ids, 12)
    resident.close()
    streamed = coli.load(d, threads=2, ram_budget=expert_bytes(d) // 4)
    assert not streamed.weights.store.resident
    assert coli_greedy(streamed, ids, 12) == want
    t = streamed.engine.totals
    assert t.bytes_read > 0 and t.hit_rate < 1.0
    streamed.close()



def test_prefetch_never_evicts_the_latest_steps_experts(converted):
    """A wrong guess may take an empty slot or one the latest step did not use, never
    the experts that step just used (the likeliest to be needed again)."""
    d = converted["int4"]
    m = coli.load(d, ram_budget=expert_bytes(d) // 2, pin=0, prefetch=True)  # 4 slots for 8 experts per layer
    cache = m.engine.new_cache()
    m.engine.step([(cache, prompt_ids(6))])
    m.engine.step([(cache, [5])])
    for layer in m.weights.store.layers.values():
        for fut in list(layer.pending.values()):
            fut.result()
        used = {int(layer.holder[s]) for s in np.flatnonzero(layer.stamp == layer._clock)}
        assert len(used) == 2  # top-2 of the decode step
        guesses = np.array([[e for e in range(8) if layer.slot_of[e] < 0]], dtype=np.int32)
        layer.prefetch(guesses)
        assert all(layer.slot_of[e] >= 0 for e in used)
        assert len(layer.pending) <= layer.slots - len(used)
    m.close()
