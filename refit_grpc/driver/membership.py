"""The fleet's membership (docs/protocol.md, "Membership"): one record per shim the fleet ever
had (`Member`: its endpoint, its link, removed or not, why a staged epoch left it behind, the
instance it joined the data group as), and the books kept on them: shims added, removed,
followed from discovery, left behind, readmitted, caught up.

Membership changes take effect at the next epoch boundary: `Fleet.refit()` forms the group
again of `Membership.members` when it differs from `Membership.group` (`driver.groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from refit_grpc.driver.calls import WorkerLink
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import WorkerFailure
from refit_grpc.errors import InvalidArgumentError, MembershipChangedError
from refit_grpc.reasons import Reason

# NeMo RL's membership hook: the workers' metadata in, the membership as it sees it now out.
ValidateWorkers = Callable[[list[dict]], list[dict]]


def endpoint_of(worker: WorkerEndpoint | Mapping[str, Any]) -> WorkerEndpoint:
    """A worker as a `WorkerEndpoint` (Dynamo-style metadata is converted)."""
    return worker if isinstance(worker, WorkerEndpoint) else WorkerEndpoint.from_metadata(worker)


@dataclass(eq=False)
class Member:
    """One shim the fleet has had (records are never deleted: a removed one is marked).

    Args:
        endpoint: where it is.
        link: the stub the driver calls it through.
        removed: `remove()`d (or gone from a `sync()`): never called again.
        left_behind: why a staged epoch went on without it; None while it is a member.
        joined_as: the instance id it joined the current data group as; None: not in it.
        shares_rank: the receiving rank it shares with other engines of its shim process
            (Describe's `shared_rank` when it joined), "" for one of its own: engines of one
            shared rank run their epochs over one stream.
    """

    endpoint: WorkerEndpoint
    link: WorkerLink
    removed: bool = False
    left_behind: WorkerFailure | None = None
    joined_as: str | None = None
    shares_rank: str = ""

    @property
    def instance_id(self) -> str:
        return self.endpoint.instance_id


class Membership:
    """Every shim the fleet has had, in the order given or added (module docstring).

    Args:
        workers: the first shims; instance ids unique, at least one.
        open_link: opens the link to a shim (`ShimCalls.open`).
        validate_workers: NeMo RL's membership hook (`check_unchanged`).

    Raises:
        InvalidArgumentError: no worker, or duplicate instance ids.
    """

    def __init__(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]],
                 open_link: Callable[[WorkerEndpoint], WorkerLink],
                 validate_workers: ValidateWorkers | None = None):
        if not workers:
            raise InvalidArgumentError("a fleet needs at least one worker",
                                       reason=Reason.INVALID_ARGUMENT)
        endpoints = [endpoint_of(w) for w in workers]
        if len({e.instance_id for e in endpoints}) != len(endpoints):
            raise InvalidArgumentError("worker instance ids must be unique",
                                       reason=Reason.INVALID_ARGUMENT)
        self.validate_workers = validate_workers
        self._open_link = open_link
        self._records = [Member(e, open_link(e)) for e in endpoints]

    # --- who is who -----------------------------------------------------------------------

    @property
    def current(self) -> list[Member]:
        """Every shim not removed, in order."""
        return [m for m in self._records if not m.removed]

    @property
    def endpoints(self) -> tuple[WorkerEndpoint, ...]:
        return tuple(m.endpoint for m in self.current)

    @property
    def members(self) -> list[Member]:
        """What the next group is formed of: every shim but those removed or left behind."""
        return [m for m in self._records if not m.removed and m.left_behind is None]

    @property
    def group(self) -> list[Member]:
        """The shims the current data group holds, in order (empty: no group)."""
        return [m for m in self._records if m.joined_as is not None]

    def group_is_members(self) -> bool:
        """The group holds exactly the members (no re-forming needed)."""
        return self.group == self.members

    @property
    def left_behind(self) -> dict[str, WorkerFailure]:
        return {m.instance_id: m.left_behind for m in self.current if m.left_behind is not None}

    def find(self, instance_id: str) -> Member:
        """The current shim with that instance id (else InvalidArgumentError)."""
        for m in self.current:
            if m.instance_id == instance_id:
                return m
        raise InvalidArgumentError(f"no worker {instance_id!r} in the fleet",
                                   reason=Reason.INVALID_ARGUMENT)

    # --- changes (`Fleet.add()`, `remove()`, `sync()`, `readmit()` document them) ---------

    def add(self, worker: WorkerEndpoint | Mapping[str, Any]) -> None:
        endpoint = endpoint_of(worker)
        if any(e.instance_id == endpoint.instance_id for e in self.endpoints):
            raise InvalidArgumentError(f"worker {endpoint.instance_id!r} is already in the fleet",
                                       reason=Reason.INVALID_ARGUMENT)
        self._records.append(Member(endpoint, self._open_link(endpoint)))

    def remove(self, instance_id: str) -> None:
        member = self.find(instance_id)
        if len(self.current) == 1:
            raise InvalidArgumentError("a fleet needs at least one worker",
                                       reason=Reason.INVALID_ARGUMENT)
        member.removed = True
        member.left_behind = None

    def sync(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]]
             ) -> tuple[list[str], list[str]]:
        wanted = {e.instance_id: e for e in map(endpoint_of, workers)}
        if not wanted:
            raise InvalidArgumentError("a fleet needs at least one worker: an empty discovery "
                                       "is not followed", reason=Reason.INVALID_ARGUMENT)
        have = {e.instance_id: e for e in self.endpoints}
        removed = [i for i, e in have.items() if wanted.get(i) != e]
        added = [i for i, e in wanted.items() if have.get(i) != e]
        for instance_id in removed:
            member = self.find(instance_id)
            member.removed = True
            member.left_behind = None
        for instance_id in added:
            self.add(wanted[instance_id])
        return added, removed

    def readmit(self, instance_id: str) -> None:
        member = next((m for m in self.current
                       if m.instance_id == instance_id and m.left_behind is not None), None)
        if member is None:
            raise InvalidArgumentError(f"{instance_id!r} is not left behind",
                                       reason=Reason.INVALID_ARGUMENT)
        member.left_behind = None

    def leave_behind(self, behind: Mapping[Member, WorkerFailure]) -> None:
        """Shims a staged epoch went on without leave the fleet's groups until `readmit()`;
        the next `refit()` forms the group again without them."""
        for member, failure in behind.items():
            member.left_behind = failure

    def caught_up(self, instance_id: str) -> None:
        """A catch-up brought the shim to the fleet's version: it left its data group (the
        next epoch forms the group with it) and, if it was left behind, is readmitted."""
        member = self.find(instance_id)
        member.left_behind = None
        member.joined_as = None

    # --- the data group -------------------------------------------------------------------

    def formed(self, members: Sequence[Member], instances: Sequence[str],
               shared: Sequence[str]) -> None:
        """A group is formed of `members`, which joined as `instances`, sharing the ranks
        `shared` ("" for a rank of its own; Describe's answers): it replaces any other."""
        for m in self._records:
            m.joined_as = None
        for m, instance_id, rank in zip(members, instances, shared):
            m.joined_as = instance_id
            m.shares_rank = rank

    def group_gone(self) -> None:
        """The data group is gone: nobody is in it."""
        for m in self._records:
            m.joined_as = None

    def check_unchanged(self) -> None:
        """Refuse a fleet whose membership changed since InitCollective (docs/protocol.md,
        invariant 5), as the `validate_workers` hook sees it. A shim restarted since it joined
        refuses the epoch itself (UpdateWeightsRequest.instance_id).

        Raises:
            MembershipChangedError: the hook's answer differs from the fleet's workers.
        """
        if self.validate_workers is None:
            return
        original = [{"instance_id": e.instance_id, "address": e.address} for e in self.endpoints]
        current = self.validate_workers([dict(m) for m in original])
        changed = [WorkerFailure(str(c.get("instance_id")), str(c.get("address")),
                                 grpc.StatusCode.FAILED_PRECONDITION, Reason.MEMBERSHIP_CHANGED,
                                 "validate_workers reported a change")
                   for o, c in zip(original, current) if dict(o) != dict(c)]
        if len(current) != len(original) or changed:
            raise MembershipChangedError(
                "membership changed after collective setup: "
                + ("; ".join(map(str, changed)) if changed else str(current)))


def links(members: Sequence[Member]) -> list[WorkerLink]:
    """The links of `members`, in order."""
    return [m.link for m in members]


def rank_bundles(members: Sequence[Member]) -> list[list[int]]:
    """The members (indexes) that are engines of one shim process sharing a receiving rank,
    two or more: their epochs run over one UpdateEngines stream and their flips in one
    FlipEngines call (`FleetConfig.stream_per_process`)."""
    by_rank: dict[str, list[int]] = {}
    for i, m in enumerate(members):
        if m.shares_rank:
            by_rank.setdefault(m.shares_rank, []).append(i)
    return [indexes for indexes in by_rank.values() if len(indexes) > 1]


__all__ = ["Member", "Membership", "ValidateWorkers", "endpoint_of", "links", "rank_bundles"]
