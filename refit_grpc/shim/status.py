"""How the shim speaks errors: a `RefitError` becomes a gRPC status with its code, message and a
`google.rpc.ErrorInfo` detail (domain `refit_grpc.v1`, the error's `Reason`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from refit_grpc.errors import ERROR_DOMAIN, Code, InternalError, RefitError

log = logging.getLogger(__name__)


def grpc_code(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def status_for(err: RefitError) -> grpc.Status:
    """The status a handler aborts with for `err` (what `failure_from_rpc` decodes)."""
    info = error_details_pb2.ErrorInfo(reason=str(err.reason), domain=ERROR_DOMAIN)
    st = status_pb2.Status(code=grpc_code(err.code).value[0], message=err.message)
    st.details.add().Pack(info)
    return rpc_status.to_status(st)


class status_on_error:  # noqa: N801  (used as a context manager, named like one)
    """Turns a RefitError raised in a handler into its gRPC status; any other exception is a
    bug, answered INTERNAL with reason INTERNAL_ERROR (its traceback logged), never gRPC's
    reasonless UNKNOWN. `on_error` sees the error first (the shim records it as Describe's
    last_error)."""

    def __init__(self, context: grpc.ServicerContext,
                 on_error: Callable[[RefitError], None] | None = None):
        self.context = context
        self.on_error = on_error

    def __enter__(self) -> status_on_error:
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:  # never suppresses
        if exc is None or not isinstance(exc, Exception):
            return False  # GeneratorExit (the caller went away) and the like pass through
        if not isinstance(exc, RefitError):
            code = getattr(self.context, "code", None)  # grpc's context; not in its stubs
            if code is not None and code() is not None:
                return False  # the handler aborted the call itself (gRPC raises to unwind)
            log.error("unexpected %s in a handler", type(exc).__name__, exc_info=exc)
            exc = InternalError(f"internal error: {type(exc).__name__}: {str(exc)[:300]}")
        if self.on_error is not None:
            self.on_error(exc)
        log.info("refused: %s/%s: %s", exc.code.name, exc.reason, exc.message)
        self.context.abort_with_status(status_for(exc))
        return False
