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
    "EpochFailedError": "refit_grpc.errors",
    "EpochRefusedError": "refit_grpc.errors",
    "FleetError": "refit_grpc.errors",
    "FleetTimeoutError": "refit_grpc.errors",
    "MembershipChangedError": "refit_grpc.errors",
    "RefitError": "refit_grpc.errors",
    "Packing": "refit_grpc.plan",
    "RefitPlan": "refit_grpc.plan",
    "TensorSpec": "refit_grpc.plan",
    "PauseMode": "refit_grpc.shim.engines.base",
}

__all__ = [
    "ChannelSecurity", "EpochFailedError", "EpochRefusedError", "EpochReport", "Fleet",
    "FleetError", "FleetTimeoutError", "MembershipChangedError", "Packing", "PauseMode",
    "RefitError", "RefitPlan", "TensorSpec", "TrainerLink", "WorkerEndpoint",
]

if TYPE_CHECKING:
    from refit_grpc.driver import ChannelSecurity, EpochReport, Fleet, TrainerLink, WorkerEndpoint
    from refit_grpc.errors import (
        EpochFailedError,
        EpochRefusedError,
        FleetError,
        FleetTimeoutError,
        MembershipChangedError,
        RefitError,
    )
    from refit_grpc.plan import Packing, RefitPlan, TensorSpec
    from refit_grpc.shim.engines.base import PauseMode


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refit_grpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
