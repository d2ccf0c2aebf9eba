"""Scheduling policies for the replay engine, registered by name (see ``replay.policies.base``)."""

from replay.policies.base import (
    ACCEPT,
    POLICIES,
    AdmissionDecision,
    Policy,
    make_policy,
    policy_class,
    register,
)
from replay.policies.fcfs import FcfsConfig, FcfsPolicy

__all__ = [
    "ACCEPT",
    "POLICIES",
    "AdmissionDecision",
    "FcfsConfig",
    "FcfsPolicy",
    "Policy",
    "make_policy",
    "policy_class",
    "register",
]
