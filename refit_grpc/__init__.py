"""refit_grpc: a typed gRPC control plane for pushing trainer weights into inference engines."""

from refit_grpc.driver import (
    ChannelSecurity,
    EpochReport,
    Fleet,
    TrainerLink,
    WorkerEndpoint,
)
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

__all__ = [
    "ChannelSecurity", "EpochFailedError", "EpochRefusedError", "EpochReport", "Fleet",
    "FleetError", "FleetTimeoutError", "MembershipChangedError", "Packing", "PauseMode",
    "RefitError", "RefitPlan", "TensorSpec", "TrainerLink", "WorkerEndpoint",
]
