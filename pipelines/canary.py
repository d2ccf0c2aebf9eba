"""A live canary's two sides, read from the lake by the events' ``pool`` label.

The live gate (``servelens gate --live``) compares the requests of a canary pool with those of a
baseline pool over the same period. Both come from the lake's derived request table and step
events, filtered by ``pool``, the envelope field every engine sets on the events it emits (e.g.
``pool='canary'`` on the canary's engines, ``pool='baseline'`` on a baseline of the same size).
A lake whose events carry no pool label, or that lacks one of the two pools, is a clear error that
names the label and the pools it does hold, never an empty comparison.
"""

from __future__ import annotations

from pipelines.config import LakeConfig
from pipelines.lake import Lake
from replay.gate import STEP_COLUMNS, Run
from servelens.errors import DataNotFoundError

POOL_HINT = ("set the `pool` field of every event the engines emit (the envelope's deployment pool label, "
             "docs/schema.md): pool='canary' on the canary's engines and pool='baseline' on a baseline pool of "
             "the same size; or gate two replays offline with --baseline and --candidate")


def _window(since_ns: int | None, until_ns: int | None) -> tuple[list[str], list]:
    clauses, params = [], []
    if since_ns is not None:
        clauses.append("arrival_ns >= ?")
        params.append(since_ns)
    if until_ns is not None:
        clauses.append("arrival_ns < ?")
        params.append(until_ns)
    return clauses, params


def pool_counts(con, since_ns: int | None = None, until_ns: int | None = None) -> dict[str | None, int]:
    """Requests per pool label in the lake (None: requests without a label)."""
    clauses, params = _window(since_ns, until_ns)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    rows = con.sql(f"SELECT pool, count(*) FROM requests {where} GROUP BY pool", params=params).fetchall()
    return {pool: int(n) for pool, n in rows}


def _check_pools(counts: dict[str | None, int], pools: tuple[str, str], lake_root: str, period: str) -> None:
    labelled = {p: n for p, n in counts.items() if p is not None}
    total = sum(counts.values())
    if not total:
        raise DataNotFoundError(f"the lake {lake_root} holds no requests{period} for the live gate",
                                "ingest the engines' events first (`servelens ingest`), or widen --since")
    if not labelled:
        raise DataNotFoundError(
            f"the live gate needs the `pool` label, and none of the {total:,} requests in the lake {lake_root}{period} "
            "carries one, so the canary cannot be told from the baseline", POOL_HINT)
    for pool in pools:
        if not labelled.get(pool):
            found = ", ".join(f"{p!r} ({n:,} requests)" for p, n in sorted(labelled.items()))
            raise DataNotFoundError(f"pool {pool!r} has no requests in the lake {lake_root}{period}; "
                                    f"pools found: {found}",
                                    "name the pools with --baseline-pool and --candidate-pool, widen --since, or " + POOL_HINT)


def lake_pools(lake_root: str, baseline_pool: str, candidate_pool: str, since_ns: int | None, until_ns: int | None,
               lake_config: LakeConfig | None = None) -> tuple[Run, Run]:
    """Two live pools from the lake over the same period (by the events' ``pool`` label); both
    ``measured`` (the replay model's error does not apply). ``lake_config``: the lake's settings
    (memory limit, object store)."""
    con = Lake(lake_root, lake_config).connect()
    period = "" if since_ns is None and until_ns is None else " in the period asked"
    _check_pools(pool_counts(con, since_ns, until_ns), (baseline_pool, candidate_pool), lake_root, period)
    runs = []
    for label, pool in (("baseline", baseline_pool), ("candidate", candidate_pool)):
        clauses, params = _window(since_ns, until_ns)
        requests = con.sql(f"SELECT * FROM requests WHERE {' AND '.join(['pool = ?', *clauses])}",
                           params=[pool, *params]).to_arrow_table()
        steps = con.sql(
            f"SELECT {', '.join(STEP_COLUMNS)} FROM events WHERE event_type = 'step_executed' AND pool = ?", params=[pool]
        ).to_arrow_table()
        runs.append(Run(label, requests, steps if steps.num_rows else None, f"{lake_root} (pool {pool})", None, None,
                        measured=True))
    return runs[0], runs[1]
