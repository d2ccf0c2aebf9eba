"""inference-perf workload configs as servelens workloads: seeded, deterministic, bursts as specified.

`inference-perf <https://github.com/kubernetes-sigs/inference-perf>`_ (the Kubernetes serving
benchmark) describes a load as *stages* (a rate in requests/s for a duration, arrivals ``poisson``
or ``constant``, both random: ``arrival_times_ns``) and the data as a generator. Two generators are read:

``shared_prefix``  ``num_unique_system_prompts`` (``num_groups``) groups of
                   ``num_users_per_system_prompt`` (``num_prompts_per_group``) prompts: a system
                   prompt of ``system_prompt_len`` tokens shared by its group, a question of
                   ``question_len`` tokens of its own, ``output_len`` tokens out. inference-perf
                   builds these prompts once and sends request ``i`` the prompt ``i mod N`` (N =
                   groups x prompts per group), so after the first round every prompt repeats
                   whole: its blocks are cached when prefix caching is on. With
                   ``enable_multi_turn_chat`` the prompts are sent as chat messages; the context does
                   not grow between rounds (measured: inference-sim H30 findings), only the chat
                   template adds its tokens.
``random``         prompt and output lengths drawn from ``input_distribution`` and
                   ``output_distribution`` (``min``, ``max``, ``mean``, ``std``); no shared prefix.

Lengths may be a number or a distribution (``{type (or distribution): normal|lognormal|skew_normal|uniform|
poisson|fixed, mean, std_dev (or std, or variance), min, max, skew}``); a field a distribution leaves out takes
inference-perf's default (min 10, max 1024, mean 512, std_dev 200, normal), as inference-perf would. Both
the nested layout of inference-perf's own configs (``data: {type: shared_prefix, shared_prefix: {...}}``) and
the flat transcription of
``../shared/fidelity/workloads`` (the generator's keys directly under ``data``) are read. As inference-perf itself,
an unknown key is refused, named with the valid key it is closest to (a misspelt ``enable_multi_turn_chat`` would
silently drop the chat template); inference-perf's keys that shape no replayed request (server, report, worker
pool) are taken and ignored, and those that shape requests the replay does not model (multimodal prompts, a
trace, a sweep, LoRA adapters) are refused when set. A stage lasts at most ``MAX_STAGE_DURATION_S`` (1e9 s, all
stages together too) at a rate of at least ``MIN_STAGE_RATE_PER_S`` (one request in that time).

Lengths are token counts: whole numbers (a distribution's mean may have a fraction), each and a sequence's
sum at most ``MAX_SEQUENCE_TOKENS`` (10M, the longest context window served); a spec is also refused before
anything is built when its distinct prompts exceed the request cap (``replay.traces.MAX_WORKLOAD_REQUESTS``)
or its table would hold more than ``MAX_PREFIX_BLOCK_IDS`` prefix block ids (requests x prompt tokens / block).

Templated prompts are longer than the spec's token counts: a chat API wraps every prompt in its
model's template (the fidelity data's Llama runs: about 27 tokens, ``chat_template_tokens``). The
template's head is part of the shared prefix, its tail follows the question.

Everything random (arrival gaps, the order prompts are dealt in, drawn lengths) comes from one
seeded generator, so a spec and a seed give the same table byte for byte.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import pyarrow as pa

from replay.errors import ReplayError
from replay.traces import MAX_TRACE_TOKENS, WORKLOAD_SCHEMA, check_workload_size
from servelens.settings import read_document

Arrivals = Literal["poisson", "constant"]
#: Tokens a chat template adds to every prompt (Llama chat template with a system and a user turn,
#: measured on the fidelity data: ~574 real prompt tokens for a 547-token spec).
DEFAULT_CHAT_TEMPLATE_TOKENS = 27
#: Engine KV block size the prefix blocks are multiples of (vLLM's default), and the prefix block of a
#: workload without shared system prompts.
ENGINE_BLOCK_TOKENS = 16
RANDOM_PREFIX_BLOCK_TOKENS = 256
DISTRIBUTIONS = ("normal", "lognormal", "skew_normal", "uniform", "poisson", "fixed")
#: What inference-perf's ``Distribution`` takes for a field a config leaves out (its config/common.py).
DISTRIBUTION_DEFAULTS = {"min": 10, "max": 1024, "mean": 512, "std_dev": 200}
#: The longest sequence (prompt and output together) a spec may ask for, tokens: the bound a trace's lengths
#: have (``replay.traces.MAX_TRACE_TOKENS``, 10M, the longest context window of any released model); beyond it a
#: spec's lengths are typos that would exhaust memory building the table (a 10M-token prompt is 100,000 prefix ids).
MAX_SEQUENCE_TOKENS = MAX_TRACE_TOKENS
#: The most prefix block ids a spec's table may hold (requests x prompt tokens / prefix block): built from
#: Python lists at about 80 bytes and 1.3 us an id (measured), 50M ids are 4 GB and about a minute, as much as
#: the request cap's 50M requests of one id each (a 2,000-token prompt behind a 100-token system prompt is 20
#: ids: 2.5M such requests).
MAX_PREFIX_BLOCK_IDS = 50_000_000


@dataclass(frozen=True, slots=True)
class LoadStage:
    """One stage of a load: a rate for a duration."""

    rate_per_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token length: a constant (``std`` 0) or a distribution clipped to [min, max]."""

    mean: float
    std: float = 0.0
    min: int = 1
    max: int = MAX_SEQUENCE_TOKENS
    distribution: str = "normal"
    skew: float = 0.0

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.distribution == "fixed":  # inference-perf: the mean, truncated, never clamped
            return np.full(n, int(self.mean), dtype=np.int64)
        if self.distribution == "poisson":
            return np.clip(rng.poisson(self.mean, n), self.min, self.max).astype(np.int64)
        if self.std <= 0:
            return np.full(n, max(self.min, min(self.max, round(self.mean))), dtype=np.int64)
        if self.distribution == "lognormal":
            sigma2 = np.log(1 + (self.std / self.mean) ** 2)
            x = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), n)
        elif self.distribution == "uniform":
            half = self.std * np.sqrt(3)
            x = rng.uniform(self.mean - half, self.mean + half, n)
        elif self.distribution == "skew_normal":
            from scipy.stats import skewnorm

            a = self.skew
            delta = a / np.sqrt(1 + a * a)
            scale = self.std / np.sqrt(1 - 2 * delta * delta / np.pi)
            loc = self.mean - scale * delta * np.sqrt(2 / np.pi)
            x = skewnorm.rvs(a, loc=loc, scale=scale, size=n, random_state=rng)
        else:
            x = rng.normal(self.mean, self.std, n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


@dataclass(frozen=True, slots=True)
class InferencePerfSpec:
    """What an inference-perf config asks for (see the module docstring)."""

    name: str
    arrivals: Arrivals
    stages: tuple[LoadStage, ...]
    generator: Literal["shared_prefix", "random"]
    num_groups: int
    num_prompts_per_group: int
    system_prompt_tokens: int
    question_tokens: Lengths
    output_tokens: Lengths
    chat: bool  # prompts go through a chat template (multi-turn chat or the chat API)

    @property
    def num_requests(self) -> int:
        return sum(round(s.rate_per_s * s.duration_s) for s in self.stages)

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.stages)


