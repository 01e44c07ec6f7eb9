"""The real coding agents and CLIs, run non-interactively against the server (opt-in).

    COLI_REAL_CLIENTS=1 COLI_CLIENT_PATH=/path/to/node_modules/.bin python -m pytest tests/test_real_clients.py

Each installed client (tests/agent_clients.py: Claude Code, Codex CLI, opencode, Qwen Code,
aider, llm), set up as the README says, runs one task against a live server on 127.0.0.1:
the agent test model (server_kit: a 64k context, its tokenizer knows the clients' recorded
prompts) answers with a fixed script, or, for a tool round trip (Claude Code, Codex), calls
one of the client's own tools and then answers. The test checks the client's exit status,
that it printed the answer, and that the server's access log shows its requests answered
200 on the endpoint it speaks. A client that is not installed skips with the command that
installs it. Results go in docs/SERVER.md.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from agent_clients import CLIENTS, Client
from server_kit import ScriptedSampler, build_agent_model, running

ANSWER = "Hello from coli."
pytestmark = pytest.mark.skipif(os.environ.get("COLI_REAL_CLIENTS") != "1",
                                reason="opt-in: set COLI_REAL_CLIENTS=1 (and COLI_CLIENT_PATH to where the "
                                       "clients are installed) to run the real coding agents")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    yield from running(build_agent_model(tmp_path_factory.getbasetemp()), default_script=ANSWER, ctx=65536,
                       kv_slots=2, config={"log_format": "text"})


def run(client: Client, srv, work, prompt=None, turns=1):
    argv, env = client.command(srv.url, work, *((prompt, turns) if prompt else ()))
    return subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def logged(capfd, api: str) -> list[str]:
    return [x for x in capfd.readouterr().err.splitlines() if re.search(rf" POST {re.escape(api)} \d{{3}} ", x)]


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.name)
def test_client_answers(client, srv, tmp_path, capfd):
    if client.path() is None:
        pytest.skip(f"{client.exe} is not installed: {client.install} (or put it on COLI_CLIENT_PATH)")
    ScriptedSampler.default[:] = [ANSWER]
    capfd.readouterr()
    out = run(client, srv, tmp_path)
    assert out.returncode == 0, (client.version(), out.stdout[-2000:], out.stderr[-2000:])
    assert ANSWER in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
    lines = logged(capfd, client.api)
    assert lines and all(" 200 " in x for x in lines), lines


ROUND_TRIPS = {"claude_code": ("/v1/messages", "Glob", {"pattern": "*.txt"}),
               "codex": ("/v1/responses", "exec_command", {"cmd": "ls"})}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_tool_round_trip(name, srv, tmp_path, capfd):
    """The model calls one of the client's own tools, the client runs it and sends the
    result back, the model answers."""
    client = next(c for c in CLIENTS if c.name == name)
    if client.path() is None:
        pytest.skip(f"{client.exe} is not installed: {client.install}")
    api, tool, args = ROUND_TRIPS[name]
    (tmp_path / "notes.txt").write_text("coli\n")
    call = json.dumps({"name": tool, "arguments": args})
    ScriptedSampler.default[:] = [f"<tool_call>\n{call}\n</tool_call>", "Found notes.txt."]
    capfd.readouterr()
    out = run(client, srv, tmp_path, "List the .txt files here.", 2)
    assert out.returncode == 0 and "Found notes.txt." in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
    lines = logged(capfd, api)
    assert len(lines) >= 2 and all(" 200 " in x for x in lines), lines
