"""404 for every URL that is neither a page of the dashboard nor one of Streamlit's own endpoints.

Streamlit answers a path it does not know with its app shell and a 200 (the fallback that lets a
multipage URL load), so ``/etc/shadow`` or the key file's path looked served even though no file
was. ``KnownPathsOnly`` is an ASGI middleware in front of Streamlit's (``dashboard/asgi.py`` serves
the app through ``st.App``). An HTTP request goes through when its decoded path is

- a page: ``/`` (the default page) or ``/<url_path>`` of another page of ``dashboard.app_pages.PAGES``;
- one of Streamlit's routes (health check, host config, media, uploads, components, ...), matched
  against the app's own routing table; the mount at the root that serves the frontend, and falls
  back to the app shell, matches every path and is left out;
- a file of Streamlit's frontend bundle (``/static/...``, ``/favicon.png``, ``/manifest.json``);

and gets a plain 404 otherwise, as does any path with a ``..`` or ``.`` segment, an empty segment
(``//``, but one trailing slash, which Streamlit redirects), a backslash or a NUL, however it was
percent-encoded (the server decodes the path before the middleware sees it).
WebSocket and lifespan messages pass untouched: the router closes a WebSocket it has no route for.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.responses import PlainTextResponse
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from dashboard.app_pages import DEFAULT_PAGE, PAGES


def page_paths() -> frozenset[str]:
    """The URL path of every page: ``/`` for the default one, ``/<url_path>`` for the others."""
    return frozenset("/" if url == DEFAULT_PAGE else f"/{url}" for _, _, url in PAGES)


def plain(path: str) -> bool:
    """Whether ``path`` (decoded) is absolute and free of ``.``, ``..`` and empty segments, backslashes
    and NULs; one trailing slash is allowed (Streamlit redirects ``/gate/`` to ``/gate``)."""
    if not path.startswith("/") or "\\" in path or "\x00" in path:
        return False
    segments = path[1:].split("/")
    if segments[-1] == "":
        segments.pop()
    return all(s not in ("", ".", "..") for s in segments)


class KnownPathsOnly:
    """The middleware: ``pages`` are the URL paths of the app's pages (``page_paths()``),
    ``static_dir`` the folder of Streamlit's frontend bundle (``streamlit.file_util.get_static_dir()``)."""

    def __init__(self, app: ASGIApp, pages: Iterable[str], static_dir: str) -> None:
        self.app = app
        self.pages = frozenset(pages)
        self.static_dir = Path(static_dir).resolve()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.known(scope):
            await PlainTextResponse("Not Found", status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def known(self, scope: Scope) -> bool:
        """Whether the request's path is a page, a route of Streamlit's or a file of its frontend."""
        path = scope["path"]
        if not plain(path):
            return False
        return (path.removesuffix("/") or "/") in self.pages or self.bundle_file(path) or self.streamlit_route(scope)

    def bundle_file(self, path: str) -> bool:
        """Whether ``path`` (plain) names a regular file of the frontend bundle."""
        return path != "/" and (self.static_dir / path[1:]).is_file()

    @staticmethod
    def streamlit_route(scope: Scope) -> bool:
        """Whether a route of the app (Starlette puts the app in ``scope["app"]``), other than a mount at
        the root, takes the request."""
        routes: Iterable[Any] = getattr(scope.get("app"), "routes", ())
        return any(not (isinstance(route, Mount) and route.path == "") and route.matches(scope)[0] is not Match.NONE
                   for route in routes)
