"""refit_grpc: a typed gRPC control plane for pushing trainer weights into inference engines.

The public names resolve lazily: vLLM imports `refit_grpc.vllm_plugin` in every engine process,
and that must not drag in the driver (gRPC channels, thread pools) it never uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ChannelSecurity": "refit_grpc.driver",
    "EpochReport": "refit_grpc.driver",
    "Fleet": "refit_grpc.driver",
    "TrainerLink": "refit_grpc.driver",
    "WorkerEndpoint": "refit_grpc.driver",
    "EpochFailedError": "refit_grpc.driver.failures",
    "EpochRefusedError": "refit_grpc.driver.failures",
    "FleetError": "refit_grpc.driver.failures",
    "FleetTimeoutError": "refit_grpc.driver.failures",
    "WorkerFailure": "refit_grpc.driver.failures",
    "WeightsMismatchError": "refit_grpc.driver.failures",
    "MembershipChangedError": "refit_grpc.errors",
    "RefitError": "refit_grpc.errors",
    "Reason": "refit_grpc.reasons",
    "Packing": "refit_grpc.plan",
    "RefitPlan": "refit_grpc.plan",
    "TensorSpec": "refit_grpc.plan",
    "Deadline": "refit_grpc.common",
    "PauseMode": "refit_grpc.common",
}

__all__ = [
    "ChannelSecurity", "Deadline", "EpochFailedError", "EpochRefusedError", "EpochReport",
    "Fleet", "FleetError", "FleetTimeoutError", "MembershipChangedError", "Packing", "PauseMode",
    "Reason", "RefitError", "RefitPlan", "TensorSpec", "TrainerLink", "WorkerEndpoint",
    "WeightsMismatchError", "WorkerFailure",
]

if TYPE_CHECKING:
    from refit_grpc.common import Deadline, PauseMode
    from refit_grpc.driver import ChannelSecurity, EpochReport, Fleet, TrainerLink, WorkerEndpoint
    from refit_grpc.driver.failures import (
        EpochFailedError,
        EpochRefusedError,
        FleetError,
        FleetTimeoutError,
        WeightsMismatchError,
        WorkerFailure,
    )
    from refit_grpc.errors import MembershipChangedError, RefitError
    from refit_grpc.plan import Packing, RefitPlan, TensorSpec
    from refit_grpc.reasons import Reason


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refit_grpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
