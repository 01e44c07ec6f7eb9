"""Raw HTTP against a real listener on 127.0.0.1: API-shaped errors, the API key, the Host
allowlist, CORS, the body limit, 429s, disconnects, slow readers, /metrics, /health,
/experts, /profile and Brio. No timing assertions: waits are bounded, never measured."""
from __future__ import annotations

import base64
import json
import socket
import threading
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_kit import WAIT, Running, chat_model_dir, http, running  # noqa: F401 (fixtures)

from coli.metrics import BUCKETS

USER = [{"role": "user", "content": "Hello there"}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 3}


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    yield from running(chat_model_dir, kv_slots=2, max_queue=2, ctx=1024)


def wait_for(cond, what: str):
    end = time.monotonic() + WAIT
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def no_end(srv) -> dict:
    return {str(t): -100 for t in srv.tokenizer.special_token_ids}


class Gate:
    """Holds the engine at its next step until opened (so a request stays in its slot)."""

    def __init__(self, srv, monkeypatch):
        self.open_ = threading.Event()
        self.entered = threading.Event()
        real = srv.runner.engine.step

        def held(entries, **kw):
            self.entered.set()
            self.open_.wait(WAIT)
            return real(entries, **kw)

        monkeypatch.setattr(srv.runner.engine, "step", held)

    def open(self):
        self.open_.set()


def raw_request(srv, body: dict, path="/v1/chat/completions", rcvbuf: int | None = None) -> socket.socket:
    host, port = srv.url.rsplit("/", 1)[-1].split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,fragment", [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                          (b"", "empty")])
def test_malformed_bodies_get_api_shaped_400s(srv, raw, fragment):
    for path, anthropic in (("/v1/chat/completions", False), ("/v1/messages", True), ("/v1/brio", False)):
        status, _, body = http(srv, "POST", path, raw=raw)
        assert status == 400
        if anthropic:
            assert body["type"] == "error" and fragment in body["error"]["message"]
        else:
            assert body["error"]["type"] == "invalid_request_error" and fragment in body["error"]["message"]


@pytest.mark.parametrize("field,value", [("messages", "hi"), ("messages", []), ("messages", [{"role": "robot",
                                                                                              "content": "x"}]),
                                         ("max_tokens", "3"), ("n", True), ("stop", [1]), ("tools", {"a": 1}),
                                         ("cache_slot", 99), ("top_k", -5), ("logprobs", 1)])
def test_wrong_types_and_values_name_the_field(srv, field, value):
    status, _, body = http(srv, "POST", "/v1/chat/completions", {**CHAT, field: value})
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if field != "cache_slot":
        assert err["param"].split("[")[0].split(".")[0] == field


def test_unknown_paths_and_methods_are_api_shaped(srv):
    status, _, body = http(srv, "GET", "/v2/nothing")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, headers, body = http(srv, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


def test_body_size_limit(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"max_body": 4096})
    try:
        status, _, body = http(s, "POST", "/v1/chat/completions", {**CHAT, "pad": "x" * 5000})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        status, _, body = http(s, "POST", "/v1/messages", {**CHAT, "pad": "x" * 5000})
        assert status == 413 and body["error"]["type"] == "request_too_large"
    finally:
        s.close()


# -- security ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, config={"api_key": "s3cret", "allowed_hosts": ("llm.example.com",),
                                                    "cors_origins": ("https://ui.example",)})
    yield s
    s.close()


