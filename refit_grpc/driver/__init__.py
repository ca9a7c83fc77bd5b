"""The trainer side: endpoints, the Fleet of stubs, and the link the sender broadcasts through."""

from refit_grpc.driver.endpoint import ChannelSecurity, WorkerEndpoint
from refit_grpc.driver.fleet import EpochHandle, EpochReport, Fleet, TrainerLink, WorkerReport

__all__ = ["ChannelSecurity", "EpochHandle", "EpochReport", "Fleet", "TrainerLink",
           "WorkerEndpoint", "WorkerReport"]
