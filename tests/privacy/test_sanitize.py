"""The sanitizer end to end: nothing identifying reaches the files, memory stays fixed, output is stable."""

from __future__ import annotations

import dataclasses
import functools
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from privacy.config import PrivacyConfig
from privacy.keys import KeyRing
from privacy.sanitize import FIELD_POLICIES, Dimension, Pseudonym, Sanitizer, sanitize_records
from privacy.sketch import OTHER
from schemas.arrow import EVENTS_SCHEMA, events_to_table
from schemas.events import EVENT_TYPES, event_as_dict
from schemas.types import field_specs
from tests.privacy.test_scrub import PII
from tests.strategies import any_event

#: Fragments that must never appear in stored bytes once the values above went in.
FORBIDDEN = [*PII.values(), "jane.doe", "555-0132", "4111", "AKIAIOSFODNN7", "sk-proj", "eyJhbGci", "192.168.23", "raw-ident"]
PII_TEXT = " ".join(PII.values())


def _poisoned(cls, i: int):
    """An event of type ``cls`` with PII in every string field the validator lets carry text."""
    values = {}
    for spec in field_specs(cls):
        if spec.name in ("event_type", "schema_version") or spec.enum:
            continue
        if spec.kind == "string":
            # identifiers carry a raw marker that must vanish; every text field carries PII
            marker = "raw-ident" if isinstance(FIELD_POLICIES.get(spec.name), Pseudonym) else "label"
            text = f"{marker} {spec.name} {i} {PII_TEXT}"
            values[spec.name] = [text, text + " 2"] if spec.is_list else text
        elif spec.kind == "int":
            values[spec.name] = [1, 2] if spec.is_list else 1
        elif spec.kind == "float":
            values[spec.name] = 1.0
        elif spec.kind == "bool":
            values[spec.name] = True
    for spec in field_specs(cls):
        if spec.enum and spec.name not in ("event_type",):
            values[spec.name] = spec.enum[0]
    if cls.EVENT_TYPE == "step_executed":
        values["start_ns"], values["end_ns"] = 1, 2
    return cls(**values)


def _all_bytes_and_strings(path) -> tuple[bytes, str]:
    raw = path.read_bytes()
    strings = []
    for column in pq.read_table(path).columns:
        flat = column
        while pa.types.is_list(flat.type):
            flat = pa.chunked_array([c.flatten() for c in flat.chunks], flat.type.value_type)
        if pa.types.is_string(flat.type):
            strings.extend(v for v in flat.to_pylist() if v is not None)
    return raw, "\n".join(strings)


def test_every_text_field_of_the_schema_has_a_policy():
    for f in EVENTS_SCHEMA:
        base = f.type.value_type if pa.types.is_list(f.type) else f.type
        if pa.types.is_string(base) or f.name == "prefix_block_ids":
            assert f.name in FIELD_POLICIES, f.name
    assert set(FIELD_POLICIES) <= set(EVENTS_SCHEMA.names)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_pii_in_every_string_field_of_every_event_type_leaves_no_trace(keyring, tmp_path, compression):
    events = [_poisoned(cls, i) for i in range(3) for cls in EVENT_TYPES.values()]
    table = events_to_table(events)
    # the raw table does contain it (the test would be vacuous otherwise)
    assert "jane.doe@example.com" in str(table.to_pylist())
    sanitizer = Sanitizer(keyring, PrivacyConfig(tenant_budget=2, label_budget=2))
    clean = sanitizer.sanitize(table)
    path = tmp_path / f"events-{compression}.parquet"
    pq.write_table(clean, path, compression=compression, use_dictionary=compression != "none")
    raw, strings = _all_bytes_and_strings(path)
    for fragment in FORBIDDEN:
        assert fragment.encode() not in raw, fragment
        assert fragment not in strings, fragment
    report = sanitizer.report()
    assert report.num_events == len(events)
    assert {"EMAIL_ADDRESS", "API_KEY", "JWT", "CREDIT_CARD"} <= set(report.redactions)
    assert set(clean["pseudonym_key_id"].to_pylist()) == {"test-1"}


