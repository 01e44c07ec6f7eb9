"""Property-based fuzzing of every endpoint from the server's own /openapi.json.

For each operation, schemathesis generates requests that follow the document (positive)
and requests that break it (negative), a bounded number each. Every answer must be
documented (status, content type, body schema), never a 5xx, every error must be
API-shaped, schema-breaking requests must be refused, and the server must still answer
afterwards.
"""
from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)
from server_kit import chat_model_dir, http, running  # noqa: F401 (fixtures)

EXAMPLES = 12  # per operation and mode: bounded so the whole file runs in about a minute


@pytest.fixture(scope="module")
def srv(chat_model_dir):
    # a short context bounds every generation a fuzzed request can ask for
    yield from running(chat_model_dir, kv_slots=2, max_queue=4, ctx=96)


@pytest.fixture(scope="module")
def operations(srv):
    _, _, doc = http(srv, "GET", "/openapi.json")
    schema = schemathesis.openapi.from_dict(doc)
    return {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}


def api_shaped(ctx, response, case):
    """Schemathesis check: every error body is OpenAI's envelope (Anthropic's under /v1/messages)."""
    if response.status_code < 400:
        return None
    body = response.json()
    if case.path.startswith("/v1/systemone"):  # TypeSafe's envelope: detail[] (422) or detail.error_type/message
        detail = body["detail"]
        assert (isinstance(detail, list) and response.status_code == 422 and all("msg" in d for d in detail)) or (
            isinstance(detail["error_type"], str) and isinstance(detail["message"], str)), body
    elif case.path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        assert isinstance(body["error"]["type"], str), body
    else:
        err = body["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), body
        assert "param" in err and "code" in err, body
    return None


POSITIVE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
NEGATIVE = [not_a_server_error, status_code_conformance, content_type_conformance, negative_data_rejection]
OPERATIONS = ["GET /v1/models", "GET /v1/models/{model}", "POST /v1/chat/completions", "POST /v1/completions",
              "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/brio", "POST /v1/systemone", "POST /tokenize",
              "POST /detokenize", "GET /health", "GET /metrics", "GET /experts", "GET /experts/atlas", "GET /profile",
              "GET /openapi.json", "POST /v1/responses", "GET /v1/responses/{id}", "DELETE /v1/responses/{id}",
              "POST /v1/responses/{id}/cancel", "GET /v1/responses/{id}/input_items"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("name", OPERATIONS)
def test_fuzz(srv, operations, name, mode):
    op = operations[name]
    if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET" and "{" not in op.path:
        pytest.skip("nothing to break: no parameters")
    checks = (POSITIVE if mode is GenerationMode.POSITIVE else NEGATIVE) + [api_shaped]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=srv.url, timeout=120)
        case.validate_response(response, checks=checks)

    run()
    # nothing stays stuck: a generation the last example started (a background response, a
    # stream whose client has gone) finishes or is dropped within a bounded wait
    for _ in range(300):
        status, _, health = http(srv, "GET", "/health")
        if status != 200 or (health["active"] == 0 and health["queued"] == 0):
            break
        time.sleep(0.1)
    assert status == 200 and health["active"] == 0 and health["queued"] == 0


def test_every_operation_is_fuzzed(operations):
    assert sorted(operations) == sorted(OPERATIONS)