#: The keys of an inference-perf config, by section: its pydantic models forbid any other (``StrictBaseModel``,
#: ``inference_perf/config`` at 7de5ef2), so a misspelt key is a typo, never a setting. The top level also takes the
#: fidelity data's transcriptions' documentation keys (``_TRANSCRIPTION_KEYS``), and ``data`` the generator's keys
#: directly (the flat layout). Keys read: api.type, data.type, the generator's lengths and counts,
#: enable_multi_turn_chat, load.type and the stages' rate and duration; the rest (the server, the report, the
#: worker pool, seeds, timeouts, the pause between stages) shape no request the replay sends, except those of
#: ``_UNMODELLED``, refused when set.
_TOP_KEYS = ("api", "data", "load", "metrics", "report", "storage", "server", "tokenizer", "circuit_breakers")
_TRANSCRIPTION_KEYS = ("profile", "used_by_training_experiments", "total_requests", "prompt_tokens_per_request_spec")
_DATA_KEYS = ("type", "path", "corpus_file_path", "input_distribution", "output_distribution", "shared_prefix",
              "multimodal", "trace", "otel_trace_replay", "weka_trace_replay", "conversation_replay", "visionarena",
              "use_chat_template")
_SHARED_PREFIX_KEYS = ("num_unique_system_prompts", "num_groups", "num_users_per_system_prompt",
                       "num_prompts_per_group", "system_prompt_len", "question_len", "output_len", "seed",
                       "question_distribution", "output_distribution", "enable_multi_turn_chat", "multimodal")
