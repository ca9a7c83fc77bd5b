"""Typed errors, shared by shim and driver.

Each error carries the gRPC status code it maps to and a machine-readable reason (the
google.rpc.ErrorInfo reason on the wire). Like Ray's exceptions, each also inherits the built-in it
means, so `except TimeoutError` or `except ValueError` keeps working in trainer code.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

ERROR_DOMAIN = "refit_grpc.v1"


class RefitError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    default_reason = "REFIT_ERROR"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason


class InvalidArgumentError(RefitError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class InvalidPlanError(InvalidArgumentError):
    default_reason = "INVALID_PLAN"


class PlanTooLargeError(RefitError, ValueError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "PLAN_TOO_LARGE"


class ResourceExhaustedError(RefitError, RuntimeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class FailedPreconditionError(RefitError, RuntimeError):
    """Wrong state, stale version, digest or group mismatch: refused before any byte moves."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class MembershipChangedError(FailedPreconditionError):
    default_reason = "MEMBERSHIP_CHANGED"


class EpochAbortedError(RefitError, RuntimeError):
    code = grpc.StatusCode.ABORTED
    default_reason = "EPOCH_ABORTED"


class CollectiveError(EpochAbortedError):
    """The data group failed: a peer closed its connection or the group was torn down."""

    default_reason = "COLLECTIVE_FAILED"


class RefitTimeoutError(RefitError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class EngineUnavailableError(RefitError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "ENGINE_UNAVAILABLE"


# --- driver side: what one worker said, and fleet-wide failures naming every worker ----------


@dataclass(frozen=True)
class WorkerFailure:
    instance_id: str
    address: str
    code: grpc.StatusCode
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.instance_id}@{self.address}: {self.code.name}/{self.reason}: {self.message}"


class FleetError(RefitError, RuntimeError):
    """One or more workers failed a fleet call; `failures` names each with its reason."""

    code = grpc.StatusCode.ABORTED
    default_reason = "FLEET_CALL_FAILED"

    def __init__(self, message: str, failures: list[WorkerFailure], *, reason: str | None = None):
        detail = "; ".join(str(f) for f in failures)
        super().__init__(f"{message}: {detail}" if detail else message, reason=reason)
        self.failures = failures

    @property
    def reasons(self) -> set[str]:
        return {f.reason for f in self.failures}

    @property
    def workers(self) -> list[str]:
        return [f.instance_id for f in self.failures]


class EpochRefusedError(FleetError):
    """At least one worker refused the epoch before any byte was broadcast."""

    default_reason = "EPOCH_REFUSED"


class EpochFailedError(FleetError):
    """The epoch failed after the broadcast began; the fleet was aborted."""

    default_reason = "EPOCH_FAILED"


class FleetTimeoutError(FleetError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"
