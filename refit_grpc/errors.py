"""Typed errors, shared by every layer (pure: no gRPC, no torch).

Each error carries the status code it maps to (`Code`, named as gRPC's codes; the shim's
`shim/status.py` turns it into a gRPC status) and a machine-readable `Reason` (the
google.rpc.ErrorInfo reason on the wire). Like Ray's exceptions, each also inherits the built-in
it means, so `except TimeoutError` or `except ValueError` keeps working in trainer code.

The fleet-level errors that name failed workers live with the driver (`driver/failures.py`).
"""

from __future__ import annotations

import enum

from refit_grpc.reasons import Reason

ERROR_DOMAIN = "refit_grpc.v1"


class Code(enum.Enum):
    """The gRPC status codes refit_grpc uses, by name, so that pure code need not import grpc."""

    UNKNOWN = "UNKNOWN"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    INTERNAL = "INTERNAL"


class RefitDeprecationWarning(DeprecationWarning):
    """A refit_grpc API that still works for this release and goes in the next (the old
    keywords of `Fleet.refit()` and the Ray channel). Its own class so a test suite, or a
    trainer, can turn exactly these into errors:
    `filterwarnings = ["error::refit_grpc.errors.RefitDeprecationWarning"]`."""


class RefitError(Exception):
    """The base of every refit_grpc error: a message, the status code it maps to, a `Reason`.

    Args:
        message: what went wrong (also `message`).
        reason: the machine-readable reason (also `reason`); by default the class's
            `default_reason`.
    """

    code: Code = Code.UNKNOWN
    default_reason: Reason = Reason.REFIT_ERROR

    def __init__(self, message: str, *, reason: Reason | str | None = None):
        super().__init__(message)
        self.message = message
        # A Reason; a plain str only where a worker's reason is relayed that this version does
        # not know (a fleet error: a newer shim's reason, or a gRPC status code's name).
        self.reason: Reason | str = reason or self.default_reason

    def __reduce__(self):
        # By class, args and attributes, never through __init__ (subclasses take other
        # arguments): Ray and multiprocessing ship these errors between processes.
        return _restore_error, (type(self), self.args, self.__dict__)


def _restore_error(cls: type[RefitError], args: tuple, state: dict) -> RefitError:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class InvalidArgumentError(RefitError, ValueError):
    """A malformed argument (INVALID_ARGUMENT); also a `ValueError`."""

    code = Code.INVALID_ARGUMENT
    default_reason = Reason.INVALID_ARGUMENT


class InvalidPlanError(InvalidArgumentError):
    """A malformed plan: a tensor's name, shape or dtype (INVALID_PLAN)."""

    default_reason = Reason.INVALID_PLAN


class PlanTooLargeError(RefitError, ValueError):
    """A plan over the message or buffer limits (RESOURCE_EXHAUSTED); also a `ValueError`."""

    code = Code.RESOURCE_EXHAUSTED
    default_reason = Reason.PLAN_TOO_LARGE


class ResourceExhaustedError(RefitError, RuntimeError):
    """Out of a resource: memory, a buffer, a limit (RESOURCE_EXHAUSTED)."""

    code = Code.RESOURCE_EXHAUSTED
    default_reason = Reason.RESOURCE_EXHAUSTED


class FailedPreconditionError(RefitError, RuntimeError):
    """Wrong state, stale version, digest or group mismatch: refused before any byte moves
    (FAILED_PRECONDITION); also a `RuntimeError`."""

    code = Code.FAILED_PRECONDITION
    default_reason = Reason.FAILED_PRECONDITION


class MembershipChangedError(FailedPreconditionError):
    """A worker is not the instance that joined the group: it restarted since
    (FAILED_PRECONDITION)."""

    default_reason = Reason.MEMBERSHIP_CHANGED


class EpochAbortedError(RefitError, RuntimeError):
    """The epoch was aborted after it began (ABORTED); also a `RuntimeError`."""

    code = Code.ABORTED
    default_reason = Reason.EPOCH_ABORTED


class CollectiveError(EpochAbortedError):
    """The data group failed: a peer closed its connection or the group was torn down."""

    default_reason = Reason.COLLECTIVE_FAILED


class RefitTimeoutError(RefitError, TimeoutError):
    """A deadline passed (DEADLINE_EXCEEDED); also a `TimeoutError`."""

    code = Code.DEADLINE_EXCEEDED
    default_reason = Reason.DEADLINE_EXCEEDED


class EngineUnavailableError(RefitError, ConnectionError):
    """The engine behind a shim does not answer (UNAVAILABLE); also a `ConnectionError`."""

    code = Code.UNAVAILABLE
    default_reason = Reason.ENGINE_UNAVAILABLE


class InternalError(RefitError, RuntimeError):
    """A bug: an exception the shim did not expect (INTERNAL, reason INTERNAL_ERROR). The shim
    logs its traceback; no request should ever produce one."""

    code = Code.INTERNAL
    default_reason = Reason.INTERNAL_ERROR


class UnauthenticatedError(RefitError, PermissionError):
    """A call without a valid token or certificate (UNAUTHENTICATED); also a
    `PermissionError`."""

    code = Code.UNAUTHENTICATED
    default_reason = Reason.UNAUTHENTICATED
