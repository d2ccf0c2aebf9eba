"""Streamlit plumbing the pages share: settings, cached data calls, URL filters, text shown safely.

- **Settings** come from the server (``dashboard.config.settings_from_env``); nothing in the URL
  changes them. The viewer's tenant scope is built here from ``dashboard.viewer_tenant`` alone.
- **Caching**: ``st.cache_data`` keyed by the lake's Delta version (looked up at most once per
  ``refresh_interval_s``), a run's events version (modification time and size) and the filters, so
  a page re-renders from memory; the derived request tables live on disk (``cache_dir``).
- **URL filters** (``st.query_params``): ``from``/``to`` (UTC, ISO 8601), ``class``, ``run``
  (repeated), ``source``, ``request``, ``instance``, ``order``. A link reproduces the view. Filters
  are remembered across pages in the session, never any privilege.
- **Text**: data (labels, ids, reasons, paths) is shown with ``st.text``, ``st.code`` or in
  dataframes, never inside Markdown; ``st.markdown`` and alerts carry only the dashboard's own words.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import streamlit as st

from dashboard import data, explorer, runs
from dashboard.config import Settings, settings_from_env
from dashboard.data import NS, LakeSnapshot, RequestsOverview, Selection, TimeWindow
from privacy.views import TenantScope
from replay.metrics import MetricsConfig
from servelens.errors import ServelensError

ALL_CLASSES = "all classes"


# ---------------------------------------------------------------------------------------------- settings


def settings() -> Settings:
    """The server's settings; a clean message (and a stop) when they are invalid."""
    try:
        return settings_from_env()
    except (ServelensError, ValueError) as exc:
        st.error("The dashboard's configuration is invalid.")
        st.text(str(exc))
        st.stop()
        raise  # unreachable: st.stop ends the run


@st.cache_data(show_spinner=False, max_entries=16)
def _metrics_config(path: str | None, mtime_ns: int) -> MetricsConfig:
    from replay.gate import default_config, load_config

    return (load_config(path) if path else default_config()).metrics_config()


def metrics_config(s: Settings) -> MetricsConfig:
    """Objectives, prices and entitlements from ``dashboard.gate_config_file`` (or the gate's defaults)."""
    path = s.dashboard.gate_config_file
    mtime = Path(path).stat().st_mtime_ns if path and Path(path).is_file() else 0
    try:
        return _metrics_config(path, mtime)
    except (ServelensError, OSError, ValueError) as exc:
        st.error("The gate configuration named by dashboard.gate_config_file cannot be read.")
        st.text(str(exc))
        st.stop()
        raise


class ScopeUnavailable(Exception):
    """dashboard.viewer_tenant is set but the key ring to resolve it is missing or invalid."""


def viewer_scope(s: Settings) -> TenantScope | None:
    """The viewer's tenant scope from server configuration only (``dashboard.viewer_tenant``,
    resolved with the configured key ring); None when no viewer tenant is configured. The URL has
    no say in it."""
    if not s.dashboard.viewer_tenant:
        return None
    from privacy.keys import load_keyring

    try:
        keyring = load_keyring(s.privacy.key_file)
    except ServelensError as exc:
        raise ScopeUnavailable(str(exc)) from None
    return TenantScope.for_tenant(keyring, s.dashboard.viewer_tenant)


# ---------------------------------------------------------------------------------------------- cached data


