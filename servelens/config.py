"""One typed configuration tree of frozen dataclasses; every field carries its help text.

Values come from, in increasing precedence: the defaults below, a TOML file (``--config`` or
``$SERVELENS_CONFIG``), and environment variables named ``SERVELENS_<SECTION>__<FIELD>``
(``SERVELENS_PATHS__SHARED_DIR=/data/shared``). Loading never does I/O beyond reading that file;
unknown keys and wrongly typed values are errors that name the key and the valid choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dashboard.config import DashboardConfig
from pipelines.config import DagsterConfig, IngestConfig, LakeConfig, NightlyConfig
from pipelines.kafka_config import KafkaConfig
from privacy.config import PrivacyConfig
from schemas.types import doc
from servelens.errors import DataNotFoundError
from servelens.settings import build, check_bounds, read_settings

#: Where the bundled data sets are published, for users without ``../shared``.
SHARED_DATA_SOURCES = {
    "traces/azure2023": "https://github.com/Azure/AzurePublicDataset (data/AzureLLMInferenceTrace_conv.csv)",
    "traces/mooncake": "https://github.com/kvcache-ai/Mooncake (FAST25-release/traces/)",
    "traces/burstgpt": "https://github.com/HPMLL/BurstGPT (data/)",
    "profiles/vidur": "https://github.com/microsoft/vidur (data/profiling/)",
}


@dataclass(frozen=True, slots=True)
class PathsConfig:
    """Where servelens reads shared data and writes its outputs."""

    shared_dir: str | None = doc(
        "Folder holding traces/ and profiles/ (the bundled real data). Unset: ../shared beside "
        "the checkout or the working directory.",
        None,
    )
    out_dir: str = doc("Folder for command outputs (events, tables, reports).", "out")

    def __post_init__(self) -> None:
        check_bounds("paths", self, non_empty=("out_dir",))


@dataclass(frozen=True, slots=True)
class Config:
    """The servelens configuration tree."""

    paths: PathsConfig = field(default_factory=PathsConfig, metadata={"doc": "Data locations."})
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig, metadata={"doc": "Sanitization and views."})
    kafka: KafkaConfig = field(default_factory=KafkaConfig, metadata={"doc": "The event stream in Kafka."})
    lake: LakeConfig = field(default_factory=LakeConfig, metadata={"doc": "The Parquet/Delta lake."})
    ingest: IngestConfig = field(default_factory=IngestConfig, metadata={"doc": "The ingest consumer."})
    nightly: NightlyConfig = field(default_factory=NightlyConfig, metadata={"doc": "The nightly replay and gate."})
    dagster: DagsterConfig = field(default_factory=DagsterConfig, metadata={"doc": "Dagster's step executor."})
    dashboard: DashboardConfig = field(default_factory=DashboardConfig, metadata={"doc": "The Streamlit dashboard."})


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The configuration from defaults, an optional TOML file and the environment."""
    return build(Config, read_settings(path, env, tree=Config), "")


def shared_dir(config: Config) -> Path:
    """The folder holding the bundled traces and profiles (never copied into the repository)."""
    if config.paths.shared_dir:
        candidates = [Path(config.paths.shared_dir)]
    else:
        checkout = Path(__file__).resolve().parents[1]
        candidates = [checkout.parent / "shared", Path.cwd().parent / "shared", Path.cwd() / "shared"]
    for candidate in candidates:
        if (candidate / "traces").is_dir():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    sources = "; ".join(f"{k}: {v}" for k, v in SHARED_DATA_SOURCES.items())
    raise DataNotFoundError(
        f"shared data not found (looked for traces/ in {looked})",
        f"set SERVELENS_SHARED_DIR to the folder holding traces/ and profiles/; the data is published at {sources}",
    )
