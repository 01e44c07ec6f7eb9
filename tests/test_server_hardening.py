"""Issue #15's server defects, each reproduced over real HTTP on 127.0.0.1: a large request
does not stall others, bad text and deep JSON are 400s, a request that can never fit is a
400, an empty x-api-key is absent, idle and slow connections are closed, the connection
cap holds, OPTIONS/metrics/NaN details. Waits are bounded generously, never benchmarked."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from server_kit import WAIT, Running, chat_model_dir, http, running  # noqa: F401 (fixtures)

USER = [{"role": "user", "content": "Hello there"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2}
SLOW = 10  # seconds: a bound that only a stalled event loop or a never-closed socket reaches


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=2, max_queue=2, ctx=512)


def host_port(srv) -> tuple[str, int]:
    host, port = srv.url.rsplit("/", 1)[-1].split(":")
    return host, int(port)


# -- 2: lone surrogates ---------------------------------------------------------------------------


SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, as the attacker sent it


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" + SURROGATE}]},
     "messages[0].content"),
    ("/v1/completions", {"model": "tiny", "prompt": SURROGATE, "max_tokens": 1}, "prompt"),
    ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages[0].content[0].text"),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages[0].content"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/v1/brio", {"model": "tiny", "state": "x", "options": ["a", "b" + SURROGATE]}, "options[1]"),
    ("/v1/chat/completions", {**CHAT, "stop": ["\udc00"]}, "stop[0]"),
    ("/v1/chat/completions", {**CHAT, "metadata": {"k" + SURROGATE: 1}}, "metadata.k\\ud800"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(srv, path, body, param):
    status, _, out = http(srv, "POST", path, body)
    assert status == 400, out
    message = out["error"]["message"]
    assert message.startswith(param + ":") and "surrogate" in message
    if not path.startswith("/v1/messages"):
        assert out["error"]["param"] == param


# -- 3: deep JSON ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"[" * 100000 + b"]" * 100000,
                                 b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}",
                                 b'{"a": ' + b'{"b": ' * 500 + b"1" + b"}" * 501])
def test_deeply_nested_json_is_a_400(srv, raw):
    for path in ("/v1/chat/completions", "/v1/messages"):
        status, _, out = http(srv, "POST", path, raw=raw)
        assert status == 400, out
        assert "nested too deeply" in (out["error"]["message"])


# -- 7: never fits --------------------------------------------------------------------------------


def test_choices_that_can_never_fit_are_a_400_not_a_429(srv):
    status, headers, out = http(srv, "POST", "/v1/chat/completions", {**CHAT, "n": 16})
    assert status == 400 and "retry-after" not in headers, out
    assert out["error"]["code"] == "too_many_choices" and "2 KV slot" in out["error"]["message"]
    # as many as the slots and the queue hold together are served
    status, _, out = http(srv, "POST", "/v1/chat/completions", {**CHAT, "n": 4, "max_tokens": 1})
    assert status == 200 and len(out["choices"]) == 4
    status, _, out = http(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2,
                                                            "max_tokens": 1})
    assert status == 400 and out["error"]["code"] == "too_many_choices"


# -- 8: an empty x-api-key ------------------------------------------------------------------------


def test_an_empty_x_api_key_counts_as_absent(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"api_key": "s3cret"})
    try:
        status, _, out = http(s, "GET", "/v1/models", headers={"x-api-key": "", "Authorization": "Bearer s3cret"})
        assert status == 200, out
        assert http(s, "GET", "/v1/models", headers={"x-api-key": ""})[0] == 401
        assert http(s, "GET", "/v1/models", headers={"x-api-key": "wrong", "Authorization": "Bearer s3cret"})[0] == 401
    finally:
        s.close()


# -- 1: length, body limit, responsiveness --------------------------------------------------------


def test_text_that_cannot_fit_is_refused_by_its_length(srv):
    big = "hello " * 100_000  # 600 k characters for a 512-token context
    for path, body in (("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": big}]}),
                       ("/v1/completions", {"model": "tiny", "prompt": big}),
                       ("/v1/messages", {**CHAT, "messages": [{"role": "user", "content": big}]})):
        status, _, out = http(srv, "POST", path, body)
        assert status == 400, out
        message = out["error"]["message"]
        assert "characters" in message and "512 tokens" in message  # refused by length, not after tokenizing
    # /tokenize counts any text within the body limit
    status, _, out = http(srv, "POST", "/tokenize", {"prompt": big})
    assert status == 200 and out["count"] > 512


def test_the_default_body_limit_is_4_mib(srv):
    status, _, out = http(srv, "POST", "/tokenize", raw=json.dumps({"prompt": "x" * (5 << 20)}).encode())
    assert status == 413 and "4194304" in out["error"]["message"]


def test_health_and_a_stream_keep_answering_while_large_requests_are_prepared(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=2, ctx=512, config={"max_body": 64 << 20})
    try:
        big_tokenize = json.dumps({"prompt": "hello " * 500_000}).encode()  # 3 MB: seconds of tokenizing
        big_prompt = json.dumps({"model": "tiny", "prompt": "hello " * 850_000}).encode()  # 5 MB
        results, took = {}, {}

        def post(name, path, raw):
            t0 = time.monotonic()
            results[name] = http(s, "POST", path, raw=raw)[0]
            took[name] = time.monotonic() - t0

        workers = [threading.Thread(target=post, args=("tokenize", "/tokenize", big_tokenize)),
                   threading.Thread(target=post, args=("prompt", "/v1/completions", big_prompt))]
        stream = {"gaps": [], "done": False}

        def streaming():
            no_end = {str(t): -100 for t in s.tokenizer.special_token_ids}
            sock = socket.create_connection(host_port(s), timeout=WAIT)
            body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 100, "stream": True,
                               "logit_bias": no_end}).encode()
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            last, data = time.monotonic(), b""
            while b"[DONE]" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                now = time.monotonic()
                stream["gaps"].append(now - last)
                last, data = now, data + chunk
            stream["done"] = b"[DONE]" in data
            sock.close()

        for w in workers:
            w.start()
        time.sleep(0.3)  # the bodies are on their way or being prepared
        streamer = threading.Thread(target=streaming)
        streamer.start()
        health = []
        while workers[0].is_alive() or not health:
            t0 = time.monotonic()
            assert http(s, "GET", "/health")[0] == 200
            health.append(time.monotonic() - t0)
            time.sleep(0.05)
        for w in (*workers, streamer):
            w.join(WAIT)
        assert results == {"tokenize": 200, "prompt": 400}
        # a blocked loop would hold /health (and the stream) for about as long as the tokenizing took
        bound = max(took["tokenize"] / 2, 2.0)
        assert max(health) < bound, (health, took)
        assert stream["done"] and max(stream["gaps"]) < bound, (stream, took)
    finally:
        s.close()


# -- 4: timeouts and the connection cap ------------------------------------------------------------


@pytest.fixture(scope="module")
def strict(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"request_timeout": 0.5, "idle_timeout": 0.5,
                                                    "max_connections": 4})
    yield s
    s.close()


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None when it kept the socket open."""
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        return data


