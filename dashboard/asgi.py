"""The dashboard as an ASGI app: ``streamlit run dashboard/asgi.py``, what ``dashboard.server.serve`` starts.

``streamlit run`` finds the module-level ``app = st.App(...)`` below and serves it with Streamlit's own
uvicorn server, under the same command-line options as ``dashboard/app.py``; the script it runs for
each session is ``dashboard/app.py``, unchanged. In front of Streamlit's routes sits
``dashboard.known_paths.KnownPathsOnly``: a URL that is neither a page nor one of Streamlit's own
endpoints gets 404, not the app shell. The chart pages' heavy modules (pandas, plotly: about a second)
are imported here, once, in the server's main thread before it serves anyone, so no page waits for
them and no two threads ever import pandas at once (its C extensions import each other in a circle:
two threads importing it together can each see the other half-initialized, and the page fails).
Nothing else differs from ``streamlit run dashboard/app.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# As in app.py: Streamlit puts the script's folder first on sys.path (and imports this file as the
# top-level module ``asgi``); the modules beside it must not shadow top-level ones.
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != HERE]
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import pandas  # noqa: E402,F401  (before any session: see above)
import streamlit as st  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from streamlit.file_util import get_static_dir  # noqa: E402

import dashboard.charts  # noqa: E402,F401  (plotly, likewise)
from dashboard.known_paths import KnownPathsOnly, page_paths  # noqa: E402

app = st.App(HERE / "app.py", middleware=[Middleware(KnownPathsOnly, pages=page_paths(), static_dir=get_static_dir())])
