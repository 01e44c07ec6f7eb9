"""The access log: one line per request on stderr, text or JSON (--log-format), with the
client's User-Agent, the tokens its generation read and wrote, queue wait and duration."""
from __future__ import annotations

import json
import re

import pytest
from server_kit import SCRIPTS, chat_model_dir, http, running  # noqa: F401 (fixtures)

from coli.server import access_log
from coli.server.config import ServerConfig
from coli.errors import InvalidRequestError


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=1, ctx=512, config={"log_format": "json"})


def lines(capfd) -> list[dict]:
    return [json.loads(x) for x in capfd.readouterr().err.splitlines() if x.startswith("{")]


def test_one_json_line_per_request(srv, capfd):
    capfd.readouterr()
    SCRIPTS[9501] = "Logged."
    status, _, m = http(srv, "POST", "/v1/messages?beta=true", {"model": "tiny", "max_tokens": 20, "seed": 9501,
                                                                "messages": [{"role": "user", "content": "hi"}]},
                        {"User-Agent": "claude-cli/2.1.197 (external, cli)"})
    assert status == 200
    http(srv, "POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
         {"User-Agent": "aider"})
    http(srv, "GET", "/health")
    (gen, missing, health) = lines(capfd)
    assert gen["method"] == "POST" and gen["path"] == "/v1/messages" and gen["status"] == 200
    assert gen["client"] == "claude-cli/2.1.197 (external, cli)"
    u = m["usage"]
    assert gen["prompt_tokens"] == u["input_tokens"] + u["cache_read_input_tokens"]
    assert gen["cached_tokens"] == u["cache_read_input_tokens"] and gen["completion_tokens"] == u["output_tokens"]
    assert gen["queue_wait_ms"] >= 0 and gen["duration_ms"] >= 0 and re.match(r"\d{4}-\d\d-\d\dT.*Z$", gen["time"])
    assert missing["status"] == 404 and missing["client"] == "aider" and missing["completion_tokens"] == 0
    assert health["path"] == "/health" and health["status"] == 200


def test_text_format_and_the_setting():
    rec = {"time": "2026-12-01T02:00:00.000Z", "method": "POST", "path": "/v1/responses", "status": 200,
           "client": "codex_exec/0.171.0", "prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3,
           "queue_wait_ms": 0, "duration_ms": 12}
    assert access_log.line(rec, "text") == ('2026-12-01T02:00:00.000Z POST /v1/responses 200 "codex_exec/0.171.0" '
                                            "prompt=10 cached=4 completion=3 queue_ms=0 ms=12")
    assert ServerConfig.from_env({"COLI_LOG_FORMAT": "json"}).log_format == "json"
    assert ServerConfig.from_env({}).log_format == "text"
    with pytest.raises(InvalidRequestError, match="--log-format"):
        ServerConfig(log_format="xml")
