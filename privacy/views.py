"""What a viewer may see: k-anonymous aggregates across tenants, detail only within one's own tenant.

Per-tenant TTFT, cached-prefix tokens and queue positions are timing side channels (prompt-cache
hits show up in TTFT: "The Early Bird Catches the Leak", arXiv 2409.20002; InputSnatch,
arXiv 2411.18191). So:

- **Across tenants**, every report and dashboard view aggregates through ``k_anonymous``: a cell
  with fewer than ``k`` distinct tenants or fewer than ``k`` requests is suppressed (its figures
  null, ``suppressed`` true, and the reason given), and the number of suppressed cells is returned
  so the view can say so instead of hiding it.
- **Within a tenant**, ``TenantScope`` filters per-request detail to the viewer's own tenant: its
  pseudonyms under every key of the ring (records from before a key rotation included).
- **Exports** (shareable traces) round timestamps down to a quantum (``coarsen_ns``): the order of
  events and the burst structure at scales above the quantum are kept, while sub-quantum timing
  (where cache-hit side channels live) is not. A coarser quantum leaks less and blurs more: at
  100 ms, TTFT differences of a few milliseconds from a cache hit vanish, yet arrival bursts per
  second and queueing of seconds stay visible.

Suppression is per cell: two views whose cells differ by one small group could be differenced. So
the dashboard feeds this helper only whole k-anonymous cells of a fixed time grid (its windows snap
to the grid, ``dashboard.data``), and its statistics across tenants cover the visible tenants only;
docs/privacy.md ("Differencing") states the guarantee and its limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from privacy.keys import KeyRing
from privacy.sanitize import FIELD_POLICIES, Pseudonym
from servelens.sql import sql_identifier


@dataclass(frozen=True, slots=True)
class KAnonymousResult:
    """Aggregated cells, with small ones suppressed, and how many were."""

    table: pa.Table
    num_suppressed: int
    k: int


def k_anonymous(
    con: duckdb.DuckDBPyConnection,
    relation: str,
    by: Sequence[str],
    aggregates: Mapping[str, str],
    *,
    k: int = 5,
    tenant_column: str = "tenant",
    request_column: str = "request_id",
    min_tenants: int | None = None,
    where: str | None = None,
    params: Sequence[object] = (),
    one_row_per_request: bool = False,
) -> KAnonymousResult:
    """Aggregate ``relation`` by ``by`` and suppress cells with < k tenants or < k requests.

    ``aggregates`` maps output names to SQL aggregate expressions (written by the caller, never
    built from user input; values are passed as ``params``). ``min_tenants`` overrides the tenant
    threshold, for views already scoped to a single tenant (pass 1).

    A cell's requests are counted as distinct values of ``request_column``. With
    ``one_row_per_request`` the caller states that every row of ``relation`` is a different request
    (``request_column`` unique and never null), and rows are counted instead (``count(*)``: the same
    number, at about half the CPU time over a million rows). Only under that precondition: were a
    request spread over two rows, the count would overstate the cell, and a cell of fewer than k
    requests could pass. So pass it only for relations whose uniqueness is checked where they are
    built (the dashboard's derived request file: ``dashboard.data.check_one_row_per_request``, and
    its tests). The tenant threshold is counted distinct either way.
    """
    min_tenants = k if min_tenants is None else min_tenants
    num_requests = "count(*)" if one_row_per_request else f"count(DISTINCT {sql_identifier(request_column)})"
    group = ", ".join(sql_identifier(c) for c in by)
    metrics = ", ".join(f"{expr} AS {sql_identifier(name)}" for name, expr in aggregates.items())
    filtered = f"WHERE {where}" if where else ""
    inner = (
        f"SELECT {group}{', ' if group else ''}count(DISTINCT {sql_identifier(tenant_column)}) AS num_tenants, "
        f"{num_requests} AS num_requests{', ' if metrics else ''}{metrics} "
        f"FROM {relation} {filtered} {'GROUP BY ' + group if group else ''}"
    )
    small = f"(num_tenants < {int(min_tenants)} OR num_requests < {int(k)})"
    hidden = ", ".join(f"CASE WHEN {small} THEN NULL ELSE {sql_identifier(n)} END AS {sql_identifier(n)}" for n in aggregates)
    outer = (
        f"SELECT {group}{', ' if group else ''}"
        f"CASE WHEN {small} THEN NULL ELSE num_tenants END AS num_tenants, "
        f"CASE WHEN {small} THEN NULL ELSE num_requests END AS num_requests"
        f"{', ' if hidden else ''}{hidden}, {small} AS suppressed, "
        f"CASE WHEN {small} THEN 'fewer than {int(min_tenants)} tenants or {int(k)} requests' END AS suppressed_reason "
        f"FROM ({inner}) {'ORDER BY ' + group if group else ''}"
    )
    table = con.sql(outer, params=list(params)).to_arrow_table()
    num_suppressed = int(np.sum(table["suppressed"].to_numpy(zero_copy_only=False))) if table.num_rows else 0
    return KAnonymousResult(table, num_suppressed, k)


@dataclass(frozen=True, slots=True)
class TenantScope:
    """The tenant a viewer belongs to, as the pseudonyms its records carry."""

    pseudonyms: frozenset[str]

    @classmethod
    def for_tenant(cls, keyring: KeyRing, tenant: str) -> TenantScope:
        """A tenant's scope from its raw id (tenants beyond the tenant budget are stored as
        'other' and have no detail to scope: raise ``privacy.tenant_budget`` to keep them)."""
        policy = FIELD_POLICIES["tenant"]
        assert isinstance(policy, Pseudonym)
        return cls(keyring.pseudonyms_everywhere(policy.kind, tenant, hex_chars=policy.hex_chars))

    def where(self, column: str = "tenant") -> tuple[str, list[str]]:
        """A SQL predicate (with parameters) restricting rows to this tenant."""
        marks = ", ".join("?" for _ in self.pseudonyms)
        return f"{sql_identifier(column)} IN ({marks})", sorted(self.pseudonyms)


def coarsen_ns(timestamps_ns: np.ndarray, quantum_ns: int) -> np.ndarray:
    """Round timestamps down to a quantum: order kept (non-decreasing stays non-decreasing)."""
    if quantum_ns <= 0:
        raise ValueError("the time quantum must be positive")
    values = np.asarray(timestamps_ns, dtype=np.int64)
    return values - np.mod(values, quantum_ns)
