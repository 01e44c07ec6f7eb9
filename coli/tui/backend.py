"""Where the chat's answers come from: the local scheduler, or a running `coli serve`.

Both backends give the app the same things: ``stream(messages, slot)`` (blocking; run
it in a worker thread) yields the scheduler's events — Started, TextDelta,
ReasoningDelta, Error, Finished — plus one ``TurnStats`` before Finished;
``cancel()`` stops the answer in flight from any thread; ``grid()`` is the routing
pane's ExpertGrid (None for a dense model); ``info()`` is what the status line shows.
"""
from __future__ import annotations

import inspect
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

from coli.errors import ColiError
from coli.scheduler.events import Error, Finished, Profile, ReasoningDelta, Started, TextDelta, Usage
from coli.tui.grid import ExpertGrid, decode, grid_from_engine
from coli.tui.stats import TurnStats, human_bytes


class LocalBackend:
    """A model loaded in this process, driven by the shared Runner."""

    remote = False

    def __init__(self, model, runner, *, max_tokens: int = 512, sampling=None, constraint=None):
        self.model, self.runner, self.max_tokens, self.sampling = model, runner, max_tokens, sampling
        self.constraint = constraint  # coli.grammar.Constraint for every answer (coli chat --plain --json-schema)
        self.slots = runner.config.kv_slots
        self.name = f"{model.config.model_type} ({model.path.name})"
        self._handle = None
        self._lock = threading.Lock()

    def info(self) -> dict:
        from coli.kv.store import weight_format

        b = self.model.engine.resident_bytes()
        return {"model": self.name, "quant": weight_format(self.model),
                "resident": human_bytes(b["pinned"] + b["cached"] + b["dense"])}

    def stream(self, messages: list[dict], slot: int) -> Iterator:
        extra = {}
        if self.constraint is not None:  # (a constrained answer starts without reasoning)
            extra["constraint"] = self.constraint
        ids = self.model.prompt_ids(messages, **({"enable_thinking": False} if self.constraint is not None else {}))
        parser = self._parser(messages)
        if parser is not None:
            extra["parser"] = parser
        handle = self.runner.submit(ids, max_tokens=self.max_tokens, sampling=self.sampling, cache_slot=slot,
                                    **extra)
        with self._lock:
            self._handle = handle
        profile = usage = None
        try:
            for ev in handle:
                if isinstance(ev, Profile):
                    profile = ev
                elif isinstance(ev, Usage):
                    usage = ev
                elif isinstance(ev, Finished):
                    if profile is not None:
                        yield TurnStats.from_events(profile, usage)
                    yield ev
                else:
                    yield ev
        finally:
            handle.cancel()  # a no-op once finished
            with self._lock:
                self._handle = None

    def _parser(self, messages):
        """A reasoning parser where the runner takes one and the template reasons (<think>)."""
        if "parser" not in inspect.signature(self.runner.submit).parameters:
            return None
        try:
            from coli.chat_format import OutputParser, detect, opens_reasoning

            tok = self.model.tokenizer
            fmt = detect(self.model.config.model_type, tok.chat_template)
            if fmt.reasoning is None:
                return None
            text = tok.apply_chat_template(messages)
            return OutputParser(fmt, in_reasoning=opens_reasoning(fmt, text))
        except Exception:  # an older chat_format: plain text it is
            return None

    def cancel(self) -> None:
        with self._lock:
            h = self._handle
        if h is not None:
            h.cancel()

    def grid(self) -> ExpertGrid | None:
        engine = self.model.engine
        if not engine.model.moe_layers:
            return None
        return grid_from_engine(engine, self.runner.steps)

    def atlas(self) -> dict | None:
        """The model's expert atlas (experts.json from `coli atlas`), or None."""
        from coli.atlas import find_atlas
        from coli.kv.store import model_fingerprint

        return find_atlas(self.model.path, model_fingerprint(self.model.path))[0]

    def close(self) -> None:
        self.runner.close()
        self.model.close()


