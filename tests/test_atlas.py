"""coli atlas on a seeded MoE whose routing is built by hand.

The model (``hand_routed``): token wN belongs to class N // 16 (4 classes of 16 tokens).
Its embedding is a large value on dimension ``class`` plus a little seeded noise; the
attention output projections and the experts' down projections are zero, so every
layer sees the embedding unchanged. Layer l's router sends class c first to expert
(c + l) % 8 and second to (c + l + 4) % 8. The atlas must find those experts, their
tokens and categories, their co-activation, and group them into one region per class.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import coli
from coli import atlas as A
from coli.atlas.corpus import Passage

ROOT = Path(__file__).resolve().parent.parent
H, LAYERS, E, K, I, V, CLASSES = 32, 3, 8, 2, 16, 64, 4


def primary(c: int, l: int) -> int:
    return (c + l) % E


def secondary(c: int, l: int) -> int:
    return (c + l + 4) % E


def write_hand_routed(out: Path, seed: int = 0) -> Path:
    from safetensors.numpy import save_file

    from conftest import write_tokenizer  # no eos: an added "w1" would split "w17"

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}
    embed = (0.05 * rng.standard_normal((V, H))).astype(np.float32)
    for tok in range(V):
        embed[tok, tok // 16] = 4.0
        embed[tok, CLASSES + tok % (H - CLASSES)] += 0.5  # tokens of a class differ a little
    t["model.embed_tokens.weight"] = embed
    for l in range(LAYERS):
        p = f"model.layers.{l}"
        t[f"{p}.input_layernorm.weight"] = np.ones(H, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(H, np.float32)
        for n in ("q_proj", "k_proj", "v_proj"):
            t[f"{p}.self_attn.{n}.weight"] = (0.02 * rng.standard_normal((H, H))).astype(np.float32)
        t[f"{p}.self_attn.o_proj.weight"] = np.zeros((H, H), np.float32)
        t[f"{p}.self_attn.q_norm.weight"] = np.ones(H, np.float32)
        t[f"{p}.self_attn.k_norm.weight"] = np.ones(H, np.float32)
        router = np.zeros((E, H), np.float32)
        for c in range(CLASSES):
            router[primary(c, l), c] = 2.0
            router[secondary(c, l), c] = 1.0
        t[f"{p}.mlp.gate.weight"] = router
        for e in range(E):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (0.02 * rng.standard_normal((I, H))).astype(np.float32)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = (0.02 * rng.standard_normal((I, H))).astype(np.float32)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = np.zeros((H, I), np.float32)
    t["model.norm.weight"] = np.ones(H, np.float32)
    t["lm_head.weight"] = (0.02 * rng.standard_normal((V, H))).astype(np.float32)
    save_file(t, str(out / "model.safetensors"))
    cfg = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": H,
           "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": E,
           "num_experts_per_tok": K, "intermediate_size": I, "vocab_size": V, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "norm_topk_prob": False,
           "clip_qkv": None, "attention_bias": False, "hidden_act": "silu", "bos_token_id": None,
           "eos_token_id": 1, "pad_token_id": 1}
    (out / "config.json").write_text(json.dumps(cfg))
    write_tokenizer(out, V)
    return out


def corpus(seed: int = 1) -> list[Passage]:
    """40 passages, each mostly one class's tokens, labelled with that class."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(40):
        c = i % CLASSES
        toks = rng.integers(c * 16, c * 16 + 16, size=24)
        out.append(Passage(" ".join(f"w{t}" for t in toks), f"class{c}"))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_hand_routed(tmp_path_factory.mktemp("atlas") / "hand-routed")


@pytest.fixture(scope="module")
def doc(model_dir) -> dict:
    m = coli.load(model_dir, threads=1)
    try:
        return A.make(m, corpus(), corpus_name="classes", n_regions=CLASSES, batch_tokens=100)
    finally:
        m.close()


