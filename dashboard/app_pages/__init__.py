"""The dashboard's pages, one Streamlit script each, run by ``st.navigation`` in ``dashboard/app.py``.

A package (this file) so that an installed servelens (the Docker image, ``pip install .``) ships
the pages beside ``app.py``; Streamlit runs them as scripts. What this module holds is the page
table, read by ``dashboard/app.py`` and by the server's ``dashboard.known_paths`` (which must not
import the Streamlit layer to learn each page's URL).
"""

#: Each page: its script (relative to ``dashboard/``), its title, its URL path.
PAGES = (
    ("app_pages/overview.py", "Overview", "overview"),
    ("app_pages/traffic.py", "Traffic", "traffic"),
    ("app_pages/service_levels.py", "Service levels", "service-levels"),
    ("app_pages/load_latency.py", "Load and latency", "load-latency"),
    ("app_pages/policies.py", "Policies", "policies"),
    ("app_pages/gate.py", "Gate", "gate"),
    ("app_pages/request_explorer.py", "Request explorer", "request-explorer"),
    ("app_pages/tenants.py", "Tenants", "tenants"),
)
DEFAULT_PAGE = "overview"  # served at "/", the others at "/<url_path>"
