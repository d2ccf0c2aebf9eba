"""docker-compose.yml and the Dockerfile agree with the code: services, entry points, profiles, ports."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from pipelines.dagster_resources import PROFILES

ROOT = Path(__file__).parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


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
        assert env[name] == value, name
    mounts = {volume.removesuffix(":ro").rsplit(":", 1)[1] for volume in COMPOSE["services"]["dagster-daemon"]["volumes"]}
    assert {env["SERVELENS_LAKE__ROOT"], env["SERVELENS_PATHS__OUT_DIR"], env["DAGSTER_HOME"],
            env["SERVELENS_PATHS__SHARED_DIR"]} <= mounts


def test_the_image_copies_every_installed_package():
    dockerfile = (ROOT / "Dockerfile").read_text()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    names = [p.removesuffix("*") for p in packages]
    assert names and all(f"COPY {name} {name}" in dockerfile for name in names)
