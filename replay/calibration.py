"""Calibrations: the few physical parameters that make the roofline replay match a real engine.

A calibration is a small JSON file: which engine (and version) and hardware it was fitted on, what it
was fitted from, the fitted values, and the fit's held-out error per metric. It holds

- the step cost (``RooflineConfig``): shares of the accelerator's peak bandwidth that weights and KV
  reads achieve, a fixed per-step and per-sequence cost, an all-reduce latency per peer and the share of
  the interconnect's bandwidth its bytes achieve; compute efficiency as configured. Every term is
  bounded: no efficiency above 1, no negative time, so a calibrated step is never faster than the
  hardware's limit;
- the frontend (``FrontendConfig``): the time outside the engine that client-side latencies include;
- the engine's own defaults for the version it describes (vLLM >= 0.12: async scheduling).

``apply_calibration`` puts a calibration on an instance; ``load_calibration`` reads a file or a shipped
calibration by name (``SHIPPED``, in ``replay/calibrations/``; ``default_calibration`` picks the one that
applies). Fitting lives in ``replay.fit`` (from run summaries, per-request telemetry or step events).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.config import ACCELERATORS, FrontendConfig, InstanceConfig, accelerator
from replay.costmodel import RooflineConfig
from replay.fidelity import METRICS as FIDELITY_METRICS
from replay.load import Load
from schemas.types import doc
from servelens.errors import ConfigError, ServelensError
from servelens.settings import build, coerce, read_document

CALIBRATION_VERSION = 1
CALIBRATIONS_DIR = Path(__file__).resolve().parent / "calibrations"


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fitted parameters of the replay for one engine on one kind of hardware, and how well they hold."""

    name: str = doc("Short name, e.g. 'vllm-0.15.1-h100'.")
    engine: str = doc("The engine and version the data came from, e.g. 'vLLM 0.15.1'.")
    accelerators: tuple[str, ...] = doc("Accelerators the data ran on (elsewhere the calibration extrapolates).")
    roofline: RooflineConfig = doc("The step cost model's fitted terms.")
    frontend: FrontendConfig = doc("The time outside the engine step that client-side latencies include.")
    async_scheduling: bool = doc("The engine's default scheduling (vLLM >= 0.12: async).", True)
    method: str = doc("What it was fitted from and how.", "")
    fitted_on: tuple[str, ...] = field(default=(), metadata={"doc": "The runs it was fitted on (ids)."})
    held_out_error_pct: tuple[tuple[str, float], ...] = field(
        default=(), metadata={"doc": "Median absolute error per metric of runs the fit never saw (leave-one-out)."}
    )
    in_sample_error_pct: tuple[tuple[str, float], ...] = field(
        default=(), metadata={"doc": "Median absolute error per metric of the runs it was fitted on."}
    )
    notes: tuple[str, ...] = field(default=(), metadata={"doc": "What a reader should know (limits, choices)."})
    fitted_load: Load | None = doc(
        "The busiest minute's load among the runs it was fitted on (replay.load): beyond it a replay extrapolates.", None
    )

    def held_out(self, metric: str) -> float | None:
        """The held-out median absolute error of ``metric`` in percent, if measured."""
        return dict(self.held_out_error_pct).get(metric)

    def as_json(self) -> dict[str, Any]:
        return {
            "calibration_version": CALIBRATION_VERSION,
            "name": self.name,
            "engine": self.engine,
            "accelerators": list(self.accelerators),
            "method": self.method,
            "fitted_on": list(self.fitted_on),
            "roofline": _fields(self.roofline),
            "frontend": _fields(self.frontend),
            "engine_defaults": {"async_scheduling": self.async_scheduling},
            "held_out_error_pct": dict(self.held_out_error_pct),
            "in_sample_error_pct": dict(self.in_sample_error_pct),
            "notes": list(self.notes),
            **({"fitted_load": self.fitted_load.as_json()} if self.fitted_load is not None else {}),
        }


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


