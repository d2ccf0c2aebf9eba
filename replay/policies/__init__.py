"""Scheduling policies for the replay engine, registered by name (see ``replay.policies.base``).

Single-instance policies (``make_policy`` by name): ``fcfs``, ``priority``, ``prefill-first``,
``decode-first``, ``sarathi``, ``vtc``, ``deadline``, ``deadline-vtc`` (``docs/policies.md``).
Routing across instances (``replay.policies.routing``) and autoscaling (``replay.policies.autoscale``:
``request-rate``, ``workload-aware``) are the cluster layer's seams.
"""

from replay.policies.base import (
    ACCEPT,
    POLICIES,
    AdmissionDecision,
    NoConfig,
    Policy,
    load_policy_config,
    make_policy,
    policy_class,
    register,
)
from replay.policies.deadline import DeadlineConfig, DeadlinePolicy, DeadlineVtcPolicy
from replay.policies.fcfs import FcfsConfig, FcfsPolicy
from replay.policies.phases import DecodeFirstConfig, DecodeFirstPolicy, PrefillFirstConfig, PrefillFirstPolicy
from replay.policies.priority import PriorityConfig, PriorityPolicy
from replay.policies.sarathi import SarathiConfig, SarathiPolicy
from replay.policies.tenancy import ClassConfig, Tenancy, TenantConfig
from replay.policies.vtc import VtcConfig, VtcPolicy

__all__ = [
    "ACCEPT",
    "POLICIES",
    "AdmissionDecision",
    "ClassConfig",
    "DeadlineConfig",
    "DeadlinePolicy",
    "DeadlineVtcPolicy",
    "DecodeFirstConfig",
    "DecodeFirstPolicy",
    "FcfsConfig",
    "FcfsPolicy",
    "NoConfig",
    "Policy",
    "PrefillFirstConfig",
    "PrefillFirstPolicy",
    "PriorityConfig",
    "PriorityPolicy",
    "SarathiConfig",
    "SarathiPolicy",
    "Tenancy",
    "TenantConfig",
    "VtcConfig",
    "VtcPolicy",
    "load_policy_config",
    "make_policy",
    "policy_class",
    "register",
]
