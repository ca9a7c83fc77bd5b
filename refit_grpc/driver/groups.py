"""The data group's formation (docs/protocol.md, "Group formation"): form a group of a given
member list (every member joins with InitCollective, the trainer joins as rank 0), form it
again of another list (a membership change, a staged epoch going on without the engines that
failed), and drop it. Nothing is swapped to do it: the member list is an argument.

`GroupFormation` owns the group's name; which shim joined it as which instance is on each
`Member` (`Membership.formed`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import grpc
import torch
from torch.distributed import TCPStore

from refit_grpc.common import GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.driver.calls import ShimCalls, WorkerLink
from refit_grpc.driver.config import FleetConfig, FleetStateError
from refit_grpc.driver.failures import FleetError, WorkerFailure, root_causes_first
from refit_grpc.driver.links import GlooLink, TrainerLink
from refit_grpc.driver.membership import Member, Membership, links
from refit_grpc.driver.plans import check_prepared, prepare_on, prepare_request
from refit_grpc.errors import InvalidArgumentError, RefitError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import BACKEND_FROM_NAME, pb
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)

# What a member that is gone answers (dead, or too frozen to answer in time): a staged epoch's
# re-forming goes on without it.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _FailureOrder:
    """Watches join futures: `any_failed` is set by the first to fail, and `futures()` lists
    those that failed so far, in the order they did (the cause of a failed formation first)."""

    def __init__(self, futures: Sequence[Future]):
        self.any_failed = threading.Event()
        self._failed: list[Future] = []
        self._lock = threading.Lock()
        for f in futures:
            f.add_done_callback(self._done)

    def _done(self, f: Future) -> None:
        if f.cancelled() or f.exception() is None:
            return
        with self._lock:
            self._failed.append(f)
        self.any_failed.set()

    def futures(self) -> list[Future]:
        with self._lock:
            return list(self._failed)


@dataclass(frozen=True)
class RankLayout:
    """The members' ranks in a group, in member order: each one's instance id (Describe's),
    its first rank counted from the engines' first (`offsets`), and the engines' ranks in all
    (`inference_world_size`, each shared rank counted once)."""

    instances: list[str]
    offsets: list[int]
    inference_world_size: int
    # Describe's `shared_rank` of each member ("" for an engine of its own rank): engines of
    # one shared rank run their epochs over one stream (`EpochHandle`).
    shared: list[str]

    def members_of(self, rank: int, width: int) -> list[int]:
        """The members (indices) that hold engine rank `rank` (counted from 0)."""
        return [i for i, o in enumerate(self.offsets) if o <= rank < o + width]


class GroupFormation:
    """Forms, re-forms and drops the fleet's data group (module docstring).

    Args:
        config: the fleet's configuration (backend, join deadline, engine world size).
        calls: the calls to the shims.
        membership: the shims, whose records say who joined the group as what.
    """

    def __init__(self, config: FleetConfig, calls: ShimCalls, membership: Membership):
        self.config = config
        self.calls = calls
        self.membership = membership
        self.group_id: str | None = None  # the formed group's name; None: no group
        # A staged epoch that flipped its quorum can end with its group gone: its last round
        # aborted after every engine still in it had staged, so nothing re-formed it. The
        # fleet is not done with that group: the next refit() forms it again (`owes_reform`).
        self.reform_owed = False
        self.last_layout: RankLayout | None = None  # the ranks the last Describe round found

    def ranks(self, members: Sequence[Member]) -> RankLayout:
        """Who the members are and which ranks they take (one Describe each): engines that
        share a rank (Describe's `shared_rank`, a shim process serving several engines) take
        one rank between them; every other engine `engine_world_size` of its own.

        Raises:
            FleetError: a Describe failed, or an engine of several ranks says it shares one.
        """
        quick = pb.DescribeRequest(skip_weights_digest=True)
        about = self.calls.all("Describe", links(members), lambda w: quick, "describe failed")
        width = self.config.engine_world_size
        offsets: list[int] = []
        first_of: dict[str, int] = {}
        next_rank = 0
        for m, d in zip(members, about):
            if d.shared_rank and width != 1:
                raise FleetError("a shared receiving rank is for engines of one rank each",
                                 [WorkerFailure(m.endpoint.instance_id, m.endpoint.address,
                                                grpc.StatusCode.FAILED_PRECONDITION,
                                                Reason.INVALID_WORLD_SIZE,
                                                f"shares rank {d.shared_rank!r} while the "
                                                f"fleet's engine_world_size is {width}")],
                                 reason=Reason.INVALID_WORLD_SIZE)
            if d.shared_rank and d.shared_rank in first_of:
                offsets.append(first_of[d.shared_rank])
                continue
            if d.shared_rank:
                first_of[d.shared_rank] = next_rank
            offsets.append(next_rank)
            next_rank += width
        layout = RankLayout([d.instance_id for d in about], offsets, next_rank,
                            [d.shared_rank for d in about])
        self.last_layout = layout
        return layout

    def start(self, members: Sequence[Member], plan: RefitPlan, ip: str, port: int,
              world_size: int, train_world_size: int, group_id: str | None = None, *,
              layout: RankLayout | None = None) -> list[Future]:
        """InitCollective on every member, without waiting (`Fleet.init_collective()`
        documents it): one future per member. `layout`: the members' ranks, when the caller
        asked for them already (`ranks()`).

        Raises:
            InvalidArgumentError: a world size that is not `train_world_size` + the members'
                ranks (INVALID_WORLD_SIZE).
            MembershipChangedError: `validate_workers` reports a change.
        """
        self.membership.check_unchanged()
        layout = layout or self.ranks(members)
        if world_size != train_world_size + layout.inference_world_size:
            raise InvalidArgumentError(
                f"world_size {world_size} != train_world_size {train_world_size} + "
                f"inference_world_size {layout.inference_world_size}",
                reason=Reason.INVALID_WORLD_SIZE)
        shims = links(members)
        group_id = group_id or f"refit-{uuid.uuid4().hex[:12]}"
        requests = [pb.InitCollectiveRequest(
            master_address=ip, master_port=port, world_size=world_size,
            rank_offset=train_world_size + offset,
            backend=BACKEND_FROM_NAME[self.config.backend], group_id=group_id,
            plan_digest=plan.digest) for offset in layout.offsets]
        futures = self.calls.join(shims, requests)
        self.group_id = group_id
        self.reform_owed = False
        self.membership.formed(members, layout.instances, layout.shared)
        return futures

    def check_backend(self) -> None:
        """Refuse nccl without CUDA in the trainer, before any shim is asked to join (they
        would wait for a rank 0 that never comes): InvalidArgumentError, BACKEND_UNAVAILABLE."""
        if self.config.backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend nccl needs CUDA in the trainer",
                                       reason=Reason.BACKEND_UNAVAILABLE)

    def form(self, members: Sequence[Member], plan: RefitPlan, ip: str, port: int = 0, *,
             device: torch.device | int | None = None) -> TrainerLink:
        """Form a group of `members` with this process as the only trainer rank
        (`Fleet.connect()`, which documents it): the trainer's store listens before any
        shim is told where; the first shim whose join fails ends the trainer's wait."""
        if not members:
            behind = self.membership.left_behind
            raise FleetStateError(
                "no member to form a group with: every worker is left behind"
                + (f" ({'; '.join(f'{i}: {f}' for i, f in behind.items())})" if behind else "")
                + "; readmit() or catch_up() one first", reason=Reason.NO_MEMBERS)
        layout = self.ranks(members)
        world = 1 + layout.inference_world_size
        store: TCPStore | None = None
        listener: socket.socket | None = None
        if self.config.backend == "nccl":
            from refit_grpc.driver.nccl import listen

            listener = listen(ip, port)  # vLLM's store takes it over
            port = listener.getsockname()[1]
        else:
            store = bind_master_store(ip, port, world, self.config.join_timeout_s)
            port = store.port
        shims = links(members)
        try:
            futures = self.start(members, plan, ip, port, world, 1, layout=layout)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        failed_first = _FailureOrder(futures)
        try:
            link = self._join_trainer(plan, ip, port, world, store, listener, device,
                                      failed_first.any_failed)
        except RefitError as e:
            causes = failed_first.futures()
            self._abort_everyone("trainer failed to join")
            failures = self._join_failures(futures, shims, causes, e, layout)
            if causes:
                message = (f"{failures[0].instance_id}'s join failed, so the trainer gave the "
                           f"rendezvous up: {failures[0].message}")
            else:
                message = f"trainer rank 0 could not join: {e}"
            raise FleetError(message, failures,
                             reason=failures[0].reason if causes else e.reason) from e
        failures = _collect(futures, self.config.join_timeout_s, shims)
        if failures:
            link.close()
            self._abort_everyone("join failed")
            raise FleetError("InitCollective failed", failures, reason=failures[0].reason)
        return link

    def reform(self, link: TrainerLink, members: Sequence[Member], plan: RefitPlan, *,
               leave_behind: bool = False) -> dict[Member, WorkerFailure]:
        """Form a new group of `members` only, the trainer's end replacing `link`'s (gloo).
        A member added (or restarted and readmitted) since has no plan; for the others
        Prepare of the plan they hold is a no-op. With `leave_behind`, members that do not
        answer Prepare (dead, frozen) are left behind instead of failing it all (returned);
        a refusal still raises.

        Raises:
            FleetStateError: not a gloo link (FLEET_NOT_CONNECTED).
            FleetError: a refusal, no member left, or the formation failed.
        """
        if not isinstance(link, GlooLink):
            raise FleetStateError("a staged epoch re-forms its group without the engines that "
                                  "failed, which only the gloo link can do; connect() again",
                                  reason=Reason.FLEET_NOT_CONNECTED)
        ip = link.group.spec.master_address
        link.close()
        self.drop()
        failed: dict[Member, WorkerFailure] = {}
        if leave_behind:
            failed = self._prepare_or_leave_behind(members, plan)
            members = [m for m in members if m not in failed]
        else:
            prepare_on(self.calls, plan, links(members))
        fresh = self.form(members, plan, ip)
        assert isinstance(fresh, GlooLink)
        link.adopt(fresh)
        return failed

    def owes_reform(self, link: TrainerLink) -> bool:
        """The last staged epoch flipped with its group gone (`reform_owed`) and `link` can
        form it again (gloo): `Fleet.refit()` re-forms before its epoch instead of refusing."""
        return self.reform_owed and isinstance(link, GlooLink)

    def drop(self) -> None:
        """The data group is gone (an epoch gave up, or a formation failed): the shims tore
        their ends down, so the next epoch must form a new one."""
        self.group_id = None
        self.membership.group_gone()

    def abort_epoch(self, reason: str, shims: Sequence[WorkerLink], keep_staged: bool = False
                    ) -> list[pb.AbortResponse | None]:
        """An epoch gave up: the shims it aborts drop their group, so the fleet has none
        either (the next epoch needs a formation first, said before any RPC). `keep_staged`:
        a staged epoch's, whose complete copies wait for the flip."""
        self.drop()
        return self.calls.abort(reason, shims, keep_staged=keep_staged)

    # --- plumbing --------------------------------------------------------------------------

    def _join_trainer(self, plan: RefitPlan, ip: str, port: int, world: int,
                      store: TCPStore | None, listener: socket.socket | None,
                      device: torch.device | int | None,
                      cancel: threading.Event) -> TrainerLink:
        """This process joins as trainer rank 0: the project's own group (gloo) or vLLM's
        NCCL rendezvous (nccl), whose listening socket `listener` is."""
        if listener is not None:
            from refit_grpc.driver.nccl import NcclLink, NcclSender

            return NcclLink(NcclSender.connect(ip, port, world, plan, self.config.join_timeout_s,
                                               device, listen_socket=listener), port)
        return GlooLink(Group.join(GroupSpec(ip, port, world, 0, self.config.backend,
                                             self.group_id or ""),
                                   self.config.join_timeout_s, store=store, cancel=cancel), plan)

    def _abort_everyone(self, reason: str) -> None:
        self.calls.abort(reason, links(self.membership.current))

    def _prepare_or_leave_behind(self, members: Sequence[Member], plan: RefitPlan
                                 ) -> dict[Member, WorkerFailure]:
        """A staged epoch goes on without the members that cannot even take the plan (dead
        since the last epoch): they are left behind, named in its report."""
        request = prepare_request(plan)
        answers = dict(zip(members, self.calls.each("Prepare", links(members),
                                                     lambda w: request)))
        failed = {m: a for m, a in answers.items() if isinstance(a, WorkerFailure)}
        refusals = [f for f in failed.values() if f.code not in _GONE]
        if refusals:  # alive and saying no (BUSY, ...): the trainer's to decide, not ours
            raise FleetError("Prepare: prepare failed", refusals, reason=refusals[0].reason)
        if failed:
            log.warning("re-forming without %s: %s", ", ".join(
                f.instance_id for f in failed.values()), "; ".join(map(str, failed.values())))
            self.membership.leave_behind(failed)
            if len(failed) == len(members):
                raise FleetError("no member can take the plan", list(failed.values()))
        left = [m for m in members if m not in failed]
        check_prepared(plan, links(left), [answers[m] for m in left])
        return failed

    def _join_failures(self, futures: list[Future], shims: Sequence[WorkerLink],
                       causes: Sequence[Future], error: RefitError, layout: RankLayout
                       ) -> list[WorkerFailure]:
        """Why a formation failed, the causes first: the shims whose joins failed before the
        trainer gave up (in the order they failed), then those that never reached the
        trainer's store (`RendezvousTimeoutError.missing_ranks`), then the rest (those the
        abort ended, root causes first)."""
        first = {id(f) for f in causes}
        missing: list[WorkerFailure] = []
        seen: set[int] = set()
        for rank in getattr(error, "missing_ranks", ()):
            for i in layout.members_of(rank - 1, self.config.engine_world_size):
                if i in seen or id(futures[i]) in first:
                    continue
                seen.add(i)
                e = shims[i].endpoint
                missing.append(WorkerFailure(
                    e.instance_id, e.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                    Reason.RENDEZVOUS_TIMEOUT,
                    f"rank {rank} never reached the trainer's rendezvous store"))
        order = {id(f): k for k, f in enumerate(causes)}
        by_future = sorted(range(len(futures)),
                           key=lambda i: order.get(id(futures[i]), len(order) + i))
        end = time.monotonic() + 5.0  # one bound for all: the abort ended every join
        cause_failures: list[WorkerFailure] = []
        rest: list[WorkerFailure] = []
        for i in by_future:
            if i in seen:
                continue
            got = _collect([futures[i]], max(end - time.monotonic(), 0.001), [shims[i]])
            (cause_failures if id(futures[i]) in first else rest).extend(got)
        return cause_failures + missing + root_causes_first(rest)


def check_formation(group_id: str | None, port: int) -> None:
    """Refuse a formation's name and port before any shim is asked (`Fleet.init_collective()`).

    Raises:
        InvalidArgumentError: an empty group_id, or a port out of range.
    """
    if group_id is not None and not group_id:
        raise InvalidArgumentError("group_id is empty", reason=Reason.INVALID_GROUP_ID)
    if not 0 < port < 65536:
        raise InvalidArgumentError(
            f"master_port {port} out of range: init_collective needs the port the trainer's "
            "store listens on (connect() binds one itself with port 0)",
            reason=Reason.INVALID_MASTER_PORT)


def _collect(futures: Sequence[Future], timeout_s: float,
             shims: Sequence[WorkerLink]) -> list[WorkerFailure]:
    """The failures of the joins `futures` (one per shim), waiting at most `timeout_s` for
    all: a join with no JOINED by then is JOIN_TIMEOUT."""
    failures = []
    end = time.monotonic() + timeout_s
    for w, f in zip(shims, futures):
        try:
            f.result(timeout=max(end - time.monotonic(), 0.001))
        except FleetError as e:
            failures += e.failures or [WorkerFailure(
                w.endpoint.instance_id, w.endpoint.address, grpc.StatusCode.UNKNOWN,
                e.reason, e.message)]
        except TimeoutError:
            failures.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                          grpc.StatusCode.DEADLINE_EXCEEDED,
                                          Reason.JOIN_TIMEOUT, "no JOINED in time"))
    return failures


__all__ = ["GroupFormation", "RankLayout", "check_formation"]
