"""The dashboard's pages in Chromium over a lake on an S3-compatible server (moto's, a real server
process): the sample lake's Delta tables copied to ``s3://<bucket>/lake``, credentials only in a
storage options file; every page renders its charts without an exception, and the figures are
the local lake's."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from benchmarks.servers import SECRET_KEY, S3Server
from dashboard import dashboard_url, serve, wait_until_ready
from servelens.config import Config
from tests.browser import open_page

from .browse import PAGES, visit_pages, wait_rendered

pytestmark = pytest.mark.scaleout


def _upload(server: S3Server, folder: Path, bucket: str, prefix: str) -> int:
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                          aws_access_key_id=server.env()["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=server.env()["AWS_SECRET_ACCESS_KEY"])
    files = [p for p in folder.rglob("*") if p.is_file() and not p.relative_to(folder).parts[0].startswith("_ingest")]
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return len(files)


def test_every_page_reads_an_s3_lake_in_chromium(sample, object_store, tmp_path, monkeypatch):
    from dashboard.data import lake_snapshot

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    bucket = object_store.bucket()
    assert _upload(object_store, sample.root / "lake", bucket, "lake") > 0
    options = tmp_path / "s3.toml"
    options.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in object_store.env().items()))
    lake = dataclasses.replace(sample.settings.lake, root=f"s3://{bucket}/lake", storage_options_file=str(options))
    dashboard = dataclasses.replace(sample.settings.dashboard, cache_dir=str(tmp_path / "cache"))
    local = lake_snapshot(sample.settings.lake.root)
    monkeypatch.setenv("SERVELENS_LAKE__STORAGE_OPTIONS_FILE", str(options))
    remote = lake_snapshot(lake.root)
    assert remote.events_version == local.events_version and len(remote.event_files) == len(local.event_files)
    assert all(f.startswith(f"s3://{bucket}/lake/events/") for f in remote.event_files)
    monkeypatch.delenv("SERVELENS_LAKE__STORAGE_OPTIONS_FILE")  # the dashboard gets it from its settings

    log_path = tmp_path / "streamlit.log"
    with log_path.open("w") as log:
        process = serve(Config(lake=lake, privacy=sample.settings.privacy), dashboard=dashboard, port=0, stdout=log,
                        stderr=log)
        try:
            url = dashboard_url(process)
            wait_until_ready(url, 90, process)
            with open_page(url) as (page, errors):
                wait_rendered(page, "servelens", 0)
                overview = page.locator("[data-testid=stMain]").inner_text()
                assert f"lake (lake.root): {lake.root}" in overview and f"v{remote.events_version}" in overview
                visits = visit_pages(page, "dashboard-s3")
                assert not errors, errors
        finally:
            process.terminate()
            process.wait(timeout=20)
    for visit, (title, _, min_charts) in zip(visits, PAGES):
        assert visit.num_exceptions == 0, title
        assert visit.num_charts >= min_charts, title
    built = list((tmp_path / "cache").rglob("requests-*.parquet"))
    assert built, "the lake's request table was derived from the s3:// files"
    import pyarrow.parquet as pq

    assert pq.read_metadata(built[0]).num_rows == sample.num_requests
    text = log_path.read_text()
    assert "Traceback" not in text and SECRET_KEY not in text
