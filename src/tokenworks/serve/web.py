"""The web page a person opens: `/` (chat, with the engine panel beside it) and `/lab` (the
evidence records and their plots), from the files in serve/web/, which the wheel carries:
no build step, nothing fetched from elsewhere.

The pages and their files are open, as /health is; what they show comes from the API
(/v1/models, /v1/chat/completions, /engine/state, /lab/records, /lab/files/NAME), which
asks for the key like every other route. Every page response carries a strict
Content-Security-Policy: scripts, styles and connections from this server only, images
from it or from blobs it sent, no frames, no inline script.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from tokenworks.serve.engine_panel import engine_state
from tokenworks.serve.errors import APIError
from tokenworks.serve.lab_records import MEDIA_TYPES

WEB = Path(__file__).with_name("web")
ASSET_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
ASSETS = sorted(p.name for p in WEB.iterdir() if p.suffix in ASSET_TYPES)
PAGES = {"/": "index.html", "/lab": "lab.html"}
OPEN_PATHS = (*PAGES, *(f"/ui/{name}" for name in ASSETS))

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"no page file {name}")
    path = WEB / name
    return Response(path.read_bytes(), media_type=ASSET_TYPES[path.suffix], headers=HEADERS)


@router.get("/")
async def chat_page():
    return _asset(PAGES["/"])


@router.get("/lab")
async def lab_page():
    return _asset(PAGES["/lab"])


@router.get("/ui/{name}")
async def page_file(name: str):
    return _asset(name)


@router.get("/engine/state")
async def engine(request: Request):
    """The engine panel's figures (serve/engine_panel.py)."""
    return engine_state(request.app.state.tokenworks)


@router.get("/lab/records")
async def records(request: Request):
    """The records folder's records, reports and plots."""
    return request.app.state.tokenworks.records.listing()


@router.get("/lab/files/{name}")
async def record_file(name: str, request: Request):
    path = request.app.state.tokenworks.records.file(name)
    if path is None:
        raise APIError(404, f"no record, plot or report {name} in the records folder")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)