def test_prompt_text_and_unknown_fields_are_dropped_and_counted(keyring):
    record = {
        "event_id": "e1", "schema_version": "1.3", "event_type": "request_arrived", "ts_ns": 5,
        "engine_id": "eng", "request_id": "r1", "num_prompt_tokens": 3,
        "prompt": "my card is 4111 1111 1111 1111", "completion": "sure, jane.doe@example.com",
    }
    table, invalid = sanitize_records(Sanitizer(keyring), [record])
    assert invalid == [] and table.column_names == EVENTS_SCHEMA.names
    assert "4111" not in str(table.to_pylist()) and "jane" not in str(table.to_pylist())
    extra = pa.table({"event_id": ["x"], "event_type": ["request_cancelled"], "secret_column": ["a@b.co"]})
    sanitizer = Sanitizer(keyring)
    sanitizer.sanitize(extra, {"prompt": 1, "outcome": 2})
    # names are printed only when they are contract names: a field name is sender-controlled text
    assert sanitizer.report().fields_dropped == {"(unknown field)": 2, "outcome": 2}


def test_raw_tenant_ids_never_appear_and_joins_still_work(keyring):
    events = [
        dataclasses.replace(_poisoned(EVENT_TYPES["request_arrived"], 0), tenant="tenant-acme", request_id="r-1"),
        dataclasses.replace(_poisoned(EVENT_TYPES["first_token"], 0), tenant="tenant-acme", request_id="r-1"),
    ]
    clean = Sanitizer(keyring).sanitize(events_to_table(events))
    tenants, requests = clean["tenant"].to_pylist(), clean["request_id"].to_pylist()
    assert tenants[0] == tenants[1] == keyring.pseudonym("tn", "tenant-acme")
    assert requests[0] == requests[1] and "r-1" not in requests[0]


def test_a_million_distinct_tenants_stay_within_budget_in_fixed_memory(keyring):
    config = PrivacyConfig(tenant_budget=20)
    sanitizer = Sanitizer(keyring, config)
    capacity = sanitizer.dimensions["tenant"].sketch.capacity
    seen: set[str] = set()
    sizes = []
    batch = 100_000
    for start in range(0, 1_000_000, batch):
        n = batch
        table = pa.table(
            {
                "event_id": [f"e{start + i}" for i in range(n)],
                "schema_version": pa.repeat(pa.scalar("1.0"), n),
                "event_type": pa.repeat(pa.scalar("request_cancelled"), n),
                "ts_ns": pa.array(range(n), pa.int64()),
                "engine_id": pa.repeat(pa.scalar("eng"), n),
                "request_id": [f"r{start + i}" for i in range(n)],
                "tenant": [f"attacker-tenant-{start + i}" for i in range(n)],
            }
        )
        out = sanitizer.sanitize(table)
        seen.update(out["tenant"].unique().to_pylist())
        sizes.append(sanitizer.sketch_sizes()["tenant"])
    assert len(seen) <= config.tenant_budget + 1 and OTHER in seen
    assert sizes[0] == sizes[-1] == capacity  # the sketch is full after the first batch and never grows
    assert sanitizer.dimensions["tenant"].sketch.heap_size <= 4 * capacity + 64 + batch
    assert sanitizer.report().folded_into_other["tenant"] >= 1_000_000 - config.tenant_budget


@st.composite
def raw_records(draw):
    """Anything the validator accepts: a valid event plus unknown fields of a newer minor version."""
    event = draw(any_event)
    record = {k: v for k, v in event_as_dict(event).items() if v is not None or draw(st.booleans())}
    names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10).filter(lambda n: n not in EVENTS_SCHEMA.names)
    extras = draw(st.dictionaries(names, st.one_of(st.text(max_size=20), st.integers(), st.none()), max_size=3))
    return {**record, **extras}, extras


