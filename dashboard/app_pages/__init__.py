"""The dashboard's pages, one Streamlit script each, run by ``st.navigation`` in ``dashboard/app.py``.

A package (this file) so that an installed servelens (the Docker image, ``pip install .``) ships
the pages beside ``app.py``; Streamlit runs them as scripts and never imports this module.
"""
