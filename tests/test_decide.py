"""`coli decide` as a shell script uses it: a real process, the state on stdin, JSON in a
pipe, exit codes for `if`, one error line for bad input, and --url to a running server."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_kit import Running, chat_model_dir  # noqa: F401 (fixtures)

ENV = {**os.environ, "COLI_THREADS": "1"}


def decide(*args, stdin: str | None = "I was charged twice for one order."):
    return subprocess.run([sys.executable, "-m", "coli.cli", "decide", *args], input=stdin, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_json_in_a_pipe_and_exit_codes(chat_model_dir, tmp_path):
    qfile = tmp_path / "q.json"
    qfile.write_text(json.dumps({"lvl": {"type": "score", "criteria": ["a", "b", "c", "d"]}}))
    r = decide("--model", str(chat_model_dir), "-y", "Is it about money?", "-c", "Which team?|billing|tech",
               "-f", str(qfile), "--threshold", "0")
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert list(reply["answers"]) == ["lvl", "Is it about money?", "Which team?"]
    p = reply["answers"]["Is it about money?"]["noul"]
    assert reply["answers"]["Which team?"]["choice"] in ("billing", "tech")
    # above the answer's probability: "no" (exit 1), which `if` reads as false
    r = decide("--model", str(chat_model_dir), "-y", "Is it about money?", "--threshold", str(min(1.0, p + 1e-3)))
    assert r.returncode == 1 and json.loads(r.stdout)["answers"]["Is it about money?"]["noul"] == pytest.approx(p)
    r = decide("--model", str(chat_model_dir), "-y", "Is it about money?", "--table")
    assert "Is it about money?" in r.stdout and "yes" in r.stdout


@pytest.mark.parametrize("args,stdin,fragment", [
    ([], "x", "no questions"), (["-y", "q"], "  ", "state is empty"), (["-c", "Which?|only"], "x", "expected"),
    (["-S", "Rate|" + "|".join(str(i) for i in range(11))], "x", "10 levels")])
def test_bad_input_is_one_line_and_exit_2(chat_model_dir, args, stdin, fragment):
    r = decide("--model", str(chat_model_dir), *args, stdin=stdin)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 2  # one message (rich may wrap it)


def test_url_asks_a_running_server(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"api_key": "k"})
    try:
        r = decide("--url", s.url, "--api-key", "k", "-y", "Is it about money?", "--threshold", "0")
        assert r.returncode == 0 and json.loads(r.stdout)["model"] == "tiny"
        r = decide("--url", s.url, "--api-key", "wrong", "-y", "Is it about money?")
        assert r.returncode == 2 and "401" in r.stderr
    finally:
        s.close()
