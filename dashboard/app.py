"""The servelens dashboard's entry point: ``servelens dashboard``, or ``streamlit run dashboard/app.py``.

Pages (``dashboard/app_pages/``; not ``pages/``, which Streamlit would also list before ``st.navigation``
runs): Overview, Traffic, Service levels, Load and latency, Policies, Gate, Request explorer, Tenants. Each is
a thin script over ``dashboard.data``, ``dashboard.runs`` and ``dashboard.explorer``; settings come from the
server (``dashboard.config``), never from the URL.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Streamlit puts the script's folder first on sys.path; modules here (config, data, ...) must not
# shadow top-level modules of the same name, and the package is imported as ``dashboard``.
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != HERE]
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import streamlit as st  # noqa: E402

from dashboard.app_pages import DEFAULT_PAGE, PAGES  # noqa: E402

st.set_page_config(page_title="servelens", layout="wide")
navigation = st.navigation([
    st.Page(str(HERE / path), title=title, default=True) if url == DEFAULT_PAGE else
    st.Page(str(HERE / path), title=title, url_path=url)
    for path, title, url in PAGES
])
navigation.run()
