"""Every machine-readable reason refit_grpc gives for a refusal or a failure.

On the wire a reason is the `google.rpc.ErrorInfo.reason` string (domain `refit_grpc.v1`) of a gRPC
status; in Python it is this `StrEnum`, so `failure.reason == Reason.STALE_VERSION` and
`failure.reason == "STALE_VERSION"` both hold. docs/protocol.md lists each one with its status
code, and a test keeps that table and this enum in step.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    # --- the plan (Prepare, and the sender's check of the tensors it is given) ------------
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INVALID_PLAN = "INVALID_PLAN"
    EMPTY_PLAN = "EMPTY_PLAN"
    EMPTY_NAME = "EMPTY_NAME"
    DUPLICATE_NAME = "DUPLICATE_NAME"
    UNSUPPORTED_DTYPE = "UNSUPPORTED_DTYPE"
    INVALID_SHAPE = "INVALID_SHAPE"
    INVALID_PACKING = "INVALID_PACKING"
    UNKNOWN_TENSOR = "UNKNOWN_TENSOR"
    TENSOR_MISMATCH = "TENSOR_MISMATCH"
    MISSING_TENSOR = "MISSING_TENSOR"
    PLAN_TOO_LARGE = "PLAN_TOO_LARGE"
    UNALIGNED_FOR_NCCL = "UNALIGNED_FOR_NCCL"
    # --- the data group (InitCollective) --------------------------------------------------
    INVALID_RANK = "INVALID_RANK"
    INVALID_WORLD_SIZE = "INVALID_WORLD_SIZE"
    INVALID_BACKEND = "INVALID_BACKEND"
    BACKEND_UNAVAILABLE = "BACKEND_UNAVAILABLE"
    INVALID_MASTER_ADDRESS = "INVALID_MASTER_ADDRESS"
    INVALID_MASTER_PORT = "INVALID_MASTER_PORT"
    INVALID_GROUP_ID = "INVALID_GROUP_ID"
    MASTER_NOT_ALLOWED = "MASTER_NOT_ALLOWED"
    RENDEZVOUS_FAILED = "RENDEZVOUS_FAILED"
    RENDEZVOUS_TIMEOUT = "RENDEZVOUS_TIMEOUT"
    # --- epochs (UpdateWeights) and the state machine --------------------------------------
    INVALID_VERSION = "INVALID_VERSION"
    INVALID_PAUSE_MODE = "INVALID_PAUSE_MODE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    WRONG_STATE = "WRONG_STATE"
    BUSY = "BUSY"
    NO_GROUP = "NO_GROUP"
    STALE_VERSION = "STALE_VERSION"
    PLAN_DIGEST_MISMATCH = "PLAN_DIGEST_MISMATCH"
    GROUP_MISMATCH = "GROUP_MISMATCH"
    BROKEN = "BROKEN"
    NOT_PAUSED = "NOT_PAUSED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    EPOCH_ABORTED = "EPOCH_ABORTED"
    COLLECTIVE_FAILED = "COLLECTIVE_FAILED"
    GROUP_CLOSED = "GROUP_CLOSED"
    RECEIVE_FAILED = "RECEIVE_FAILED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    # --- the engine behind the shim ---------------------------------------------------------
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"
    ENGINE_ROUTE_MISSING = "ENGINE_ROUTE_MISSING"
    ENGINE_REJECTED = "ENGINE_REJECTED"
    ENGINE_ERROR = "ENGINE_ERROR"
    WEIGHT_TRANSFER_NOT_CONFIGURED = "WEIGHT_TRANSFER_NOT_CONFIGURED"
    # --- the reference engine's own Generate service ---------------------------------------
    NO_MODEL = "NO_MODEL"
    INVALID_GENERATE_REQUEST = "INVALID_GENERATE_REQUEST"
    INVALID_PROMPT_TOKEN = "INVALID_PROMPT_TOKEN"
    INVALID_CANARY = "INVALID_CANARY"
    CANARY_UNSUPPORTED = "CANARY_UNSUPPORTED"
    REQUEST_ABORTED = "REQUEST_ABORTED"
    # --- access ----------------------------------------------------------------------------
    UNAUTHENTICATED = "UNAUTHENTICATED"
    MISSING_TOKEN = "MISSING_TOKEN"
    MALFORMED_TOKEN = "MALFORMED_TOKEN"
    INVALID_TOKEN = "INVALID_TOKEN"
    # --- the driver's own verdicts (never sent by a shim) ----------------------------------
    REFIT_ERROR = "REFIT_ERROR"
    FLEET_CALL_FAILED = "FLEET_CALL_FAILED"
    MEMBERSHIP_CHANGED = "MEMBERSHIP_CHANGED"
    EPOCH_REFUSED = "EPOCH_REFUSED"
    EPOCH_FAILED = "EPOCH_FAILED"
    ACCEPT_TIMEOUT = "ACCEPT_TIMEOUT"
    COMMIT_TIMEOUT = "COMMIT_TIMEOUT"
    JOIN_TIMEOUT = "JOIN_TIMEOUT"
    UNRESPONSIVE = "UNRESPONSIVE"
    DRIVER_ERROR = "DRIVER_ERROR"
    WEIGHTS_MISMATCH = "WEIGHTS_MISMATCH"
    CANARY_MISMATCH = "CANARY_MISMATCH"
