"""docker-compose.yml and the Dockerfile agree with the code: services, entry points, profiles, ports;
the compose file is valid Compose and keeps its data: every service states what it writes, and that is a
named volume; each restarts and has a healthcheck; one image, built once, run as a user that is not root.

No Docker engine here: the file is checked against the Compose Specification's JSON schema, as shipped by
check-jsonschema (its vendored copy of compose-spec/compose-spec, Apache-2.0), with nothing fetched."""

from __future__ import annotations

import base64
import copy
import json
import re
import tomllib
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipelines.dagster_resources import PROFILES

ROOT = Path(__file__).parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _unset(value: str) -> str:
    """A value as Compose reads it with none of its variables set: ``${VAR:-default}`` -> default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_compose_runs_kafka_in_kraft_mode_with_the_ingest_and_dagster_services():
    services = COMPOSE["services"]
    assert {"kafka", "ingest", "dagster-webserver", "dagster-daemon"} <= set(services)
    kafka = services["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller" and "ZOOKEEPER" not in " ".join(kafka)
    assert services["dagster-webserver"]["entrypoint"][:3] == ["dagster-webserver", "-m", "pipelines.definitions"]
    assert services["dagster-daemon"]["entrypoint"] == ["dagster-daemon", "run", "-m", "pipelines.definitions"]


def test_every_published_port_binds_to_loopback_only():
    ports = [port for service in COMPOSE["services"].values() for port in service.get("ports", [])]
    assert ports and all(port.startswith("127.0.0.1:") for port in ports)


def test_the_compose_profile_of_the_dagster_resources_matches_the_compose_environment():
    env = COMPOSE["services"]["dagster-daemon"]["environment"]
    assert env["SERVELENS_ENV"] == "compose"
    for name, value in PROFILES["compose"].items():
        assert _unset(env[name]) == value, name
    mounts = {volume.removesuffix(":ro").rsplit(":", 1)[1] for volume in COMPOSE["services"]["dagster-daemon"]["volumes"]}
    assert {_unset(env["SERVELENS_LAKE__ROOT"]), env["SERVELENS_PATHS__OUT_DIR"],
            env["DAGSTER_STORAGE_DIR"], env["SERVELENS_PATHS__SHARED_DIR"]} <= mounts


def test_the_image_copies_every_installed_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [p.removesuffix("*") for p in packages]
    assert names and all(f"COPY {name} {name}" in dockerfile for name in names)


# ------------------------------------------------------------------------------ a compose file that keeps its data

# What each service writes, mount point -> named volume: everything else it mounts is read-only. A service
# not listed writes nothing of its own.
WRITES = {
    "kafka": {"/var/lib/kafka/data": "kafka-data"},
    "postgres": {"/var/lib/postgresql/data": "dagster-pg"},
    "minio": {"/data": "lake-objects"},
    "ingest": {"/data/lake": "lake"},
    "dagster-webserver": {"/data/dagster": "dagster-storage"},
    "dagster-daemon": {"/data/lake": "lake", "/data/out": "out", "/data/dagster": "dagster-storage"},
    "dashboard": {"/data/out": "out"},
}
SERVELENS_IMAGE = "servelens:${SERVELENS_VERSION:-local}"


def _mounts(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each of a service's volumes (short syntax; a source may be ${VAR:-path})."""
    mounts = []
    for volume in service.get("volumes", []):
        match = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::(ro|rw))?", volume)
        assert match, volume
        mounts.append((match[1], match[2], match[3] == "ro"))
    return mounts


def test_compose_file_is_valid_against_the_compose_specification_schema():
    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert not [error.message for error in validator.iter_errors(COMPOSE)]
    broken = copy.deepcopy(COMPOSE)
    broken["services"]["kafka"]["restart_policy"] = "always"  # not a Compose key: the schema must say so
    assert not validator.is_valid(broken)


