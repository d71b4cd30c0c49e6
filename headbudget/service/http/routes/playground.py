"""GET /playground: a page, served by the server itself, to try a budget by hand and see what it buys.

Plain HTML, CSS and JavaScript from headbudget/service/static, no build step and nothing fetched from elsewhere
(the Content-Security-Policy says so to the browser). The page calls the public API: /v1/models for the
budget grid and its accuracy curve, /classify with the key pasted into it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
PAGE_URL, ASSETS_URL = "/playground", "/playground/assets"
# Only this server's own scripts, styles and API; no inline code, no frames.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

router = APIRouter(tags=["playground"])


@router.get(PAGE_URL, include_in_schema=False)
async def playground() -> HTMLResponse:
    """The playground page."""
    html = (STATIC_DIR / "playground.html").read_text(encoding="utf-8")
    return HTMLResponse(html, headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


def install_playground(app: FastAPI) -> None:
    """Mount the page and its script and style."""
    app.include_router(router)
    app.mount(ASSETS_URL, StaticFiles(directory=STATIC_DIR), name="playground-assets")