def test_a_slow_request_head_is_closed(strict):
    sock = socket.create_connection(host_port(strict))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and the rest never comes
    assert closed_within(sock, SLOW) is not None
    sock = socket.create_connection(host_port(strict))  # nothing at all
    assert closed_within(sock, SLOW) == b""


def test_a_slow_body_gets_408(strict):
    sock = socket.create_connection(host_port(strict))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\":")
    data = closed_within(sock, SLOW)
    assert data is not None and data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data


def test_an_idle_keepalive_connection_is_closed(strict):
    sock = socket.create_connection(host_port(strict))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = closed_within(sock, SLOW)
    assert data is not None and data.startswith(b"HTTP/1.1 200")


def test_idle_connections_past_the_cap_make_room(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"max_connections": 4})  # timeouts far away: only the cap acts
    idle = [socket.create_connection(host_port(s)) for _ in range(12)]
    try:
        for _ in range(3):
            assert http(s, "GET", "/health")[0] == 200
        closed = [closed_within(sock, 0.5) is not None for sock in idle]
        assert closed[:8] == [True] * 8 and sum(closed) <= 9, closed  # the idlest went, the newest stay
    finally:
        for sock in idle:
            sock.close()
        s.close()


# -- 9: the smaller ones --------------------------------------------------------------------------


def test_options_advertises_the_methods_of_the_route(srv):
    status, headers, _ = http(srv, "OPTIONS", "/health", headers={"Origin": "http://localhost:5173",
                                                                  "Access-Control-Request-Method": "GET"})
    assert status == 204 and "POST" not in headers["allow"] and "GET" in headers["allow"]
    assert "POST" not in headers["access-control-allow-methods"]
    status, headers, _ = http(srv, "OPTIONS", "/v1/chat/completions")
    assert status == 204 and headers["allow"] == "POST, OPTIONS"


def test_metrics_use_the_0_0_4_text_format(srv):
    status, headers, _ = http(srv, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")


def test_nan_is_named_as_nan(srv):
    raw = json.dumps({**CHAT, "temperature": float("nan")}).encode()
    status, _, out = http(srv, "POST", "/v1/chat/completions", raw=raw)
    assert status == 400 and out["error"]["message"] == "temperature: expected a number, got NaN"


def test_openapi_carries_the_cross_field_rules(srv):
    jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema (in the test extra)")
    doc = http(srv, "GET", "/openapi.json")[2]

    def valid(name: str, body: dict) -> bool:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    chat = {"model": "tiny", "messages": USER}
    assert valid("ChatCompletionRequest", chat) and valid("ChatCompletionRequest", {**chat, "top_logprobs": None})
    assert not valid("ChatCompletionRequest", {**chat, "top_logprobs": 2})
    assert valid("ChatCompletionRequest", {**chat, "top_logprobs": 2, "logprobs": True})
    assert not valid("ChatCompletionRequest", {**chat, "tool_choice": "required"})
    assert not valid("ChatCompletionRequest", {**chat, "n": 16})  # 2 slots + 2 waiting
    brio = {"model": "tiny", "options": ["a", "b"]}
    assert valid("BrioRequest", {**brio, "state": "x"}) and valid("BrioRequest", {**brio, "messages": USER})
    assert not valid("BrioRequest", brio) and not valid("BrioRequest", {**brio, "state": "x", "messages": USER})
    # and the server agrees
    assert http(srv, "POST", "/v1/chat/completions", {**chat, "top_logprobs": 2})[0] == 400
    assert http(srv, "POST", "/v1/brio", {**brio, "state": "x", "messages": USER})[0] == 400
