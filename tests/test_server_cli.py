"""`coli serve` as a user runs it: a process that loads the model, says where it listens,
answers with the key from COLI_API_KEY, and exits cleanly on Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from server_kit import WAIT, chat_model_dir, http  # noqa: F401 (fixtures)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_coli_serve_starts_answers_and_stops(chat_model_dir, tmp_path, stop):
    env = {**os.environ, "COLI_API_KEY": "k3y", "COLI_ALLOWED_HOSTS": "box.lan,other.lan", "COLI_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "coli.cli", "serve", "--model", str(chat_model_dir), "--port", "0",
                             "--model-id", "tiny-cli", "--kv-slots", "2", "--ctx", "128", "--no-kv-persist"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(WAIT), "".join(lines)
        url = re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
        assert url.startswith("http://127.0.0.1:")
        assert http(url, "GET", "/v1/models")[0] == 401
        status, _, models = http(url, "GET", "/v1/models", headers={"Authorization": "Bearer k3y"})
        assert status == 200 and models["data"][0]["id"] == "tiny-cli"
        assert http(url, "GET", "/health", headers={"Host": "box.lan:8000"})[0] == 200
        assert http(url, "GET", "/health", headers={"Host": "evil.lan"})[0] == 403
        status, _, out = http(url, "POST", "/v1/chat/completions", {
            "model": "tiny-cli", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            {"x-api-key": "k3y"})
        assert status == 200 and out["usage"]["completion_tokens"] <= 2
    finally:
        proc.send_signal(stop)
        code = proc.wait(WAIT)
    assert code == 0, "".join(lines)
