"""`coli chat` in a terminal: a Textual app over a backend (local scheduler or `coli serve`).

Layout: a top bar (KV slot selector, status line), the transcript and the prompt, and a
side column with the routing and profiling panes (below the transcript on narrow
terminals). Answers stream from a thread worker through ``call_from_thread``; the
panes refresh from a timer.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.widgets import Collapsible, Footer, Select, Static

from coli.errors import ColiError
from coli.scheduler.events import Error, Finished, ReasoningDelta, Started, TextDelta
from coli.tui.conversation import HISTORY_FILE, Conversation, Message
from coli.tui.stats import History, TurnStats
from coli.tui.widgets import MessageView, ProfilePane, PromptInput, RoutingPane

HELP = """\
**Commands**: `/clear` new conversation in this slot · `/system TEXT` set the system prompt · \
`/slot N` switch KV slot · `/save FILE.md` or `/save FILE.json` export · `/help` · `/quit`

**Keys**: Enter send · Up/Down history · Esc or Ctrl+C stop the answer · F2 routing pane · \
F3 profiling pane · F4 expand reasoning · F5 next slot · F6 atlas regions · Ctrl+Q quit"""
BATCH_SECONDS = 0.03  # a fast model's tokens reach the UI in batches, so the UI thread leaves the engine be
POLL_SECONDS = 0.5  # how often a server's /experts is read
NARROW = 110  # columns below which the panes go under the transcript


class ChatApp(App):
    """A conversation per KV slot, with live routing and profiling panes."""

    CSS_PATH = "chat.tcss"
    TITLE = "coli chat"
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+c", "stop", "Stop", show=False, priority=True),
        Binding("f2", "toggle_routing", "Routing"),
        Binding("f3", "toggle_profile", "Profile"),
        Binding("f4", "toggle_reasoning", "Reasoning"),
        Binding("f5", "next_slot", "Slot"),
        Binding("f6", "toggle_regions", "Regions"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("ctrl+d", "quit", "Quit", show=False, priority=True),  # before the text box's delete-right
    ]

    slot = reactive(0)
    busy = reactive(False)
    show_routing = reactive(True)
    show_profile = reactive(True)
    show_reasoning = reactive(False)

    def __init__(self, backend, *, system: str | None = None, history_file: Path | None = HISTORY_FILE,
                 refresh_seconds: float = 0.1):
        super().__init__()
        self.backend = backend
        self.conversations = [Conversation(system) for _ in range(backend.slots)]
        self.history = History()
        self.history_file = history_file
        self.refresh_seconds = refresh_seconds
        self._info = {}
        self._views: list[MessageView] = []
        self._status_text = ""
        self._polled = 0.0  # when /experts was last asked for

    def compose(self) -> ComposeResult:
        with Horizontal(id="top"):
            yield Select([(f"slot {i}", i) for i in range(self.backend.slots)], value=0, allow_blank=False,
                         id="slot", compact=True)
            yield Static("", id="status")
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield VerticalScroll(id="transcript")
                yield PromptInput(self.history_file, placeholder="Ask something (/help for commands)", id="prompt")
            with Vertical(id="side"):
                yield RoutingPane(id="routing")
                yield ProfilePane(id="profile")
        yield Footer()

    def on_mount(self) -> None:
        self.routing, self.profile = self.query_one(RoutingPane), self.query_one(ProfilePane)
        self.transcript = self.query_one("#transcript", VerticalScroll)
        self.status_line = self.query_one("#status", Static)
        self._info = self.backend.info()
        self.sub_title = self._info.get("model", "")
        self.refresh_status()
        self.query_one("#prompt").focus()
        self.refresh_panes()
        self.set_interval(self.refresh_seconds, self.refresh_panes)
        self.set_interval(0.1, self.flush_views)
        self.fit_layout(self.size.width)

    def on_resize(self, event) -> None:
        """Stack the panes under the transcript on narrow terminals."""
        self.fit_layout(event.size.width)

    def fit_layout(self, width: int) -> None:
        """Narrow or wide layout, and the rows the routing pane may take."""
        if not hasattr(self, "routing"):  # a resize before on_mount
            return
        narrow = width < NARROW
        self.query_one("#body").set_class(narrow, "narrow")
        body = self.size.height - 2  # the top line and the footer
        if narrow:  # the side row may take 45% of the body, borders included
            lines = int(body * 0.45) - 2
        else:
            lines = body - ((self.profile.outer_size.height or 13) if self.show_profile else 0) - 2
        self.routing.max_lines = max(2, lines)
        self.routing.show_grid(self.routing.grid, force=True)

    # -- sending ---------------------------------------------------------------------------------

    @property
    def conversation(self) -> Conversation:
        return self.conversations[self.slot]

    async def on_input_submitted(self, event: PromptInput.Submitted) -> None:
        """Send a message or run a slash command."""
        text = event.value.strip()
        prompt = self.query_one(PromptInput)
        prompt.value = ""
        if not text:
            return
        prompt.remember(text)
        if text.startswith("/"):
            await self.command(text)
        elif self.busy:
            self.notify("An answer is still streaming: Esc stops it.", severity="warning")
        else:
            await self.send(text)

    async def send(self, text: str) -> None:
        conv = self.conversation
        conv.messages.append(Message("user", text))
        messages = conv.for_template()
        reply = Message("assistant")
        conv.messages.append(reply)
        await self.add_view(MessageView("user", text))
        view = MessageView("assistant", note="…")
        await self.add_view(view)
        self.busy = True
        self.answer(view, reply, messages, self.slot)

    async def add_view(self, view: MessageView) -> None:
        transcript = self.query_one("#transcript")
        await transcript.mount(view)
        self._views.append(view)
        transcript.scroll_end(animate=False)

    @work(thread=True, exclusive=True, group="answer")
    def answer(self, view: MessageView, reply: Message, messages: list[dict], slot: int) -> None:
        """Stream one answer from the backend into ``view``."""
        t0, first, sent = time.perf_counter(), None, 0.0
        pending = []  # events not handed to the UI yet: deltas closer than BATCH_SECONDS go together
        try:
            for ev in self.backend.stream(messages, slot):
                now = time.perf_counter()
                delta = isinstance(ev, (TextDelta, ReasoningDelta))
                if first is None and delta:
                    first = now - t0
                if isinstance(ev, TurnStats):
                    ev = replace(ev, ttft=first)
                pending.append(ev)
                if not delta or now - sent >= BATCH_SECONDS:
                    self.call_from_thread(self.on_answer_events, view, reply, pending)
                    pending, sent = [], now
        except ColiError as e:
            pending.append(Error("invalid_request", str(e)))
        except Exception as e:  # noqa: BLE001 - the app must outlive a broken answer
            pending.append(Error("engine_error", f"{type(e).__name__}: {e}"))
        finally:
            try:
                if pending:
                    self.call_from_thread(self.on_answer_events, view, reply, pending)
                self.call_from_thread(self.answer_done, view)
            except RuntimeError:  # the app has closed
                pass

    def on_answer_events(self, view: MessageView, reply: Message, events: list) -> None:
        """Apply events of the answer in flight."""
        for ev in events:
            self.on_answer_event(view, reply, ev)

    def on_answer_event(self, view: MessageView, reply: Message, ev) -> None:
        """Apply one event of the answer in flight."""
        if isinstance(ev, TextDelta):
            reply.content += ev.text
            view.append(text=ev.text)
        elif isinstance(ev, ReasoningDelta):
            reply.reasoning += ev.text
            view.append(reasoning=ev.text)
        elif isinstance(ev, Started):
            view.set_note(f"slot {ev.slot} · {ev.cached_tokens}/{ev.prompt_tokens} prompt tokens cached"
                          if ev.prompt_tokens else "")
        elif isinstance(ev, TurnStats):
            self._info = self.backend.info()  # resident memory moves as experts stream in
            self.history.add(ev)
            if self.profile.is_attached:
                self.profile.show(self.history)
            tps = ev.tokens_per_second
            view.set_note(f"{ev.completion_tokens} tokens" + (f" · {tps:.1f} tok/s" if tps else ""))
            self.refresh_status()
        elif isinstance(ev, Error):
            if ev.code == "cancelled":
                reply.stopped = True
                view.set_note("(stopped)")
            else:
                view.set_note(f"error: {ev.message}")
                self.notify(ev.message, title="error", severity="error")
        elif isinstance(ev, Finished) and ev.finish_reason == "length":
            view.set_note((view.note + " · " if view.note else "") + "cut at --max-tokens")

    def answer_done(self, view: MessageView) -> None:
        """The answer ended (finished, stopped or failed)."""
        self.busy = False
        if not self.transcript.is_attached:  # the app is closing
            return
        view.flush()
        if view.note == "…":
            view.set_note("")
        self.refresh_status()

    def flush_views(self) -> None:
        """Redraw streamed text (at most 10 times a second)."""
        if any(v.flush() for v in self._views[-2:]) and self.transcript.is_attached:
            self.transcript.scroll_end(animate=False)

    # -- commands ----------------------------------------------------------------------------------

    async def command(self, text: str) -> None:
        """Run a slash command."""
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            self.exit()
        elif name == "/help":
            transcript = self.query_one("#transcript")
            await transcript.mount(Static(_markdown(HELP), classes="help"))
            transcript.scroll_end(animate=False)
        elif name == "/clear":
            if self.busy:
                self.notify("Stop the answer first (Esc).", severity="warning")
                return
            self.conversation.clear()
            await self.show_conversation()
            self.notify(f"New conversation in slot {self.slot}.")
        elif name == "/system":
            self.conversation.system = arg or None
            self.notify(f"System prompt {'set' if arg else 'cleared'} for slot {self.slot}.")
        elif name == "/slot":
            try:
                self.switch_slot(int(arg))
            except ValueError:
                self.notify(f"/slot N: N is a slot number from 0 to {self.backend.slots - 1}", severity="error")
        elif name == "/save":
            self.save(arg)
        else:
            self.notify(f"Unknown command {name}: /help lists them.", severity="error")

    def save(self, arg: str) -> None:
        if not arg:
            self.notify("/save FILE.md or /save FILE.json", severity="error")
            return
        try:
            path = self.conversation.save(arg, model=self._info.get("model", ""), slot=self.slot)
        except (ValueError, OSError) as e:
            self.notify(str(e), severity="error")
            return
        self.notify(f"Saved {path}")

    def switch_slot(self, n: int) -> None:
        if not 0 <= n < self.backend.slots:
            raise ValueError(n)
        if self.busy and n != self.slot:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.slot = n

    # -- reactive state -----------------------------------------------------------------------------

    async def watch_slot(self, slot: int) -> None:
        """Show the slot's conversation."""
        select = self.query_one("#slot", Select)
        if select.value != slot:
            select.value = slot
        await self.show_conversation()
        self.refresh_status()

    def on_select_changed(self, event: Select.Changed) -> None:
        """The slot selector moved."""
        if event.value is not Select.BLANK and event.value != self.slot:
            try:
                self.switch_slot(int(event.value))
            except ValueError:
                pass
            if event.value != self.slot:
                event.select.value = self.slot

    async def show_conversation(self) -> None:
        transcript = self.query_one("#transcript")
        await transcript.remove_children()
        self._views = []
        for m in self.conversation.messages:
            await self.add_view(MessageView(m.role, m.content, m.reasoning, "(stopped)" if m.stopped else ""))

    def watch_busy(self, busy: bool) -> None:
        self.refresh_status()

    def watch_show_routing(self, show: bool) -> None:
        self.query_one(RoutingPane).display = show
        self._side()

    def watch_show_profile(self, show: bool) -> None:
        self.query_one(ProfilePane).display = show
        self._side()
        self.call_after_refresh(self.fit_layout, self.size.width)  # the routing pane may grow

    def _side(self) -> None:
        self.query_one("#side").display = self.show_routing or self.show_profile

    def watch_show_reasoning(self, show: bool) -> None:
        for block in self.query(Collapsible):
            block.collapsed = not show

    # -- actions ------------------------------------------------------------------------------------

    def action_stop(self) -> None:
        """Stop the answer in flight (the app keeps running)."""
        if self.busy:
            self.backend.cancel()
        else:
            self.notify("Nothing to stop. Ctrl+Q quits.", timeout=2)

    def action_toggle_routing(self) -> None:
        """Show or hide the routing pane."""
        self.show_routing = not self.show_routing

    def action_toggle_profile(self) -> None:
        """Show or hide the profiling pane."""
        self.show_profile = not self.show_profile

    def action_toggle_reasoning(self) -> None:
        """Expand or collapse reasoning blocks."""
        self.show_reasoning = not self.show_reasoning

    def action_toggle_regions(self) -> None:
        """Label the routing pane's cells by expert-atlas region (coli atlas), or stop."""
        pane = self.routing
        if pane.regions is None:
            doc = getattr(self.backend, "atlas", lambda: None)()
            if not doc or not doc.get("regions"):
                self.notify("This model has no expert atlas: make one with coli atlas --model DIR", timeout=4)
                return
            from coli.atlas import region_grid

            pane.regions = region_grid(doc)
        else:
            pane.regions = None
        pane.show_grid(pane.grid, force=True)

    def action_next_slot(self) -> None:
        """Switch to the next KV slot."""
        self.switch_slot((self.slot + 1) % self.backend.slots)

    # -- status and panes ---------------------------------------------------------------------------

    def refresh_status(self) -> None:
        if not hasattr(self, "status_line"):  # before on_mount
            return
        info, last = self._info, self.history.last
        parts = [info.get("model", "?")] + ([info["quant"]] if info.get("quant") else []) + \
            [f"{info.get('resident', '?')} resident"]
        tps = last.tokens_per_second if last else None
        parts.append(f"{tps:.1f} tok/s" if tps else "– tok/s")
        parts.append(f"TTFT {last.ttft * 1000:.0f} ms" if last and last.ttft is not None else "TTFT –")
        hit = last.hit_rate if last else None
        parts.append(f"hit {hit:.0%}" if hit is not None else "hit –")
        if self.busy:
            parts.append("● answering")
        text = " · ".join(parts)
        if text != self._status_text and self.status_line.is_attached:  # an update lays the screen out again
            self._status_text = text
            self.status_line.update(text)

    def refresh_panes(self) -> None:
        """Read the experts again (a worker does it for a server)."""
        if not self.show_routing or not self.routing.is_attached:
            return
        if self.backend.remote:
            now = time.monotonic()
            if now - self._polled >= POLL_SECONDS:
                self._polled = now
                self.poll_server()
        else:
            self.routing.show_grid(self.backend.grid(), idle_decay=0.85)

    @work(thread=True, exclusive=True, group="poll")
    def poll_server(self) -> None:
        """Fetch /experts from the server."""
        try:
            grid = self.backend.grid()
        except ColiError:
            return
        try:
            self.call_from_thread(self.routing.show_grid, grid, 0.85)
        except RuntimeError:
            pass

    def on_unmount(self) -> None:
        self.backend.cancel()


def _markdown(text: str):
    from rich.markdown import Markdown

    return Markdown(text)
