"""What went wrong, per worker and fleet-wide: decoding a shim's gRPC status into a
`WorkerFailure`, and the fleet errors that name every failed worker with its reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.errors import Code, MembershipChangedError, RefitError
from refit_grpc.reasons import Reason

# The reasons the driver gives a worker that did not answer (not what the worker said).
_CONCLUDED_BY_DRIVER = frozenset({Reason.UNRESPONSIVE, Reason.ACCEPT_TIMEOUT,
                                  Reason.COMMIT_TIMEOUT, Reason.JOIN_TIMEOUT,
                                  Reason.DRIVER_ERROR})


@dataclass(frozen=True)
class WorkerFailure:
    """What one worker said (or did not say) when a fleet call failed.

    Args:
        instance_id: the worker's `WorkerEndpoint.instance_id`.
        address: the shim's gRPC target.
        code: the gRPC status code.
        reason: a `Reason` when refit_grpc sent it; else the status code's name.
        message: the status message.
    """

    instance_id: str
    address: str
    code: grpc.StatusCode
    reason: str  # a `Reason` when refit_grpc sent it; else the status code's name
    message: str

    def __str__(self) -> str:
        return f"{self.instance_id}@{self.address}: {self.code.name}/{self.reason}: {self.message}"

    @property
    def reported_by_worker(self) -> bool:
        """The worker itself sent this failure, with a reason of its own (its status's
        ErrorInfo): it was alive and answering when it did. False for a transport failure or a
        deadline (the reason is the status code's name), a cancel, or what the driver concluded
        on its own (a timeout, UNRESPONSIVE, DRIVER_ERROR)."""
        return self.reason != self.code.name and self.reason not in _CONCLUDED_BY_DRIVER


# How many failures a FleetError's message names (every one is in `failures`).
_NAMED_IN_MESSAGE = 20


class FleetError(RefitError, RuntimeError):
    """One or more workers failed a fleet call; `failures` names each with its reason.

    Args:
        message: what failed; the failures are appended to it.
        failures: one `WorkerFailure` per failed worker (may be empty: a fleet-wide failure).
        reason: the error's `Reason`; by default the class's `default_reason`.
    """

    code = Code.ABORTED
    default_reason = Reason.FLEET_CALL_FAILED
    # A `reports.RollbackReport` when the fleet was rolled back after this failure (a staged
    # epoch's check that failed after the flip); None otherwise.
    rollback: Any = None

    def __init__(self, message: str, failures: list[WorkerFailure], *,
                 reason: Reason | str | None = None):
        # The message names the first failures (root causes come first); at a thousand
        # engines the whole list would be a megabyte of log line. `failures` has every one.
        shown = failures[:_NAMED_IN_MESSAGE]
        detail = "; ".join(str(f) for f in shown)
        if len(failures) > len(shown):
            detail += f"; and {len(failures) - len(shown)} more (FleetError.failures)"
        super().__init__(f"{message}: {detail}" if detail else message, reason=reason)
        self.failures = failures

    @property
    def reasons(self) -> set[str]:
        """The failed workers' reasons."""
        return {f.reason for f in self.failures}

    @property
    def workers(self) -> list[str]:
        """The failed workers' instance ids, in the order of `failures`."""
        return [f.instance_id for f in self.failures]


class EpochRefusedError(FleetError):
    """At least one worker refused the epoch before any byte was broadcast; nobody is left
    waiting in the collective. Re-form the group (`connect()`) and re-run the epoch."""

    default_reason = Reason.EPOCH_REFUSED


class MembershipRefusedError(EpochRefusedError, MembershipChangedError):
    """Every refusal said MEMBERSHIP_CHANGED: a worker restarted since the group was formed.

    Both an EpochRefusedError (naming the workers) and a MembershipChangedError.
    """

    default_reason = Reason.MEMBERSHIP_CHANGED


class EpochFailedError(FleetError):
    """The epoch failed after the broadcast began; the fleet was aborted, and the engines that
    failed are BROKEN until they are prepared again."""

    default_reason = Reason.EPOCH_FAILED


class WeightsMismatchError(FleetError):
    """Every engine committed, but their weights digests differ (`Checks(verify=True)`).

    The fleet was not flushed, so the engines stay paused and serve nothing; `failures` names
    the engines whose digest is not the fleet's. After a reversible staged epoch's flip the
    fleet was rolled back instead (`rollback`: what was done).
    """

    default_reason = Reason.WEIGHTS_MISMATCH


class CanaryMismatchError(FleetError):
    """Every engine committed, but some computed the canary's log-probabilities away from the
    trainer's by more than the tolerance, or could not compute them (`Checks(canary=...)`).

    The fleet was not flushed, so the engines stay paused and serve nothing; after a
    reversible staged epoch's flip it was rolled back instead (`rollback`: what was done).

    Args:
        message: what failed.
        failures: the engines that differ.
        gaps: every engine's largest difference, by instance id (inf where none came); kept
            as `gaps`.
        reason: by default CANARY_MISMATCH.
    """

    default_reason = Reason.CANARY_MISMATCH

    def __init__(self, message: str, failures: Sequence[WorkerFailure], *,
                 gaps: Mapping[str, float], reason: str | None = None):
        super().__init__(message, list(failures), reason=reason)
        self.gaps = dict(gaps)


class QuorumError(FleetError):
    """A staged epoch could not reach `min_engines`: too few engines staged the new version
    (nothing flipped: every engine serves the previous one, never paused), or too few flipped.

    Args:
        message: what failed.
        failures: the engines left behind and why, root causes first.
        staged: the engines that did stage (or flip) it; kept as `staged`.
        reason: by default QUORUM_NOT_MET.
    """

    default_reason = Reason.QUORUM_NOT_MET

    def __init__(self, message: str, failures: Sequence[WorkerFailure], *,
                 staged: Sequence[str], reason: str | None = None):
        super().__init__(message, list(failures), reason=reason)
        self.staged = list(staged)


class FleetTimeoutError(FleetError, TimeoutError):
    """Workers stayed silent past a deadline (no ACCEPTED, no COMMITTED); `failures` names them.
    Also a built-in `TimeoutError`."""

    code = Code.DEADLINE_EXCEEDED
    default_reason = Reason.DEADLINE_EXCEEDED


def failure_from_rpc(endpoint: WorkerEndpoint, err: grpc.RpcError) -> WorkerFailure:
    """Decode a failed call to a shim.

    Args:
        endpoint: the shim called.
        err: the call's error.

    Returns:
        A WorkerFailure with the ErrorInfo reason the shim attached (or the status code's name).
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    message = err.details() if hasattr(err, "details") else str(err)
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):
        status = None
    return _failure(endpoint, code, message or "", status)


def failure_from_status(endpoint: WorkerEndpoint, status: bytes) -> WorkerFailure:
    """Decode the status one engine's epoch ended with inside an UpdateEngines stream
    (`EngineUpdate.status`: the google.rpc.Status its UpdateWeights would have ended with),
    exactly as `failure_from_rpc` decodes that call's.

    Args:
        endpoint: the engine.
        status: the serialized google.rpc.Status.

    Returns:
        A WorkerFailure with the ErrorInfo reason the shim attached (or the status code's name).
    """
    parsed = status_pb2.Status.FromString(status)
    code = _CODES.get(parsed.code, grpc.StatusCode.UNKNOWN)
    return _failure(endpoint, code, parsed.message, parsed)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _failure(endpoint: WorkerEndpoint, code: grpc.StatusCode, message: str,
             status: status_pb2.Status | None) -> WorkerFailure:
    reason = code.name
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    known = Reason.__members__.get(reason)
    return WorkerFailure(endpoint.instance_id, endpoint.address, code, known or reason, message)


def odd_digests(digests: Sequence[str]) -> tuple[str | None, list[int]]:
    """The fleet's digest (held by the largest group of engines, when that group is strictly the
    largest) and the indexes of the engines that do not hold it. A tie has no fleet digest and
    names every engine; an empty digest (none could be computed) is always named."""
    groups = Counter(d for d in digests if d)
    ranked = groups.most_common(2)
    majority = ranked[0][0] if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]) \
        else None
    return majority, [i for i, d in enumerate(digests) if not d or d != majority]


def root_causes_first(failures: Iterable[WorkerFailure]) -> list[WorkerFailure]:
    """Order failures so the cause leads: a worker that vanished or failed on its own, then
    workers whose collective broke because a peer went away, then those our Abort cancelled.
    Stable: within one rank, the order given (the driver's: the order the failures came)."""

    def rank(f: WorkerFailure) -> int:
        if f.code == grpc.StatusCode.UNAVAILABLE:
            return 0
        if f.code != grpc.StatusCode.ABORTED:
            return 1 if f.reason != Reason.COMMIT_TIMEOUT else 4
        return 2 if f.reason == Reason.COLLECTIVE_FAILED else 3

    return sorted(failures, key=rank)


def explained_by_abort(f: WorkerFailure) -> bool:
    """Whether the driver's own Abort (or the deadline running out meanwhile) could have caused
    this failure: the shim's epoch aborted or its group torn down under it, a cancelled or
    expired stream, or an UpdateWeights that reached the shim after the Abort had dropped its
    group. A failure that arrives after the driver aborted a refused epoch names its worker only
    when nothing the driver did explains it: the worker is unreachable (UNAVAILABLE: dead, or
    did not even answer Abort), or it refused on its own (STALE_VERSION, MEMBERSHIP_CHANGED...)."""
    return (f.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.DEADLINE_EXCEEDED)
            or f.reason in (Reason.NO_GROUP, Reason.WRONG_STATE))
