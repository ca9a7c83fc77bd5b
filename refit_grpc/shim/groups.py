"""The groups a request asks this engine to take part in, every field checked against the engine
and where the shim may connect: InitCollective's data group, CatchUp's two-rank group with a
peer, and the rendezvous ServeCatchUp hosts. Each check raises the field's own reason; none reads
the shim's state (the handler's admission does that after)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from refit_grpc.common import MAX_ENGINE_WORLD_SIZE, MAX_WORLD_SIZE, GroupSpec, PauseMode
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError
from refit_grpc.proto import BACKEND_NAMES, pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.fields import (
    Network,
    check_digest_shape,
    check_group_id,
    check_instance_id,
    check_master,
    check_not_own_port,
    check_version,
    pause_mode,
)


def data_group(request: pb.InitCollectiveRequest, engine: Engine, networks: Sequence[Network],
               own_ports: Iterable[int]) -> GroupSpec:
    """InitCollective's group: a trainer's rendezvous the shim may join, a backend the engine
    can use, and ranks that fit the world."""
    check_digest_shape(request.plan_digest, "plan_digest")
    check_group_id(request.group_id)
    backend = BACKEND_NAMES.get(request.backend)
    if backend is None:
        raise InvalidArgumentError("backend must be GLOO or NCCL", reason=Reason.INVALID_BACKEND)
    check_master(request.master_address, networks)
    spec = GroupSpec(request.master_address, request.master_port, request.world_size,
                     request.rank_offset, backend, request.group_id)
    spec.validate()
    if request.world_size > MAX_WORLD_SIZE:
        raise InvalidArgumentError(f"world_size {request.world_size} is over {MAX_WORLD_SIZE}",
                                   reason=Reason.INVALID_WORLD_SIZE)
    check_not_own_port(request.master_address, request.master_port, own_ports)
    engine.check_backend(backend)
    if request.rank_offset < 1:
        raise InvalidArgumentError("rank_offset must be >= 1: rank 0 is the trainer",
                                   reason=Reason.INVALID_RANK)
    if request.rank_offset + engine.world_size > request.world_size:
        raise InvalidArgumentError(
            f"ranks [{request.rank_offset}, {request.rank_offset + engine.world_size})"
            f" do not fit world_size {request.world_size}", reason=Reason.INVALID_RANK)
    return spec


def serve_world(request: pb.ServeCatchUpRequest, engine: Engine,
                networks: Sequence[Network]) -> int:
    """ServeCatchUp's fields, and an engine that can serve its copy; the group's world."""
    check_instance_id(request.instance_id, "instance_id")
    check_instance_id(request.target_instance_id, "target_instance_id")
    check_digest_shape(request.staged_digest, "staged_digest")
    check_digest_shape(request.plan_digest, "plan_digest")
    if request.version < 1 or not request.staged_digest or not request.group_id:
        raise InvalidArgumentError("ServeCatchUp needs version >= 1, the committed copy's "
                                   "staged digest and a group id",
                                   reason=Reason.INVALID_CATCH_UP)
    check_version(request.version, "version")
    check_group_id(request.group_id)
    if not request.listen_address:
        raise InvalidArgumentError("ServeCatchUp needs the listen_address the newcomer "
                                   "reaches this engine at", reason=Reason.INVALID_CATCH_UP)
    check_master(request.listen_address, networks)
    world = request.world_size or 2
    if not 2 <= world <= 1 + MAX_ENGINE_WORLD_SIZE:
        raise InvalidArgumentError(
            f"world_size must be 1 + the newcomer's engine ranks (2 to "
            f"{1 + MAX_ENGINE_WORLD_SIZE}; 0 means 2), got {world}",
            reason=Reason.INVALID_WORLD_SIZE)
    if not engine.capabilities.serving_copy:
        raise FailedPreconditionError(
            f"the {engine.kind} engine cannot serve its committed copy; catch the "
            "engine up from another peer or by the next epoch",
            reason=Reason.CATCH_UP_UNSUPPORTED)
    return world


def catch_up_group(request: pb.CatchUpRequest, engine: Engine, networks: Sequence[Network],
                   own_ports: Iterable[int]) -> tuple[GroupSpec, PauseMode]:
    """CatchUp's fields, and an engine that can stage; the two-rank group it joins and the
    pause mode of its load."""
    check_instance_id(request.instance_id, "instance_id")
    check_instance_id(request.peer_instance_id, "peer_instance_id")
    check_digest_shape(request.staged_digest, "staged_digest")
    check_digest_shape(request.plan_digest, "plan_digest")
    mode = pause_mode(request.pause_mode, PauseMode.KEEP)
    if request.version < 1 or not request.staged_digest or not request.group_id:
        raise InvalidArgumentError("CatchUp needs version >= 1, the peer copy's staged "
                                   "digest and a group id", reason=Reason.INVALID_CATCH_UP)
    check_version(request.version, "version")
    check_group_id(request.group_id)
    check_master(request.master_address, networks)
    spec = GroupSpec(request.master_address, request.master_port,
                     1 + engine.world_size, 1, "gloo", request.group_id)
    spec.validate()
    check_not_own_port(request.master_address, request.master_port, own_ports)
    if not engine.capabilities.staging:
        raise FailedPreconditionError(
            f"the {engine.kind} engine cannot stage, so it cannot catch up from a "
            "peer; the next epoch brings it to the fleet's version",
            reason=Reason.CATCH_UP_UNSUPPORTED)
    return spec, mode


__all__ = ["catch_up_group", "data_group", "serve_world"]
