"""A recording proxy for real clients (a test helper, also a script).

``CaptureProxy(upstream)`` listens on 127.0.0.1, forwards every request to ``upstream``
(a running ``coli serve``) unchanged, streams the answer back, and records each request:
method, path with query, the headers that matter to the protocol (keys redacted) and the
JSON body. The recorded requests are the fixtures under tests/fixtures/clients/, replayed
by tests/test_client_fixtures.py.

Recording a client by hand (the client installed, a server running on :8000):

    python tests/client_capture.py http://127.0.0.1:8000 out.json --port 8100
    ANTHROPIC_BASE_URL=http://127.0.0.1:8100 claude -p "hi" --max-turns 1
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading

from aiohttp import ClientSession, ClientTimeout, web

KEEP_HEADERS = ("user-agent", "anthropic-beta", "anthropic-version", "content-type", "accept", "openai-beta",
                "x-stainless-lang", "x-stainless-package-version", "originator", "session_id")
SECRET_HEADERS = ("authorization", "x-api-key")


class CaptureProxy:
    def __init__(self, upstream: str, port: int = 0):
        self.upstream, self.port = upstream.rstrip("/"), port
        self.requests: list[dict] = []
        self.url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="capture-proxy")

    def __enter__(self) -> "CaptureProxy":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the capture proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._session = ClientSession(timeout=ClientTimeout(total=None))
        self._ready.set()
        await self._stop.wait()
        await self._session.close()
        await runner.cleanup()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k.lower(): v for k, v in request.headers.items()}
        record = {"method": request.method, "path": request.path_qs,
                  "headers": {k: v for k, v in headers.items() if k in KEEP_HEADERS or k.startswith("x-stainless")},
                  "body": body}
        record["headers"].update({k: "REDACTED" for k in SECRET_HEADERS if k in headers})
        self.requests.append(record)
        fwd = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length",
                                                                            "accept-encoding")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=raw,
                                         headers=fwd) as up:
            record["status"] = up.status
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() in ("content-type", "retry-after", "x-request-id")})
            await out.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionError:  # the client left once it had what it wanted (Codex does)
                pass
            return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="record the requests a client sends to a coli server")
    ap.add_argument("upstream")
    ap.add_argument("out")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args(argv)
    with CaptureProxy(args.upstream, args.port) as proxy:
        print(f"recording at {proxy.url}; Ctrl-C to stop", file=sys.stderr)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    with open(args.out, "w") as f:
        json.dump(proxy.requests, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
