"""What a `Fleet` is configured with, and what it is doing: one frozen configuration, validated
once, and the fleet's state derived from what it holds (the shim's state is derived the same
way, `shim/service.py`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from refit_grpc.driver.endpoint import ChannelSecurity
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError
from refit_grpc.plan import Packing
from refit_grpc.reasons import Reason

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    """How a fleet talks to its shims. Immutable: `client_copy()` and pickling ship it whole.

    Args:
        engine_world_size: ranks one engine takes in the data group (its TP x PP).
        control_timeout_s: the deadline of every unary call (Describe, Prepare, Flush, ...).
        join_timeout_s: how long InitCollective may take to form the group.
        epoch_timeout_s: one UpdateWeights epoch, broadcast included.
        packing: the packing contract; None: the one every shim offers (`negotiate_packing`).
        backend: "gloo" (CPU, the project's receiver) or "nccl" (vLLM's own, GPUs).
        retry_attempts: attempts of an idempotent call that fails UNAVAILABLE (with backoff).
        abort_timeout_s: how long Abort waits for each shim (an epoch's teardown waits this).
        security: TLS, tokens and keepalive of every channel.
        flip_timeout_s: a staged epoch: how long each engine keeps its staged copy waiting for
            the flip before it drops it and serves on (what a trainer that dies between STAGED
            and the flip costs).
        stream_per_process: engines of one shim process that share a receiving rank
            (Describe's `shared_rank`) run an epoch over one UpdateEngines stream and flip in
            one FlipEngines call, not a stream and a Flip each (the trainer's control cost per
            engine; docs/scale.md). False: a call per engine, as before (for comparison).

    Raises:
        InvalidArgumentError: a value out of range (reason INVALID_WORLD_SIZE, INVALID_BACKEND
            or INVALID_ARGUMENT).
    """

    engine_world_size: int = 1
    control_timeout_s: float = 30.0
    join_timeout_s: float = 120.0
    epoch_timeout_s: float = 600.0
    packing: Packing | None = None
    backend: str = "gloo"
    retry_attempts: int = 8
    abort_timeout_s: float = 1.0
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    flip_timeout_s: float = 120.0
    stream_per_process: bool = True

    def __post_init__(self) -> None:
        if self.engine_world_size < 1:
            raise InvalidArgumentError(
                f"engine_world_size must be >= 1, got {self.engine_world_size}",
                reason=Reason.INVALID_WORLD_SIZE)
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got "
                                       f"{self.backend!r}", reason=Reason.INVALID_BACKEND)
        for name in ("control_timeout_s", "join_timeout_s", "epoch_timeout_s",
                     "abort_timeout_s", "flip_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value}",
                                           reason=Reason.INVALID_ARGUMENT)
        if self.retry_attempts < 1:
            raise InvalidArgumentError(f"retry_attempts must be >= 1, got "
                                       f"{self.retry_attempts}", reason=Reason.INVALID_ARGUMENT)
        if self.packing is not None:
            self.packing.validate()


class FleetState(enum.Enum):
    """What a fleet can do next, derived from what it holds (`Fleet.state`)."""

    EMPTY = "empty"          # no plan: prepare() first
    PREPARED = "prepared"    # a plan on every shim, no data group: connect() / init_collective()
    CONNECTED = "connected"  # a data group: epochs (refit(), update_weights())
    CLOSED = "closed"        # close() ran: nothing more


# What each state lacks, for the error a call made too early raises.
_MISSING = {
    FleetState.EMPTY: ("prepare() first", Reason.FLEET_NOT_PREPARED),
    FleetState.PREPARED: ("no data group: connect() or init_collective() first (an epoch that "
                          "failed or was refused ends the group)", Reason.FLEET_NOT_CONNECTED),
    FleetState.CLOSED: ("the fleet is closed", Reason.FLEET_CLOSED),
}


class FleetStateError(FailedPreconditionError):
    """A call the fleet's state does not allow yet (or any more): typed, with the reason
    FLEET_NOT_PREPARED, FLEET_NOT_CONNECTED or FLEET_CLOSED; also a RuntimeError."""


def refuse_unless(state: FleetState, allowed: tuple[FleetState, ...], what: str) -> None:
    """Raise FleetStateError when `state` is not one of `allowed` for the call `what`."""
    if state in allowed:
        return
    why, reason = _MISSING.get(state, (f"not allowed in state {state.value}", Reason.WRONG_STATE))
    raise FleetStateError(f"{what}: {why}", reason=reason)