@functools.cache
def _fuzz_keyring_and_analyzer():
    """The fuzz test's key ring and one warm Presidio analyzer (stateless; building it takes about half a
    second, once, not once per example). Each example's sanitizers are still new: caches, sketches, budgets."""
    keyring = KeyRing("h", {"h": bytes(32)})
    return keyring, Sanitizer(keyring).scrubber.load()._analyzer


def _fresh_sanitizer() -> Sanitizer:
    keyring, analyzer = _fuzz_keyring_and_analyzer()
    sanitizer = Sanitizer(keyring)
    sanitizer.scrubber._analyzer = analyzer  # shared with its label scrubber
    return sanitizer


@given(st.lists(raw_records(), min_size=1, max_size=6))
def test_sanitize_never_raises_drops_unknown_fields_and_is_deterministic(records):
    raw = [r for r, _ in records]
    first, invalid = sanitize_records(_fresh_sanitizer(), raw)
    second, _ = sanitize_records(_fresh_sanitizer(), raw)
    assert invalid == []
    assert first.schema == EVENTS_SCHEMA and first.num_rows == len(raw)
    assert first.equals(second)
    stored = str(first.to_pylist())
    for _, extras in records:
        for value in extras.values():
            if isinstance(value, str) and len(value) >= 6 and value.isalnum():
                assert value not in stored


def test_identifier_and_dimension_policies_cover_the_guide():
    """Tenants, users, API keys and sessions are keyed pseudonyms; models and classes bounded labels."""
    for name in ("tenant", "user", "api_key_id", "session_id", "request_id", "event_id", "adapter"):
        assert isinstance(FIELD_POLICIES[name], Pseudonym), name
    for name in ("model", "service_class", "instance_id", "engine_id", "pool", "reason", "user_agent"):
        assert isinstance(FIELD_POLICIES[name], Dimension), name


def test_markup_and_sql_in_labels_are_stored_inert(keyring):
    labels = ["<script>alert(1)</script>", "[x](javascript:alert(1))", "'; DROP TABLE events; --"]
    events = [
        dataclasses.replace(_poisoned(EVENT_TYPES["request_arrived"], i), model=label, service_class=label, pool=label)
        for i, label in enumerate(labels)
    ]
    clean = Sanitizer(keyring).sanitize(events_to_table(events))
    for column in ("model", "service_class", "pool"):
        for value in clean[column].to_pylist():
            assert not set(value) & set("<>[]()'\";` "), value


def test_labels_keep_system_names_and_fold_everything_else(keyring):
    """Label fields accept the shape of a system name (Hugging Face ids, accelerators, replay engines);
    a canary of any kind folds into 'other' and is counted; user agents keep product tokens only."""
    from tests.privacy.canaries import CANARIES, FRAGMENTS

    kept = {"model": "meta-llama/Llama-3.1-8B-Instruct", "engine_id": "replay-0a1b2c3d4e5f", "pool": "h100-sxm",
            "instance_id": "llama-3-8b@a100-80g", "service_class": "interactive"}
    base = _poisoned(EVENT_TYPES["request_arrived"], 0)
    events = [dataclasses.replace(base, event_id=f"k{i}", user_agent="Mozilla/5.0 (X11; Linux x86_64) curl/8.5.0", **kept)
              for i in range(3)]
    events += [dataclasses.replace(base, event_id=f"c{kind}", user_agent=canary, **{name: canary for name in kept})
               for kind, canary in CANARIES.items()]
    sanitizer = Sanitizer(keyring, PrivacyConfig(ner_model=None))  # labels never need the NER model
    clean = sanitizer.sanitize(events_to_table(events)).to_pylist()
    for row in clean[:3]:
        assert {name: row[name] for name in kept} == kept
        assert row["user_agent"] == "Mozilla/5.0_curl/8.5.0"  # product tokens, made inert
    for row in clean[3:]:
        assert {row[name] for name in [*kept, "user_agent"]} == {OTHER}, row
    stored = str(clean)
    assert not [kind for kind, fragment in FRAGMENTS.items() if fragment in stored]
    refused = sanitizer.report().labels_refused
    assert refused["model"] == refused["engine"] == refused["user_agent"] == len(CANARIES)
