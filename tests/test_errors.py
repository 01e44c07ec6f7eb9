"""Bad input gets one clear line on stderr, exit code 2, and no traceback."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import coli
from coli.errors import ModelLoadError, UnsupportedModelError


def coli_cli(*args, stdin=""):
    env = {**os.environ, "COLI_THREADS": "1"}
    env.pop("COLI_MODEL", None)
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=120)


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert r.stdout == ""


@pytest.fixture
def model_copy(hf_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(hf_models("llama"), d)
    return d


def test_missing_directory(tmp_path):
    assert_one_line_error(coli_cli("run", "--model", str(tmp_path / "nope"), "hi"), "nope", "not a directory")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "config.json", "missing")


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), str(model_copy), "safetensors")


def test_truncated_weights(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "model.safetensors", "truncated")


def test_corrupt_header(model_copy):
    f = model_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    f.write_bytes(bytes(data))
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "model.safetensors", "corrupt")


def test_tensor_of_wrong_shape(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (model_copy / "config.json").write_text(json.dumps(cfg))
    r = coli_cli("run", "-m", str(model_copy), "hi")
    assert_one_line_error(r, "model.safetensors", "gate_proj.weight", "shape")


def test_unknown_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "mamba9"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    r = coli_cli("run", "-m", str(model_copy), "hi")
    assert_one_line_error(r, "mamba9", "supported", "qwen3_moe", "llama")
    with pytest.raises(UnsupportedModelError):
        coli.load(model_copy)


def test_invalid_json_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "config.json", "JSON")


def test_missing_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "tokenizer.json")


def test_empty_prompt(model_copy):
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), stdin="  \n"), "prompt is empty")


def test_shard_index_naming_a_missing_shard(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert_one_line_error(coli_cli("run", "-m", str(model_copy), "hi"), "model-00002-of-00002.safetensors", "missing")


def test_api_raises_typed_errors(model_copy):
    with pytest.raises(ModelLoadError, match="not a directory"):
        coli.load(model_copy / "sub")
    m = coli.load(model_copy)
    with pytest.raises(coli.errors.InvalidRequestError):
        m.forward([])
    with pytest.raises(coli.errors.InvalidRequestError, match="vocabulary"):
        m.forward([10**6])


def test_load_does_not_copy_f32_weights(model_copy, monkeypatch):
    """f32 tensors are views of the mapped file, not copies; where the kernel gives huge
    pages the dense ones are then moved, once, into the huge-page buffer (and the file's
    pages unmapped), never held twice."""
    from coli.weights.packing import _in_huge_buffer, _mapped_file, huge_pages

    monkeypatch.setenv("COLI_PACK", "0")
    q = coli.load(model_copy).engine.model.layers[0].attn.q_proj.mat.data
    assert not q.flags.owndata and not q.flags.writeable and _mapped_file(q) is not None
    monkeypatch.delenv("COLI_PACK")
    mat = coli.load(model_copy).engine.model.layers[0].attn.q_proj.mat
    if huge_pages():
        assert _in_huge_buffer(mat) and _mapped_file(mat.data) is None
    else:
        assert _mapped_file(mat.data) is not None