ENDPOINTS = [("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None), ("POST", "/v1/chat/completions", CHAT),
             ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}),
             ("POST", "/v1/messages", CHAT), ("POST", "/v1/messages/count_tokens", CHAT),
             ("POST", "/v1/brio", {"model": "tiny", "state": "x", "options": ["a", "b"]}),
             ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/metrics", None), ("GET", "/experts", None), ("GET", "/profile", None),
             ("GET", "/openapi.json", None)]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_api_key_guards_every_endpoint(keyed, method, path, body):
    status, headers, err = http(keyed, method, path, body)
    assert status == 401 and headers.get("www-authenticate") == "Bearer"
    assert (err["error"]["type"] if "type" not in err else err["error"]["type"]) == "authentication_error"
    assert http(keyed, method, path, body, {"Authorization": "Bearer wrong"})[0] == 401
    assert http(keyed, method, path, body, {"Authorization": "Bearer s3cret"})[0] == 200
    assert http(keyed, method, path, body, {"x-api-key": "s3cret"})[0] == 200


def test_health_has_a_public_part(keyed):
    status, _, public = http(keyed, "GET", "/health")
    assert status == 200 and public["status"] == "ok" and "active" in public and "slots" in public
    assert "model" not in public and "memory" not in public
    _, _, full = http(keyed, "GET", "/health", headers={"x-api-key": "s3cret"})
    assert full["model"] == "tiny" and full["memory"]["experts_ram_bytes"] > 0 and full["hardware"]["threads"] == 1 \
        and full["hardware"]["threads_in_use"] == 1 and full["kv_cache_dtype"] == "f16"


@pytest.mark.parametrize("host,ok", [("127.0.0.1:8000", True), ("localhost", True), ("[::1]:8000", True),
                                     ("127.9.9.9", True), ("llm.example.com", True), ("LLM.example.com:443", True),
                                     ("evil.example.com", False), ("localhost.evil.com", False),
                                     ("example.com.llm.example.com", False), ("", False)])
def test_host_allowlist_blocks_dns_rebinding(keyed, host, ok):
    status, _, body = http(keyed, "GET", "/v1/models", headers={"Host": host, "x-api-key": "s3cret"})
    assert (status == 200) == ok
    if not ok:
        assert status == 403 and body["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("origin,ok", [("http://localhost:5173", True), ("tauri://localhost", True),
                                       ("https://ui.example", True), ("https://ui.example.evil", False),
                                       ("http://localhost:5174", False), ("null", False)])
