"""The trainer side: endpoints, the Fleet of stubs, its epochs, and the links the sender broadcasts
through. Imports nothing from the shim: the two meet only on the wire (the proto)."""

from refit_grpc.driver.catch_up import CatchUpError, CatchUpReport
from refit_grpc.driver.endpoint import ChannelSecurity, WorkerEndpoint
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.failures import (
    EpochFailedError,
    EpochRefusedError,
    FleetError,
    FleetTimeoutError,
    MembershipRefusedError,
    QuorumError,
    WeightsMismatchError,
    WorkerFailure,
)
from refit_grpc.driver.fleet import EpochReport, Fleet, WorkerReport
from refit_grpc.driver.links import GlooLink, TrainerLink

__all__ = ["CatchUpError", "CatchUpReport", "ChannelSecurity", "EpochFailedError", "EpochHandle",
           "EpochRefusedError",
           "EpochReport", "Fleet", "FleetError", "FleetTimeoutError", "GlooLink",
           "MembershipRefusedError", "QuorumError", "WeightsMismatchError",
           "ProgressCallback", "TrainerLink", "WorkerEndpoint", "WorkerFailure", "WorkerReport"]