def _tick(s: Settings) -> int:
    return int(time.time() // max(1.0, s.dashboard.refresh_interval_s))


@st.cache_data(show_spinner=False, max_entries=8)
def _snapshot(root: str, tick: int) -> LakeSnapshot:
    return data.lake_snapshot(root)


_BUILDS: dict[str, threading.Thread] = {}
_BUILDS_LOCK = threading.Lock()


def _build(snapshot: LakeSnapshot, cache_dir: str, memory_limit: str | None) -> threading.Thread:
    """The one thread (per lake version and process) deriving that version's request file."""
    key = str(data.requests_file(snapshot, cache_dir))
    with _BUILDS_LOCK:
        thread = _BUILDS.get(key)
        if thread is None or (not thread.is_alive() and not Path(key).is_file()):
            thread = threading.Thread(target=data.lake_requests_path, args=(snapshot, cache_dir, memory_limit),
                                      name=f"derive-{Path(key).stem}", daemon=True)
            _BUILDS[key] = thread
            thread.start()
        return thread


@dataclass(frozen=True, slots=True)
class LakeView:
    """The lake as a page sees it: a snapshot and its derived request file."""

    snapshot: LakeSnapshot
    requests_path: str
    overview: RequestsOverview
    version_shown: int | None  # the lake version the request file holds (older while a newer one is derived)


def lake_snapshot(s: Settings) -> LakeSnapshot:
    try:
        return _snapshot(s.lake.root, _tick(s))
    except Exception as exc:  # a lake that cannot be opened: say so, keep the other pages working
        st.error("The lake cannot be read.")
        st.text(f"{s.lake.root}: {type(exc).__name__}: {exc}")
        st.stop()
        raise


def lake_view(s: Settings) -> LakeView | None:
    """The lake's request file (None when the lake holds no events). A new lake version is derived
    in the background while the newest derived one is shown; only the very first derivation is
    waited for."""
    snapshot = lake_snapshot(s)
    if snapshot.is_empty:
        return None
    cache_dir, memory_limit = s.dashboard.cache_dir, s.lake.duckdb_memory_limit
    path = data.requests_file(snapshot, cache_dir)
    version = snapshot.events_version
    if not path.is_file():
        thread = _build(snapshot, cache_dir, memory_limit)
        previous = data.newest_built(snapshot.root, cache_dir)
        if previous is None:
            with st.spinner(f"Deriving the request table of lake version v{version} (once per version) ..."):
                thread.join()
            if not path.is_file():
                st.error("The lake's request table could not be derived; the dashboard's log says why.")
                st.stop()
        else:
            path, version = Path(previous.path), previous.events_version
            st.caption(f"Showing lake version v{version}; v{snapshot.events_version} is being derived and "
                       "will be shown once it is ready.")
    return LakeView(snapshot, str(path), overview(str(path)), version)


@st.cache_data(show_spinner=False, max_entries=32)
def overview(requests_path: str) -> RequestsOverview:
    return data.requests_overview(requests_path)


@st.cache_data(show_spinner=False, max_entries=32)
def _ingest_health(root: str, tick: int) -> tuple[data.IngestHealth, ...]:
    return data.ingest_health(root)


def ingest_health(s: Settings) -> tuple[data.IngestHealth, ...]:
    """Each ingest process's last health line (re-read at most every refresh interval)."""
    return _ingest_health(s.lake.root, _tick(s))


@st.cache_data(show_spinner=False, max_entries=16)
def dead_letters(snapshot: LakeSnapshot, memory_limit: str | None) -> pa.Table:
    return data.dead_letters_by_reason(snapshot, memory_limit)


@st.cache_data(show_spinner=False, max_entries=64)
def arrivals(path: str, selection: Selection, bin_s: float, k: int) -> tuple[pa.Table, int]:
    return data.arrivals_over_time(path, selection, bin_s, k)


@st.cache_data(show_spinner=False, max_entries=64)
def count_requests(path: str, selection: Selection) -> int:
    return data.count_requests(path, selection)


@st.cache_data(show_spinner=False, max_entries=64)
def totals(path: str, selection: Selection, k: int) -> pa.Table:
    return data.selection_totals(path, selection, k).table


@st.cache_data(show_spinner=False, max_entries=64)
def service_levels(path: str, selection: Selection, objectives: tuple[data.Objective, ...], bin_s: float,
                   k: int) -> data.ServiceLevels:
    return data.service_levels(path, selection, objectives, bin_s, k)


@st.cache_data(show_spinner=False, max_entries=64)
def tenant_service(path: str, selection: Selection, config: MetricsConfig, k: int) -> tuple[pa.Table, int]:
    result = data.tenant_service(path, selection, config, k)
    return result.table, result.num_suppressed


@st.cache_data(show_spinner=False, max_entries=64)
def fairness(path: str, selection: Selection, config: MetricsConfig, k: int) -> data.Fairness:
    return data.fairness(path, selection, config, k)


@st.cache_data(show_spinner=False, max_entries=32)
def list_runs(runs_dir: str, tick: int) -> tuple[runs.RunInfo, ...]:
    return runs.list_runs(runs_dir)


@st.cache_data(show_spinner="Deriving the run's request table and metrics (once per run) ...", max_entries=256)
def run_metric_values(run: runs.RunInfo, cache_dir: str, config: MetricsConfig, memory_limit: str | None) -> pa.Table:
    return runs.run_metric_values(run, cache_dir, config, memory_limit)


@st.cache_data(show_spinner="Deriving the run's request table (once per run) ...", max_entries=64)
def run_requests(run: runs.RunInfo, cache_dir: str, memory_limit: str | None) -> str:
    return str(runs.run_requests_path(run, cache_dir, memory_limit))


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    import duckdb

    return (OSError, ValueError, duckdb.Error)  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors


def report_unreadable(broken: list[tuple[str, BaseException]], *, of: int) -> None:
    """An error above the page naming each run whose files cannot be read, of ``of`` chosen (names as text:
    they are data)."""
    if broken:
        which = f"{len(broken)} of the {of} chosen runs" if of > 1 else "The chosen run"
        shown = "; the others are shown" if of > len(broken) else ""
        st.error(f"{which} cannot be read (a file cut short, or not Parquet){shown}. "
                 "Replay again, or remove what cannot be read from dashboard.runs_dir.")
        for name, exc in broken:
            st.text(f"{name}: {type(exc).__name__}: {exc}")


def readable_run_metrics(s: Settings, selected: tuple[runs.RunInfo, ...], config: MetricsConfig,
                         ) -> tuple[tuple[runs.RunInfo, ...], tuple[pa.Table, ...]]:
    """The chosen runs whose files can be read, with their metrics (``run_metric_values``); the others are
    named in an error above the page instead of ending it."""
    kept, values, broken = [], [], []
    for run in selected:
        try:
            values.append(run_metric_values(run, s.dashboard.cache_dir, config, s.lake.duckdb_memory_limit))
            kept.append(run)
        except _unreadable_errors() as exc:
            broken.append((run.name, exc))
    report_unreadable(broken, of=len(selected))
    return tuple(kept), tuple(values)


def readable_run_requests(s: Settings, run: runs.RunInfo) -> str:
    """``run_requests``, or an error naming the run and a stop when its files cannot be read."""
    try:
        return run_requests(run, s.dashboard.cache_dir, s.lake.duckdb_memory_limit)
    except _unreadable_errors() as exc:
        report_unreadable([(run.name, exc)], of=1)
        st.stop()
        raise


@st.cache_data(show_spinner=False, max_entries=16)
def gate_report(folder: str, mtime_ns: int) -> runs.GateReport | None:
    return runs.read_gate_report(folder)


@st.cache_data(show_spinner=False, max_entries=16)
def _gate_reports(gate_dir: str, tick: int) -> tuple[runs.GateReportRef, ...]:
    return runs.list_gate_reports(gate_dir)


def gate_reports(s: Settings) -> tuple[runs.GateReportRef, ...]:
    """The gate reports under dashboard.gate_dir, newest first (re-listed every refresh interval)."""
    return _gate_reports(s.dashboard.gate_dir, _tick(s))


def lake_page(s: Settings, page: str) -> tuple[LakeView, Selection]:
    """The top of a lake page: the lake's request file and the selection from the time-window and
    class filters (the first-run panel and a stop when the lake holds no events)."""
    view = lake_view(s)
    if view is None:
        first_run(s, "the lake holds no events")
        st.stop()
    return view, lake_selection(view, page)


def lake_selection(view: LakeView, page: str) -> Selection:
    """The time-window and class filters of a lake page, side by side."""
    left, right = st.columns([3, 1])
    with left:
        window = window_filter(view.overview, page)
    with right:
        service_class = class_filter(view.overview.classes, page)
    return Selection(window, service_class)


def series_bin_s(s: Settings, view: LakeView, selection: Selection) -> float:
    """The time bin of a page's series: at most ``max_points`` bins, and wide enough that a class's
    bin holds 8 k requests on average (so few cells fall under the k-anonymity threshold)."""
    k = s.privacy.min_group_size
    span_s = selection.window.span_s if selection.window is not None else 0.0
    num_series = 1 if selection.service_class is not None else max(1, len(view.overview.classes))
    width = data.choose_bin_s(span_s, s.dashboard.max_points, num_requests=count_requests(view.requests_path, selection),
                              num_series=num_series, min_requests_per_bin=8 * k)
    return float(math.ceil(width / data.WINDOW_GRID_S) * data.WINDOW_GRID_S)  # whole grid cells (docs/privacy.md)


def run_list(s: Settings) -> tuple[runs.RunInfo, ...]:
    return list_runs(s.dashboard.runs_dir, _tick(s))


# ---------------------------------------------------------------------------------------------- URL filters


def url_get(name: str) -> str | None:
    value = st.query_params.get(name)
    return value if value else None


def url_get_all(name: str) -> list[str]:
    return [v for v in st.query_params.get_all(name) if v]


def url_set(name: str, value: str | list[str] | None) -> None:
    """Write one filter into the URL (None or empty removes it), and remember it for other pages."""
    if value is None or value == [] or value == "":
        if name in st.query_params:
            del st.query_params[name]
    else:
        st.query_params[name] = value
    st.session_state[f"filter.{name}"] = value


def remembered(name: str) -> str | list[str] | None:
    """A filter from the URL, else the value last set on another page of this session."""
    if name in st.query_params:
        values = url_get_all(name)
        return values if len(values) > 1 else (values[0] if values else None)
    return st.session_state.get(f"filter.{name}")


def parse_time(text: str | None) -> int | None:
    """UTC epoch ns from ISO 8601 (``2023-11-16T18:02:00Z``) or epoch seconds; None if unparsable."""
    if not text:
        return None
    try:
        return int(float(text) * NS)
    except ValueError:
        pass
    try:
        stamp = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.UTC)
    return int(stamp.timestamp()) * NS + stamp.microsecond * 1000