_LOAD_KEYS = ("type", "interval", "stages", "sweep", "num_workers", "worker_max_concurrency",
              "worker_max_tcp_connections", "trace", "circuit_breakers", "request_timeout", "lora_traffic_split",
              "base_seed")
_STAGE_KEYS = ("rate", "duration", "num_requests", "concurrency_level")
#: inference-perf's distribution keys (its ``type`` is the shape), and servelens's own ``distribution`` and ``std``.
_DISTRIBUTION_KEYS = ("type", "distribution", "mean", "std_dev", "std", "variance", "min", "max", "skew", "total_count")
#: Keys inference-perf reads that change the requests it sends, which the replay does not model: refused when set.
_UNMODELLED = {
    "multimodal": "images, video or audio attached to the prompts",
    "trace": "prompts or arrivals replayed from a trace file (give the trace to --workload instead)",
    "sweep": "stages generated up to the server's saturation rate (give the stages)",
    "lora_traffic_split": "requests sent to LoRA adapters",
    "num_requests": "a concurrent load's request count",
    "concurrency_level": "a concurrent load's concurrency",
}
#: The longest a load stage (and all of them together) may last, seconds: about 31 years, as a workload's span
#: (``replay.workload.MAX_SPAN_S``), so arrival times in nanoseconds fit a 64-bit integer.
MAX_STAGE_DURATION_S = 1e9
#: The lowest rate a stage may have, requests/s: one request in the longest stage; below it a stage sends none.
MIN_STAGE_RATE_PER_S = 1 / MAX_STAGE_DURATION_S


