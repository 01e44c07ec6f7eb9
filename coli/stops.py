"""Stop strings over a stream of text pieces.

Stop strings can span token boundaries, so the matcher holds back the longest
tail of the text that could still grow into a stop string, and releases it as
soon as it cannot. The stop string itself is never emitted.

``ignore_leading``: stop strings met before any non-whitespace text are dropped
instead of ending the text (a template's role marker that a model sometimes
writes before its answer).
"""
from __future__ import annotations

from collections.abc import Sequence

from coli.errors import InvalidRequestError


class StopMatcher:
    def __init__(self, stops: str | Sequence[str] | None = None, ignore_leading: bool = False):
        if isinstance(stops, str):
            stops = [stops]
        self.stops = [s for s in (stops or [])]
        if any(not isinstance(s, str) or s == "" for s in self.stops):
            raise InvalidRequestError("stop sequences must be non-empty strings")
        self.ignore_leading = ignore_leading
        self._leading = True  # nothing but whitespace has been emitted
        self._held = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped is not None:
            return "", True
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return self._emit(buf), False
        if self.ignore_leading and self._leading:
            buf = self._drop_leading(buf)
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, s = min(hits)
            self.stopped, self._held = s, ""
            return self._emit(buf[:at]), True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        if self.ignore_leading and self._leading and not buf.strip():
            hold = len(buf)  # whitespace may still be followed by a leading stop: keep it with it
        elif self.ignore_leading and self._leading and any(s.startswith(buf.lstrip()) for s in self.stops):
            hold = len(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return self._emit(buf[: len(buf) - hold]), False

    def flush(self) -> str:
        """The held-back tail at the end of the stream (it never became a stop)."""
        out, self._held = self._held, ""
        return "" if self.stopped is not None else out

    def _drop_leading(self, buf: str) -> str:
        while True:
            rest = buf.lstrip()
            hit = next((s for s in self.stops if rest.startswith(s)), None)
            if hit is None:
                return buf
            buf = buf[: len(buf) - len(rest)] + rest[len(hit):]

    def _emit(self, text: str) -> str:
        if self._leading and text.strip():
            self._leading = False
        return text