def test_the_atlas_finds_the_hand_routed_experts(doc):
    assert doc["format"] == "coli-atlas" and doc["version"] == A.ATLAS_VERSION
    assert doc["model"]["moe_layer_count"] == LAYERS and doc["model"]["experts_per_layer"] == E
    assert doc["corpus"]["tokens"] == 40 * 24
    for l in range(LAYERS):
        experts = doc["layers"][l]["experts"]
        assert abs(sum(e["frequency"] for e in experts) - K) < 1e-3  # every token routes to k experts
        for c in range(CLASSES):
            p, s = experts[primary(c, l)], experts[secondary(c, l)]
            for e in (p, s):
                assert e["top_tokens"], e
                assert all(int(t["token"][1:]) // 16 == c for t in e["top_tokens"]), (l, c, e["top_tokens"])
                assert all(t["share"] == pytest.approx(0.5) for t in e["top_tokens"])  # 1 of each token's k=2 routings
                assert e["categories"][0]["category"] == f"class{c}"
                assert e["frequency"] == pytest.approx(0.25, abs=0.05)
                ex = e["examples"][0]
                assert int(ex["token"].strip()[1:]) // 16 == c and ex["category"] == f"class{c}"
            assert p["gate_mean"] > 0.9 > 0.1 > s["gate_mean"]  # softmax of logits ~11 vs ~5.5
            assert p["co_activation"][0]["expert"] == secondary(c, l)
            if l + 1 < LAYERS:
                assert {x["expert"] for x in p["next_layer"][:2]} == {primary(c, l + 1), secondary(c, l + 1)}
            else:
                assert p["next_layer"] == []


def test_the_regions_are_the_token_classes(doc):
    assert len(doc["regions"]) == CLASSES
    groups = {frozenset(map(tuple, r["experts"])) for r in doc["regions"]}
    expected = {frozenset((l, f(c, l)) for l in range(LAYERS) for f in (primary, secondary)) for c in range(CLASSES)}
    assert groups == expected
    for r in doc["regions"]:
        c = {e["region"] for l, e_ in r["experts"] for e in [doc["layers"][l]["experts"][e_]]}
        assert c == {r["id"]}  # each expert names its region
        cls = r["categories"][0]["category"]
        assert r["name"].startswith(cls.capitalize() + ":"), r["name"]
        assert all(int(t["token"][1:]) // 16 == int(cls[-1]) for t in r["top_tokens"])
        assert 0.0 <= r["x"] <= 1.0 and 0.0 <= r["y"] <= 1.0
        assert r["layers"] == {str(l): 2 for l in range(LAYERS)}
    assert len({r["id"] for r in doc["regions"]}) == CLASSES


def test_an_interrupted_run_resumes_to_the_same_atlas(model_dir, doc, tmp_path):
    m = coli.load(model_dir, threads=1)
    state = tmp_path / "state.npz"
    steps = []

    def stop_on_third(rec, total):
        steps.append(rec.passages_done)
        if len(steps) == 3:
            raise KeyboardInterrupt

    try:
        heat = [np.array(x.counts) for x in m.engine.model.moe_layers]
        with pytest.raises(KeyboardInterrupt):
            A.make(m, corpus(), corpus_name="classes", n_regions=CLASSES, batch_tokens=100, state=state,
                   on_step=stop_on_third, checkpoint_seconds=0)
        assert state.is_file()
        assert all((x.counts == h).all() for x, h in zip(m.engine.model.moe_layers, heat))  # heat left alone
        saved = A.Recorder.load(state, LAYERS, E, K, V, {})
        assert 0 < saved.passages_done < 40
        resumed = []
        again = A.make(m, corpus(), corpus_name="classes", n_regions=CLASSES, batch_tokens=100, state=state,
                       on_step=lambda rec, total: resumed.append(rec.passages_done))
    finally:
        m.close()
    assert resumed[0] > saved.passages_done  # it went on from the checkpoint, not from the start
    assert not state.exists()
    strip = lambda d: {k: v for k, v in d.items() if k != "created"}  # noqa: E731
    assert strip(again) == strip(doc)


def test_corpus_sources(tmp_path, monkeypatch):
    default = A.read_corpus()
    assert len(default) >= 250
    assert {"definition", "prose", "code", "numbers", "dialogue"} <= {p.category for p in default}
    d = tmp_path / "c"
    (d / "code").mkdir(parents=True)
    (d / "code" / "a.py").write_text("def f():\n    return 1\n\n\nprint(f())\n")
    (d / "prose.txt").write_text("One paragraph.\n\nAnother one.\n")
    got = sorted((p.category, p.text) for p in A.read_corpus(d))
    assert got == [("code", "def f():\n    return 1"), ("code", "print(f())"), ("prose", "Another one."),
                   ("prose", "One paragraph.")]
    j = tmp_path / "x.jsonl"
    j.write_text('{"text": "a", "category": "k"}\n{"text": "b"}\n')
    assert [(p.text, p.category) for p in A.read_corpus(j)] == [("a", "k"), ("b", "x")]
    from coli.errors import InvalidRequestError

    for bad in (tmp_path / "missing", tmp_path / "empty.txt"):
        if bad.name == "empty.txt":
            bad.write_text("\n\n")
        with pytest.raises(InvalidRequestError):
            A.read_corpus(bad)


def _coli(*args, stdin: str | None = None, env: dict | None = None):
    e = {**os.environ, "COLI_THREADS": "1", **(env or {})}
    e.pop("COLI_MODEL", None)
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], input=stdin, capture_output=True, text=True,
                          env=e, cwd=ROOT, timeout=300)


