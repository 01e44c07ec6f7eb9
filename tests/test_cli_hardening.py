"""Issue #15's CLI defects, as a new user meets them: option errors are one line, every
setting has a COLI_* variable that works, a cut answer says so, convert and kv inspect
name the real problem, the plain REPL knows its commands, Ctrl+D quits the app."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WAIT = 120


def coli(*args, env=None, stdin=None):
    return subprocess.run([sys.executable, "-m", "coli.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "COLI_THREADS": "1", "COLUMNS": "100", **(env or {})}, timeout=WAIT,
                          input=stdin if stdin is not None else "")


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr and "╭" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("args,needles", [
    (("serve", "--threads", "0"), ("--threads", "1")),
    (("run", "hi", "--quant", "int5"), ("--quant", "int4", "bf16")),
    (("convert", "a", "b", "-q", "q9"), ("--quant", "int8")),
    (("run", "hi", "--no-such-option"), ("--no-such-option",)),
    (("nosuch",), ("nosuch",)),
])
def test_option_errors_are_one_line(args, needles):
    one_line_error(coli(*args), *needles)


def test_quant_is_a_choice_list_in_help():
    out = coli("run", "--help").stdout
    assert "f32|bf16|int8|int4" in out.replace(" ", "")


def test_every_server_and_model_option_has_a_coli_variable():
    import typer

    from coli.cli.main import app

    by_hand = {"--allowed-host", "--cors-origin"}  # COLI_ALLOWED_HOSTS / COLI_CORS_ORIGINS, comma-separated lists
    missing = []
    for name in ("serve", "web"):
        command = typer.main.get_command(app).commands[name]
        for p in command.params:
            if getattr(p, "param_type_name", "") == "option" and p.opts[0] != "--help" \
                    and not p.envvar and p.opts[0] not in by_hand:
                missing.append(f"{name} {p.opts[0]}")
    for name in ("run", "chat"):
        command = typer.main.get_command(app).commands[name]
        for p in command.params:
            if p.opts[0] in ("--ctx", "--pin", "--kv-persist", "--slots", "--quant", "--kv-dir") and not p.envvar:
                missing.append(f"{name} {p.opts[0]}")
    assert not missing


def test_convert_of_a_missing_source_says_so(tmp_path):
    one_line_error(coli("convert", str(tmp_path / "nope"), str(tmp_path / "out")), "no such directory or file")


def test_a_cut_answer_says_why_on_stderr_and_coli_ctx_works(hf_models):
    model = str(hf_models("qwen3_moe"))  # a word-level vocabulary without an end token: it never stops by itself
    r = coli("run", "--raw", "w1 w2 w3", "-m", model, "-n", "50", "--no-kv-persist", env={"COLI_CTX": "8"})
    assert r.returncode == 0, r.stderr
    assert "cut at the end of the context (8 tokens" in r.stderr, r.stderr
    assert len(r.stdout.split()) == 8 - 3  # the context held 3 prompt tokens and 5 generated
    r = coli("run", "--raw", "w1 w2 w3", "-m", model, "-n", "2", "--no-kv-persist")
    assert r.returncode == 0 and "cut at --max-tokens 2" in r.stderr, r.stderr
    r = coli("run", "--raw", "w1", "-m", model, "-n", "1", "--ctx", "100000", "--no-kv-persist")
    assert r.returncode == 0 and "--ctx 100000 is more than this model holds: using 256" in r.stderr, r.stderr


def test_plain_repl_knows_its_commands(monkeypatch, tmp_path):
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    import coli.cli.chat as chat
    from coli.scheduler.events import TextDelta

    class Recording:
        name = "recording"

        def __init__(self):
            self.sent = []

        def stream(self, messages, slot):
            self.sent.append([dict(m) for m in messages])
            yield TextDelta("ok")

        def cancel(self):
            pass

    monkeypatch.setattr(chat, "HISTORY_FILE", tmp_path / "history")
    printed = []
    monkeypatch.setattr(chat.stderr, "print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    backend = Recording()
    with create_pipe_input() as pipe:
        pipe.send_text("/bogus thing\r/system be brief\rhello\r//slash\r\x04")
        with create_app_session(input=pipe, output=DummyOutput()):
            chat._repl(backend, None)
    assert any("unknown command /bogus" in p for p in printed), printed
    assert any("system prompt set" in p for p in printed), printed
    assert backend.sent[0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert backend.sent[1][-1] == {"role": "user", "content": "/slash"}
    assert len(backend.sent) == 2  # /bogus never reached the model


def test_ctrl_d_quits_the_full_screen_chat_even_with_text_in_the_box(tmp_path):
    pytest.importorskip("textual")
    from test_tui import ScriptedBackend

    from coli.tui.app import ChatApp

    async def body():
        app = ChatApp(ScriptedBackend(), history_file=tmp_path / "h")
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.click("#prompt")
            app.query_one("#prompt").value = "half a thought"
            app.query_one("#prompt").cursor_position = 0
            await pilot.press("ctrl+d")
            await pilot.pause(0.2)
            return app.return_code, app.query_one("#prompt").value if app.is_running else None

    code, left = asyncio.run(body())
    assert code == 0, left


def test_loading_reports_progress(hf_models):
    import coli

    seen = []
    m = coli.load(hf_models("qwen3_moe"), quant="int8", threads=1, progress=lambda done, total: seen.append((done,
                                                                                                            total)))
    m.close()
    total = seen[-1][1]
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1)) and seen[-1][0] == total > 10


def test_a_progress_line_while_loading_on_a_terminal_only(hf_models):
    import pty
    import select

    model = str(hf_models("qwen3_moe"))
    args = [sys.executable, "-m", "coli.cli", "run", "--raw", "w1", "-m", model, "-n", "1", "--no-kv-persist"]
    env = {**os.environ, "COLI_THREADS": "1", "COLUMNS": "100", "TERM": "xterm"}
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, cwd=ROOT, env=env)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], WAIT)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read()
    assert proc.wait(WAIT) == 0, seen
    os.close(master)
    assert b"Loading model" in seen and b"tensors" in seen, seen
    assert b"Loading" not in out  # stdout holds the answer only
    piped = coli("run", "--raw", "w1", "-m", model, "-n", "1", "--no-kv-persist")
    assert piped.returncode == 0 and "Loading" not in piped.stderr, piped.stderr
