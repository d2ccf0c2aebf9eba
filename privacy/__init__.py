"""Tenant privacy before anything is stored: pseudonyms, an allowlist, bounded cardinality,
PII scrubbing of free text, and k-anonymous aggregates.

Pure, fast functions that the ingest path, the replay exports and the dashboard all use, so that
nothing un-sanitized reaches Parquet, DuckDB, a dashboard or an exported trace:

- ``privacy.keys``: keyed HMAC-SHA256 pseudonyms under a rotatable key ring;
- ``privacy.sanitize``: the per-field policy applied to every event batch, and the privacy report;
- ``privacy.sketch``: Space-Saving heavy hitters with hysteresis, for bounded cardinality;
- ``privacy.scrub``: Presidio (offline) plus secret recognizers, and inert labels;
- ``privacy.views``: k-anonymous aggregates, tenant-scoped detail, coarsened exports.

The model is documented in ``docs/privacy.md``.
"""

from privacy.config import PrivacyConfig
from privacy.keys import KeyRing, load_keyring
from privacy.sanitize import PrivacyReport, Sanitizer
from privacy.views import TenantScope, coarsen_ns, k_anonymous

__all__ = [
    "KeyRing",
    "PrivacyConfig",
    "PrivacyReport",
    "Sanitizer",
    "TenantScope",
    "coarsen_ns",
    "k_anonymous",
    "load_keyring",
]
