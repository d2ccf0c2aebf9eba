"""The cost models by name: ``make_cost_model`` builds the named step-cost model for an instance.

The factory sits above the models (``replay.costmodel``'s roofline and constant models, the Vidur
profile model of ``replay.profiles``, profiles of our own in ``replay.measured.fit``, and the
speculative-decoding wrapper of ``replay.speculative``), so no model module imports another's subclass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from replay.config import InstanceConfig
from replay.costmodel import ConstantCostConfig, ConstantCostModel, RooflineConfig, RooflineCostModel, StepCostModel
from replay.errors import unknown_name
from replay.measured.fit import FittedProfileConfig, load_fitted_model
from replay.profiles import ProfileCostConfig, ProfileCostModel, load_profile_tables
from replay.speculative import SpeculativeCostModel
from servelens.errors import DataNotFoundError

COST_MODELS = ("roofline", "profile", "constant")


def make_cost_model(
    name: str,
    instance: InstanceConfig,
    *,
    config: object | None = None,
    shared: Path | None = None,
) -> StepCostModel:
    """The named cost model for an instance (the profile model reads its tables from ``shared``); with
    speculative decoding on the instance, wrapped by ``replay.speculative`` (the draft costed alike)."""
    if instance.speculative is not None:
        plain = dataclasses.replace(instance, speculative=None)
        draft = dataclasses.replace(plain, model=instance.speculative.draft)
        return SpeculativeCostModel(make_cost_model(name, plain, config=config, shared=shared),
                                    make_cost_model(name, draft, config=config, shared=shared), instance.speculative)
    if name == "roofline":
        return RooflineCostModel(instance, config if isinstance(config, RooflineConfig) else None)
    if name == "constant":
        return ConstantCostModel(config if isinstance(config, ConstantCostConfig) else ConstantCostConfig())
    if name == "profile":
        return _profile_model(instance, config, shared)
    raise unknown_name("cost model", name, COST_MODELS)


def _profile_model(instance: InstanceConfig, config: object | None, shared: Path | None) -> StepCostModel:
    if isinstance(config, FittedProfileConfig):  # a profile of our own (servelens profile)
        return load_fitted_model(instance, config)
    cfg = config if isinstance(config, ProfileCostConfig) else ProfileCostConfig()
    if cfg.profile_dir is not None:
        folder = Path(cfg.profile_dir)
    elif shared is not None:
        folder = shared / "profiles" / "vidur"
    else:
        raise DataNotFoundError("the profile cost model needs the shared data folder (profiles/vidur)")
    return ProfileCostModel(instance, load_profile_tables(instance, folder), cfg)


__all__ = ["COST_MODELS", "make_cost_model"]
