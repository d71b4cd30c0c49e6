"""GET /docs and /redoc with their scripts and styles served from the installed package, not a CDN.

FastAPI's default pages load Swagger UI and ReDoc from jsdelivr: on a machine without internet (air-gapped
networks, where many inference servers run) they render blank. The ``fastapi_offline`` package ships both
bundles; they are mounted under /docs/static.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL, REDOC_URL, ASSETS_URL = "/docs", "/redoc", "/docs/static"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
# ReDoc's side menu shows a logo from cdn.redoc.ly: the browser is told not to fetch it.
LOCAL_IMAGES = "img-src 'self' data:"


def assets_dir() -> Path:
    """The folder of Swagger UI's and ReDoc's bundles inside the installed ``fastapi_offline``."""
    return Path(str(files("fastapi_offline") / "static"))


def install_docs(app: FastAPI) -> None:
    """Serve /docs (Swagger UI) and /redoc from local assets; the app must be built with both URLs off."""
    if app.docs_url is not None or app.redoc_url is not None:  # FastAPI's own CDN pages would shadow these
        raise ValueError("build the app with docs_url=None and redoc_url=None")
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-static")
    openapi_url = app.openapi_url or "/openapi.json"

    def root(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        base = root(request)
        return get_swagger_ui_html(
            openapi_url=base + openapi_url, title=f"{app.title} - API",
            swagger_js_url=f"{base}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{base}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{base}{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=base + OAUTH2_REDIRECT_URL, swagger_ui_parameters=app.swagger_ui_parameters)

    @app.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        base = root(request)
        page = get_redoc_html(openapi_url=base + openapi_url, title=f"{app.title} - API reference",
                              redoc_js_url=f"{base}{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{base}{ASSETS_URL}/favicon.png", with_google_fonts=False)
        page.headers["Content-Security-Policy"] = LOCAL_IMAGES
        return page
