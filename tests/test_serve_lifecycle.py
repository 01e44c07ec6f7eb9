"""`coli serve` as a process: a port in use is one line before anything loads; Ctrl+C and
SIGTERM during a stream end it cleanly (error event, [DONE]), save KV and exit; the
open-file limit is raised at start. Real subprocesses, real signals, real sockets."""
from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from server_kit import WAIT, chat_model_dir  # noqa: F401 (fixtures)


def coli(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coli.cli", *args], env={**os.environ, "COLI_THREADS": "1",
                                                                              **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_port_in_use_is_one_line_before_loading(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:  # the model does not exist: had it been loaded first, that would be the error
        proc = coli("serve", "--model", str(tmp_path / "no-model"), "--port", str(port))
        out, err = proc.communicate(timeout=WAIT)
    finally:
        taken.close()
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], err


class Served:
    """A `coli serve` subprocess, its stderr collected, its URL once it listens."""

    def __init__(self, *args, env=None, **kw):
        self.proc = coli("serve", "--port", "0", *args, env=env, **kw)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.ready.wait(WAIT), self.stderr
        self.url = re.search(r"listening on (http://\S+)", self.stderr).group(1)
        self.host, port = self.url.rsplit("/", 1)[-1].split(":")
        self.port = int(port)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self.ready.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_during_a_stream_ends_it_cleanly_saves_kv_and_exits(chat_model_dir, tmp_path, stop):
    kv = tmp_path / "kv"
    served = Served("--model", str(chat_model_dir), "--ctx", "512", "--kv-dir", str(kv))
    try:
        vocab = json.loads((chat_model_dir / "tokenizer.json").read_text())["added_tokens"]
        no_end = {str(t["id"]): -100 for t in vocab if t["special"]}
        body = json.dumps({"prompt": "hello there", "max_tokens": 500, "stream": True, "logit_bias": no_end,
                           "temperature": 0}).encode()
        sock = socket.create_connection((served.host, served.port), timeout=WAIT)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while data.count(b"data: {") < 3:  # it is generating
            data += sock.recv(65536)
        served.proc.send_signal(stop)
        t0 = time.monotonic()
        while not data.endswith(b"data: [DONE]\n\n") and (chunk := sock.recv(65536)):
            data += chunk
        sock.close()
        code = served.proc.wait(WAIT)
        took = time.monotonic() - t0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "server_shutting_down" in events[-2]
    assert code == 0 and "Traceback" not in served.stderr and "stopping" in served.stderr, served.stderr
    assert took < 30, took  # a bound only a hang reaches (the shutdown grace is 3 s)
    assert (kv / ".coli_kv").is_file()  # the slot it held was saved


def test_the_open_file_limit_is_raised_to_the_hard_limit(chat_model_dir):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard open-file limit is {hard}: nothing to raise")
    want = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096

    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, want))

    served = Served("--model", str(chat_model_dir), "--no-kv-persist", preexec_fn=low)
    try:
        limits = open(f"/proc/{served.proc.pid}/limits").read()
        soft = int(re.search(r"Max open files\s+(\d+)", limits).group(1))
        assert soft == want, limits
    finally:
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(WAIT) == 0, served.stderr


def test_a_second_signal_exits_at_once(chat_model_dir):
    served = Served("--model", str(chat_model_dir), "--no-kv-persist", "--max-body", "16M")
    try:
        body = json.dumps({"prompt": "hello " * 1_000_000}).encode()  # seconds of tokenizing: a handler in flight
        sock = socket.create_connection((served.host, served.port), timeout=WAIT)
        sock.sendall(f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(1.0)  # the body is in; the graceful stop will wait for its handler
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        served.proc.send_signal(signal.SIGINT)
        code = served.proc.wait(WAIT)
        sock.close()
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
    time.sleep(0.2)  # the reader thread drains stderr
    assert code == 130 and "stopped at once" in served.stderr and "Traceback" not in served.stderr, served.stderr


def test_idle_connections_cannot_exhaust_a_low_file_limit(chat_model_dir):
    def low():
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))  # soft and hard: nothing to raise

    served = Served("--model", str(chat_model_dir), "--no-kv-persist", preexec_fn=low)
    idle = []
    try:
        for _ in range(200):  # more than the process may open
            try:
                idle.append(socket.create_connection((served.host, served.port), timeout=WAIT))
            except OSError:
                break
        for _ in range(3):
            from server_kit import http

            assert http(served.url, "GET", "/health")[0] == 200
    finally:
        for s in idle:
            s.close()
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(WAIT) == 0, served.stderr
    assert "Too many open files" not in served.stderr, served.stderr