#: The keys of a calibration file (``Calibration.as_json``).
CALIBRATION_KEYS = ("calibration_version", "name", "engine", "accelerators", "method", "fitted_on", "roofline",
                    "frontend", "engine_defaults", "held_out_error_pct", "in_sample_error_pct", "notes", "fitted_load")
#: The figures a calibration's errors are given for: ``replay.fidelity.METRICS`` (fitted to runs) and the step times
#: of a fit to step events (``replay.calibrate.calibrate_steps``).
ERROR_METRICS = (*FIDELITY_METRICS, "step_time_median", "step_time_p90")
#: The largest error a calibration may record, percent (the replay 10x off): beyond it the gate also takes a run
#: manifest's record as corrupt (``replay.gate``); no calibration worth using comes near it.
MAX_ERROR_PCT = 1000.0
#: The smallest share of the hardware's peak a calibrated step may achieve: 1%. The fitted shares are 0.05 to 1
#: (``replay.fit`` bounds them so; the shipped ones 0.6 to 0.8); a share of 1e-9 makes a step a billion times the
#: roofline's, days per token, and overflows the replay's clock.
MIN_EFFICIENCY = 0.01
_EFFICIENCIES = ("compute_efficiency", "memory_efficiency", "kv_memory_efficiency", "moe_memory_efficiency",
                 "interconnect_efficiency")
#: The most a calibrated frontend may spend on a prompt or output token, s: 1 ms. A fast tokenizer takes about a
#: microsecond a token (the shipped fit: 8.4 us with the API server's work), so 1 ms a token would be a second for
#: a 1,000-token prompt, which no API server takes.
MAX_FRONTEND_S_PER_TOKEN = 1e-3
#: The most a calibrated frontend's per-request and per-chunk times may be, s: a second. They are an HTTP round trip,
#: parsing and a queue wait (fitted: at most 50 ms, ``replay.fit.FRONTEND_BOUNDS``); a second per request or
#: streamed chunk is a broken server, not one to calibrate against.
MAX_FRONTEND_OVERHEAD_S = 1.0
_PER_TOKEN = ("tokenize_s_per_token", "detokenize_s_per_token")


def calibration_from_json(doc_: dict[str, Any], where: str = "calibration") -> Calibration:
    """A calibration from its JSON form (``Calibration.as_json``); unknown or missing keys are errors, and so are
    terms beyond physical bounds (``MIN_EFFICIENCY``, ``MAX_FRONTEND_S_PER_TOKEN``, ``MAX_FRONTEND_OVERHEAD_S``,
    ``MAX_ERROR_PCT``) and accelerators no preset names."""
    if not isinstance(doc_, dict) or doc_.get("calibration_version") != CALIBRATION_VERSION:
        raise ConfigError(f"{where}: not a calibration of version {CALIBRATION_VERSION}",
                          "write one with `servelens calibrate`")
    unknown = sorted(str(k) for k in doc_ if k not in CALIBRATION_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
                          f"valid keys: {', '.join(CALIBRATION_KEYS)} ({_REWRITE})")
    try:
        calibration = _calibration(doc_)
        _check_physical(calibration)
        return calibration
    except ServelensError as exc:  # a key of the wrong type, a value out of its bounds: named, with the file
        raise ConfigError(f"{where}: {exc.message}", exc.hint or _REWRITE) from None


def _calibration(doc_: dict[str, Any]) -> Calibration:
    """The calibration a JSON mapping of its known keys describes, each key checked as it is read."""
    return Calibration(
        name=_text(doc_, "name"),
        engine=_text(doc_, "engine"),
        accelerators=_accelerators(doc_),
        roofline=build(RooflineConfig, _section(doc_, "roofline"), "roofline."),
        frontend=build(FrontendConfig, _section(doc_, "frontend"), "frontend."),
        async_scheduling=build(_EngineDefaults, _section(doc_, "engine_defaults", {}), "engine_defaults.").async_scheduling,
        method=_text(doc_, "method", ""),
        fitted_on=_texts(doc_, "fitted_on"),
        held_out_error_pct=_percents(doc_, "held_out_error_pct"),
        in_sample_error_pct=_percents(doc_, "in_sample_error_pct"),
        notes=_texts(doc_, "notes"),
        fitted_load=Load.of_json(doc_["fitted_load"]) if "fitted_load" in doc_ else None,
    )


