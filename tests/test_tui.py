"""The Textual app, driven by app.run_test() against a scripted backend and a tiny model."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("textual")

from coli.scheduler.events import Error, Finished, ReasoningDelta, Started, TextDelta  # noqa: E402
from coli.tui.app import ChatApp  # noqa: E402
from coli.tui.grid import ExpertGrid  # noqa: E402
from coli.tui.stats import TurnStats  # noqa: E402
from coli.tui.widgets import NO_EXPERTS, MessageView, ProfilePane, RoutingPane  # noqa: E402


class ScriptedBackend:
    """Answers "word0 word1 ..." (``words`` of them, ``delay`` apart), with reasoning first."""

    remote = False
    name = "scripted"

    def __init__(self, slots=2, words=5, delay=0.0, experts=True):
        self.slots, self.words, self.delay, self.experts = slots, words, delay, experts
        self.sent: list[tuple[list[dict], int]] = []
        self.cancelled = threading.Event()
        self.step = 0

    def info(self):
        return {"model": "scripted", "quant": "int4", "resident": "1.0 MiB"}

    def stream(self, messages, slot):
        self.cancelled.clear()
        self.sent.append((messages, slot))
        yield Started(slot, 10, 4, 0.0, 64)
        yield ReasoningDelta("thinking about it")
        for i in range(self.words):
            if self.cancelled.is_set():
                yield Error("cancelled", "the request was cancelled")
                return
            time.sleep(self.delay)
            self.step += 1
            yield TextDelta(f"word{i} ")
        yield TurnStats(1.0, io_wait=0.1, expert_matmul=0.4, attention=0.2, lm_head=0.1, completion_tokens=self.words,
                        decode_seconds=0.5, experts_needed=10, experts_hit=9)
        yield Finished("stop")

    def cancel(self):
        self.cancelled.set()

    def grid(self):
        if not self.experts:
            return None
        return deterministic_grid(self.step)

    def close(self):
        pass


def deterministic_grid(seq=1) -> ExpertGrid:
    tiers = np.array([[2, 2, 1, 1, 1, 0, 0, 0], [2, 1, 1, 1, 0, 0, 0, 0]], np.uint8)
    heat = np.array([[9, 8, 7, 5, 3, 1, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]], np.uint8)
    routed = np.zeros((2, 8), bool)
    routed[0, [0, 3]] = routed[1, [7, 2]] = True
    return ExpertGrid(tiers, heat, routed, seq)


def run(coro):
    return asyncio.run(coro)


async def wait_for(pilot, cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        await pilot.pause(0.05)


def transcript_text(app) -> str:
    return "\n".join(v.content for v in app.query(MessageView))


async def send(pilot, app, text):
    await pilot.click("#prompt")
    app.query_one("#prompt").value = text
    await pilot.press("enter")


def test_send_a_message_and_see_streamed_text(tmp_path):
    async def body():
        app = ChatApp(ScriptedBackend(), history_file=tmp_path / "h")
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "hello there")
            await wait_for(pilot, lambda: not app.busy and "word4" in transcript_text(app))
            await pilot.pause(0.1)
            views = list(app.query(MessageView))
            assert [v.role for v in views] == ["user", "assistant"]
            assert views[1].content == "word0 word1 word2 word3 word4 "
            assert views[1].reasoning == "thinking about it"
            md = views[1].query_one("Markdown")
            assert "word4" in md.source
            assert app.backend.sent[0] == ([{"role": "user", "content": "hello there"}], 0)
            status = str(app.query_one("#status").render())
            assert "10.0 tok/s" in status and "hit 90%" in status and "int4" in status
            # the next turn sends the whole conversation
            await send(pilot, app, "and again")
            await wait_for(pilot, lambda: len(app.backend.sent) == 2 and not app.busy)
            assert [m["role"] for m in app.backend.sent[1][0]] == ["user", "assistant", "user"]
            # history: Up brings back the last line
            await pilot.press("up")
            assert app.query_one("#prompt").value == "and again"
        assert "and again" in (tmp_path / "h").read_text()

    run(body())


def test_cancel_mid_answer_keeps_the_app(tmp_path):
    async def body():
        app = ChatApp(ScriptedBackend(words=400, delay=0.02), history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "a long one")
            await wait_for(pilot, lambda: "word2" in transcript_text(app))
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.busy)
            reply = app.conversation.messages[-1]
            assert reply.stopped and "word399" not in reply.content
            assert "(stopped)" in app.query(MessageView).last().note
            assert app.is_running
            # ctrl+c stops too, and does not quit
            await send(pilot, app, "again")
            await wait_for(pilot, lambda: app.busy and "word1" in app.conversation.messages[-1].content)
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.busy)
            assert app.conversation.messages[-1].stopped and app.is_running

    run(body())


def test_switch_slot_keeps_a_conversation_per_slot():
    async def body():
        backend = ScriptedBackend(slots=3, words=2)
        app = ChatApp(backend, history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "in slot zero")
            await wait_for(pilot, lambda: not app.busy and len(backend.sent) == 1)
            await send(pilot, app, "/slot 2")
            await pilot.pause(0.1)
            assert app.slot == 2 and app.query_one("#slot").value == 2
            assert not list(app.query(MessageView))  # slot 2's conversation is empty
            await send(pilot, app, "in slot two")
            await wait_for(pilot, lambda: not app.busy and len(backend.sent) == 2)
            assert backend.sent[1] == ([{"role": "user", "content": "in slot two"}], 2)
            await pilot.press("f5")  # next slot wraps to 0
            await pilot.pause(0.1)
            assert app.slot == 0
            assert "in slot zero" in transcript_text(app)
            await send(pilot, app, "/slot 9")
            await pilot.pause(0.05)
            assert app.slot == 0

    run(body())


def test_toggle_panes_and_reasoning():
    async def body():
        app = ChatApp(ScriptedBackend(), history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            assert app.query_one(RoutingPane).display and app.query_one(ProfilePane).display
            await pilot.press("f2")
            assert not app.query_one(RoutingPane).display
            await pilot.press("f3")
            assert not app.query_one(ProfilePane).display and not app.query_one("#side").display
            await pilot.press("f2", "f3")
            assert app.query_one(RoutingPane).display and app.query_one(ProfilePane).display
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.busy)
            await pilot.pause(0.1)
            block = app.query_one("Collapsible")
            assert block.display and block.collapsed
            await pilot.press("f4")
            assert not block.collapsed

    run(body())


def test_narrow_terminal_stacks_the_panes():
    async def body():
        app = ChatApp(ScriptedBackend(), history_file=None)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.1)
            assert app.query_one("#body").has_class("narrow")
            side, chat = app.query_one("#side").region, app.query_one("#chat").region
            assert side.y >= chat.bottom and side.width == 80
            await send(pilot, app, "hi")
            await wait_for(pilot, lambda: not app.busy)
            await pilot.pause(0.1)
            screen = app.screen.region
            for selector in ("#status", "#transcript", "#prompt", "#routing", "#profile", "Footer"):
                region = app.query_one(selector).region
                assert region.height > 0 and screen.contains_region(region), selector

    run(body())


def test_export_markdown_and_json(tmp_path):
    async def body():
        app = ChatApp(ScriptedBackend(words=3), history_file=None, system="be brief")
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "what is up")
            await wait_for(pilot, lambda: not app.busy)
            await send(pilot, app, f"/save {tmp_path / 'chat.md'}")
            await send(pilot, app, f"/save {tmp_path / 'chat.json'}")
            await send(pilot, app, f"/save {tmp_path / 'chat.txt'}")
            await pilot.pause(0.1)
        md = (tmp_path / "chat.md").read_text()
        assert "## User" in md and "what is up" in md and "word2" in md and "be brief" in md
        body = json.loads((tmp_path / "chat.json").read_text())
        assert body["system"] == "be brief" and body["slot"] == 0
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
        assert body["messages"][1]["reasoning"] == "thinking about it"
        assert not (tmp_path / "chat.txt").exists()

    run(body())


def test_clear_system_and_help():
    async def body():
        backend = ScriptedBackend(words=1)
        app = ChatApp(backend, history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "one")
            await wait_for(pilot, lambda: not app.busy)
            await send(pilot, app, "/clear")
            await send(pilot, app, "/system you are terse")
            await send(pilot, app, "/help")
            await pilot.pause(0.1)
            assert not list(app.query(MessageView))
            assert "/save" in str(app.query_one(".help").render()) or app.query(".help")
            await send(pilot, app, "two")
            await wait_for(pilot, lambda: not app.busy and len(backend.sent) == 2)
            assert backend.sent[1][0] == [{"role": "system", "content": "you are terse"},
                                          {"role": "user", "content": "two"}]

    run(body())


def test_dense_model_says_it_has_no_experts():
    async def body():
        app = ChatApp(ScriptedBackend(experts=False), history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(0.2)
            assert NO_EXPERTS in str(app.query_one(RoutingPane).render())

    run(body())


def test_real_model_streams_into_the_app(hf_models, tmp_path):
    import coli
    from coli.runner import Runner
    from coli.tui.backend import LocalBackend

    m = coli.load(hf_models("qwen3_moe"))
    runner = Runner(m, kv_slots=2, persist=False)
    backend = LocalBackend(m, runner, max_tokens=8)

    async def body():
        app = ChatApp(backend, history_file=None)
        async with app.run_test(size=(120, 36)) as pilot:
            await send(pilot, app, "w5 w6 w7")
            await wait_for(pilot, lambda: not app.busy and app.history.last is not None, timeout=60)
            reply = app.conversation.messages[-1]
            assert reply.content.strip().startswith("w")
            assert app.history.last.completion_tokens >= 1
            pane = app.query_one(RoutingPane)
            await pilot.pause(0.3)
            assert pane.grid is not None and pane.grid.shape == (2, 8)  # two MoE layers (one is mlp-only)
            assert pane.grid.heat.sum() > 0

    try:
        run(body())
    finally:
        backend.close()
