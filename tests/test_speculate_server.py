"""Speculative decoding over HTTP: the x_colibri_speculative extension field through the
official clients, its refusals as API-shaped 400s, and the /metrics series."""
from __future__ import annotations

import pytest

from server_kit import SCRIPTS, chat_model_dir, http, running  # noqa: F401 (fixtures)

LOOP_SEED = 9101
SCRIPTS[LOOP_SEED] = "one two three four, " * 8 + "done."


@pytest.fixture(scope="module")
def srv(chat_model_dir):  # noqa: F811
    yield from running(chat_model_dir, kv_slots=2, runner={"speculative": "ngram"})


def _chat(srv, mode, **kw):
    extra = {} if mode is None else {"x_colibri_speculative": mode}
    r = srv.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count for me"}],
                                             max_tokens=120, extra_body=extra, **kw)
    return r.choices[0].message.content, r.usage.completion_tokens


def test_the_extension_field_turns_speculation_on_and_off_per_request(srv):
    drafted = lambda: srv.metric("colibri_scheduler_speculative_draft_tokens_total") or 0.0  # noqa: E731
    before = drafted()
    off = _chat(srv, "off", seed=LOOP_SEED)
    assert drafted() == before  # "off" never drafts
    assert off[0] == SCRIPTS[LOOP_SEED]
    on = _chat(srv, None, seed=LOOP_SEED)  # the server's own mode (ngram)
    assert on == off
    assert drafted() > before
    accepted = srv.metric("colibri_scheduler_speculative_accepted_tokens_total")
    assert accepted > 0  # the repeated text was drafted from the output and accepted
    greedy = [_chat(srv, m, temperature=0) for m in ("off", "ngram", "auto")]
    assert greedy[0] == greedy[1] == greedy[2]
    msg = srv.anthropic().messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"x_colibri_speculative": "off", "temperature": 0})
    assert msg.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("value,fragment", [("sometimes", "x_colibri_speculative"), (3, "x_colibri_speculative"),
                                            ("draft", "draft model"), ("mtp", "mtp")])
def test_bad_or_unavailable_modes_are_400s(srv, value, fragment):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})):
        status, _, reply = http(srv, "POST", path, {"model": "tiny", "x_colibri_speculative": value, **body})
        assert status == 400, (path, reply)
        assert fragment in str(reply)


def test_metrics_expose_acceptance_and_tokens_per_step(srv):
    _chat(srv, "ngram", seed=LOOP_SEED)
    status, _, text = http(srv, "GET", "/metrics")
    assert status == 200
    for name in ("colibri_scheduler_speculative_steps_total", "colibri_scheduler_speculative_draft_tokens_total",
                 "colibri_scheduler_speculative_accepted_tokens_total",
                 "colibri_scheduler_speculative_tokens_per_step_bucket",
                 "colibri_scheduler_speculative_acceptance_ratio"):
        assert name in text
    steps = srv.metric("colibri_scheduler_speculative_tokens_per_step_count")
    total = srv.metric("colibri_scheduler_speculative_tokens_per_step_sum")
    assert steps > 0 and total / steps > 1.0  # more than one token per verification on repeated text