def _check_physical(calibration: Calibration) -> None:
    """Refuse step-cost and frontend terms beyond what any hardware and API server do (see the bounds' notes)."""
    for name in _EFFICIENCIES:
        value = getattr(calibration.roofline, name)
        if value is not None and value < MIN_EFFICIENCY:
            raise ConfigError(f"roofline.{name} {value:g} is below {MIN_EFFICIENCY:g}: a step achieving under 1% of the "
                              "hardware's peak is no engine's", "a share of the peak: fitted ones are 0.05 to 1")
    for f in dataclasses.fields(calibration.frontend):
        value = getattr(calibration.frontend, f.name)
        most = MAX_FRONTEND_S_PER_TOKEN if f.name in _PER_TOKEN else MAX_FRONTEND_OVERHEAD_S
        if value > most:
            what = "a token" if f.name in _PER_TOKEN else "a request or streamed chunk"
            raise ConfigError(f"frontend.{f.name} {value:g} s is more than {most:g} s, beyond any API server's time "
                              f"for {what}", "give it in seconds: fitted ones are microseconds to milliseconds")


_REWRITE = "write one with `servelens calibrate` (the shipped ones: replay/calibrations/)"


@dataclass(frozen=True, slots=True)
class _EngineDefaults:
    async_scheduling: bool = True


def _section(doc_: dict[str, Any], key: str, default: dict[str, Any] | None = None) -> dict[str, Any]:
    value = doc_.get(key, default)
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping" + ("" if key in doc_ else " and is missing"))
    return value


def _text(doc_: dict[str, Any], key: str, default: str | None = None) -> str:
    value = doc_.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be text, not {value!r}" if key in doc_ else f"{key} is missing")
    return value


def _accelerators(doc_: dict[str, Any]) -> tuple[str, ...]:
    """The accelerators a calibration was fitted on: at least one, each an accelerator preset (by its own name, so
    that a replay on it is not taken for an extrapolation)."""
    names = _texts(doc_, "accelerators")
    if not names:
        raise ConfigError("accelerators is empty: a calibration was fitted on some accelerator",
                          f"name the accelerators its data ran on, e.g. [\"h100-sxm\"] (presets: {', '.join(ACCELERATORS)})")
    out = []
    for name in names:
        try:
            out.append(accelerator(name).name)
        except ServelensError:
            raise ConfigError(f"accelerators: {name!r} is not an accelerator the replay knows",
                              f"presets: {', '.join(ACCELERATORS)}") from None
    return tuple(out)


def _texts(doc_: dict[str, Any], key: str) -> tuple[str, ...]:
    value = doc_.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of names, not {value!r}")
    return tuple(value)


def _percents(doc_: dict[str, Any], key: str) -> tuple[tuple[str, float], ...]:
    """A metric -> median absolute error mapping: each metric one of ``ERROR_METRICS``, each error a finite
    percentage from 0 to ``MAX_ERROR_PCT``."""
    value = _section(doc_, key, {})
    unknown = sorted(str(k) for k in value if k not in ERROR_METRICS)
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} "
                          + ", ".join(f"{key}.{k}" for k in unknown),
                          f"valid keys in {key}: the metrics {', '.join(ERROR_METRICS)}")
    out = tuple((str(k), coerce(v, float, f"{key}.{k}")) for k, v in value.items())
    bad = next(((k, v) for k, v in out if not 0 <= v <= MAX_ERROR_PCT), None)
    if bad:
        raise ConfigError(f"{key}.{bad[0]} is an absolute error in percent, from 0 to {MAX_ERROR_PCT:g}, not {bad[1]:.6g}",
                          f"beyond {MAX_ERROR_PCT:g}% the replay is more than 10x off and the calibration of no use; "
                          + _REWRITE)
    return out


