"""`coli pull` and hub names against a local HTTP server that serves a repository in the
hub's layout (the real huggingface_hub client, pointed at it with HF_ENDPOINT, real files
over TCP): only what coli loads is fetched, a dropped connection is resumed with a Range
request, `-m ORG/NAME` then resolves offline, and the failures are one line, exit 2."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("huggingface_hub", reason="hub names need huggingface_hub (pip install huggingface_hub)")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-llama"


class FakeHub(ThreadingHTTPServer):
    """Serves {repo: {file: bytes}} as the hub does: repo info, tree, HEAD/GET resolve with Range."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos = repos
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.drop_once: set[str] = set()  # files whose first full GET is cut in the middle
        self.auth: set[str | None] = set()  # the Authorization headers seen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):
        pass

    def _json(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _missing(self, what="Repository not found"):
        body = json.dumps({"error": what}).encode()
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound" if what.startswith("Repo") else "EntryNotFound")
        self.send_header("X-Error-Message", what)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?")[0]
        self.server.log.append((self.command, path, self.headers.get("Range")))
        self.server.auth.add(self.headers.get("Authorization"))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo = "/".join(parts[2:4])
            files = self.server.repos.get(repo)
            if files is None:
                return self._missing()
            if parts[4:5] == ["revision"]:
                return self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": f} for f in files]})
            if parts[4:5] == ["tree"]:
                return self._json([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for f, b in files.items()])
            return self._missing()
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            files = self.server.repos.get(repo)
            if files is None:
                return self._missing()
            if name not in files:
                return self._missing("Entry not found")
            return self._file(name, files[name])
        return self._missing()

    def _file(self, name: str, data: bytes):
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if not start and name in self.server.drop_once:
            self.server.drop_once.discard(name)
            self.wfile.write(data[: len(data) - 4096])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # the connection drops mid-file
            return
        self.wfile.write(data[start:])


@pytest.fixture(scope="module")
def repo_files(hf_models, tmp_path_factory):
    from tests.gguf_kit import write_gguf

    src = hf_models("llama")
    files = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"\0" * 1000  # a format coli does not load: never fetched
    # a second, large shard (> huggingface_hub's 10 MB read chunk, so a cut leaves bytes to resume from)
    from safetensors.numpy import save

    files["model-extra.safetensors"] = save({"unused.pad": np.arange(3_000_000, dtype=np.float32)})
    files["README.md"] = b"# tiny\n"
    gguf_repo = {"tiny-Q8_0.gguf": write_gguf(src, tmp_path_factory.mktemp("g") / "t.gguf", "Q8_0").read_bytes(),
                 "tiny-F32.gguf": b"not fetched", "README.md": b"# gguf\n"}
    return {REPO: files, "tiny-org/tiny-llama-GGUF": gguf_repo}


@pytest.fixture
def hub(repo_files, tmp_path):
    server = FakeHub(repo_files)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


def env(hub_url: str, tmp_path: Path, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COLI_"))}
    e.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub_url, COLI_HOME=str(tmp_path / "coli"),
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", **extra)
    return e


def coli(*args, env, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_pull_fetches_only_what_coli_loads_and_resumes_a_dropped_download(hub, repo_files, tmp_path):
    hub.drop_once.add("model-extra.safetensors")
    e = env(hub.url, tmp_path, HF_TOKEN="hf_test_token")
    r = coli("pull", REPO, env=e)
    assert r.returncode == 0, r.stderr
    assert hub.auth == {"Bearer hf_test_token"}  # HF_TOKEN on every request, the resumed one too
    snap = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    for name in ("config.json", "model.safetensors", "model-extra.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (snap / name).read_bytes() == repo_files[REPO][name]
    assert not (snap / "pytorch_model.bin").exists() and not (snap / "README.md").exists()
    ranged = [rng for m, p, rng in hub.log if m == "GET" and p.endswith("/model-extra.safetensors") and rng]
    assert ranged and int(ranged[0][6:].split("-")[0]) > 0  # resumed where the connection dropped
    # now by name, with no network at all
    off = env("http://127.0.0.1:9", tmp_path, HF_HUB_OFFLINE="1")
    r = coli("run", "-m", REPO, "--raw", "-n", "3", "--temperature", "0", "w1 w2 w3", env=off)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) >= 1
    r = coli("list", "--json", env=off)
    assert r.returncode == 0, r.stderr
    listed = {m["name"]: m for m in json.loads(r.stdout)}
    assert listed[REPO]["arch"] == "llama" and listed[REPO]["params"] > 0 and listed[REPO]["fits"] is True


def test_pull_one_gguf_file_then_run_it_by_name(hub, tmp_path):
    e = env(hub.url, tmp_path)
    r = coli("pull", "tiny-org/tiny-llama-GGUF", "--file", "tiny-Q8_0.gguf", env=e)
    assert r.returncode == 0, r.stderr
    snap = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama-GGUF" / "snapshots" / COMMIT
    assert (snap / "tiny-Q8_0.gguf").exists() and not (snap / "tiny-F32.gguf").exists()
    import coli as C
    from coli.hub import resolve_name

    os.environ.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    try:
        from huggingface_hub import constants

        old = constants.HF_HUB_CACHE
        constants.HF_HUB_CACHE = str(tmp_path / "hf" / "hub")
        path = resolve_name("tiny-org/tiny-llama-GGUF")
        assert path.name == "tiny-Q8_0.gguf"
        m = C.load(path, threads=1)
        assert m.weights.quant == "int8"
        assert np.isfinite(m.forward([1, 2, 3])).all()
    finally:
        constants.HF_HUB_CACHE = old
        del os.environ["HF_HUB_OFFLINE"]


def test_pull_with_quant_converts(hub, tmp_path):
    e = env(hub.url, tmp_path)
    r = coli("pull", REPO, "--quant", "int8", env=e)
    assert r.returncode == 0, r.stderr
    conv = tmp_path / "coli" / "models" / "tiny-org--tiny-llama--int8"
    assert (conv / "coli.json").exists()
    r = coli("show", REPO + " (int8)", "--json", env=e)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "coli int8 (head int8)"


def test_hub_failures_are_one_line_exit_2(hub, tmp_path):
    e = env(hub.url, tmp_path)
    cases = [
        (("run", "-m", "tiny-org/not-pulled", "hi"), "run: coli pull tiny-org/not-pulled"),
        (("pull", "tiny-org/missing"), "no such repository"),
        (("pull", "tiny-org/tiny-llama-GGUF"), "--file"),
        (("pull", "tiny-org/tiny-llama-GGUF", "--file", "nope.gguf"), "no file nope.gguf in the repository (its GGUF files: tiny-F32.gguf, tiny-Q8_0.gguf)"),
        (("pull", "not a name"), "not a hub name"),
    ]
    for args, needle in cases:
        r = coli(*args, env=e)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    dead = env("http://127.0.0.1:9", tmp_path)  # nothing listens there: no network
    r = coli("pull", REPO, env=dead)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot reach the hub" in r.stderr or "download failed" in r.stderr
    r = coli("pull", REPO, env=env(hub.url, tmp_path, HF_HUB_OFFLINE="1"))
    assert r.returncode == 2 and "offline" in r.stderr, r.stderr
    assert not list((tmp_path / "hf").rglob("*.safetensors"))  # nothing half-written


def test_disk_full_keeps_the_partial_download_and_the_next_pull_resumes(hub, repo_files, tmp_path):
    """A real full disk (a small tmpfs as the Hugging Face cache): one line, exit 2, the
    partial file kept as blobs/<etag>.incomplete and nothing linked into a snapshot; after
    freeing space the next pull continues it with a Range request and finishes."""
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(hf_home)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"the disk-full test mounts a tmpfs and needs root (mount said: {r.stderr.strip()})")
    try:
        filler = hf_home / "filler"
        filler.write_bytes(b"\0" * (8 << 20))  # leaves ~8 MB: less than model-extra.safetensors' 12 MB
        e = env(hub.url, tmp_path)
        r = coli("pull", REPO, env=e)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "disk full while downloading model-extra.safetensors" in r.stderr and "to resume" in r.stderr
        repo_dir = hf_home / "hub" / "models--tiny-org--tiny-llama"
        (partial,) = (repo_dir / "blobs").glob("*.incomplete")
        kept = partial.stat().st_size
        extra = repo_files[REPO]["model-extra.safetensors"]
        assert 0 < kept < len(extra) and partial.read_bytes() == extra[:kept]
        assert not (repo_dir / "snapshots").exists()  # nothing half-written where a loader would look
        r = coli("list", "--json", env=e)  # the half-pulled repository is not listed, and breaks nothing
        assert r.returncode == 0 and json.loads(r.stdout) == [], r.stderr
        filler.unlink()  # space freed
        hub.log.clear()
        r = coli("pull", REPO, env=e)
        assert r.returncode == 0, r.stderr
        ranged = [rng for m, p, rng in hub.log if m == "GET" and p.endswith("/model-extra.safetensors")]
        assert ranged == [f"bytes={kept}-"]  # continued from the kept bytes, not from zero
        snap = repo_dir / "snapshots" / COMMIT
        for name in ("model-extra.safetensors", "model.safetensors", "config.json"):
            assert (snap / name).read_bytes() == repo_files[REPO][name]
        assert not list(repo_dir.rglob("*.incomplete"))
    finally:
        subprocess.run(["umount", str(hf_home)], capture_output=True)
