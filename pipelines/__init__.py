"""The data path from engines to the lake, and the tables derived from it.

``pipelines.tables`` derives one row per request from any event stream (real or replayed). The
emitter SDK, the Kafka ingest consumer and the Dagster definitions that orchestrate the batch side
live here too; Dagster wraps these library functions and adds nothing they need. Importing this
package does not import Dagster.
"""