def shipped_calibrations() -> dict[str, Path]:
    """The calibrations shipped with servelens, by name."""
    return {p.stem: p for p in sorted(CALIBRATIONS_DIR.glob("*.json"))}


def load_calibration(name_or_path: str | Path) -> Calibration:
    """A shipped calibration by name, or a calibration file."""
    shipped = shipped_calibrations()
    path = shipped.get(str(name_or_path)) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"no calibration {str(name_or_path)!r}",
                          f"shipped: {', '.join(shipped) or 'none'}; or the path of a file from `servelens calibrate`")
    hint = "write one with `servelens calibrate`"
    return calibration_from_json(read_document(path, "calibration", hint), str(path))


def write_calibration(calibration: Calibration, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.as_json(), indent=2) + "\n")
    return path


def default_calibration() -> Calibration | None:
    """The shipped calibration replays use when none is named (the newest engine version shipped)."""
    shipped = shipped_calibrations()
    return load_calibration(sorted(shipped)[-1]) if shipped else None


def calibration_named(name: str) -> Calibration | None:
    """``auto``: the shipped calibration (``default_calibration``); ``none``: None; else a name or a file."""
    if name == "none":
        return None
    return default_calibration() if name == "auto" else load_calibration(name)


def apply_calibration(instance: InstanceConfig, calibration: Calibration) -> tuple[InstanceConfig, RooflineConfig]:
    """The instance with the calibration's frontend and engine defaults (a setting the instance gives, such as
    ``async_scheduling``, is kept), and the calibration's step cost terms."""
    engine = instance.engine
    if engine.async_scheduling is None:
        engine = dataclasses.replace(engine, async_scheduling=calibration.async_scheduling)
    return dataclasses.replace(instance, engine=engine, frontend=calibration.frontend), calibration.roofline


def calibration_record(calibration: Calibration, instance: InstanceConfig) -> dict[str, Any]:
    """What a run manifest says about the calibration behind it."""
    return {
        "name": calibration.name,
        "engine": calibration.engine,
        "fitted_on_accelerators": list(calibration.accelerators),
        "extrapolated": bool(calibration.accelerators) and instance.accelerator.name not in calibration.accelerators,
        "held_out_error_pct": dict(calibration.held_out_error_pct),
        **({"other_engine": note} if (note := other_engine(calibration)) else {}),
    }


#: The first vLLM release whose default engine is v1, the scheduler the replay models (replay/engine.py).
VLLM_V1_DEFAULT = (0, 8)


def other_engine(calibration: Calibration) -> str | None:
    """Why the calibration's terms may not hold for the replay's engine (vLLM v1's scheduling): fitted on another
    engine, or on a vLLM release that ran the v0 engine; None when it names vLLM v1, or names no engine."""
    engine = calibration.engine.strip()
    if not engine:
        return None
    if not re.search(r"\bvllm\b", engine, re.IGNORECASE):
        return f"fitted on {engine}, not vLLM: the replay schedules as vLLM v1 does, so its terms may not carry over"
    version = re.search(r"(\d+)\.(\d+)", engine)
    if version and (int(version[1]), int(version[2])) < VLLM_V1_DEFAULT:
        return (f"fitted on {engine}, which ran vLLM's v0 engine: the replay schedules as v1 does "
                f"({'.'.join(map(str, VLLM_V1_DEFAULT))} and later), so its terms may not carry over")
    return None


__all__ = [
    "CALIBRATIONS_DIR",
    "CALIBRATION_VERSION",
    "Calibration",
    "apply_calibration",
    "calibration_from_json",
    "calibration_record",
    "default_calibration",
    "load_calibration",
    "other_engine",
    "shipped_calibrations",
    "write_calibration",
]
