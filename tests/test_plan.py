"""The memory check before loading: a model larger than the usable memory (COLI_MEMORY_LIMIT,
the documented override; a cgroup limit works the same way) is refused in one line, exit 2,
before any weight is read, naming what would fit; `coli plan` prints the plan; --ram-budget
is the whole process, and under a limit a converted MoE model takes its budget from it."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import coli
from coli.errors import ModelLoadError
from coli.plan import RUNTIME, make_plan, usable_memory
from coli.weights.convert import convert

BIG = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
           num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
           rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A 336M-parameter llama whose safetensors file is sparse: its header is real, its
    1.3 GB of data never written (reading them would take seconds and show up in RSS)."""
    d = tmp_path_factory.mktemp("big")
    (d / "config.json").write_text(json.dumps(BIG))
    H, I, V = BIG["hidden_size"], BIG["intermediate_size"], BIG["vocab_size"]
    kv = BIG["num_key_value_heads"] * H // BIG["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H], "lm_head.weight": [V, H]}
    for i in range(BIG["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": [H], f"{p}.post_attention_layernorm.weight": [H],
                       f"{p}.self_attn.q_proj.weight": [H, H], f"{p}.self_attn.k_proj.weight": [kv, H],
                       f"{p}.self_attn.v_proj.weight": [kv, H], f"{p}.self_attn.o_proj.weight": [H, H],
                       f"{p}.mlp.gate_proj.weight": [I, H], f"{p}.mlp.up_proj.weight": [I, H],
                       f"{p}.mlp.down_proj.weight": [H, I]})
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 4 * int(__import__("math").prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    with open(d / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)  # sparse: no data blocks on disk
    from tests.conftest import write_tokenizer

    write_tokenizer(d, 160)
    return d


def cli(*args, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    e.update(env)
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], capture_output=True, text=True, env=e,
                          timeout=120)


def test_too_big_is_refused_before_loading_naming_what_fits(big_model):
    t0 = time.monotonic()
    r = cli("run", "-m", str(big_model), "hello", COLI_MEMORY_LIMIT="1G")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "needs about" in lines[0] and "1.00 GiB is usable (COLI_MEMORY_LIMIT)" in lines[0]
    assert "try --quant int4" in lines[0] or "try --quant int8" in lines[0]
    assert time.monotonic() - t0 < 60  # no 1.3 GB read (the sparse file would read as zeros, slowly)
    for cmd in (("serve", "--port", "0"), ("bench", "--prompt-tokens", "4")):
        r = cli(*cmd, "-m", str(big_model), COLI_MEMORY_LIMIT="1G")
        assert r.returncode == 2 and "needs about" in r.stderr, (cmd, r.stderr)


def test_plan_prints_the_table_and_exits_by_fit(big_model):
    r = cli("plan", "-m", str(big_model), "--quant", "int4", COLI_MEMORY_LIMIT="1G")
    assert r.returncode == 0, r.stderr
    for word in ("weights", "kv cache", "buffers", "total", "usable", "fits"):
        assert word in r.stdout
    r = cli("plan", "-m", str(big_model), "--json", COLI_MEMORY_LIMIT="1G")
    assert r.returncode == 2
    plan = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert plan["fits"] is False and plan["quant"] == "f32" and plan["usable_bytes"] == 1 << 30
    n_params = 2 * 32000 * 2048 + 4 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 5632) + 9 * 2048
    assert abs(plan["weights_bytes"] - 4 * n_params) < 1 << 20


def test_plan_numbers_follow_format_ctx_and_slots(big_model, monkeypatch):
    monkeypatch.setenv("COLI_MEMORY_LIMIT", "64G")
    f32 = make_plan(big_model, ctx=1024)
    int4 = make_plan(big_model, quant="int4", ctx=1024)
    int4s = make_plan(big_model, quant="int4s", ctx=1024)
    assert int4s.weights < int4.weights < f32.weights / 4  # 4.5 and 5 bits (int8 embeddings and head)
    assert make_plan(big_model, ctx=2048, kv_slots=3).kv == 6 * f32.kv
    per_token = 4 * 2 * 512 * 2  # layers x (k + v) x kv width x 2 bytes (the default f16 cache)
    assert f32.kv_per_token == per_token
    assert make_plan(big_model, ctx=1024, kv_cache_dtype="f32").kv == 2 * f32.kv
    assert usable_memory() == (64 << 30, "COLI_MEMORY_LIMIT")
    monkeypatch.setenv("COLI_MEMORY_LIMIT", "lots")
    with pytest.raises(ModelLoadError, match="COLI_MEMORY_LIMIT"):
        usable_memory()