def test_cors_preflight_and_requests(keyed, origin, ok):
    status, headers, _ = http(keyed, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    if ok:
        assert status == 204 and headers["access-control-allow-origin"] == origin
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"]
    else:
        assert status == 403 and "access-control-allow-origin" not in headers
    status, headers, _ = http(keyed, "POST", "/v1/chat/completions", CHAT,
                              {"Origin": origin, "Authorization": "Bearer s3cret"})
    assert (status == 200) == ok
    assert (headers.get("access-control-allow-origin") == origin) == ok
    if ok:
        assert "x-colibri-queue-wait-ms" in headers["access-control-expose-headers"]


def test_same_origin_pages_are_allowed(keyed):
    host = keyed.url.split("//")[1]
    status, headers, _ = http(keyed, "GET", "/v1/models", headers={"Origin": f"http://{host}", "x-api-key": "s3cret"})
    assert status == 200 and headers["access-control-allow-origin"] == f"http://{host}"


# -- flow control -------------------------------------------------------------------------------


def test_saturated_queue_gets_429_before_streaming_headers(chat_model_dir, monkeypatch):
    s = Running(chat_model_dir, kv_slots=1, max_queue=0)
    gate = Gate(s, monkeypatch)
    try:
        holder = threading.Thread(target=http, args=(s, "POST", "/v1/chat/completions", CHAT))
        holder.start()
        gate.entered.wait(WAIT)
        for body in (CHAT, {**CHAT, "stream": True}):
            status, headers, err = http(s, "POST", "/v1/chat/completions", body)
            assert status == 429 and headers["retry-after"] == "1"
            assert headers["content-type"].startswith("application/json")
            assert err["error"]["code"] == "queue_full" and err["error"]["type"] == "rate_limit_error"
        status, _, err = http(s, "POST", "/v1/messages", {**CHAT, "stream": True})
        assert status == 429 and err["error"]["type"] == "rate_limit_error"
        gate.open()
        holder.join(WAIT)
        status, headers, _ = http(s, "POST", "/v1/chat/completions", CHAT)
        assert status == 200 and int(headers["x-colibri-queue-wait-ms"]) >= 0
    finally:
        gate.open()
        s.close()


def test_queue_timeout_gets_429(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=1, max_queue=2, runner={"queue_timeout": 0.05})
    try:
        # a long generation holds the only slot (deadlines are checked between engine steps)
        holder = raw_request(s, {**CHAT, "max_tokens": 100000, "stream": True, "logit_bias": no_end(s)})
        wait_for(lambda: s.runner.scheduler.snapshot()["active"] == 1, "the slot to be taken")
        status, headers, err = http(s, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 429 and err["error"]["code"] == "queue_timeout" and headers["retry-after"]
        holder.close()
    finally:
        s.close()


def test_disconnect_frees_the_slot(srv):
    sched = srv.runner.scheduler
    before = sched.snapshot()["cancelled"]
    sock = raw_request(srv, {**CHAT, "max_tokens": 100000, "stream": True, "logit_bias": no_end(srv)})
    assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    sock.close()
    wait_for(lambda: sched.snapshot()["cancelled"] == before + 1 and sched.snapshot()["active"] == 0,
             "the stream's request to be cancelled")
    # a non-streaming request whose client leaves is cancelled too
    sock = raw_request(srv, {**CHAT, "max_tokens": 100000, "logit_bias": no_end(srv)})
    wait_for(lambda: sched.snapshot()["active"] == 1, "the request to be admitted")
    sock.close()
    wait_for(lambda: sched.snapshot()["cancelled"] == before + 2 and sched.snapshot()["active"] == 0,
             "the request to be cancelled")
    assert srv.runner.metrics.value("colibri_scheduler_active") == 0


def test_a_client_that_stops_reading_does_not_slow_another_stream(chat_model_dir):
    s = Running(chat_model_dir, kv_slots=2, ctx=1024, config={
        "stream_high": 2048, "stream_low": 512, "stream_ceiling": 16384, "send_buffer": 4096})
    try:
        sched = s.runner.scheduler
        slow = raw_request(s, {**CHAT, "max_tokens": 100000, "stream": True, "logit_bias": no_end(s)}, rcvbuf=4096)
        wait_for(lambda: sched.snapshot()["active"] == 1, "the slow client's request to start")
        fast = s.openai().chat.completions.create(model="tiny", messages=USER, max_tokens=30, stream=True,
                                                  logit_bias=no_end(s))
        text = "".join(c.choices[0].delta.content or "" for c in fast if c.choices)
        assert len(s.tokenizer.encode(text, add_special_tokens=False)) >= 20
        dropped = s.server.telemetry.metrics.dropped_total
        wait_for(lambda: dropped._value.get() == 1, "the slow stream to be dropped at its byte ceiling")
        wait_for(lambda: sched.snapshot()["active"] == 0, "the slow stream's request to be cancelled")
        assert sched.snapshot()["cancelled"] == 1
        slow.close()
    finally:
        s.close()


# -- observability --------------------------------------------------------------------------------

SPEC_SERIES = {"active": "gauge", "queued": "gauge", "capacity": "gauge", "max_queue": "gauge",
               "admitted": "counter", "completed": "counter", "failed": "counter", "rejected": "counter",
               "timed_out": "counter", "cancelled": "counter", "queue_wait_seconds": "histogram",
               "slot_duration_seconds": "histogram", "first_output_seconds": "histogram",
               "engine_call_seconds": "histogram", "prompt_tokens": "counter", "cached_tokens": "counter",
               "prefix_hits": "counter", "kv_tokens": "gauge", "kv_capacity_tokens": "gauge"}


def test_metrics_in_prometheus_text_format(srv):
    http(srv, "POST", "/v1/chat/completions", CHAT)
    status, headers, text = http(srv, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for suffix, kind in SPEC_SERIES.items():
        f = families["colibri_scheduler_" + suffix]
        assert f.type == kind, suffix
        if kind == "histogram":
            les = sorted({float(x.labels["le"]) for x in f.samples if x.name.endswith("_bucket")})
            assert les == sorted(BUCKETS)
            assert {x.name.rsplit("_", 1)[-1] for x in f.samples} >= {"bucket", "sum", "count"}
    value = {x.name: x.value for f in families.values() for x in f.samples if not x.labels}
    assert value["colibri_scheduler_admitted_total"] >= 1 and value["colibri_scheduler_capacity"] == 2
    assert families["colibri_server_requests"].type == "counter"
    assert all(x.labels.keys() <= {"endpoint", "status", "le"} for f in families.values() for x in f.samples)


def test_gauges_return_to_zero_after_aborted_clients(srv):
    socks = [raw_request(srv, {**CHAT, "max_tokens": 100000, "stream": True, "logit_bias": no_end(srv)})
             for _ in range(3)]  # 2 slots: two run, one waits
    sched = srv.runner.scheduler
    wait_for(lambda: sched.snapshot()["active"] == 2 and sched.snapshot()["queued"] == 1, "2 running, 1 queued")
    for sock in socks:
        sock.close()
    wait_for(lambda: sched.snapshot()["active"] == 0 and sched.snapshot()["queued"] == 0, "an idle scheduler")
    _, _, text = http(srv, "GET", "/metrics")
    value = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
    assert value["colibri_scheduler_active"] == 0 and value["colibri_scheduler_queued"] == 0
    assert value["colibri_server_streams_open"] == 0


def test_health_experts_and_profile(srv):
    status, _, h = http(srv, "GET", "/health")
    assert status == 200 and h["status"] == "ok" and h["capacity"] == 2 and len(h["slots"]) == 2
    _, _, before = http(srv, "GET", "/experts")
    http(srv, "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    _, _, g = http(srv, "GET", "/experts")
    cfg = srv.model.config
    assert (g["rows"], g["cols"]) == (cfg.num_hidden_layers, cfg.num_experts) and g["seq"] > before["seq"]
    cells = np.frombuffer(base64.b64decode(g["cells"]), np.uint8).reshape(g["rows"], g["cols"])
    assert ((cells >> 6) == 1).all()  # resident experts: tier RAM
    heat = cells & 63
    counts = srv.model.engine.heat()
    assert (heat == np.array([[int(c).bit_length() for c in row] for row in counts])).all()
    routed = np.unpackbits(np.frombuffer(base64.b64decode(g["routed"]), np.uint8), bitorder="little")
    routed = routed[: g["rows"] * g["cols"]].reshape(g["rows"], g["cols"])
    assert (routed.sum(axis=1) == cfg.num_experts_per_tok).all()  # one decode token, k experts per layer
    _, _, p = http(srv, "GET", "/profile")
    turn = p["turns"][-1]
    assert turn["completion_tokens"] == 4 and turn["forward_passes"] >= 4 and turn["other_seconds"] >= 0
    assert p["totals"]["forward_passes"] >= turn["forward_passes"]


# -- brio ---------------------------------------------------------------------------------------


def test_brio_scores_options_from_one_prefix(srv):
    options = ["Paris", "Tokyo", "London is big"]
    before = srv.runner.metrics.value("colibri_scheduler_cached_tokens_total")
    status, headers, r = http(srv, "POST", "/v1/brio", {"model": "tiny", "state": "The capital of France.",
                                                        "question": "Which city?", "options": options})
    assert status == 200 and r["object"] == "brio.choice" and "x-colibri-queue-wait-ms" in headers
    ps = [c["p"] for c in r["choices"]]
    assert sum(ps) == pytest.approx(1.0) and 0 <= r["entropy"] <= 1
    assert r["answer"] == options[int(np.argmax(ps))]
    # each option's log-probability is what the model computes for it after the prefix
    tok = srv.tokenizer
    prefix = srv.model.prompt_ids([{"role": "user", "content": "The capital of France.\n\nWhich city?"}],
                                  enable_thinking=False)
    for c in r["choices"]:
        ids = tok.encode(c["option"], add_special_tokens=False)
        lp = srv.model.forward(prefix + ids).astype(np.float64)
        lp -= np.log(np.exp(lp - lp.max(-1, keepdims=True)).sum(-1, keepdims=True)) + lp.max(-1, keepdims=True)
        want = sum(lp[len(prefix) - 1 + j, t] for j, t in enumerate(ids))
        assert c["logprob"] == pytest.approx(want, abs=1e-3) and c["tokens"] == len(ids)
        assert c["mean_logprob"] == pytest.approx(want / len(ids), abs=1e-3)
    assert r["usage"] == {"prompt_tokens": len(prefix), "completion_tokens": 0,
                          "read_tokens": sum(c["tokens"] for c in r["choices"]),
                          "total_tokens": len(prefix) + sum(c["tokens"] for c in r["choices"])}
    # the prefix is computed once, stays in the slot, and the same context asked again reuses it
    http(srv, "POST", "/v1/brio", {"model": "tiny", "state": "The capital of France.", "question": "Which city?",
                                   "options": options[:2]})
    reused = srv.runner.metrics.value("colibri_scheduler_cached_tokens_total") - before
    assert reused >= len(prefix) - 1
    s = http(srv, "POST", "/v1/brio", {"model": "tiny", "messages": USER, "options": options, "normalize": "sum"})[2]
    assert s["normalize"] == "sum" and sum(c["p"] for c in s["choices"]) == pytest.approx(1.0)


@pytest.mark.parametrize("body", [{"state": "x", "options": ["a"]}, {"state": "x", "options": ["a", "a"]},
                                  {"state": "x", "options": ["a", ""]}, {"options": ["a", "b"]},
                                  {"state": "x", "messages": USER, "options": ["a", "b"]},
                                  {"state": "x", "options": ["a", "b"], "normalize": "max"},
                                  {"state": "x", "options": [str(i) for i in range(65)]}])
def test_brio_refuses_bad_requests(srv, body):
    status, _, err = http(srv, "POST", "/v1/brio", {"model": "tiny", **body})
    assert status == 400 and err["error"]["type"] == "invalid_request_error"


def test_openapi_describes_every_route(srv):
    from coli.server import build_app

    _, _, doc = http(srv, "GET", "/openapi.json")
    assert doc["openapi"].startswith("3.")
    routes = {(r.method.lower(), r.resource.canonical) for r in build_app(srv.server).router.routes()
              if r.method != "HEAD" and not r.handler.__module__.endswith(".dashboard")}  # (static web files)
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented


def test_openai_streams_carry_keepalives_the_client_ignores(chat_model_dir, monkeypatch):
    s = Running(chat_model_dir, kv_slots=1, config={"keepalive": 0.02})
    gate = Gate(s, monkeypatch)
    try:
        # raw: the held engine makes the stream send SSE comments while nothing is produced
        sock = raw_request(s, {**CHAT, "stream": True})
        seen = b""
        while seen.count(b": keepalive") < 2:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        gate.open()
        sock.close()
        wait_for(lambda: s.runner.scheduler.snapshot()["active"] == 0, "the request to end")
        # the official client reads a stream with keepalives in it as if they were not there
        gate.open_.clear()
        threading.Timer(0.3, gate.open).start()
        stream = s.openai().chat.completions.create(model="tiny", messages=USER, max_tokens=3, stream=True,
                                                    logit_bias=no_end(s))
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        gate.open()
        s.close()
