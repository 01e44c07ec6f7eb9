"""`coli ps` (a running server registers itself and leaves at exit; /health reports the
memory plan), `coli list` / `show` / `rm` over coli's models directory, and misspelt
names answered with the closest one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from coli.weights.convert import convert


def env(tmp_path: Path) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("COLI_", "HF_"))}
    e.update(COLI_HOME=str(tmp_path / "coli"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    return e


def cli(*args, env, input=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120, input=input, cwd=cwd)


def test_ps_lists_a_running_server_until_it_exits(hf_models, tmp_path):
    e = env(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "coli.cli", "serve", "-m", str(hf_models("llama")), "--port", "0",
                          "--threads", "1", "--kv-slots", "2"], stderr=subprocess.PIPE, text=True, env=e)
    try:
        url = None
        for line in p.stderr:
            if "listening on" in line:
                url = line.split("listening on ")[1].split()[0]
                break
        assert url, "the server did not start"
        r = cli("ps", "--json", env=e)
        procs = json.loads(r.stdout)
        assert [x["pid"] for x in procs] == [p.pid]
        assert procs[0]["url"] == url and procs[0]["kv_slots"] == 2 and procs[0]["rss"] > 0
        assert "llama" in cli("ps", env=e).stdout
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
        assert health["plan"]["fits"] is True and health["plan"]["quant"] == "f32"
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    assert json.loads(cli("ps", "--json", env=e).stdout) == []
    assert not list((tmp_path / "coli" / "run").glob("*.json"))


def test_list_show_rm_and_misspelt_names(hf_models, tmp_path):
    e = env(tmp_path)
    models = tmp_path / "coli" / "models"
    convert(hf_models("qwen3_moe"), models / "acme--tiny-moe--int8", "int8")
    r = cli("list", "--json", env=e)
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)
    assert entry["name"] == "acme/tiny-moe (int8)" and entry["arch"] == "qwen3_moe"
    assert 0 < entry["active_params"] < entry["params"] and entry["fits"] is True
    assert "acme/tiny-moe (int8)" in cli("list", env=e).stdout
    r = cli("show", "acme/tiny-moe (int8)", env=e)
    assert r.returncode == 0, r.stderr
    assert "qwen3_moe" in r.stdout and "count 8, active 2" in r.stdout
    # -m by hub name finds coli's converted model first
    r = cli("run", "-m", "acme/tiny-moe", "--raw", "-n", "2", "--threads", "1", "w1 w2", env=e)
    assert r.returncode == 0, r.stderr
    r = cli("show", "acme/tiny-mo (int8)", env=e)
    assert r.returncode == 2 and "did you mean acme/tiny-moe (int8)?" in r.stderr
    r = cli("run", "-m", "acme/tiny-mo", "hi", env=e)  # a hub name not cached, close to one that is
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "run: coli pull acme/tiny-mo" in r.stderr and "did you mean acme/tiny-moe" in r.stderr
    r = cli("rm", "acme/tiny-moe (int8)", env=e, input="n\n")
    assert r.returncode != 0 and (models / "acme--tiny-moe--int8").exists()
    r = cli("rm", "acme/tiny-moe (int8)", "--yes", env=e)
    assert r.returncode == 0 and not (models / "acme--tiny-moe--int8").exists()
    assert json.loads(cli("list", "--json", env=e).stdout) == []


def test_list_remembers_ggufs_loaded_by_path(hf_models, tmp_path):
    """`-m FILE.gguf` puts the file on `coli list` (a registry under $COLI_HOME, rewritten
    atomically); a file that is gone drops off; `coli rm` forgets it and keeps the file."""
    from tests.gguf_kit import write_gguf

    e = {**env(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    a = write_gguf(hf_models("llama"), tmp_path / "a.gguf", "Q8_0")
    (tmp_path / "sub").mkdir()
    b = write_gguf(hf_models("qwen3"), tmp_path / "sub" / "b.gguf")
    for path in (a, b, a):  # loading the same file twice keeps one entry
        r = cli("run", "-m", os.path.relpath(path, tmp_path / "sub"), "--raw", "-n", "1", "--threads", "1", "<|end|>",
                env=e, cwd=tmp_path / "sub")  # a relative path is remembered as the absolute one
        assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "xdg" / "coli" / "kv").iterdir())) == 2  # a GGUF's KV state: in the cache
    reg = json.loads((tmp_path / "coli" / "ggufs.json").read_text())
    assert sorted(x["path"] for x in reg) == sorted([str(a), str(b)])
    assert not list((tmp_path / "coli").glob(".ggufs-*"))  # no temporary file left behind
    listed = {m["name"]: m for m in json.loads(cli("list", "--json", env=e).stdout)}
    assert set(listed) == {str(a), str(b)}
    assert listed[str(a)]["arch"] == "llama" and listed[str(a)]["format"].startswith("gguf Q8_0")
    assert listed[str(a)]["size"] == a.stat().st_size and listed[str(b)]["fits"] is True
    assert "b.gguf" in cli("list", env=e).stdout
    r = cli("show", str(a), env=e)
    assert r.returncode == 0 and "Q8_0" in r.stdout, r.stderr
    b.unlink()  # stale: dropped from the list and from the file
    assert [m["name"] for m in json.loads(cli("list", "--json", env=e).stdout)] == [str(a)]
    assert [x["path"] for x in json.loads((tmp_path / "coli" / "ggufs.json").read_text())] == [str(a)]
    r = cli("rm", str(a), "--yes", env=e)
    assert r.returncode == 0 and "the file stays" in r.stderr, r.stderr
    assert a.exists() and json.loads(cli("list", "--json", env=e).stdout) == []


def test_gguf_registry_survives_a_damaged_file_and_concurrent_writers(hf_models, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from coli import models_cache as mc

    monkeypatch.setenv("COLI_HOME", str(tmp_path / "coli"))
    (tmp_path / "coli").mkdir()
    (tmp_path / "coli" / "ggufs.json").write_text("{not json")
    files = []
    for i in range(8):
        f = tmp_path / f"m{i}.gguf"
        f.write_bytes(b"GGUF")
        files.append(f)
    with ThreadPoolExecutor(8) as ex:  # every writer holds the lock: none loses another's entry
        list(ex.map(mc.remember_gguf, files))
    assert sorted(e["path"] for e in json.loads((tmp_path / "coli" / "ggufs.json").read_text())) == \
        sorted(str(f) for f in files)
