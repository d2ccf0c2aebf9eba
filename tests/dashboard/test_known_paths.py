"""Issue #22: the dashboard's server answers 404 to every URL that is neither a page nor one of
Streamlit's own endpoints (``dashboard.known_paths``), checked here on a Starlette app with a few
of Streamlit's routes and its app-shell fallback; the browser test checks the real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from streamlit.file_util import get_static_dir

from dashboard.app_pages import PAGES
from dashboard.known_paths import KnownPathsOnly, page_paths


async def _ok(request):
    return PlainTextResponse("ok")


async def _shell(scope, receive, send):  # Streamlit's static mount: the app shell for any path it has no file for
    await PlainTextResponse('<div id="root"></div>')(scope, receive, send)


APP = Starlette(routes=[Route("/_stcore/health", _ok), Route("/media/{file_id:path}", _ok), Mount("/", app=_shell)],
                middleware=[Middleware(KnownPathsOnly, pages=page_paths(), static_dir=get_static_dir())])


def status(path: str) -> int:
    """The status ``APP`` answers a GET of ``path`` (as the server hands it over: percent-decoded)."""
    messages: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [], "scheme": "http", "server": ("127.0.0.1", 8501), "http_version": "1.1"}
    asyncio.run(APP(scope, receive, send))
    return messages[0]["status"]


def test_the_pages_are_those_of_the_app():
    assert page_paths() == {"/"} | {f"/{url}" for _, _, url in PAGES[1:]}
    assert "/gate" in page_paths() and "/overview" not in page_paths()  # the default page is at "/" only


@pytest.mark.parametrize("path", ["/", "/gate", "/gate/", "/service-levels", "/_stcore/health", "/media/abc.png",
                                  "/favicon.png", "/manifest.json"])
def test_pages_streamlit_routes_and_frontend_files_go_through(path):
    assert status(path) == 200


@pytest.mark.parametrize("path", ["/nope", "/overview", "/etc/shadow", "/etc/passwd", "/gate/../../etc/passwd",
                                  "/media/../../etc/passwd", "/media/./x", "/app/static/etc/passwd", "//etc/passwd",
                                  "/gate//x", "/..\\..\\etc\\passwd", "/gate\x00", "/_stcore/nope",
                                  "/static/js/missing.js", "/gate/_stcore/health", "/_stcore/health/x"])
def test_every_other_path_is_not_found(path):
    assert status(path) == 404


def test_a_frontend_file_is_found_by_name():
    js = next(Path(get_static_dir(), "static", "js").glob("*.js"))
    assert status(f"/static/js/{js.name}") == 200
