"""The Streamlit + plotly dashboard that analysts and release managers open every day.

It reads only DuckDB and Parquet (the lake and the replay reports), never the live stream, and
shows tenant data only through the k-anonymous helpers of ``privacy/``.
"""
