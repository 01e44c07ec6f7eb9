"""What ``coli kv inspect`` reports about state files: one ``SlotReport`` per file."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from coli.kv.format import KVFileError, read_header, read_state

TEXT_CHARS = 40
_SLOT_NAME = re.compile(r"^\.coli_kv(?:\.(\d+))?$")


@dataclass
class SlotReport:
    file: str
    slot: int | None
    valid: bool
    problem: str | None  # why the file cannot be used
    tokens: int
    bytes: int
    bytes_per_token: float | None
    fingerprint: str | None
    fingerprint_match: bool | None  # None: no model to compare with
    weight_format: str | None  # the weights' format that computed the KV ("f32", "int4/int8", ...)
    saved_at: float | None  # Unix time
    model_path: str | None
    head: str | None  # the first ~40 characters of the cached text (or token ids without a tokenizer)
    tail: str | None  # the last ~40

    def to_json(self) -> dict:
        return asdict(self)


def slot_files(directory: str | os.PathLike) -> list[Path]:
    """The state files of a directory, by slot number."""
    found = []
    for p in Path(directory).iterdir():
        m = _SLOT_NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1) or 0), p))
    return [p for _, p in sorted(found)]


def inspect_file(path: str | os.PathLike, *, fingerprint: str | None = None, tokenizer=None) -> SlotReport:
    """Report on one state file. ``fingerprint``/``tokenizer``: the model to compare
    with and decode by; without them, the model recorded in the file is used when it
    still exists (see ``model_reference``)."""
    path = Path(path)
    size = path.stat().st_size
    m = _SLOT_NAME.match(path.name)
    slot = int(m.group(1) or 0) if m else None
    try:
        header, _ = read_header(path)
    except KVFileError as e:
        return SlotReport(str(path), slot, False, str(e), 0, size, None, None, None, None, None, None, None, None)
    n = int(header["tokens"])
    report = SlotReport(str(path), header.get("slot", slot), True, None, n, size, size / n if n else None,
                        header.get("fingerprint"), None, header.get("weight_format"), header.get("saved_at"),
                        header.get("model_path"), None, None)
    if fingerprint is None and tokenizer is None:
        fingerprint, tokenizer = model_reference(report.model_path)
    if fingerprint is not None:
        report.fingerprint_match = fingerprint == report.fingerprint
    try:
        state = read_state(path)
    except KVFileError as e:
        report.valid, report.problem = False, str(e)
        return report
    if report.fingerprint_match is False:
        report.problem = "it belongs to another model (fingerprint differs)"
    toks = state.tokens
    if tokenizer is not None and report.fingerprint_match:
        report.head = tokenizer.decode(toks[:64])[:TEXT_CHARS]
        report.tail = tokenizer.decode(toks[-64:])[-TEXT_CHARS:] if toks else ""
    else:
        report.head = _ids(toks[:8]) + (" …" if len(toks) > 8 else "")
        report.tail = ("… " if len(toks) > 8 else "") + _ids(toks[-8:])
    return report


def model_reference(model_dir: str | os.PathLike | None):
    """(fingerprint, tokenizer) of a model directory, or (None, None) when it is gone or unreadable."""
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        return None, None
    from coli.errors import ColiError
    from coli.kv.store import model_fingerprint
    from coli.tokenizer import Tokenizer

    try:
        fingerprint = model_fingerprint(model_dir)
    except OSError:
        return None, None
    try:
        return fingerprint, Tokenizer.from_dir(model_dir)
    except (ColiError, OSError):
        return fingerprint, None


def _ids(toks: list[int]) -> str:
    return " ".join(str(t) for t in toks)