def test_ram_budget_is_the_whole_process(hf_models, tmp_path, monkeypatch):
    """A converted MoE model: --ram-budget B leaves B - (dense + KV + buffers + runtime) to
    experts; with no budget under a limit, the limit is the budget and experts stream."""
    d = convert(hf_models("qwen3_moe"), tmp_path / "moe", "int8")
    monkeypatch.setenv("COLI_MEMORY_LIMIT", "64G")
    full = make_plan(d, ctx=512)
    budget = full.weights + full.kv + full.buffers + RUNTIME + full.experts_total // 2
    m = coli.load(d, threads=1, process_budget=budget, max_context=512)
    assert m.weights.store.ram_budget == m.plan.experts < full.experts_total
    assert not m.weights.store.resident
    m.close()
    monkeypatch.setenv("COLI_MEMORY_LIMIT", str(budget))  # no --ram-budget: the limit decides
    m = coli.load(d, threads=1, max_context=512)
    assert not m.weights.store.resident and m.weights.store.ram_budget < full.experts_total
    m.close()
    monkeypatch.setenv("COLI_MEMORY_LIMIT", "64G")
    m = coli.load(d, threads=1)
    assert m.weights.store.resident
    assert m.plan.as_dict()["fits"] is True
    m.close()


def test_a_whole_process_budget_below_the_need_is_refused(big_model, monkeypatch):
    from coli.plan import check_before_load

    monkeypatch.setenv("COLI_MEMORY_LIMIT", "64G")
    with pytest.raises(ModelLoadError, match=r"is usable \(--ram-budget\)"):
        check_before_load(big_model, quant="int4", ram_budget=200 << 20)
    plan, experts = check_before_load(big_model, quant="int4", ram_budget=2 << 30)
    assert plan.fits and plan.usable == 2 << 30 and experts is None  # dense: no expert cache to size


def _in_new_cgroup(limit: int) -> tuple[Path, str]:
    """A fresh memory cgroup (v2, else v1) limited to ``limit`` bytes, and the file a shell
    writes its pid into to join it; skips when this process may not create one."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
        base, limit_file = v2, "memory.max"
    else:
        base, limit_file = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
    d = base / f"coli-test-{os.getpid()}"
    try:
        d.mkdir()
        (d / limit_file).write_text(str(limit))
    except OSError as e:
        if d.exists():
            d.rmdir()
        pytest.skip(f"a real cgroup limit needs root and a writable memory cgroup ({e}); "
                    "COLI_MEMORY_LIMIT covers the same check")
    return d, str(d / "cgroup.procs")


def test_a_real_cgroup_limit_is_the_usable_memory(big_model):
    """`coli run` started inside a 1 GiB memory cgroup: the plan reads the limit (v1 or v2,
    the tightest on the way up) and refuses the 1.3 GB model before reading a weight."""
    d, procs = _in_new_cgroup(1 << 30)
    try:
        e = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
        join = f'echo $$ > {procs} && exec "$@"'
        r = subprocess.run(["sh", "-c", join, "sh", sys.executable, "-m", "coli.cli", "run", "-m", str(big_model),
                            "hello"], capture_output=True, text=True, env=e, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "is usable (cgroup limit)" in r.stderr and "try --quant" in r.stderr, r.stderr
        r = subprocess.run(["sh", "-c", join, "sh", sys.executable, "-m", "coli.cli", "plan", "-m", str(big_model),
                            "--quant", "int4", "--json"], capture_output=True, text=True, env=e, timeout=120)
        plan = json.loads(r.stdout)
        assert r.returncode == 0 and plan["usable_from"] == "cgroup limit" and plan["usable_bytes"] < 1 << 30
    finally:
        d.rmdir()


def test_a_cluster_worker_checks_memory_before_loading(big_model, monkeypatch):
    """A Ray worker (the actor class, in process) makes the same plan on its own machine and
    refuses the model before reading a weight."""
    from coli.cluster.worker import Worker

    monkeypatch.setenv("COLI_MEMORY_LIMIT", "1G")
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"needs about .* 1.00 GiB is usable \(COLI_MEMORY_LIMIT\); try --quant"):
        Worker("w0", str(big_model), {"threads": 1})
    assert time.monotonic() - t0 < 30
