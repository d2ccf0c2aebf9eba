"""``pipelines.lake.staged_parquet``: a file that claims to be sanitized is validated and its key ids checked against
the key ring, never trusted; the staged file lives only in the caller's work folder (probe 3, D1 and D4)."""

from __future__ import annotations

import base64

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.lake import check_key_ids, is_sanitized, staged_parquet
from privacy.config import PrivacyConfig
from privacy.keys import load_keyring
from privacy.sanitize import Sanitizer
from schemas.arrow import events_to_table
from schemas.validate import InvalidEventsError
from servelens.errors import ServelensError
from tests.pipelines.test_tables import completed_request

ENV = {"SERVELENS_PSEUDONYM_KEY": "test-key:" + base64.b64encode(bytes(range(32))).decode()}


def _sanitizer() -> Sanitizer:
    return Sanitizer(load_keyring(None, ENV), PrivacyConfig())


def _key_ids(table: pa.Table, values: list) -> pa.Table:
    index = table.schema.get_field_index("pseudonym_key_id")
    return table.set_column(index, "pseudonym_key_id", pa.array(values))


def test_a_sanitized_file_is_validated_and_staged_as_it_is_in_the_work_folder_only(tmp_path):
    sanitized = _sanitizer().sanitize(events_to_table(completed_request()))
    pq.write_table(sanitized, tmp_path / "s.parquet")
    work = tmp_path / "work"
    work.mkdir()
    staged = staged_parquet(tmp_path / "s.parquet", work, _sanitizer())
    assert staged == work / "events.sanitized.parquet" and sorted(p.name for p in work.iterdir()) == [staged.name]
    assert pq.read_table(staged).equals(sanitized)  # validated, not pseudonymized a second time


def test_is_sanitized_is_only_a_claim_of_text_key_ids_on_every_event(tmp_path):
    raw = events_to_table(completed_request())
    cases = {"raw": raw, "sanitized": _sanitizer().sanitize(raw),
             "numbers": _key_ids(raw, list(range(raw.num_rows)))}
    for name, table in cases.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
    assert [is_sanitized(tmp_path / f"{name}.parquet") for name in cases] == [False, True, False]


def test_key_ids_the_ring_does_not_hold_are_named(tmp_path):
    raw = events_to_table(completed_request())
    ids = [f"k{i}" for i in range(raw.num_rows)]
    pq.write_table(_key_ids(raw, ids), tmp_path / "f.parquet")
    with pytest.raises(ServelensError) as refused:
        check_key_ids(tmp_path / "f.parquet", load_keyring(None, ENV))
    shown = ", ".join(repr(k) for k in sorted(ids)[:5])
    assert refused.value.message == (
        f"{tmp_path / 'f.parquet'} claims to be sanitized (every event carries a pseudonym key id) but names key ids "
        f"the configured key ring does not hold: {shown} and {len(ids) - 5} more (the ring holds test-key)")
    with pytest.raises(ServelensError, match="does not hold: 'k0'"):
        staged_parquet(tmp_path / "f.parquet", tmp_path, _sanitizer())
    assert not (tmp_path / "events.sanitized.parquet").exists()


def test_an_invalid_file_that_claims_to_be_sanitized_is_refused(tmp_path):
    sanitized = _sanitizer().sanitize(events_to_table(completed_request()))
    index = sanitized.schema.get_field_index("event_type")
    types = ["totally_unknown", *sanitized["event_type"].to_pylist()[1:]]
    pq.write_table(sanitized.set_column(index, "event_type", pa.array(types)), tmp_path / "bad.parquet")
    with pytest.raises(InvalidEventsError, match=r"bad\.parquet:1: "):
        staged_parquet(tmp_path / "bad.parquet", tmp_path, _sanitizer())
