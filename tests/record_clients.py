"""Record the requests real clients send: the fixtures under tests/fixtures/clients/.

    COLI_CLIENT_PATH=/tmp/clients/node_modules/.bin python tests/record_clients.py [NAME ...]

Starts the tiny scripted chat model (tests/server_kit.py) with a 32k context, puts a
recording proxy (tests/client_capture.py) in front of it, runs each installed client
(tests/agent_clients.py) for one turn, and writes what it sent to
tests/fixtures/clients/NAME.json: {"client", "version", "requests": [...]}. Bodies are
kept whole; keys are redacted. tests/test_client_fixtures.py replays them.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

ANSWER = "Hello from coli."
# a tool round trip: the first answer calls a tool, the next (with its result) answers
ROUND_TRIPS = {"claude_code": ['<tool_call>\n{"name": "Glob", "arguments": {"pattern": "*.txt"}}\n</tool_call>',
                               "Found notes.txt."],
               "codex": ['<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>',
                         "Found notes.txt."]}
ROUND_TRIP_ARGS = ("List the .txt files here.", 2)
FIXTURES = HERE / "fixtures" / "clients"


def main(names: list[str]) -> int:
    import pytest

    from agent_clients import BY_NAME, CLIENTS
    from client_capture import CaptureProxy
    from server_kit import ScriptedSampler, build_agent_model, running

    chosen = [BY_NAME[n.removesuffix("_tools")] for n in names] if names else CLIENTS
    runs = [(c, n.endswith("_tools")) for c, n in zip(chosen, names)] if names else [(c, False) for c in chosen]
    runs += [(BY_NAME[n], True) for n in ROUND_TRIPS if not names]
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_agent_model(Path(tmp))
        gen = running(model_dir, default_script=ANSWER, ctx=65536, kv_slots=2)
        srv = next(gen)
        try:
            for client, tools in runs:
                if client.path() is None:
                    print(f"{client.name}: not installed ({client.install})", file=sys.stderr)
                    continue
                name = client.name + ("_tools" if tools else "")
                ScriptedSampler.default[:] = ROUND_TRIPS[client.name] if tools else [ANSWER]
                with CaptureProxy(srv.url) as proxy:
                    work = Path(tmp) / name
                    work.mkdir()
                    (work / "notes.txt").write_text("coli\n")
                    argv, env = client.command(proxy.url, work, *(ROUND_TRIP_ARGS if tools else ()))
                    try:
                        out = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=240,
                                             stdin=subprocess.DEVNULL)
                        rc, text = out.returncode, out.stdout + out.stderr
                    except subprocess.TimeoutExpired as e:
                        rc, text = "timeout", str(e.stdout or "") + str(e.stderr or "")
                record = {"client": client.name, "version": client.version(), "exit": rc,
                          "requests": proxy.requests}
                (FIXTURES / f"{name}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
                print(f"{name} {record['version']}: exit {rc}, {len(proxy.requests)} request(s): "
                      f"{[(r['method'], r['path'], r.get('status')) for r in proxy.requests]}\n{text[-1500:]}",
                      file=sys.stderr)
        finally:
            gen.close()
    del pytest
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