def format_time(ns: int) -> str:
    """UTC ISO 8601 with a Z, to the second (what the URL carries)."""
    return dt.datetime.fromtimestamp(ns // NS, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _naive(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns // NS, dt.UTC).replace(tzinfo=None)


def _ns(value: dt.datetime) -> int:
    return int(value.replace(tzinfo=dt.UTC).timestamp()) * NS


def window_filter(ov: RequestsOverview, page: str) -> TimeWindow:
    """The time-window slider (UTC), initialised from the URL (``from``/``to``), written back to it."""
    if ov.first_arrival_ns is None or ov.last_arrival_ns is None:
        return TimeWindow(0, 1)
    grid = data.WINDOW_GRID_S * NS  # windows are whole cells of the fixed grid: no arbitrary window to difference
    full = data.snap(TimeWindow(ov.first_arrival_ns, ov.last_arrival_ns + 1))
    lo, hi = full.start_ns, full.end_ns
    start = parse_time(_one(remembered("from"))) or lo
    end = parse_time(_one(remembered("to"))) or hi
    start = min(max(start, lo), hi - grid)
    end = max(min(end, hi), start + grid)
    start, end = data.snap(TimeWindow(start, end)).start_ns, data.snap(TimeWindow(start, end)).end_ns
    span_s = (hi - lo) / NS
    step_s = int(math.ceil(data.choose_bin_s(span_s, 600) / data.WINDOW_GRID_S) * data.WINDOW_GRID_S)
    chosen = st.slider("Time window (UTC, by arrival)", min_value=_naive(lo), max_value=_naive(hi),
                       value=(_naive(start), _naive(end)), step=dt.timedelta(seconds=step_s), format="YYYY-MM-DD HH:mm:ss",
                       key=f"{page}.window")
    window = data.snap(TimeWindow(max(_ns(chosen[0]), lo), min(_ns(chosen[1]), hi)))
    at_full = window.start_ns == lo and window.end_ns == hi
    url_set("from", None if at_full else format_time(window.start_ns))
    url_set("to", None if at_full else format_time(window.end_ns))
    return window


def _one(value: str | list[str] | None) -> str | None:
    return value[-1] if isinstance(value, list) else value


def class_filter(classes: tuple[str, ...], page: str) -> str | None:
    """The service-class selector (``class`` in the URL); None: every class."""
    options = [ALL_CLASSES, *classes]
    wanted = _one(remembered("class"))
    index = options.index(wanted) if wanted in options else 0
    chosen = st.selectbox("Service class", options, index=index, key=f"{page}.class")
    url_set("class", None if chosen == ALL_CLASSES else chosen)
    return None if chosen == ALL_CLASSES else chosen


# ---------------------------------------------------------------------------------------------- showing things


def page(title: str, purpose: str) -> Settings:
    """Title the page, say what it is for, and return the settings."""
    st.title(title)
    st.caption(purpose)
    return settings()


def _is_share(name: str) -> bool:
    return name.startswith("attainment") or name.endswith("_share") or name in ("dead_letter_rate", "busy_share")


def show_table(table: pa.Table, *, height: int | None = None) -> None:
    """A table (cells are rendered as text, never as Markdown or HTML): shares as percentages,
    ``*_ns`` timestamps as UTC times, other numbers to four significant digits."""
    frame = table.to_pandas()
    columns = {}
    for field in table.schema:
        if field.name.endswith("_ns") and pa.types.is_integer(field.type):
            import pandas as pd

            frame[field.name] = pd.to_datetime(frame[field.name], unit="ns", utc=True)
            columns[field.name] = st.column_config.DatetimeColumn(format="YYYY-MM-DD HH:mm:ss.SSS")
        elif pa.types.is_floating(field.type):
            columns[field.name] = st.column_config.NumberColumn(format="percent" if _is_share(field.name) else "%.4g")
    kwargs = {"height": height} if height is not None else {}
    st.dataframe(frame, hide_index=True, width="stretch", column_config=columns, **kwargs)


def show_figure(fig, key: str) -> None:
    st.plotly_chart(fig, key=key, width="stretch", config={"displaylogo": False})


def fmt(value: float | None, spec: str = ",.3g", suffix: str = "") -> str:
    """A number for ``st.metric`` (n/a for none)."""
    if value is None:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def compact(value: float | None) -> str:
    """A count in a few characters: 950, 12.3k, 4.56M, 7.89G."""
    if value is None:
        return "n/a"
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:,.0f}"


