"""The chat page at GET / (index.html, app.js, markdown.js, style.css in this folder): static
files read once when the app is built, served with a Content-Security-Policy that allows only
the page's own origin. The page is a client of the server's own API (/v1/chat/completions,
/v1/models, /stats); nothing here sits on the API's request path."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "markdown.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def add_ui_routes(app: FastAPI) -> None:
    files = {name: (resources.files(__name__) / name).read_bytes() for name in TYPES}

    def page(name: str) -> Response:
        return Response(files[name], media_type=TYPES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return page("index.html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in files or name == "index.html":
            return Response("not found", status_code=404, media_type="text/plain")
        return page(name)
