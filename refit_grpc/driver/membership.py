"""The fleet's membership: workers added, removed, followed from discovery, left behind by a
staged epoch, readmitted, and caught up from a peer (docs/protocol.md, "Membership" and
"Catch-up from a peer"). Functions of a `Fleet`, which delegates its public methods here:
membership changes take effect at the next epoch boundary, where `Fleet.refit()` forms the
group again of `fleet._members`; this module keeps those books and starts catch-ups
(`refit_grpc.driver.catch_up` runs one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from refit_grpc.common import PauseMode
from refit_grpc.driver.catch_up import CatchUpError, CatchUpReport, catch_up_from_peers
from refit_grpc.driver.config import FleetState, refuse_unless
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import WorkerFailure
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

if TYPE_CHECKING:
    from refit_grpc.driver.fleet import Fleet

log = logging.getLogger(__name__)

# States in which a worker may be added: any but CLOSED.
_OPEN = (FleetState.EMPTY, FleetState.PREPARED, FleetState.CONNECTED)


def endpoint_of(worker: WorkerEndpoint | Mapping[str, Any]) -> WorkerEndpoint:
    return worker if isinstance(worker, WorkerEndpoint) else WorkerEndpoint.from_metadata(worker)


def add(fleet: Fleet, worker: WorkerEndpoint | Mapping[str, Any]) -> None:
    """`Fleet.add()`, which documents it."""
    refuse_unless(fleet.state, _OPEN, "add()")
    endpoint = endpoint_of(worker)
    if any(e.instance_id == endpoint.instance_id for e in fleet.endpoints):
        raise InvalidArgumentError(f"worker {endpoint.instance_id!r} is already in the fleet",
                                   reason=Reason.INVALID_ARGUMENT)
    fleet._endpoints.append(endpoint)
    fleet._open_link(endpoint)
    fleet._members.append(len(fleet._endpoints) - 1)


def remove(fleet: Fleet, instance_id: str) -> None:
    """`Fleet.remove()`, which documents it."""
    index = index_of(fleet, instance_id)
    if len(fleet._current()) == 1:
        raise InvalidArgumentError("a fleet needs at least one worker",
                                   reason=Reason.INVALID_ARGUMENT)
    fleet._removed.add(index)
    fleet._members = [i for i in fleet._members if i != index]
    fleet._left_behind.pop(instance_id, None)


def sync(fleet: Fleet, workers: Sequence[WorkerEndpoint | Mapping[str, Any]]
         ) -> tuple[list[str], list[str]]:
    """`Fleet.sync()`, which documents it."""
    wanted = {e.instance_id: e for e in map(endpoint_of, workers)}
    if not wanted:
        raise InvalidArgumentError("a fleet needs at least one worker: an empty discovery "
                                   "is not followed", reason=Reason.INVALID_ARGUMENT)
    have = {e.instance_id: e for e in fleet.endpoints}
    removed = [i for i, e in have.items() if wanted.get(i) != e]
    added = [i for i, e in wanted.items() if have.get(i) != e]
    for instance_id in removed:
        index = index_of(fleet, instance_id)
        fleet._removed.add(index)
        fleet._members = [i for i in fleet._members if i != index]
        fleet._left_behind.pop(instance_id, None)
    for instance_id in added:
        add(fleet, wanted[instance_id])
    return added, removed


def members(fleet: Fleet) -> tuple[WorkerEndpoint, ...]:
    """`Fleet.members`, which documents it."""
    return tuple(fleet._endpoints[i] for i in fleet._members)


def left_behind(fleet: Fleet) -> dict[str, WorkerFailure]:
    """`Fleet.left_behind`, which documents it."""
    return dict(fleet._left_behind)


def readmit(fleet: Fleet, instance_id: str) -> None:
    """`Fleet.readmit()`, which documents it."""
    if instance_id not in fleet._left_behind:
        raise InvalidArgumentError(f"{instance_id!r} is not left behind",
                                   reason=Reason.INVALID_ARGUMENT)
    del fleet._left_behind[instance_id]
    fleet._members = [i for i in fleet._current()
                      if fleet._endpoints[i].instance_id not in fleet._left_behind]


def catch_up(fleet: Fleet, instance_id: str, *, timeout_s: float | None = None,
             pause_mode: PauseMode = PauseMode.KEEP) -> CatchUpReport:
    """`Fleet.catch_up()`, which documents it."""
    report = catch_up_async(fleet, instance_id, timeout_s=timeout_s,
                            pause_mode=pause_mode).result()
    settle_catch_ups(fleet)
    return report


def catch_up_async(fleet: Fleet, instance_id: str, *, timeout_s: float | None = None,
                   pause_mode: PauseMode = PauseMode.KEEP) -> Future[CatchUpReport]:
    """`Fleet.catch_up_async()`, which documents it."""
    plan = fleet._plan_for("catch_up()", (FleetState.PREPARED, FleetState.CONNECTED))
    index = index_of(fleet, instance_id)
    if fleet._committed is None:
        raise CatchUpError(f"no member holds the fleet's version {fleet._version} in a "
                           "committed copy (the last epoch was in place, or none flipped "
                           "yet); the next epoch brings the worker to it", [],
                           reason=Reason.NO_CATCH_UP_PEER)
    version, digest = fleet._committed
    target = fleet._workers[index]
    fleet._prepare_on(plan, [target])
    quick = pb.DescribeRequest(skip_weights_digest=True)
    (about,) = fleet.calls.all("Describe", [target], lambda w: quick,
                               "Describe of the worker catching up failed")
    candidates = [i for i in fleet._members if i != index]
    answers = fleet.calls.each("Describe", fleet._member_links(candidates), lambda w: quick)
    peers = [fleet._workers[i] for i, a in zip(candidates, answers)
             if isinstance(a, pb.DescribeResponse)
             and (a.committed_copy_version, a.committed_copy_digest) == (version, digest)
             and a.state in (pb.SHIM_STATE_READY, pb.SHIM_STATE_PREPARED)
             and not a.serving_catch_up_to]
    if not peers:
        raise CatchUpError(f"no member holds version {version} ({digest[:16]}) in its "
                           "committed copy, or every one that does is busy; the next epoch "
                           "brings the worker to it", [],
                           reason=Reason.NO_CATCH_UP_PEER)
    future = fleet._catch_up_pool.submit(
        catch_up_from_peers, target, peers, version=version, staged_digest=digest,
        plan=plan, target_world_size=max(about.engine_world_size, 1),
        target_instance=about.instance_id,
        timeout_s=timeout_s or fleet.config.epoch_timeout_s, pause_mode=pause_mode)
    fleet._catch_ups.append(future)
    return future


def index_of(fleet: Fleet, instance_id: str) -> int:
    for i in fleet._current():
        if fleet._endpoints[i].instance_id == instance_id:
            return i
    raise InvalidArgumentError(f"no worker {instance_id!r} in the fleet",
                               reason=Reason.INVALID_ARGUMENT)


def settle_catch_ups(fleet: Fleet) -> None:
    """Wait for the catch-ups under way; each that succeeded changes the membership: its
    worker left its data group (the next epoch forms the group with it) and, if it was
    left behind, is readmitted. A failed one is the caller's news (its future's error)."""
    pending, fleet._catch_ups = fleet._catch_ups, []
    for future in pending:
        try:
            report = future.result()
        except CatchUpError as e:
            log.warning("a catch-up failed, the next epoch brings its worker up: %s", e)
            continue
        index = index_of(fleet, report.instance_id)
        fleet._left_behind.pop(report.instance_id, None)
        if index not in fleet._members:
            fleet._members = [i for i in fleet._current()
                              if fleet._endpoints[i].instance_id not in fleet._left_behind]
        if fleet._group_members is not None and index in fleet._group_members:
            keep = [k for k, i in enumerate(fleet._group_members) if i != index]
            fleet._group_members = tuple(fleet._group_members[k] for k in keep)
            if fleet._joined_instances is not None:
                fleet._joined_instances = tuple(fleet._joined_instances[k] for k in keep)


def leave_behind(fleet: Fleet, behind: Mapping[int, WorkerFailure]) -> None:
    """Engines a staged epoch went on without leave the fleet's groups until `readmit()`;
    the next `refit()` forms the group again without them."""
    for i, f in behind.items():
        fleet._left_behind[fleet._endpoints[i].instance_id] = f
    fleet._members = [i for i in fleet._members if i not in behind]
