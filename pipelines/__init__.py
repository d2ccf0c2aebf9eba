"""The data path from engines to the lake, and the tables derived from it.

The request table (one row per request from any event stream, real or replayed) is derived by
``replay.derive``, below this package; the lake's daily tables and SQL views use it. The
emitter SDK, the Kafka ingest consumer and the Dagster definitions that orchestrate the batch side
live here too; Dagster wraps these library functions and adds nothing they need. Importing this
package does not import Dagster.
"""
