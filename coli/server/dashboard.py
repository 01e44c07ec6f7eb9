"""The web dashboard's files (coli/web_dist, built from web/), served beside the API.

Every file of the build gets its own GET route ("/" is index.html). They are public
like /health: the page must load before it can ask for the API key, and it holds no
secrets (the same files ship in the Python package). Hashed assets are cached for good.
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

from coli.server.security import PUBLIC

DIST = Path(__file__).resolve().parent.parent / "web_dist"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
         ".png": "image/png", ".ico": "image/x-icon", ".json": "application/json", ".txt": "text/plain"}


def files(root: Path = DIST) -> dict[str, Path]:
    """URL path -> file, for every file of the build ({} when it is not built)."""
    if not (root / "index.html").is_file():
        return {}
    out = {"/": root / "index.html"}
    for f in sorted(root.rglob("*")):
        if f.is_file():
            out["/" + f.relative_to(root).as_posix()] = f
    return out


def mount(app: web.Application, root: Path = DIST) -> None:
    table = files(root)
    for path, file in table.items():
        immutable = path.startswith("/assets/")
        app.router.add_get(path, _handler(file, immutable))
        PUBLIC.add(path)
    if not table:
        app.router.add_get("/", _not_built)
        PUBLIC.add("/")


def _handler(file: Path, immutable: bool):
    body = file.read_bytes()
    headers = {"Content-Type": TYPES.get(file.suffix, "application/octet-stream"),
               "Cache-Control": "public, max-age=31536000, immutable" if immutable else "no-cache",
               "X-Content-Type-Options": "nosniff"}
    if file.suffix == ".html":
        headers["Content-Type"] += "; charset=utf-8"

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, headers=headers)

    return handler


async def _not_built(request: web.Request) -> web.Response:
    return web.Response(text="The dashboard is not built: run web/build.sh (needs Node 20), or use the API under /v1.\n",
                        content_type="text/plain")
