"""The passages ``coli atlas`` runs through a model, each with an optional category.

Sources (``read_corpus``):

- a ``.jsonl`` file: one ``{"text": ..., "category": ...}`` object per line (category optional);
- a ``.txt`` / ``.md`` / other text file: passages separated by blank lines, the category
  being the file's stem;
- a directory: every such file below it; a file in a sub-directory takes the
  sub-directory's name as its category (``corpus/code/a.py`` -> ``code``);
- ``-``: standard input, JSONL when every line is a JSON object, else blank-line passages
  (category ``stdin``).

``None`` is the default corpus that ships with coli (``default_corpus.jsonl``): about 300
passages we wrote, labelled ``definition``, ``prose``, ``code``, ``numbers``, ``dialogue``
and ``question``, so the atlas works offline.
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from coli.errors import InvalidRequestError

DEFAULT_CORPUS = Path(__file__).parent / "default_corpus.jsonl"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".js", ".ts", ".c", ".h", ".rs", ".go", ".java", ".sh", ".sql",
                 ".json", ".jsonl", ".html", ".css", ".toml", ".yaml", ".yml", ".csv"}


@dataclass(frozen=True)
class Passage:
    text: str
    category: str | None = None


def read_corpus(source: str | Path | None = None) -> list[Passage]:
    """The passages of ``source`` (see the module docstring); raises InvalidRequestError
    for a missing, unreadable or empty corpus."""
    if source is None:
        passages = _jsonl(DEFAULT_CORPUS.read_text(encoding="utf-8"), str(DEFAULT_CORPUS))
    elif str(source) == "-":
        passages = _from_text(sys.stdin.read(), "stdin", "stdin")
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            passages = []
            for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES):
                category = f.parent.name if f.parent != path else f.stem
                passages += _from_file(f, category)
        elif path.is_file():
            passages = _from_file(path, path.stem)
        else:
            raise InvalidRequestError(f"--corpus: {source} does not exist")
    passages = [p for p in passages if p.text.strip()]
    if not passages:
        raise InvalidRequestError(f"--corpus: {source or DEFAULT_CORPUS} holds no text")
    return passages


def corpus_digest(passages: list[Passage]) -> str:
    """A hash of the passages and their categories (a resumed run must see the same corpus)."""
    h = hashlib.sha256(b"coli-atlas-corpus-v1\0")
    for p in passages:
        h.update(p.text.encode("utf-8", "surrogatepass") + b"\0" + (p.category or "").encode() + b"\1")
    return h.hexdigest()[:32]


def _from_file(path: Path, category: str) -> list[Passage]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"--corpus: cannot read {path}: {e}") from None
    if path.suffix.lower() == ".jsonl":
        return _jsonl(text, str(path), category)
    return _paragraphs(text, category)


def _from_text(text: str, where: str, category: str) -> list[Passage]:
    lines = [l for l in text.splitlines() if l.strip()]
    if lines and all(l.lstrip().startswith("{") for l in lines):
        return _jsonl(text, where, category)
    return _paragraphs(text, category)


def _jsonl(text: str, where: str, category: str | None = None) -> list[Passage]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise InvalidRequestError(f"--corpus: {where} line {n} is not JSON: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise InvalidRequestError(f"--corpus: {where} line {n} needs a \"text\" string")
        cat = d.get("category", category)
        out.append(Passage(d["text"], str(cat) if cat is not None else None))
    return out


def _paragraphs(text: str, category: str | None) -> list[Passage]:
    blocks, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line)
        elif cur:
            blocks.append("\n".join(cur))
            cur = []
    if cur:
        blocks.append("\n".join(cur))
    return [Passage(b, category) for b in blocks]
