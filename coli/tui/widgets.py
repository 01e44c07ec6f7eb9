"""The chat's widgets: the transcript's messages, the prompt with history, and the
routing and profiling panes. Rendering of the panes is in pure functions
(``render_routing``, ``render_profile``) so tests can compare their text."""
from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Collapsible, Input, Markdown, Sparkline, Static

from coli.tui.grid import TIER_DISK, TIER_NAMES, TIER_PINNED, TIER_RAM, TIER_RGB, ExpertGrid, Flash, cell_colors
from coli.tui.stats import PHASES, History, TurnStats, bar_widths

CELL = "■"
COMPACT_HEIGHT = 32  # terminals shorter than this get the short profile legend
NO_EXPERTS = "This model is dense: it has no experts to route."


HALF = "▀"  # two layers in one character: the upper in the foreground, the lower in the background
LEGEND = "  ".join(f"[#%02x%02x%02x]{CELL}[/] {TIER_NAMES[t]}" % TIER_RGB[t] for t in (TIER_PINNED, TIER_RAM, TIER_DISK))


REGION_MARKS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def render_routing(grid: ExpertGrid | None, flash=None, width: int = 40, max_lines: int | None = None,
                   regions=None) -> Text:
    """One row of cells per MoE layer, wrapped when the experts outnumber the width. When
    that is more than ``max_lines`` rows, two layers share a row (half blocks).

    ``regions`` ((rows, cols) region index per expert, -1 for none; region names), from
    the expert atlas: each cell shows its region's mark instead of a block (the upper
    layer's where two layers share a row), and a legend of the marks follows."""
    if grid is None or grid.empty:
        return Text(NO_EXPERTS, style="italic")
    rows, cols = grid.shape
    label = len(str(rows - 1)) + 2  # "L7 "
    per_line = max(4, width - label)
    wraps = -(-cols // per_line)
    half = max_lines is not None and rows * wraps > max_lines and rows > 1
    colors = cell_colors(grid, flash)
    marks = None
    if regions is not None and regions[0].shape == (rows, cols):
        marks = regions[0]
    out = Text(no_wrap=True)
    for r in range(0, rows, 2 if half else 1):
        for start in range(0, cols, per_line):
            out.append((f"L{r}" if start == 0 else "").ljust(label), style="dim")
            for c in range(start, min(cols, start + per_line)):
                ch = CELL if marks is None else _mark(marks[r, c])
                if not half:
                    out.append(ch, style=colors[r][c])
                else:
                    below = f" on {colors[r + 1][c]}" if r + 1 < rows else ""
                    out.append(HALF if marks is None else ch, style=colors[r][c] + below)
            out.append("\n")
    if marks is not None:
        used = 0
        for i, name in enumerate(regions[1][: len(REGION_MARKS)]):
            item = f"{REGION_MARKS[i]} {name}"
            if used and used + len(item) + 2 > width:
                out.append("\n")
                used = 0
            out.append(("  " if used else "") + item, style="dim")
            used += len(item) + (2 if used else 0)
    out.rstrip()
    return out


def _mark(i: int) -> str:
    return REGION_MARKS[i] if 0 <= i < len(REGION_MARKS) else "·"


SHORT = {"io_wait": "I/O", "expert_matmul": "matmul", "attention": "attn", "lm_head": "head", "other": "other"}


def render_profile(turn: TurnStats | None, width: int = 40, compact: bool = False) -> Text:
    """The last turn's time split as one bar, then a legend with milliseconds and shares
    (``compact``: shares only, several phases a line, for short terminals)."""
    if turn is None:
        return Text("No answer yet: the time split of each turn shows here.", style="italic")
    out = Text(no_wrap=True)
    bar = max(10, width)
    for (_, _, colour, _), n in zip(turn.split(), bar_widths(turn, bar)):
        out.append("█" * n, style=colour)
    out.append("\n")
    total = sum(s for *_, s in turn.split()) or 1.0
    if compact:
        used = 0
        for key, _, colour, secs in turn.split():
            item = f"{SHORT[key]} {secs / total:.0%}  "
            if used and used + len(item) + 2 > width:
                out.append("\n")
                used = 0
            out.append("█ ", style=colour)
            out.append(item)
            used += len(item) + 2
        out.append("\n")
    else:
        for key, label, colour, secs in turn.split():
            out.append("█ ", style=colour)
            out.append(f"{label:<16}{secs * 1000:8.1f} ms {secs / total:4.0%}\n")
    tps = turn.tokens_per_second
    out.append(f"{turn.completion_tokens} tokens", style="bold")
    out.append(f" · {tps:.1f} tok/s" if tps else "")
    if turn.ttft is not None:
        out.append(f" · TTFT {turn.ttft * 1000:.0f} ms")
    if turn.draft_tokens:  # speculative decoding took part
        out.append(f"\nspeculative: {turn.accepted_tokens}/{turn.draft_tokens} drafts accepted "
                   f"({turn.accepted_tokens / turn.draft_tokens:.0%})")
    return out


class RoutingPane(Widget):
    """Live routing: one cell per expert per layer."""

    DEFAULT_CSS = "RoutingPane { height: auto; }"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.grid: ExpertGrid | None = None
        self.flash = Flash()
        self.border_title = "Routing"
        self.border_subtitle = LEGEND
        self.tooltip = "One cell per expert per MoE layer. Colour: where it lives. Bright: often routed. " \
                       "White: routed in the latest step."
        self.max_lines: int | None = None  # rows the pane may take (set by the app's layout)
        self.regions = None  # (region index per expert, names) from the atlas, while labels are on
        self._text = render_routing(None)
        self._drawn = None  # what the screen shows: (seq, flash sum, heat sum, tiers), width, max_lines

    def render(self) -> Text:
        return self._text

    def show_grid(self, grid: ExpertGrid | None, idle_decay: float = 1.0, force: bool = False) -> None:
        """Draw a new reading of the experts (only when something changed)."""
        self.grid = grid
        if grid is not None:
            self.flash.update(grid, idle_decay)
        width = max(10, self.content_size.width or 40)
        key = None if grid is None else (grid.seq, float(self.flash.value.sum()), int(grid.heat.sum()),
                                         grid.tiers.tobytes(), self.regions is not None)
        if not force and self._drawn == (key, width, self.max_lines):
            return
        lines = len(self._text.plain.splitlines())
        self._drawn = (key, width, self.max_lines)
        self._text = render_routing(grid, self.flash.value, width, self.max_lines, self.regions)
        # a colour change repaints the pane; only a change of its height lays the screen out again
        self.refresh(layout=len(self._text.plain.splitlines()) != lines)

    def on_resize(self) -> None:
        """Rewrap the rows."""
        self.show_grid(self.grid, force=True)


class ProfilePane(Vertical):
    """The last turn's time split and the tok/s of the last 30 turns."""

    def compose(self):
        yield Static(render_profile(None), id="split")
        yield Static("tok/s, last 30 turns", id="speed-label", classes="dim")
        yield Sparkline([], id="speed")

    def on_mount(self) -> None:
        self.border_title = "Profile"
        self.history: History | None = None

    def on_resize(self) -> None:
        """Redraw for the new width (and the short legend on short terminals)."""
        if self.history is not None:
            self.show(self.history)

    def show(self, history: History) -> None:
        """Draw the latest turn and the speed history."""
        self.history = history
        width = max(10, self.content_size.width or 40)
        compact = self.screen.size.height < COMPACT_HEIGHT
        self.query_one("#split", Static).update(render_profile(history.last, width, compact))
        speeds = history.speeds()
        label = f"tok/s, last {len(speeds)} turns" + (f": {min(speeds):.1f}…{max(speeds):.1f}" if speeds else "")
        self.query_one("#speed-label", Static).update(label)
        self.query_one("#speed", Sparkline).data = speeds


class MessageView(Vertical):
    """One message of the transcript; an assistant's has a collapsible reasoning block."""

    def __init__(self, role: str, content: str = "", reasoning: str = "", note: str = "", **kw):
        super().__init__(classes=f"message {role}", **kw)
        self.role, self.content, self.reasoning, self.note = role, content, reasoning, note
        self._dirty = False
        self._shown = len(content)  # characters of content the Markdown widget holds

    def compose(self):
        if self.role == "assistant":
            with Collapsible(title="Reasoning", collapsed=not self.app.show_reasoning, classes="reasoning") as c:
                c.display = bool(self.reasoning)
                yield Static(self.reasoning, classes="reasoning-text")
            yield Markdown(self.content, classes="content")
        else:
            yield Static(Text(("› " if self.role == "user" else "") + self.content), classes="content")
        yield Static(self.note, classes="note")

    def append(self, text: str = "", reasoning: str = "") -> None:
        """Add streamed text; the screen catches up on the next flush."""
        self.content += text
        self.reasoning += reasoning
        self._dirty = True

    def flush(self) -> bool:
        """Redraw what streamed in since the last flush; True if anything did."""
        if not self._dirty or not self.is_mounted:
            return False
        self._dirty = False
        if self.role == "assistant":
            block = self.query_one(Collapsible)
            if self.reasoning:
                block.display = True
                block.query_one(".reasoning-text", Static).update(self.reasoning)
            if len(self.content) > self._shown:  # append parses only the tail, not the whole answer again
                self.query_one(Markdown).append(self.content[self._shown:])
                self._shown = len(self.content)
        return True

    def set_note(self, note: str) -> None:
        self.note = note
        if self.is_mounted:
            self.query_one(".note", Static).update(note)


class PromptInput(Input):
    """The message input, with Up/Down through earlier messages (shared with --plain)."""

    BINDINGS = [Binding("up", "older", "Older", show=False), Binding("down", "newer", "Newer", show=False)]
    position = reactive(0)

    def __init__(self, history_file: Path | None = None, **kw):
        super().__init__(**kw)
        self.history_file = history_file
        self.entries: list[str] = []
        if history_file is not None and history_file.exists():
            from prompt_toolkit.history import FileHistory

            self.entries = list(reversed(list(FileHistory(str(history_file)).load_history_strings())))[-500:]
        self.position = len(self.entries)

    def remember(self, text: str) -> None:
        """Keep a sent line for Up/Down (and in the history file)."""
        if text and (not self.entries or self.entries[-1] != text):
            self.entries.append(text)
            if self.history_file is not None:
                from prompt_toolkit.history import FileHistory

                try:
                    self.history_file.parent.mkdir(parents=True, exist_ok=True)
                    FileHistory(str(self.history_file)).store_string(text)
                except OSError:
                    pass
        self.position = len(self.entries)

    def action_older(self) -> None:
        """Show the previous line."""
        if self.position > 0:
            self.position -= 1
            self.value = self.entries[self.position]
            self.cursor_position = len(self.value)

    def action_newer(self) -> None:
        """Show the next line (or an empty input)."""
        if self.position < len(self.entries):
            self.position += 1
            self.value = self.entries[self.position] if self.position < len(self.entries) else ""
            self.cursor_position = len(self.value)


__all__ = ["MessageView", "ProfilePane", "PromptInput", "RoutingPane", "render_profile", "render_routing",
           "NO_EXPERTS", "PHASES"]
