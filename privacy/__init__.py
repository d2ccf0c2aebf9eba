"""Tenant privacy before anything is stored: pseudonyms, an allowlist, bounded cardinality,
PII scrubbing of free text, and k-anonymous aggregates.

Pure, fast functions that the ingest path, the replay exports and the dashboard all use, so that
nothing un-sanitized reaches Parquet, DuckDB, a dashboard or an exported trace. See
``docs/privacy.md`` for the model (built in issue 3).
"""