def first_run(s: Settings, what: str) -> None:
    """The first-run panel: what is missing and the exact commands that produce it."""
    st.info(f"There is no data for this page yet: {what}. These commands produce it (with this "
            "dashboard's configured paths):")
    st.code(data.getting_started(s), language="bash")


def suppressed_note(num_suppressed: int, k: int, unit: str) -> None:
    if num_suppressed:
        st.caption(f"{num_suppressed:,} {unit} hidden: fewer than {k} tenants or {k} requests (privacy.min_group_size).")


def link_to(page_path: str, label: str, params: dict[str, str | list[str]]) -> None:
    """A link to another page of the dashboard with filters in its URL (a shareable link)."""
    st.page_link(page_path, label=label, query_params=params)


@st.cache_data(show_spinner=False, max_entries=64)
def candidate_requests(path: str, visibility: explorer.Visibility, window: TimeWindow | None, service_class: str | None,
                       order: str) -> pa.Table:
    return explorer.candidate_requests(path, visibility, window=window, service_class=service_class, order=order)


@st.cache_data(show_spinner=False, max_entries=64)
def find_request(path: str, request_id: str, visibility: explorer.Visibility) -> explorer.RequestSummary | None:
    return explorer.find_request(path, request_id, visibility)


@st.cache_data(show_spinner=False, max_entries=64)
def request_life(relation: str, summary: explorer.RequestSummary, hive: bool, memory_limit: str | None) -> explorer.RequestLife:
    return explorer.request_life(relation, summary, hive=hive, memory_limit=memory_limit)


@st.cache_data(show_spinner=False, max_entries=64)
def batch_composition(relation: str, instance_id: str, window: TimeWindow, hive: bool, max_points: int,
                      memory_limit: str | None) -> tuple[pa.Table, float]:
    return explorer.batch_composition(relation, instance_id, window, hive=hive, max_points=max_points, memory_limit=memory_limit)


@st.cache_data(show_spinner=False, max_entries=64)
def tenant_detail(path: str, selection: Selection, config: MetricsConfig, scope: TenantScope) -> data.TenantDetail:
    return data.tenant_detail(path, selection, config, scope)
