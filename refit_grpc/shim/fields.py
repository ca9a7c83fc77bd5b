"""What each request field may hold, and its translation from the proto (docs/protocol.md,
"What the shim accepts"). Each check raises the field's own reason; none reads the shim's state."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from refit_grpc.common import (
    MAX_ID_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME_BYTES,
    MAX_VERSION,
    PauseMode,
    clip,
    digest_problem,
    text_problem,
)
from refit_grpc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidPlanError,
    PlanTooLargeError,
)
from refit_grpc.plan import DTYPES, AdapterSpec, Packing, RefitPlan, TensorSpec
from refit_grpc.proto import DTYPE_FROM_PROTO, PAUSE_MODE_FROM_PROTO, pb
from refit_grpc.reasons import Reason

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def check_version(value: int, field: str, reason: Reason = Reason.INVALID_VERSION) -> None:
    """A version is 1 .. MAX_VERSION (a 0 that means "none" is the caller's to allow)."""
    if not 1 <= value <= MAX_VERSION:
        raise InvalidArgumentError(f"{field} must be 1 to {MAX_VERSION}, got {value}",
                                   reason=reason)


def check_digest_shape(value: str, field: str) -> None:
    problem = digest_problem(value)
    if problem:
        raise InvalidArgumentError(f"{field} {clip(value, 16)!r} {problem}",
                                   reason=Reason.INVALID_DIGEST)


def check_group_id(value: str, *, required: bool = True) -> None:
    """A group id: non-empty (where required), at most MAX_ID_BYTES, printable: it becomes part
    of the rendezvous store's keys and of log lines."""
    if not value:
        if required:
            raise InvalidArgumentError("group_id is empty", reason=Reason.INVALID_GROUP_ID)
        return
    problem = text_problem(value, MAX_ID_BYTES)
    if problem:
        raise InvalidArgumentError(f"group_id {clip(value)!r} {problem}",
                                   reason=Reason.INVALID_GROUP_ID)


def check_instance_id(value: str, field: str) -> None:
    """An instance id (optional everywhere): at most MAX_ID_BYTES, printable."""
    problem = text_problem(value, MAX_ID_BYTES) if value else None
    if problem:
        raise InvalidArgumentError(f"{field} {clip(value)!r} {problem}",
                                   reason=Reason.INVALID_INSTANCE_ID)


def check_master(address: str, networks: Sequence[Network]) -> None:
    """A peer's or a trainer's rendezvous address (or where this shim listens for one): an IP
    literal (no host name, no zone), unicast, within the allowed networks."""
    try:
        if "%" in address:
            raise ValueError("a scoped address")
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise InvalidArgumentError(f"master_address {clip(address)!r} is not an IP address",
                                   reason=Reason.INVALID_MASTER_ADDRESS) from None
    if ip.is_unspecified or ip.is_multicast or \
            (isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address(
                "255.255.255.255")):
        raise InvalidArgumentError(
            f"master_address {address} is not a unicast address (unspecified, multicast "
            "or broadcast)", reason=Reason.INVALID_MASTER_ADDRESS)
    if not any(ip in net for net in networks):
        raise FailedPreconditionError(
            f"master_address {address} is outside the allowed networks "
            f"{[str(n) for n in networks]}", reason=Reason.MASTER_NOT_ALLOWED)


def check_not_own_port(address: str, port: int, own_ports: Iterable[int]) -> None:
    """A rendezvous on this host is never at one of the shim's own ports (gRPC, metrics): the
    store client would talk to the shim's own server."""
    if port in own_ports and ipaddress.ip_address(address).is_loopback:
        raise InvalidArgumentError(
            f"master_port {port} is this shim's own gRPC or metrics port, not a rendezvous",
            reason=Reason.INVALID_MASTER_PORT)


def flip_timeout(requested: float, default_s: float, max_s: float) -> float:
    """A staged epoch's flip timeout: 0 means the shim's default; capped at its maximum."""
    if requested < 0 or requested != requested or requested == float("inf"):
        raise InvalidArgumentError(f"flip_timeout_s must be >= 0 and finite, got {requested}",
                                   reason=Reason.INVALID_FLIP_TIMEOUT)
    if requested == 0:
        return default_s
    return min(requested, max_s)


def printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped, for logs."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def pause_mode(value: int, default: PauseMode) -> PauseMode:
    if value == pb.PAUSE_MODE_UNSPECIFIED:
        return default
    if value not in PAUSE_MODE_FROM_PROTO:
        raise InvalidArgumentError(f"unknown pause mode {value}", reason=Reason.INVALID_PAUSE_MODE)
    return PAUSE_MODE_FROM_PROTO[value]


def epoch_mode(value: int) -> int:
    if value == pb.EPOCH_MODE_UNSPECIFIED:
        return pb.EPOCH_MODE_IN_PLACE
    if value not in (pb.EPOCH_MODE_IN_PLACE, pb.EPOCH_MODE_STAGED):
        raise InvalidArgumentError(f"unknown epoch mode {value}", reason=Reason.INVALID_EPOCH_MODE)
    return value


def plan_from_request(request: pb.PrepareRequest, max_plan_tensors: int) -> RefitPlan:
    """The plan a Prepare asks for, each tensor's name, rank and dtype checked (the plan's
    limits and bucket layout are `RefitPlan.validate`'s)."""
    if len(request.tensors) > max_plan_tensors:
        raise PlanTooLargeError(f"plan has {len(request.tensors)} tensors, limit "
                                f"{max_plan_tensors}")
    specs = []
    for i, t in enumerate(request.tensors):
        problem = text_problem(t.name, MAX_TENSOR_NAME_BYTES) if t.name else None
        if problem:
            raise InvalidPlanError(f"tensor {i}: name {clip(t.name)!r} {problem}",
                                   reason=Reason.INVALID_NAME)
        if len(t.shape) > MAX_TENSOR_DIMS:
            raise InvalidPlanError(f"tensor {i} ({clip(t.name)!r}): {len(t.shape)} "
                                   f"dimensions, over {MAX_TENSOR_DIMS}",
                                   reason=Reason.INVALID_SHAPE)
        dtype = DTYPE_FROM_PROTO.get(t.dtype)
        if dtype is None:
            raise InvalidPlanError(
                f"tensor {i} ({clip(t.name)!r}): dtype {t.dtype} is not one of "
                f"{sorted(DTYPES)}", reason=Reason.UNSUPPORTED_DTYPE)
        specs.append(TensorSpec(t.name, tuple(t.shape), dtype))
    if request.HasField("packing"):
        packing = Packing(request.packing.buffer_size_bytes, request.packing.num_buffers)
    else:
        packing = Packing()
    adapter = AdapterSpec(request.adapter.name, request.adapter.peft_config_json) \
        if request.HasField("adapter") else None
    return RefitPlan(tuple(specs), packing, adapter)  # validated (the adapter too) by the caller


def packing_pb(p: Packing) -> pb.Packing:
    return pb.Packing(buffer_size_bytes=p.buffer_size_bytes, num_buffers=p.num_buffers)


__all__ = ["check_digest_shape", "check_group_id", "check_instance_id", "check_master",
           "check_not_own_port", "check_version", "epoch_mode", "flip_timeout", "packing_pb",
           "pause_mode", "plan_from_request", "printable"]
