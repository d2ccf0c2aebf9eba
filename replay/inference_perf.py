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

Lengths may be a number or a distribution (``{distribution: normal|lognormal|skew_normal|uniform,
mean, std_dev (or std), min, max, skew}``). Both the nested layout of inference-perf's own configs
(``data: {type: shared_prefix, shared_prefix: {...}}``) and the flat transcription of
``../shared/fidelity/workloads`` (the generator's keys directly under ``data``) are read.

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
from replay.traces import WORKLOAD_SCHEMA, check_workload_size
from servelens.settings import read_document

Arrivals = Literal["poisson", "constant"]
#: Tokens a chat template adds to every prompt (Llama chat template with a system and a user turn,
#: measured on the fidelity data: ~574 real prompt tokens for a 547-token spec).
DEFAULT_CHAT_TEMPLATE_TOKENS = 27
#: Engine KV block size the prefix blocks are multiples of (vLLM's default), and the prefix block of a
#: workload without shared system prompts.
ENGINE_BLOCK_TOKENS = 16
RANDOM_PREFIX_BLOCK_TOKENS = 256
DISTRIBUTIONS = ("normal", "lognormal", "skew_normal", "uniform")
#: The longest sequence (prompt and output together) a spec may ask for, tokens: 10M, the longest context
#: window of any released model (Llama 4 Scout's); no engine serves a longer one, and beyond it a spec's
#: lengths are typos that would exhaust memory building the table (a 10M-token prompt is 100,000 prefix ids).
MAX_SEQUENCE_TOKENS = 10_000_000
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


def read_inference_perf(path: str | Path) -> InferencePerfSpec:
    """Read an inference-perf config (YAML); an unknown or missing key is an error that names it."""
    path = Path(path)
    doc = read_document(path, "inference-perf config")
    if not isinstance(doc, dict) or not isinstance(doc.get("load"), dict) or not isinstance(doc.get("data"), dict):
        raise ReplayError(f"{path}: not an inference-perf config", "it needs a `load:` with stages and a `data:` section")
    return parse_inference_perf(doc, name=str(doc.get("profile") or path.stem), where=str(path))


def parse_inference_perf(doc: dict[str, Any], *, name: str = "inference-perf", where: str = "config") -> InferencePerfSpec:
    """The spec of an inference-perf config already read into a mapping."""
    load, data = doc["load"], doc["data"]
    arrivals = cast(Arrivals, str(load.get("type", "poisson")))
    if arrivals not in ("poisson", "constant"):
        raise ReplayError(f"{where}: load.type {arrivals!r} is not supported", "use poisson or constant")
    raw_stages = load.get("stages") or ()
    if not isinstance(raw_stages, list) or not raw_stages or not all(isinstance(s, dict) for s in raw_stages):
        raise ReplayError(f"{where}: load.stages needs at least one stage with a positive rate and duration")
    stages = tuple(
        LoadStage(_number(_need(s, "rate", where), "rate", where), _number(_need(s, "duration", where), "duration", where))
        for s in raw_stages
    )
    check_workload_size(int(sum(s.rate_per_s * s.duration_s for s in stages)), f"{where}: the stages ask for",
                        "lower a stage's rate or duration (the summed rate x duration is the request count)")
    kind = str(data.get("type", "shared_prefix"))
    api = doc.get("api")
    chat_api = (api.get("type") if isinstance(api, dict) else api) == "chat"
    if kind == "shared_prefix":
        spec = _shared_prefix(data, name, arrivals, stages, chat_api, where)
    elif kind == "random":
        spec = InferencePerfSpec(
            name, arrivals, stages, "random", 1, 1, 0,
            _lengths(_need(data, "input_distribution", where), "input_distribution", where),
            _lengths(_need(data, "output_distribution", where), "output_distribution", where), chat_api,
        )
    else:
        raise ReplayError(f"{where}: data.type {kind!r} is not supported", "supported: shared_prefix, random")
    _check_table_size(spec, where)
    return spec


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
        _lengths(_need(g, "question_len", where), "question_len", where),
        _lengths(_need(g, "output_len", where), "output_len", where),
        bool(g.get("enable_multi_turn_chat", False)) or chat_api,
    )


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
    ``MAX_SEQUENCE_TOKENS``); an error names ``key``."""
    if not isinstance(value, dict):
        return Lengths(_tokens(value, key, where))
    if "mean" not in value:
        raise ReplayError(f"{where}: {key} needs a numeric mean", "e.g. {mean: 200, std_dev: 50, min: 1, max: 1024}")
    distribution = str(value.get("distribution", "normal"))
    if distribution not in DISTRIBUTIONS:
        raise ReplayError(f"{where}: {key}'s distribution {distribution!r} is not supported", f"valid: {', '.join(DISTRIBUTIONS)}")
    lengths = Lengths(
        mean=_tokens(value["mean"], f"{key}'s mean", where, whole=False),
        std=_number(value.get("std_dev", value.get("std", 0.0)) or 0.0, f"{key}'s std_dev", where, zero=True),
        min=int(_tokens(value.get("min", 1), f"{key}'s min", where, zero=True)),
        max=int(_tokens(value.get("max", MAX_SEQUENCE_TOKENS), f"{key}'s max", where)),
        distribution=distribution,
        skew=_number(value.get("skew", 0.0), f"{key}'s skew", where, signed=True),
    )
    if lengths.min > lengths.max:
        raise ReplayError(f"{where}: {key} needs min <= max, not {value!r}")
    return lengths


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
    "LoadStage",
    "arrival_times_ns",
    "inference_perf_workload",
    "parse_inference_perf",
    "prefix_block_tokens",
    "read_inference_perf",
]
