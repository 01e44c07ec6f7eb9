"""One conversation per KV slot: its messages, and /save as Markdown or JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

HISTORY_FILE = Path.home() / ".cache" / "coli" / "chat_history"  # the app's and --plain's input history


@dataclass
class Message:
    role: str  # "user" | "assistant" | "system"
    content: str = ""
    reasoning: str = ""
    stopped: bool = False  # the answer was cancelled part way


@dataclass
class Conversation:
    system: str | None = None
    messages: list[Message] = field(default_factory=list)

    def for_template(self) -> list[dict]:
        """The messages a chat template renders (reasoning is not sent back)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m.role, "content": m.content} for m in self.messages]

    def clear(self) -> None:
        self.messages.clear()

    def to_markdown(self, title: str = "coli chat") -> str:
        out = [f"# {title}", ""]
        if self.system:
            out += ["**System:** " + self.system, ""]
        for m in self.messages:
            out += [f"## {m.role.capitalize()}", ""]
            if m.reasoning:
                out += ["<details><summary>Reasoning</summary>", "", m.reasoning.strip(), "", "</details>", ""]
            out += [m.content.strip() + (" *(stopped)*" if m.stopped else ""), ""]
        return "\n".join(out)

    def to_json(self, **meta) -> str:
        body = {**meta, "system": self.system,
                "messages": [{k: v for k, v in asdict(m).items() if v or k in ("role", "content")}
                             for m in self.messages]}
        return json.dumps(body, indent=2, ensure_ascii=False) + "\n"

    def save(self, path: str | Path, **meta) -> Path:
        """Write as Markdown (.md, .markdown) or JSON (.json); other suffixes raise ValueError."""
        p = Path(path).expanduser()
        suffix = p.suffix.lower()
        if suffix in (".md", ".markdown"):
            text = self.to_markdown(meta.get("model", "coli chat"))
        elif suffix == ".json":
            text = self.to_json(**meta)
        else:
            raise ValueError(f"/save: {p.name}: use a .md or .json file name")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        return p