def test_each_service_writes_only_the_named_volumes_it_states():
    services = COMPOSE["services"]
    assert set(WRITES) <= set(services)
    for name, service in services.items():
        writable = {target: source for source, target, read_only in _mounts(service) if not read_only}
        assert writable == WRITES.get(name, {}), name
        read_only_sources = [source for source, _, read_only in _mounts(service) if read_only]
        assert all(source in COMPOSE["volumes"] or source.startswith("${") for source in read_only_sources), name
    assert set(COMPOSE["volumes"]) == {v for writes in WRITES.values() for v in writes.values()}


def test_kafka_keeps_its_log_on_its_volume_and_a_valid_cluster_id():
    kafka = COMPOSE["services"]["kafka"]
    log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"].split(",")
    assert log_dirs and all(WRITES["kafka"].get(d) == "kafka-data" for d in log_dirs)
    cluster_id = kafka["environment"]["CLUSTER_ID"]  # KRaft formats the volume with it once
    assert len(cluster_id) == 22 and len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_every_service_restarts_and_has_a_healthcheck():
    for name, service in COMPOSE["services"].items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name


def test_one_image_built_once_and_run_by_every_servelens_service_as_a_user_that_is_not_root():
    services = COMPOSE["services"]
    built = [name for name, service in services.items() if "build" in service]
    assert built == ["ingest"] and services["ingest"]["image"] == SERVELENS_IMAGE
    ours = [name for name, service in services.items() if service.get("image") == SERVELENS_IMAGE]
    assert set(ours) == {"ingest", "dagster-webserver", "dagster-daemon", "dashboard"}
    assert all(services[name]["pull_policy"] == "never" for name in ours if name not in built)
    assert not [name for name, service in services.items() if str(service.get("user", "")).split(":")[0] in ("root", "0")]
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert users and users[-1] not in ("root", "0")
    others = {service["image"] for name, service in services.items() if name not in ours}
    assert all(re.search(r":[\w.-]*\d", image) for image in others), others  # third-party images pinned by tag


def test_postgres_holds_dagsters_storage_and_minio_is_optional():
    services = COMPOSE["services"]
    env = services["dagster-daemon"]["environment"]
    assert env["DAGSTER_PG_HOST"] == "postgres" and services["postgres"]["environment"]["POSTGRES_DB"] == env["DAGSTER_PG_DB"]
    instance = yaml.safe_load((ROOT / "deploy" / "dagster.yaml").read_text())
    assert "postgres" in instance["storage"] and instance["run_coordinator"]["class"] == "QueuedRunCoordinator"
    for name in ("dagster-webserver", "dagster-daemon"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
    optional = {name for name, service in services.items() if service.get("profiles")}
    assert optional == {"minio", "minio-bucket"} and all(services[n]["profiles"] == ["s3"] for n in optional)
    for name, service in services.items():  # a service always started may wait for an optional one, not need it
        needs = service.get("depends_on", {})
        assert all(needs[dep].get("required") is False for dep in optional & set(needs) if name not in optional), name


def test_the_image_installs_the_lock_file_and_its_context_leaves_out_local_state():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install -r requirements/image.txt" in dockerfile and "pip install --no-deps ." in dockerfile
    assert "COPY deploy/dagster.yaml /opt/servelens/dagster/dagster.yaml" in dockerfile
    assert "DAGSTER_HOME=/opt/servelens/dagster" in dockerfile
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "secrets", "out", "tests"} <= ignored
    copied = {src.split("/")[0] for line in re.findall(r"^COPY (.+)$", dockerfile, flags=re.M) for src in line.split()[:-1]}
    assert copied and not copied & ignored, copied & ignored


@pytest.mark.parametrize("service", ["ingest", "dagster-webserver", "dagster-daemon", "dashboard"])
def test_servelens_services_share_one_environment(service):
    env = COMPOSE["services"][service]["environment"]
    assert env["SERVELENS_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:9092" and env["DAGSTER_STORAGE_DIR"] == "/data/dagster"
