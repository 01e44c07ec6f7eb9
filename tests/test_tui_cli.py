"""The real `coli chat` as a user runs it: piped, in a terminal (tmux), and --plain."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

COLI = [sys.executable, "-m", "coli.cli"]
ENV = {**os.environ, "COLI_THREADS": "1", "NO_COLOR": "1"}


def coli_chat(args, stdin: str | None, timeout=120):
    return subprocess.run(COLI + ["chat", *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=ENV)


# -- pipes ------------------------------------------------------------------------------------


def test_piped_stdout_holds_exactly_the_answer(hf_models):
    import coli

    path = hf_models("qwen3_moe")
    m = coli.load(path)
    expected = "".join(m.generate([{"role": "user", "content": "w3 w4 w5"}], max_tokens=6))
    r = coli_chat(["-m", str(path), "-n", "6", "--no-kv-persist"], "w3 w4 w5\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    assert r.stderr == ""


def test_piped_bad_model_path_is_one_error_line(tmp_path):
    r = coli_chat(["-m", str(tmp_path / "nope")], "hello\n")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope" in lines[0]


def test_piped_empty_prompt_exits_2(hf_models):
    r = coli_chat(["-m", str(hf_models("qwen3_moe"))], "  \n")
    assert r.returncode == 2 and r.stdout == "" and "empty" in r.stderr


# -- a terminal ---------------------------------------------------------------------------------


class Tmux:
    """A detached tmux server of its own, one window of a fixed size; the screen is read back."""

    def __init__(self, width=100, height=30):
        self.socket = f"coli-test-{uuid.uuid4().hex[:8]}"
        self.size = (width, height)

    def run(self, *args, check=True):
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check)

    def start(self, command: str):
        w, h = self.size
        self.run("new-session", "-d", "-x", str(w), "-y", str(h), "-s", "t", command)

    def keys(self, *keys):
        self.run("send-keys", "-t", "t", *keys)

    def type(self, text: str):
        self.run("send-keys", "-t", "t", "-l", text)

    def screen(self) -> str:
        r = self.run("capture-pane", "-t", "t", "-p", check=False)
        return r.stdout

    def wait_for(self, predicate, timeout=60.0, what="") -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.screen()
            if predicate(s):
                return s
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what!r}; the screen:\n{self.screen()}")

    def close(self):
        self.run("kill-server", check=False)


@pytest.fixture
def tmux():
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    t = Tmux()
    yield t
    t.close()


def shell_command(args: str, marker: str) -> str:
    env = " ".join(f"{k}={v}" for k, v in (("COLI_THREADS", "1"), ("HOME", os.environ.get("HOME", "/tmp"))))
    # keep the window open after exit so the test can read the exit status
    return f"cd {os.getcwd()} && env {env} {sys.executable} -m coli.cli chat {args}; echo {marker}$?; sleep 60"


def test_the_app_in_a_terminal_answers_a_question(hf_models, tmux, tmp_path):
    path = hf_models("qwen3_moe")
    tmux.start(shell_command(f"-m {path} -n 12 --no-kv-persist --kv-dir {tmp_path}", "EXIT="))
    tmux.wait_for(lambda s: "Ask something" in s, what="the prompt")
    tmux.type("w7 w8 w9")
    tmux.keys("Enter")

    def answer_lines(s):
        return [line for line in s.splitlines() if line.strip().startswith("w") and "›" not in line]

    # the model's words, read off the screen, with the turn's note under them
    screen = tmux.wait_for(lambda s: "12 tokens" in s and answer_lines(s), what="the answer")
    assert "› w7 w8 w9" in screen
    assert "Routing" in screen and "Profile" in screen and "tok/s" in screen
    tmux.keys("C-q")
    screen = tmux.wait_for(lambda s: "EXIT=" in s, timeout=30, what="exit")
    assert "EXIT=0" in screen


def test_plain_repl_answers_and_quits_on_ctrl_d(hf_models, tmux, tmp_path):
    path = hf_models("qwen3_moe")
    tmux.start(shell_command(f"-m {path} -n 5 --no-kv-persist --plain", "EXIT="))
    tmux.wait_for(lambda s: "›" in s, what="the prompt")
    tmux.type("w1 w2")
    tmux.keys("Enter")
    screen = tmux.wait_for(lambda s: s.count("›") >= 2, what="the answer and the next prompt")
    lines = screen.splitlines()
    asked = next(i for i, line in enumerate(lines) if "› w1 w2" in line)
    assert lines[asked + 1].strip().startswith("w")  # the answer, under the question
    tmux.keys("C-d")
    screen = tmux.wait_for(lambda s: "EXIT=" in s, timeout=30, what="exit")
    assert "EXIT=0" in screen


def test_plain_ctrl_c_stops_the_answer_not_the_repl(capsys):
    from coli.cli.chat import _answer
    from coli.scheduler.events import TextDelta

    class Interrupted:
        cancelled = False

        def stream(self, messages, slot):
            yield TextDelta("one ")
            yield TextDelta("two ")
            raise KeyboardInterrupt  # what Ctrl-C does to the reading loop

        def cancel(self):
            self.cancelled = True

    b = Interrupted()
    text, stopped = _answer(b, [{"role": "user", "content": "hi"}])
    assert (text, stopped, b.cancelled) == ("one two ", True, True)
    assert capsys.readouterr().out == "one two "