def test_cli_writes_experts_json_beside_the_model_and_serve_finds_it(model_dir, tmp_path):
    from server_kit import Running, http

    work = tmp_path / "model"
    work.mkdir()
    for f in model_dir.iterdir():
        (work / f.name).symlink_to(f)
    srv = Running(work, kv_slots=1, config={"api_key": "k"})
    try:
        auth = {"Authorization": "Bearer k"}
        status, _, body = http(srv, "GET", "/experts/atlas", headers=auth)
        assert status == 404 and body["error"]["code"] == "atlas_not_found"
        assert "coli atlas" in body["error"]["message"]
        jsonl = "\n".join(json.dumps({"text": p.text, "category": p.category}) for p in corpus())
        r = _coli("atlas", "-m", str(work), "--corpus", "-", "--regions", "4", stdin=jsonl)
        assert r.returncode == 0, r.stderr
        assert (work / "experts.json").is_file() and "wrote" in r.stderr and "Traceback" not in r.stderr
        status, _, body = http(srv, "GET", "/experts/atlas")
        assert status == 401  # auth like the other endpoints
        status, headers, body = http(srv, "GET", "/experts/atlas", headers=auth)
        assert status == 200 and headers["content-type"].startswith("application/json")
        assert body["format"] == "coli-atlas" and len(body["regions"]) == 4
        assert body["model"]["fingerprint"] == A.model_info(srv.model)["fingerprint"]
    finally:
        srv.close()


