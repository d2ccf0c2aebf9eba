"""Dagster resources: the lake, Kafka and the pseudonym key, per environment, from one variable.

``SERVELENS_ENV`` selects a profile: ``local`` (the defaults of ``servelens.config``: ``./lake``,
``./out``, a broker on 127.0.0.1:9092, the demo's local key if no key is configured), ``compose``
(the services of ``docker-compose.yml``: ``/data/lake``, ``/data/out``, ``kafka:9092``) or
``production`` (nothing assumed: the lake, the outputs, the brokers and the key must be configured).
Within a profile the usual configuration (a TOML file, ``SERVELENS_<SECTION>__<KEY>``) applies, so
a production lake on object storage is ``SERVELENS_LAKE__ROOT=s3://bucket/lake``.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from pipelines.batch import LOAD_SCENARIOS, ReplayCase
from pipelines.config import DagsterConfig
from pipelines.ingest import PartitionLag, topic_backlog
from pipelines.kafka_config import KafkaConfig
from pipelines.lake import Lake
from privacy.keys import ENV_KEY, KeyRing, load_keyring
from replay.policies import POLICIES, policy_class
from servelens.config import Config, load_config
from servelens.errors import ConfigError

ENV_VARIABLE = "SERVELENS_ENV"
PROFILES: dict[str, dict[str, str]] = {
    "local": {},
    "compose": {"SERVELENS_LAKE__ROOT": "/data/lake", "SERVELENS_PATHS__OUT_DIR": "/data/out",
                "SERVELENS_KAFKA__BOOTSTRAP_SERVERS": "kafka:9092"},
    "production": {},
}
REQUIRED_IN_PRODUCTION = ("SERVELENS_LAKE__ROOT", "SERVELENS_PATHS__OUT_DIR", "SERVELENS_KAFKA__BOOTSTRAP_SERVERS")


def profile_config(env: str) -> Config:
    """The configuration tree of one profile (the environment's own settings win)."""
    if env not in PROFILES:
        raise ConfigError(f"unknown {ENV_VARIABLE} {env!r}", f"valid: {', '.join(PROFILES)}")
    environ = {**PROFILES[env], **os.environ}
    if env == "production":
        missing = [name for name in REQUIRED_IN_PRODUCTION if name not in environ]
        if missing:
            raise ConfigError(f"{ENV_VARIABLE}=production needs {', '.join(missing)}",
                              "production assumes no location: set them in the deployment")
    return load_config(env=environ)


class LakeResource(dg.ConfigurableResource):
    """The Delta/Parquet lake (read through DuckDB) and the folder for derived tables and replays."""

    env: str = "local"

    def config(self) -> Config:
        return profile_config(self.env)

    def lake(self) -> Lake:
        config = self.config()
        return Lake(config.lake.root, config.lake)

    def out_dir(self) -> Path:
        return Path(self.config().paths.out_dir)


class KafkaResource(dg.ConfigurableResource):
    """The event topic: how far the lake is behind it."""

    env: str = "local"
    timeout_s: float = 5.0

    def config(self) -> KafkaConfig:
        return profile_config(self.env).kafka

    def backlog(self, lake: Lake) -> tuple[PartitionLag, ...]:
        return topic_backlog(self.config(), lake, self.timeout_s)


class PrivacyKeyResource(dg.ConfigurableResource):
    """The pseudonym key ring (never logged): which key ids may appear in sanitized tables."""

    env: str = "local"

    def keyring(self) -> KeyRing:
        config = profile_config(self.env)
        key_file = config.privacy.key_file
        configured = key_file is not None or ENV_KEY in os.environ
        if not configured and self.env == "local" and Path(config.privacy.demo_key_file).is_file():
            key_file = config.privacy.demo_key_file
        return load_keyring(key_file)


class ReplayPlanResource(dg.ConfigurableResource):
    """What the nightly replay compares: the production policy against the candidates, per load
    (from the ``[nightly]`` configuration section)."""

    production: str = "fcfs"
    candidates: list[str] = []  # empty: every registered policy besides production
    loads: list[str] = ["1x", "2x"]
    engine: str = "llama-3-8b@h100-sxm"
    engine_config: str = ""  # YAML of vllm serve settings (nightly.engine_config)
    calibration: str = "auto"
    seed: int = 0

    def engine_kwargs(self) -> dict[str, str]:
        """How ``pipelines.batch.replay_day`` builds the instance."""
        return {"engine": self.engine, "engine_config": self.engine_config, "calibration": self.calibration}

    def candidate_names(self) -> list[str]:
        """The candidates (every registered policy besides production when none are named); an
        unknown policy or load fails here, naming the valid ones."""
        for name in [self.production, *self.candidates]:
            policy_class(name)
        unknown = [load for load in self.loads if load not in LOAD_SCENARIOS]
        if unknown:
            raise ConfigError(f"nightly load {unknown[0]!r} is not a load scenario", f"valid: {', '.join(LOAD_SCENARIOS)}")
        return [p for p in (self.candidates or sorted(POLICIES)) if p != self.production]

    def cases(self) -> list[ReplayCase]:
        """Production and every candidate at every load."""
        return [ReplayCase(p, load) for p in [self.production, *self.candidate_names()] for load in self.loads]


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def resources_for_env(env: str | None = None) -> dict[str, dg.ConfigurableResource]:
    """Every resource of the definitions, for ``env`` (default: ``$SERVELENS_ENV``, else local)."""
    env = env or os.environ.get(ENV_VARIABLE, "local")
    nightly = profile_config(env).nightly  # an unknown or incomplete profile fails at load, with the fix
    plan = ReplayPlanResource(production=nightly.production, candidates=_names(nightly.candidates),
                              loads=_names(nightly.loads), engine=nightly.engine, engine_config=nightly.engine_config,
                              calibration=nightly.calibration, seed=nightly.seed)
    return {"lake": LakeResource(env=env), "kafka": KafkaResource(env=env), "privacy_key": PrivacyKeyResource(env=env),
            "plan": plan}


#: The step executors ``dagster.executor`` may name.
EXECUTORS = ("multiprocess", "in_process", "k8s", "celery")


def _scaleout_module(name: str, executor: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"dagster.executor {executor} needs {name.replace('_', '-')}",
                          "pip install 'servelens[scaleout]' (the image has it)") from None


def executor_for(config: DagsterConfig) -> dg.ExecutorDefinition:
    """The step executor ``config`` names: multiprocess (default), in_process, k8s (each step a
    Kubernetes Job, ``dagster-k8s``) or celery (steps on Celery workers, ``dagster-celery``)."""
    steps = {"max_concurrent": config.max_concurrent_steps} if config.max_concurrent_steps else {}
    if config.executor == "multiprocess":  # steps forked from a server that imported the definitions once
        start = {"start_method": {"forkserver": {"preload_modules": ["pipelines.definitions"]}}}
        return dg.multiprocess_executor.configured({**steps, **start}, name="multiprocess")
    if config.executor == "in_process":
        return dg.in_process_executor
    if config.executor == "k8s":
        k8s = _scaleout_module("dagster_k8s", "k8s")
        settings = {**steps, **({"job_namespace": config.k8s_namespace} if config.k8s_namespace else {}),
                    **({"job_image": config.k8s_image} if config.k8s_image else {})}
        return k8s.k8s_job_executor.configured(settings, name="k8s") if settings else k8s.k8s_job_executor
    if config.executor == "celery":
        celery = _scaleout_module("dagster_celery", "celery")
        return celery.celery_executor.configured({"broker": config.celery_broker, "backend": config.celery_backend},
                                                 name="celery")
    raise ConfigError(f"unknown dagster.executor {config.executor!r}", f"valid: {', '.join(EXECUTORS)}")


def executor_for_env(env: str | None = None) -> dg.ExecutorDefinition:
    """The step executor of the definitions, from the ``[dagster]`` section of ``env``'s configuration."""
    return executor_for(profile_config(env or os.environ.get(ENV_VARIABLE, "local")).dagster)
