"""The [privacy] section: every bound it sets is checked, so a setting cannot lift one silently."""

from __future__ import annotations

import pytest

from privacy.config import PrivacyConfig
from privacy.scrub import clean_text, inert_label
from servelens.config import load_config
from servelens.errors import ConfigError


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("label_max_chars", -1, "privacy.label_max_chars must be at least 1, not -1"),
    ("text_max_chars", -1, "privacy.text_max_chars must be at least 0"),
    ("tenant_budget", 0, "privacy.tenant_budget must be at least 1"),
    ("min_group_size", 0, "privacy.min_group_size must be at least 1"),
    ("export_time_quantum_ms", -100, "privacy.export_time_quantum_ms must be at least 0"),
    ("score_threshold", 1.5, "privacy.score_threshold is a Presidio score, between 0 and 1"),
    ("scrub_budget_per_batch", -1, "privacy.scrub_budget_per_batch must be at least 0"),
])
def test_a_setting_that_would_lift_a_bound_is_refused_by_name(setting, value, message):
    with pytest.raises(ConfigError, match=message):
        PrivacyConfig(**{setting: value})
    with pytest.raises(ConfigError, match=message):  # as an operator sets it
        load_config(env={f"SERVELENS_PRIVACY__{setting.upper()}": str(value)})


def test_what_a_negative_cut_would_have_kept():
    """Why the length bounds are checked: Python's slice by -1 keeps all but the last character."""
    secret = "user alice@example.com said " + "x" * 2000
    assert "alice@example.com" in clean_text(secret, -1) and len(inert_label(secret, -1)) == len(secret) - 1
    assert len(clean_text(secret, PrivacyConfig().text_max_chars)) == 1024
    assert PrivacyConfig(text_max_chars=0, export_time_quantum_ms=0).text_max_chars == 0  # 0: no text, exact exports