def _check_keys(sections: list[tuple[dict[str, Any], tuple[str, ...], str]], where: str) -> None:
    """Refuse the keys of ``sections`` (each: a mapping, its valid keys, its name, "" at the top) that are not valid,
    all at once, each with the valid key it is closest to; and a set key of ``_UNMODELLED``."""
    import difflib

    named, valid_of = [], []
    for section, valid, name in sections:
        prefix = f"{name}." if name else ""
        unknown = [str(k) for k in section if k not in valid]
        for key in unknown:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
            named.append(f"{prefix}{key}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
        if unknown:
            valid_of.append(f"{name or 'the top level'} takes {', '.join(valid)}")
    if named:
        raise ReplayError(f"{where}: unknown key{'s' if len(named) > 1 else ''} {', '.join(named)}",
                          "; ".join(valid_of) + " (inference-perf's keys: it refuses others too; docs/replay.md, "
                          "inference-perf workloads)")
    for section, _, name in sections:
        for key, what in _UNMODELLED.items():
            if section.get(key) not in (None, False, [], {}):
                prefix = f"{name}." if name else ""
                raise ReplayError(f"{where}: {prefix}{key} is set, but the replay does not model {what}",
                                  f"remove {prefix}{key} to replay the config without it")


def _check_sections(doc: dict[str, Any], where: str) -> None:
    """The keys of every section the replay reads (``_check_keys``)."""
    load, data = doc["load"], doc["data"]
    nested = isinstance(data.get("shared_prefix"), dict)
    flat = str(data.get("type", "shared_prefix")) == "shared_prefix" and not nested
    sections = [(doc, _TOP_KEYS + _TRANSCRIPTION_KEYS, ""), (load, _LOAD_KEYS, "load")]
    sections += [(stage, _STAGE_KEYS, f"load.stages[{i}]") for i, stage in enumerate(load.get("stages") or ())
                 if isinstance(stage, dict)]
    sections.append((data, tuple(dict.fromkeys(_DATA_KEYS + (_SHARED_PREFIX_KEYS if flat else ()))), "data"))
    if nested:
        sections.append((data["shared_prefix"], _SHARED_PREFIX_KEYS, "data.shared_prefix"))
    _check_keys(sections, where)


def read_inference_perf(path: str | Path) -> InferencePerfSpec:
    """Read an inference-perf config (YAML); an unknown or missing key is an error that names it."""
    path = Path(path)
    doc = read_document(path, "inference-perf config")
    if not isinstance(doc, dict) or not isinstance(doc.get("load"), dict) or not isinstance(doc.get("data"), dict):
        raise ReplayError(f"{path}: not an inference-perf config", "it needs a `load:` with stages and a `data:` section")
    return parse_inference_perf(doc, name=str(doc.get("profile") or path.stem), where=str(path))


def parse_inference_perf(doc: dict[str, Any], *, name: str = "inference-perf", where: str = "config") -> InferencePerfSpec:
    """The spec of an inference-perf config already read into a mapping; an unknown key is an error that names it
    (``_check_keys``)."""
    load, data = doc["load"], doc["data"]
    arrivals = cast(Arrivals, str(load.get("type", "poisson")))
    if arrivals not in ("poisson", "constant"):
        raise ReplayError(f"{where}: load.type {arrivals!r} is not supported", "use poisson or constant")
    kind = str(data.get("type", "shared_prefix"))
    if kind not in ("shared_prefix", "random"):
        raise ReplayError(f"{where}: data.type {kind!r} is not supported", "supported: shared_prefix, random")
    _check_sections(doc, where)
    stages = _stages(load, where)
    api = doc.get("api")
    chat_api = (api.get("type") if isinstance(api, dict) else api) == "chat"
    if kind == "shared_prefix":
        spec = _shared_prefix(data, name, arrivals, stages, chat_api, where)
    else:
        spec = InferencePerfSpec(
            name, arrivals, stages, "random", 1, 1, 0,
            _lengths(_need(data, "input_distribution", where), "input_distribution", where),
            _lengths(_need(data, "output_distribution", where), "output_distribution", where), chat_api,
        )
    _check_table_size(spec, where)
    return spec


def _stages(load: dict[str, Any], where: str) -> tuple[LoadStage, ...]:
    """The load's stages: each a rate of at least ``MIN_STAGE_RATE_PER_S`` for at most ``MAX_STAGE_DURATION_S`` (and
    all together at most that long), asking for at most a workload's requests (``check_workload_size``)."""
    raw_stages = load.get("stages") or ()
    if not isinstance(raw_stages, list) or not raw_stages or not all(isinstance(s, dict) for s in raw_stages):
        raise ReplayError(f"{where}: load.stages needs at least one stage with a positive rate and duration",
                          "e.g. stages: [{rate: 2.5, duration: 600}] (requests/s, seconds)")
    stages = []
    for i, s in enumerate(raw_stages):
        key = f"load.stages[{i}]"
        rate = _number(_need(s, "rate", where), f"{key}.rate", where)
        duration = _number(_need(s, "duration", where), f"{key}.duration", where)
        if duration > MAX_STAGE_DURATION_S:
            raise ReplayError(f"{where}: {key}.duration {duration:g} s is more than {MAX_STAGE_DURATION_S:g} s (about 31 "
                              "years), the longest a replayed workload may span",
                              "give the stage's duration in seconds (inference-perf's unit)")
        if rate < MIN_STAGE_RATE_PER_S:
            raise ReplayError(f"{where}: {key}.rate {rate:g} requests/s is below {MIN_STAGE_RATE_PER_S:g}, less than one "
                              f"request in the longest stage ({MAX_STAGE_DURATION_S:g} s): it sends none",
                              "give the stage's rate in requests per second (inference-perf's unit)")
        stages.append(LoadStage(rate, duration))
    total = sum(s.duration_s for s in stages)
    if total > MAX_STAGE_DURATION_S:
        raise ReplayError(f"{where}: the stages last {total:g} s together, more than {MAX_STAGE_DURATION_S:g} s (about 31 "
                          "years), the longest a replayed workload may span", "shorten the stages")
    check_workload_size(int(sum(s.rate_per_s * s.duration_s for s in stages)), f"{where}: the stages ask for",
                        "lower a stage's rate or duration (the summed rate x duration is the request count)")
    return tuple(stages)


def _shared_prefix(data: dict[str, Any], name: str, arrivals: Arrivals, stages: tuple[LoadStage, ...], chat_api: bool,
                   where: str) -> InferencePerfSpec:
    """The spec of a ``shared_prefix`` generator (nested or flat); its distinct prompts at most a workload's
    requests (``MAX_WORKLOAD_REQUESTS``): each is drawn whether or not it is sent."""
    g: dict[str, Any] = data["shared_prefix"] if isinstance(data.get("shared_prefix"), dict) else data
    groups = g.get("num_unique_system_prompts", g.get("num_groups"))
    per_group = g.get("num_users_per_system_prompt", g.get("num_prompts_per_group"))
    if groups is None or per_group is None:
        raise ReplayError(f"{where}: shared_prefix needs num_unique_system_prompts and num_users_per_system_prompt >= 1")
    num_groups = int(_number(groups, "num_unique_system_prompts", where, whole=True))
    num_per_group = int(_number(per_group, "num_users_per_system_prompt", where, whole=True))
    check_workload_size(num_groups * num_per_group,
                        f"{where}: num_unique_system_prompts x num_users_per_system_prompt ({num_groups:,} x "
                        f"{num_per_group:,}) are distinct prompts, as many as",
                        "lower num_unique_system_prompts or num_users_per_system_prompt (requests beyond their "
                        "product repeat its prompts)")
    system = _tokens(_need(g, "system_prompt_len", where), "system_prompt_len", where, zero=True)
    return InferencePerfSpec(
        name, arrivals, stages, "shared_prefix", num_groups, num_per_group, int(system),
        _generator_lengths(g, "question_len", "question_distribution", where),
        _generator_lengths(g, "output_len", "output_distribution", where),
        bool(g.get("enable_multi_turn_chat", False)) or chat_api,
    )


def _generator_lengths(g: dict[str, Any], key: str, legacy: str, where: str) -> Lengths:
    """The shared-prefix generator's length ``key``, or its legacy distribution ``legacy`` where given (inference-perf
    takes the legacy one over a whole-number ``key``, and refuses it beside a distribution)."""
    if g.get(legacy) is None:
        return _lengths(_need(g, key, where), key, where)
    if isinstance(g.get(key), dict):
        raise ReplayError(f"{where}: {key} is a distribution and {legacy} gives another",
                          f"give one of them (inference-perf refuses both); {legacy} is the older spelling")
    return _lengths(g[legacy], legacy, where)


def _need(mapping: dict[str, Any], key: str, where: str) -> Any:
    if key not in mapping or mapping[key] is None:
        raise ReplayError(f"{where}: missing {key!r}", "see docs/replay.md, inference-perf workloads")
    return mapping[key]


def _number(value: Any, key: str, where: str, *, whole: bool = False, zero: bool = False, signed: bool = False) -> float:
    """``value`` as a finite positive number (0 allowed with ``zero``, any sign with ``signed``; integral
    with ``whole``), else an error naming ``key``. A numeric string (YAML reads ``1e3`` as one) counts,
    as inference-perf's own config parser takes it."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))
    if not ok or (not signed and (value < 0 or (value == 0 and not zero))) or (whole and value != int(value)):
        sign = "finite" if signed else "non-negative" if zero else "positive"
        kind = "whole number" if whole else "number"
        raise ReplayError(f"{where}: {key} must be a {sign} {kind}, not {value!r}",
                          f"give {key} as a {sign} {kind} (docs/replay.md, inference-perf workloads)")
    return float(value)


def _tokens(value: Any, key: str, where: str, *, whole: bool = True, zero: bool = False) -> float:
    """``value``, a token length of ``key``: ``_number``, at most ``MAX_SEQUENCE_TOKENS``."""
    tokens = _number(value, key, where, whole=whole, zero=zero)
    if tokens > MAX_SEQUENCE_TOKENS:
        raise ReplayError(f"{where}: {key} {tokens:,.15g} is more than the {MAX_SEQUENCE_TOKENS:,} tokens of the longest "
                          "context window any model serves", f"give {key} in tokens, at most {MAX_SEQUENCE_TOKENS:,}")
    return tokens


def _lengths(value: Any, key: str, where: str) -> Lengths:
    """The token length ``key``: a whole number, or a distribution (its mean, min and max at most
    ``MAX_SEQUENCE_TOKENS``; a field left out takes inference-perf's default, ``DISTRIBUTION_DEFAULTS``);
    an error names ``key``."""
    if not isinstance(value, dict):
        return Lengths(_tokens(value, key, where))
    _check_keys([(value, _DISTRIBUTION_KEYS, key)], where)
    distribution = _shape(value, key, where)
    lengths = Lengths(
        mean=_tokens(value.get("mean", DISTRIBUTION_DEFAULTS["mean"]), f"{key}'s mean", where, whole=False),
        std=_spread(value, key, where),
        min=int(_tokens(value.get("min", DISTRIBUTION_DEFAULTS["min"]), f"{key}'s min", where, zero=True)),
        max=int(_tokens(value.get("max", DISTRIBUTION_DEFAULTS["max"]), f"{key}'s max", where)),
        distribution=distribution,
        skew=_number(value.get("skew", 0.0), f"{key}'s skew", where, signed=True),
    )
    if lengths.min > lengths.max:
        raise ReplayError(f"{where}: {key} needs min <= max, not {value!r}")
    return lengths


def _shape(value: dict[str, Any], key: str, where: str) -> str:
    """A distribution's shape: inference-perf's ``type`` or servelens's ``distribution`` (normal when neither)."""
    given = {k: str(value[k]) for k in ("type", "distribution") if value.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ReplayError(f"{where}: {key} gives type {given['type']!r} and distribution {given['distribution']!r}",
                          "give one: type (inference-perf's name) or distribution")
    distribution = next(iter(given.values()), "normal")
    if distribution not in DISTRIBUTIONS:
        raise ReplayError(f"{where}: {key}'s distribution {distribution!r} is not supported", f"valid: {', '.join(DISTRIBUTIONS)}")
    return distribution


def _spread(value: dict[str, Any], key: str, where: str) -> float:
    """A distribution's standard deviation: ``std_dev`` (or ``std``), or the square root of inference-perf's
    ``variance``, never both (inference-perf's default, 200, when none)."""
    if value.get("variance") is None:
        given = value.get("std_dev", value.get("std", DISTRIBUTION_DEFAULTS["std_dev"]))
        return _number(given, f"{key}'s std_dev", where, zero=True)
    std = _number(value.get("std_dev", value.get("std", 0.0)) or 0.0, f"{key}'s std_dev", where, zero=True)
    if std > 0:
        raise ReplayError(f"{where}: {key} gives both std_dev and variance", "give one of them (inference-perf refuses both)")
    return float(np.sqrt(_number(value["variance"], f"{key}'s variance", where, zero=True)))


def _check_table_size(spec: InferencePerfSpec, where: str) -> None:
    """A spec whose sequence is longer than ``MAX_SEQUENCE_TOKENS``, or whose table would hold more than
    ``MAX_PREFIX_BLOCK_IDS`` prefix block ids (at the lengths' means), is an error naming its lengths."""
    prompt, output = ("system_prompt_len + question_len", "output_len") if spec.generator == "shared_prefix" else (
        "input_distribution", "output_distribution")
    tokens = spec.system_prompt_tokens + spec.question_tokens.mean
    if tokens + spec.output_tokens.mean > MAX_SEQUENCE_TOKENS:
        raise ReplayError(f"{where}: {prompt} + {output} is {tokens + spec.output_tokens.mean:,.0f} tokens a sequence, "
                          f"more than the {MAX_SEQUENCE_TOKENS:,} of the longest context window any model serves",
                          f"shorten {prompt} or {output}")
    template = DEFAULT_CHAT_TEMPLATE_TOKENS if spec.chat else 0
    shared = spec.system_prompt_tokens + template // 2 if spec.generator == "shared_prefix" else 0
    block = prefix_block_tokens(shared)
    ids = spec.num_requests * int((tokens + template) // block)
    if ids > MAX_PREFIX_BLOCK_IDS:
        raise ReplayError(f"{where}: {spec.num_requests:,} requests of {tokens + template:,.0f} prompt tokens are "
                          f"{ids:,} prefix block ids of {block} tokens, more than the {MAX_PREFIX_BLOCK_IDS:,} a "
                          "workload built in memory may hold",
                          f"shorten {prompt}, or lower a stage's rate or duration")


def arrival_times_ns(spec: InferencePerfSpec, rng: np.random.Generator) -> np.ndarray:
    """Arrival times from 0, stage after stage, as inference-perf's load timers draw them.

    ``constant`` is inference-perf's ``ConstantLoadTimer`` (its default load type): not even spacing but
    ``int(rate x duration)`` exponential gaps scaled to sum to the stage's duration, so the stage holds
    exactly that many requests, the last at its end, and bursts like a Poisson process given its count.
    ``poisson`` is a Poisson process: exponential gaps until the stage ends (the count is Poisson with
    mean rate x duration). inference-perf's ``PoissonLoadTimer`` draws a Poisson count for each second and
    spreads it over that second the same way, which differs only in pinning each second's last arrival
    to its end, and stops after ``int(rate x duration)`` requests.
    """
    parts = []
    start = 0.0
    for stage in spec.stages:
        if spec.arrivals == "constant":
            gaps = rng.exponential(1 / stage.rate_per_s, int(stage.rate_per_s * stage.duration_s))
            offsets = np.cumsum(gaps) * (stage.duration_s / gaps.sum()) if gaps.size else gaps
        else:
            n = round(stage.rate_per_s * stage.duration_s)
            offsets = np.cumsum(rng.exponential(1 / stage.rate_per_s, n + 10 * int(np.sqrt(n)) + 10))
            offsets = offsets[offsets < stage.duration_s]
        parts.append(np.rint((start + offsets) * 1e9).astype(np.int64))
        start += stage.duration_s
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def inference_perf_workload(
    spec: InferencePerfSpec,
    seed: int = 0,
    *,
    chat_template_tokens: int | None = None,
    mean_output_tokens: float | None = None,
) -> pa.Table:
    """The workload table of ``spec``: arrivals, templated prompt lengths, prefix block ids, outputs.

    ``mean_output_tokens`` replaces the spec's output length (a run whose model stopped early, e.g.
    the fidelity data's measured mean); ``chat_template_tokens`` (default 27 for chat prompts, 0
    otherwise) is added to every prompt.
    """
    rng = np.random.default_rng(seed)
    arrivals = arrival_times_ns(spec, rng)
    n = len(arrivals)
    template = chat_template_tokens if chat_template_tokens is not None else (DEFAULT_CHAT_TEMPLATE_TOKENS if spec.chat else 0)
    num_prompts = spec.num_groups * spec.num_prompts_per_group
    if spec.generator == "shared_prefix":
        questions = spec.question_tokens.draw(rng, num_prompts)
        outputs = spec.output_tokens.draw(rng, num_prompts)
        users = rng.permutation(num_prompts)  # which group's system prompt each prompt slot is sent with
        slot = np.arange(n) % num_prompts
        prompt_index = slot
        group = users[slot] // spec.num_prompts_per_group
        question = questions[slot]
        output = outputs[slot]
    else:
        prompt_index = np.arange(n)
        group = np.full(n, -1)
        question = spec.question_tokens.draw(rng, n)
        output = spec.output_tokens.draw(rng, n)
    if mean_output_tokens is not None:
        output = _with_mean(output, mean_output_tokens)
    head = template // 2
    shared = (spec.system_prompt_tokens + head) if spec.generator == "shared_prefix" else 0
    prompt = shared + question + (template - head if spec.generator == "shared_prefix" else template)
    block = prefix_block_tokens(shared)
    width = max(6, len(str(n)))
    columns = {
        "request_id": pa.array([f"{spec.name}-{i:0{width}d}" for i in range(n)], pa.string()),
        "arrival_ns": pa.array(arrivals, pa.int64()),
        "num_prompt_tokens": pa.array(prompt, pa.int64()),
        "num_output_tokens": pa.array(output, pa.int64()),
        "prefix_block_ids": pa.array(_prefix_block_ids(spec.name, group, prompt_index, block, prompt, shared),
                                     pa.list_(pa.int64())),
        "prefix_block_size_tokens": pa.array(np.full(n, block), pa.int64()),
        "num_branches": pa.array(np.ones(n, dtype=np.int64), pa.int64()),
        "failed": pa.array(np.zeros(n, dtype=bool), pa.bool_()),
    }
    return pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in WORKLOAD_SCHEMA], schema=WORKLOAD_SCHEMA
    )


def _with_mean(lengths: np.ndarray, mean: float) -> np.ndarray:
    """Lengths scaled to ``mean``, the fraction spread deterministically (request i gets ceil where
    the running total falls short), so the table's mean is ``mean`` to within 1/n."""
    scaled = lengths * (mean / lengths.mean()) if lengths.mean() > 0 else np.full(len(lengths), mean)
    totals = np.floor(np.cumsum(scaled) + 0.5)
    out = np.diff(np.concatenate([[0.0], totals])).astype(np.int64)
    return np.maximum(out, 1)


def prefix_block_tokens(shared_tokens: int) -> int:
    """Tokens per prefix block id: the engine blocks that the shared system prompt fills (a group's shared
    part is then exactly one block id), or ``RANDOM_PREFIX_BLOCK_TOKENS`` without one. Coarser ids than
    the engine's 16-token blocks keep lookups cheap; the cache hits are the same, as a prompt is either
    shared up to its system prompt or repeated whole."""
    full = shared_tokens // ENGINE_BLOCK_TOKENS * ENGINE_BLOCK_TOKENS
    return full if full else RANDOM_PREFIX_BLOCK_TOKENS


def _prefix_block_ids(name: str, group: np.ndarray, prompt_index: np.ndarray, block: int, prompt: np.ndarray,
                      shared: int) -> list[list[int]]:
    """Each request's block ids (computed once per distinct prompt: shared-prefix prompts repeat)."""
    cache: dict[tuple[int, int, int], list[int]] = {}
    out = []
    for key in zip(group.tolist(), prompt_index.tolist(), prompt.tolist()):
        ids = cache.get(key)
        if ids is None:
            ids = cache[key] = _block_ids(name, key[0], key[1], block, shared, key[2])
        out.append(ids)
    return out


def _block_ids(name: str, group: int, prompt: int, block: int, shared_tokens: int, num_tokens: int) -> list[int]:
    """Hash ids of a prompt's full blocks of ``block`` tokens: a block inside its group's shared prefix is
    named by the group, the rest by the prompt (a block's content includes everything before it)."""
    ids = []
    for b in range(num_tokens // block):
        owner = f"g{group}" if group >= 0 and (b + 1) * block <= shared_tokens else f"p{prompt}"
        digest = hashlib.blake2b(f"{name}/{owner}/{b}".encode(), digest_size=8).digest()
        ids.append(int.from_bytes(digest, "big") >> 1)
    return ids


__all__ = [
    "DEFAULT_CHAT_TEMPLATE_TOKENS",
    "ENGINE_BLOCK_TOKENS",
    "InferencePerfSpec",
    "Lengths",
    "MAX_PREFIX_BLOCK_IDS",
    "MAX_SEQUENCE_TOKENS",
    "MAX_STAGE_DURATION_S",
    "MIN_STAGE_RATE_PER_S",
    "LoadStage",
    "arrival_times_ns",
    "inference_perf_workload",
    "parse_inference_perf",
    "prefix_block_tokens",
    "read_inference_perf",
]