class RemoteBackend:
    """A running `coli serve`: /v1/chat/completions (SSE) for answers, /experts and
    /profile for the panes, /health for the status line."""

    remote = True

    def __init__(self, url: str, api_key: str | None = None, *, max_tokens: int = 512, sampling: dict | None = None,
                 timeout: float = 10.0):
        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.api_key, self.max_tokens, self.sampling, self.timeout = api_key, max_tokens, sampling or {}, timeout
        self._resp = None
        self._cancelled = threading.Event()
        health = self._json("GET", "/health")
        self.slots = int(health.get("capacity") or len(health.get("slots") or []) or 1)
        self.model_id = health.get("model")
        if self.model_id is None:
            models = self._json("GET", "/v1/models").get("data") or [{}]
            self.model_id = models[0].get("id")
        self.name = f"{self.model_id} @ {self.base}"
        self._memory = health.get("memory") or {}
        self._dense = True

    # -- HTTP -------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raise ColiError(f"{self.base}{path}: HTTP {e.code}: {_error_text(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ColiError(f"cannot reach {self.base}: {reason}") from None

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        with self._request(method, path, body) as resp:
            try:
                return json.loads(resp.read())
            except ValueError:
                raise ColiError(f"{self.base}{path} did not answer JSON: is it a coli server?") from None

    # -- the backend API ----------------------------------------------------------------------------

    def info(self) -> dict:
        m = self._memory
        resident = sum(int(m.get(k) or 0) for k in ("dense_bytes", "experts_pinned_bytes", "experts_ram_bytes"))
        return {"model": self.name, "resident": human_bytes(resident) if m else "?"}  # /health tells no format

    def stream(self, messages: list[dict], slot: int) -> Iterator:
        self._cancelled.clear()
        body = {"model": self.model_id, "messages": messages, "stream": True, "max_tokens": self.max_tokens,
                "cache_slot": slot, "stream_options": {"include_usage": True}, **self.sampling}
        try:
            resp = self._request("POST", "/v1/chat/completions", body, timeout=3600)
        except ColiError as e:
            yield Error("engine_error", str(e))
            return
        self._resp = resp
        reason, usage = None, None
        yield Started(slot, 0, 0, 0.0, self.max_tokens)
        try:
            for raw in resp:
                if self._cancelled.is_set():
                    break
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    yield Error(err.get("code") or "engine_error", err.get("message", "server error"))
                    return
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        yield ReasoningDelta(delta["reasoning_content"])
                    if delta.get("content"):
                        yield TextDelta(delta["content"])
                    reason = choice.get("finish_reason") or reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
        except Exception as e:  # a closed connection reads as many things
            if not self._cancelled.is_set():
                yield Error("engine_error", f"the stream from {self.base} broke: {e}")
                return
        finally:
            self._resp = None
            resp.close()
        if self._cancelled.is_set():
            yield Error("cancelled", "the request was cancelled")
            return
        turn = self._last_turn()
        if turn is not None:
            yield turn
        elif usage:
            yield TurnStats(0.0, completion_tokens=int(usage.get("completion_tokens") or 0),
                            prompt_tokens=int(usage.get("prompt_tokens") or 0))
        yield Finished(reason or "stop")

    def _last_turn(self) -> TurnStats | None:
        try:
            turns = self._json("GET", "/profile").get("turns") or []
        except ColiError:
            return None
        return TurnStats.from_server(turns[-1]) if turns else None

    def cancel(self) -> None:
        """Stop reading: closing the connection makes the server cancel the request."""
        self._cancelled.set()
        resp = self._resp
        if resp is not None:
            try:
                resp.close()
            except Exception:
                pass

    def grid(self) -> ExpertGrid | None:
        body = self._json("GET", "/experts")
        g = decode(body)
        return None if g.empty else g

    def atlas(self) -> dict | None:
        """The server's expert atlas (GET /experts/atlas), or None when it has none."""
        try:
            return self._json("GET", "/experts/atlas")
        except Exception:  # 404 atlas_not_found, or an older server
            return None

    def close(self) -> None:
        self.cancel()


def _error_text(e) -> str:
    try:
        body = json.loads(e.read())
        err = body.get("error", body)
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except Exception:
        return e.reason or "error"
