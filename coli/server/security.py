"""Who may talk to the server: Host allowlist, CORS, API key; and the error envelope.

One middleware runs in this order on every request:

1. the Host header must name this machine (localhost, a loopback address, the bound
   address) or a host given with --allowed-host: a page on another site whose name was
   re-pointed at 127.0.0.1 (DNS rebinding) is refused;
2. a request carrying an Origin must come from an allowed origin (exact match: the Vite
   dev server and Tauri by default, --cors-origin, and this server itself); preflights
   are answered here;
3. with an API key configured, every endpoint but the public part of /health needs it,
   as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant time;
4. errors of any kind become API-shaped JSON (Anthropic's envelope under /v1/messages).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging

from aiohttp import web

from coli.server.config import DEFAULT_CORS_ORIGINS, ServerConfig
from coli.server.errors import ApiError

log = logging.getLogger("coli.server")

PUBLIC = {"/health"}  # answer without a key (with less in them)
ALLOW_METHODS = "GET, POST, DELETE, OPTIONS"
ALLOW_HEADERS = ("authorization, content-type, x-api-key, anthropic-version, anthropic-beta, "
                 "anthropic-dangerous-direct-browser-access, openai-organization, openai-project")
EXPOSE_HEADERS = "x-colibri-queue-wait-ms, retry-after"
AUTHENTICATED = web.RequestKey("authenticated", bool)


def split_host(host: str) -> str:
    """The name or address of a Host header, without port or IPv6 brackets, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1: host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.hosts = {"localhost"} | {split_host(h) for h in config.allowed_hosts}
        if config.host not in ("", "0.0.0.0", "::"):
            self.hosts.add(split_host(config.host))
        self.origins = set(DEFAULT_CORS_ORIGINS) | {o.rstrip("/") for o in config.cors_origins}
        self.any_origin = "*" in self.origins
        self._key = hashlib.sha256(config.api_key.encode()).digest() if config.api_key else None

    # -- checks -----------------------------------------------------------------------------

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        host = split_host(host_header)
        return host in self.hosts or is_loopback(host)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        origin = origin.rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        # this server's own pages (a dashboard served from the same address)
        return bool(host_header) and origin in (f"http://{host_header}", f"https://{host_header}")

    def key_ok(self, request: web.Request) -> bool:
        if self._key is None:
            return True
        given = request.headers.get("x-api-key", "").strip() or None  # an empty header counts as absent
        auth = request.headers.get("Authorization", "")
        if given is None and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not given:
            return False
        # hashing first makes the comparison independent of the key's length too
        return hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(), self._key)

    # -- the middleware ---------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        anthropic = request.path.startswith("/v1/messages")
        if request.path.startswith("/v1/systemone"):
            anthropic = "jev"  # TypeSafe's envelope (coli.server.systemone)
        try:
            return await self._guarded(request, handler)
        except ApiError as e:
            return error_response(e, anthropic)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(_from_http(e, request), anthropic)
        except ConnectionResetError:
            raise
        except Exception as e:  # a bug: answer 500, never a traceback page
            log.exception("request failed: %s %s", request.method, request.path)
            return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"),
                                  anthropic)

    async def _guarded(self, request: web.Request, handler):
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            raise ApiError(403, f"the Host header {host!r} is not allowed; start the server with --allowed-host "
                                "NAME (or COLI_ALLOWED_HOSTS) to serve it", code="host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin, host):
            raise ApiError(403, f"the origin {origin!r} is not allowed; add it with --cors-origin",
                           code="origin_not_allowed")
        if request.method == "OPTIONS":
            return self._preflight(request, origin)
        request[AUTHENTICATED] = self.key_ok(request)
        if not request[AUTHENTICATED] and request.path not in PUBLIC:
            raise ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY'", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    def _preflight(self, request: web.Request, origin: str | None) -> web.Response:
        allow = allowed_methods(request)
        headers = {"Allow": allow}
        if origin is not None:
            headers.update({"Access-Control-Allow-Methods": allow,
                            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                                ALLOW_HEADERS),
                            "Access-Control-Max-Age": "600"})
        return web.Response(status=204, headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Adds CORS headers to every response of an allowed origin (streams included)."""
        origin = request.headers.get("Origin")
        response.headers["Vary"] = "Origin"
        if origin is not None and self.origin_allowed(origin, request.headers.get("Host")):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS


def allowed_methods(request: web.Request) -> str:
    """The methods the request's path answers (plus OPTIONS); every method for an unknown path."""
    exc = getattr(request.match_info, "http_exception", None)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        methods = set(exc.allowed_methods) | {"OPTIONS"}
        return ", ".join(m for m in ("GET", "HEAD", "POST", "OPTIONS") if m in methods)
    return ALLOW_METHODS


def error_response(e: ApiError, anthropic: bool | str) -> web.Response:
    body = e.jev() if anthropic == "jev" else e.anthropic() if anthropic else e.openai()
    return web.json_response(body, status=e.status, headers=e.headers)


def _from_http(e: web.HTTPException, request: web.Request) -> ApiError:
    if e.status == 404:
        return ApiError(404, f"no such endpoint: {request.method} {request.path} (see GET /openapi.json)",
                        code="not_found")
    if e.status == 405:
        return ApiError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed",
                        headers={"Allow": e.headers.get("Allow", "")})
    if e.status == 413:
        return ApiError(413, f"the request body is larger than the limit (--max-body): {e.text}",
                        code="request_too_large")
    return ApiError(e.status, e.reason or str(e), code="http_error")
