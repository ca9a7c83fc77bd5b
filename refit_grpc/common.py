"""The vocabulary every layer shares: pause modes, deadlines, the data group's spec, limits.

Pure (no gRPC, no torch), so the driver, the shim, the engines and the code that runs inside vLLM
workers can all import it without pulling in each other.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

from refit_grpc.errors import EpochAbortedError, InvalidArgumentError, RefitTimeoutError
from refit_grpc.reasons import Reason

BACKENDS = ("gloo", "nccl")

# gRPC's default 4 MiB is plenty: control messages never carry weights. A plan of a million
# tensors is ~60 MiB, so both ends raise the limit to what a shim's max_plan_tensors allows.
MAX_MESSAGE_BYTES = 128 << 20

# How often a blocked wait looks at its cancel flag; bounds how late an abort is noticed.
CANCEL_POLL_S = 0.05


class PauseMode(enum.Enum):
    KEEP = "keep"    # in-flight requests are suspended and continue after resume
    WAIT = "wait"    # in-flight requests finish first
    ABORT = "abort"  # in-flight requests are aborted


class EpochMode(enum.Enum):
    """Where an epoch's bytes land (docs/protocol.md, "Staged epochs")."""

    IN_PLACE = "in_place"  # pause, receive into the live weights, resume: no extra memory
    STAGED = "staged"      # serve on while the bytes land in a host copy; switch at the flip


class Deadline:
    """An absolute monotonic deadline plus a cancel flag, handed down every blocking call."""

    def __init__(self, seconds: float, cancel: threading.Event | None = None):
        self.at = time.monotonic() + seconds
        self.cancel = cancel or threading.Event()

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self, what: str) -> float:
        """Seconds left; raises EpochAbortedError once cancelled, RefitTimeoutError once past."""
        if self.cancel.is_set():
            raise EpochAbortedError(f"{what}: aborted", reason=Reason.EPOCH_ABORTED)
        left = self.remaining()
        if left <= 0:
            raise RefitTimeoutError(f"{what}: deadline exceeded")
        return left


@dataclass(frozen=True)
class GroupSpec:
    """One member's view of a refit session's data group (trainer rank 0 is the master)."""

    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str = "gloo"
    group_id: str = "refit"

    def validate(self) -> None:
        if not self.master_address:
            raise InvalidArgumentError("master_address is empty",
                                       reason=Reason.INVALID_MASTER_ADDRESS)
        if not 0 < self.master_port < 65536:
            raise InvalidArgumentError(f"master_port {self.master_port} out of range",
                                       reason=Reason.INVALID_MASTER_PORT)
        if self.world_size < 2:
            raise InvalidArgumentError(f"world_size must be >= 2, got {self.world_size}",
                                       reason=Reason.INVALID_WORLD_SIZE)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} outside [0, {self.world_size})",
                                       reason=Reason.INVALID_RANK)
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(f"backend {self.backend!r} not in {BACKENDS}",
                                       reason=Reason.INVALID_BACKEND)
        if not self.group_id:
            raise InvalidArgumentError("group_id is empty", reason=Reason.INVALID_GROUP_ID)