def test_cli_errors_are_one_line(model_dir, tmp_path):
    r = _coli("atlas", "-m", str(model_dir), "--corpus", str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _coli("atlas", "-m", str(model_dir), "--regions", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_a_dense_model_has_no_atlas(hf_models, tmp_path):
    r = _coli("atlas", "-m", str(hf_models("llama")), "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "no MoE layers" in r.stderr and "Traceback" not in r.stderr


def test_the_builtin_model_ships_its_atlas():
    from coli.api import DEFAULT_MODEL_DIR
    from coli.kv.store import model_fingerprint

    doc = A.load(DEFAULT_MODEL_DIR / A.ATLAS_FILE)
    assert doc["model"]["fingerprint"] == model_fingerprint(DEFAULT_MODEL_DIR)  # made from these weights
    found, where = A.find_atlas(DEFAULT_MODEL_DIR, doc["model"]["fingerprint"])
    assert found == doc, where
    assert 2 <= len(doc["regions"]) <= 10
    every = sorted(tuple(x) for r in doc["regions"] for x in r["experts"])
    assert len(every) == len(set(every))  # a partition of the experts it saw


# -- the TUI's routing pane, labelled by region ----------------------------------------------------


def test_routing_pane_labels_cells_by_region(doc):
    from coli.tui.grid import ExpertGrid
    from coli.tui.widgets import CELL, REGION_MARKS, render_routing

    regions = A.region_grid(doc)
    g = ExpertGrid(np.ones((LAYERS, E), np.uint8), np.ones((LAYERS, E), np.uint8), np.zeros((LAYERS, E), bool))
    lines = render_routing(g, None, width=60, regions=regions).plain.splitlines()
    for l in range(LAYERS):
        marks = lines[l].split()[1]
        for c in range(CLASSES):  # a class's two experts in a layer carry one mark
            assert marks[primary(c, l)] == marks[secondary(c, l)]
        assert len(set(marks)) == CLASSES and CELL not in marks
    legend = " ".join(lines[LAYERS:])
    assert all(f"{REGION_MARKS[i]} {r['name']}" in legend for i, r in enumerate(doc["regions"]))
    assert CELL in render_routing(g, None, width=60).plain  # without regions: blocks


def test_f6_toggles_region_labels_in_the_chat_app(doc):
    from test_tui import ScriptedBackend, run

    from coli.tui.app import ChatApp
    from coli.tui.grid import ExpertGrid
    from coli.tui.widgets import CELL, RoutingPane

    class WithAtlas(ScriptedBackend):
        def __init__(self, atlas):
            super().__init__()
            self.doc = atlas

        def atlas(self):
            return self.doc

        def grid(self):
            return ExpertGrid(np.ones((LAYERS, E), np.uint8), np.ones((LAYERS, E), np.uint8),
                              np.zeros((LAYERS, E), bool), self.step)

    async def body(backend, labelled):
        app = ChatApp(backend, history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            pane = app.query_one(RoutingPane)
            await pilot.press("f6")
            await pilot.pause(0.1)
            assert (pane.regions is not None) == labelled
            assert (CELL not in pane.render().plain.splitlines()[0]) == labelled
            await pilot.press("f6")
            await pilot.pause(0.1)
            assert pane.regions is None and CELL in pane.render().plain.splitlines()[0]

    run(body(WithAtlas(doc), True))
    run(body(WithAtlas(None), False))  # no atlas: a notice, the blocks stay


# -- --pin auto: the pinned hot set from the atlas -------------------------------------------------


def test_pin_auto_seeds_the_pinned_set_from_the_atlas(tmp_path):
    from coli.api import DEFAULT_MODEL_DIR
    from coli.errors import InvalidRequestError
    from coli.weights.convert import convert

    conv = convert(DEFAULT_MODEL_DIR, tmp_path / "int4", "int4", force=True)
    m = coli.load(conv, threads=1)
    total = m.engine.weights.store.total_bytes
    doc = A.make(m, A.read_corpus()[::7])
    m.close()
    budget = int(total * 0.6)
    with pytest.raises(InvalidRequestError, match="coli atlas --model"):
        coli.load(conv, threads=1, ram_budget=budget, pin="auto")
    A.save(doc, A.atlas_path(conv, doc["model"]["fingerprint"]))
    assert (conv / A.ATLAS_FILE).is_file()

    def pinned(**load):
        (conv / ".coli_usage").unlink(missing_ok=True)  # a fresh installation: nothing learned
        m = coli.load(conv, threads=1, ram_budget=budget, **load)
        try:
            layers = list(m.engine.weights.store.layers.values())
            return {(i, e) for i, s in enumerate(layers) for e in range(s.E)
                    if s.slot_of[e] >= 0 and s.pinned[s.slot_of[e]]}
        finally:
            m.close()

    assert pinned() == set()  # learned pinning has nothing to learn from yet
    auto = pinned(pin="auto")
    counts = {(l, e["expert"]): e["count"] for l, layer in enumerate(doc["layers"]) for e in layer["experts"]}
    assert auto and max(counts, key=counts.get) in auto
    for l in range(len(doc["layers"])):  # within a layer, the pinned experts are its most routed
        mine = [counts[x] for x in auto if x[0] == l]
        others = [c for (ll, e), c in counts.items() if ll == l and (ll, e) not in auto]
        if mine and others:
            assert min(mine) >= max(others)
