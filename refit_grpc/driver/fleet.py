"""The trainer's view of the fleet: one stub per shim, deadlines, retries, epochs.

Its surface mirrors NeMo RL's `DynamoRefitChannel` (`nemo_rl.models.generation.dynamo.refit`:
the HTTP-JSON refit over Dynamo's RL routes that this project replaces; the code and docs call
it "NeMo RL's channel") so trainer code written for it can switch:
`client_copy()`, `inference_world_size`, `sender_spec`, `prepare()`, `init_collective()` and
`update_weights()` returning handles, `flush_cache()`. On top: `connect()` (group + trainer join),
`refit()` (one whole epoch), `describe()`, `abort()`.

Who owns what: `epoch.py` tracks one UpdateWeights epoch (its streams and threads),
`failures.py` decodes what a worker said, `links.py` is the trainer's end of the data group
(`nccl.py` for vLLM's own NCCL receiver); this module orchestrates.

Retry policy: idempotent unary calls (Describe, Prepare, Flush, Abort) retry on UNAVAILABLE with
exponential backoff and jitter. InitCollective and UpdateWeights are never retried alone: a failed
epoch is aborted fleet-wide and must be re-run as a whole (connect, then refit).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import grpc
import torch
from torch.distributed import TCPStore

from refit_grpc.canary import Canary
from refit_grpc.collective import Group, bind_master_store
from refit_grpc.common import EpochMode, GroupSpec, PauseMode
from refit_grpc.driver import membership, staged
from refit_grpc.driver.calls import ShimCalls, WorkerLink
from refit_grpc.driver.catch_up import CatchUpReport
from refit_grpc.driver.config import FleetConfig, FleetState, FleetStateError, refuse_unless
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.failures import (
    CanaryMismatchError,
    EpochFailedError,
    FleetError,
    WeightsMismatchError,
    WorkerFailure,
    odd_digests,
    root_causes_first,
)
from refit_grpc.driver.links import GlooLink, TrainerLink
from refit_grpc.driver.membership import endpoint_of
from refit_grpc.driver.reports import EpochReport, WorkerReport
from refit_grpc.errors import InvalidArgumentError, MembershipChangedError, RefitError
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import (
    BACKEND_FROM_NAME,
    DTYPE_TO_PROTO,
    EPOCH_MODE_TO_PROTO,
    PAUSE_MODE_TO_PROTO,
    pb,
)
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)



def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


# States in which a call may run: any but CLOSED; with a plan.
_OPEN = (FleetState.EMPTY, FleetState.PREPARED, FleetState.CONNECTED)
_PREPARED = (FleetState.PREPARED, FleetState.CONNECTED)


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


class Fleet:
    """The trainer's fleet of shims: stubs with deadlines and retries, the plan, the data group
    and the epochs (module docstring of `refit_grpc.driver`; README, A trainer using `Fleet`).

    Args:
        workers: the shims, as `WorkerEndpoint`s or Dynamo-style metadata dicts
            (`WorkerEndpoint.from_metadata`); instance ids unique.
        config: the configuration (`FleetConfig`); its fields may also be given as keywords,
            which override it (`Fleet(workers, epoch_timeout_s=60)`).
        validate_workers: NeMo RL's membership hook: called with the workers' metadata before
            each group formation and epoch; a different answer is MEMBERSHIP_CHANGED.
        **overrides: `FleetConfig` fields, overriding `config`'s.

    Raises:
        InvalidArgumentError: no worker, duplicate instance ids, or a bad configuration value.
    """

    def __init__(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]],
                 config: FleetConfig | None = None, *,
                 validate_workers: Callable[[list[dict]], list[dict]] | None = None,
                 **overrides: Any):
        if not workers:
            raise InvalidArgumentError("a fleet needs at least one worker",
                                       reason=Reason.INVALID_ARGUMENT)
        # Every worker the fleet ever had, index-stable (`remove()` marks, never deletes):
        # the group, the epochs and the reports refer to workers by these indexes.
        self._endpoints = [endpoint_of(w) for w in workers]
        if len({e.instance_id for e in self._endpoints}) != len(self._endpoints):
            raise InvalidArgumentError("worker instance ids must be unique",
                                       reason=Reason.INVALID_ARGUMENT)
        self._removed: set[int] = set()
        if overrides.get("security", ...) is None:
            del overrides["security"]  # None: the default, as callers with no TLS pass it
        self.config = replace(config or FleetConfig(), **overrides)
        self.validate_workers = validate_workers
        self._packing = self.config.packing  # the configured one, or negotiated once
        # Every call to a shim: channels, threads, deadlines, retries (`driver.calls`).
        self.calls = ShimCalls(self.config)
        self._workers: list[WorkerLink] = []
        for e in self._endpoints:
            self._open_link(e)
        self._epochs: list[EpochHandle] = []
        self._epochs_lock = threading.Lock()
        self._closed = False
        self._plan: RefitPlan | None = None
        self._group_id: str | None = None
        self._joined_instances: tuple[str, ...] | None = None
        self._version = 0
        # Worker indexes the next group is formed of: every worker but those removed and those
        # a staged epoch left behind (`left_behind`), and those the formed group holds (None:
        # no group). The next epoch forms the group again when the two differ.
        self._members = list(range(len(self._workers)))
        self._group_members: tuple[int, ...] | None = None
        self._left_behind: dict[str, WorkerFailure] = {}
        # Delta epochs: (version, staged digest, the plan's bytes) of the last staged epoch
        # that flipped with delta=True, the trainer's one extra copy (`refit_grpc.delta`).
        self._delta_base: tuple[int, str, torch.Tensor] | None = None
        # The fleet's version as its members' committed copies hold it: (version, staged
        # digest) of the last staged epoch that flipped; None after an in-place one (which ends
        # the copies) and while an epoch runs. What a catch-up serves.
        self._committed: tuple[int, str] | None = None
        # Catch-ups under way (`catch_up_async`): applied to the membership at the next epoch.
        self._catch_ups: list[Future[CatchUpReport]] = []
        self._catch_up_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="catch-up")

    # --- NeMo RL's channel's surface ------------------------------------------------------

    def _open_link(self, e: WorkerEndpoint) -> None:
        self._workers.append(self.calls.open(e))

    @property
    def endpoints(self) -> tuple[WorkerEndpoint, ...]:
        """The fleet's workers, in the order they were given or added (removed ones gone)."""
        return tuple(e for i, e in enumerate(self._endpoints) if i not in self._removed)

    def _current(self) -> list[int]:
        return [i for i in range(len(self._endpoints)) if i not in self._removed]

    # --- membership (refit_grpc.driver.membership) --------------------------------------------

    def add(self, worker: WorkerEndpoint | Mapping[str, Any]) -> None:
        """Add a worker; it joins at the next epoch boundary: the next `refit()` prepares it,
        forms the group again with it, and its first epoch (a full one) brings it to the
        fleet's version.

        Args:
            worker: its endpoint, or Dynamo-style metadata.

        Raises:
            InvalidArgumentError: an instance id the fleet already has.
            FleetStateError: FLEET_CLOSED.
        """
        return membership.add(self, worker)

    def remove(self, instance_id: str) -> None:
        """Remove a worker; it leaves at the next epoch boundary (the next `refit()` forms the
        group without it). It is not called again: it keeps serving what it holds.

        Args:
            instance_id: the worker's instance id.

        Raises:
            InvalidArgumentError: no such worker, or it is the last one.
        """
        return membership.remove(self, instance_id)

    def sync(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]]
             ) -> tuple[list[str], list[str]]:
        """Follow a discovered membership (a workers file an operator edits, Dynamo's worker
        list): add the workers that appeared, remove those that disappeared. A worker whose
        address changed is removed and added again (a new instance). Takes effect at the next
        epoch boundary, as `add()` and `remove()`.

        Args:
            workers: the membership as discovered now.

        Returns:
            (instance ids added, instance ids removed).
        """
        return membership.sync(self, workers)

    def client_copy(self) -> Fleet:
        """A copy to ship to rollout actors: endpoints and configuration only.

        Returns:
            A new `Fleet` on the same shims, with no validator, plan or group.
        """
        return Fleet(self.endpoints, self.config)

    def __getstate__(self) -> dict:
        return {"endpoints": self.endpoints, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        Fleet.__init__(self, state["endpoints"], state["config"])

    @property
    def state(self) -> FleetState:
        """The fleet's state, derived from what it holds, never stored.

        Returns:
            CLOSED, else CONNECTED with a data group, else PREPARED with a plan, else EMPTY.
        """
        if self._closed:
            return FleetState.CLOSED
        if self._group_id is not None:
            return FleetState.CONNECTED
        return FleetState.PREPARED if self._plan is not None else FleetState.EMPTY

    def _plan_for(self, what: str, allowed: tuple[FleetState, ...]) -> RefitPlan:
        """The prepared plan, for a call allowed in `allowed` states (else FleetStateError)."""
        refuse_unless(self.state, allowed, what)
        assert self._plan is not None  # every state a plan-needing call allows has one
        return self._plan

    def _drop_group(self) -> None:
        """The data group is gone (an epoch gave up, or a formation failed): the shims tore
        their ends down, so the next epoch must form a new one."""
        self._group_id = None
        self._joined_instances = None
        self._group_members = None

    @property
    def members(self) -> tuple[WorkerEndpoint, ...]:
        """The workers the data group is formed of: every worker but those `left_behind`."""
        return membership.members(self)

    @property
    def left_behind(self) -> dict[str, WorkerFailure]:
        """Workers a staged epoch went on without (`refit(mode="staged", min_engines=...)`),
        with why; they serve the version they had and are left out of every later group until
        `readmit()`."""
        return membership.left_behind(self)

    def readmit(self, instance_id: str) -> None:
        """Bring a worker left behind back into the fleet: the next `refit()` prepares it and
        forms the group with it (its next epoch is a full one, so it catches up to the fleet's
        version).

        Args:
            instance_id: the worker's instance id, as in `left_behind`.

        Raises:
            InvalidArgumentError: the worker is not left behind.
        """
        return membership.readmit(self, instance_id)

    # --- catch-up from a peer (refit_grpc.driver.membership, .catch_up) -------------------------

    def catch_up(self, instance_id: str, *, timeout_s: float | None = None,
                 pause_mode: PauseMode = PauseMode.KEEP) -> CatchUpReport:
        """Bring a worker to the fleet's version from a member's committed copy, without the
        trainer in the transfer (docs/protocol.md, "Catch-up from a peer"): a worker just
        added, one restarted, one left behind. The fleet's last epoch must have been staged
        (members keep its copy); the worker is prepared first if it has no plan, leaves its
        data group for the catch-up, and joins the next epoch's group at the fleet's version
        (a worker left behind is readmitted). On failure it is as it was, and the next epoch
        brings it to the fleet's version as for any member.

        Args:
            instance_id: the worker, a member or left behind.
            timeout_s: each attempt's deadline; by default the epoch timeout.
            pause_mode: how it pauses its requests for the load.

        Returns:
            What the catch-up did (`CatchUpReport`).

        Raises:
            CatchUpError: NO_CATCH_UP_PEER (no member holds the fleet's version), or
                CATCH_UP_FAILED (every peer tried failed, each named).
            FleetStateError: no plan, or the fleet is closed.
        """
        return membership.catch_up(self, instance_id, timeout_s=timeout_s,
                                   pause_mode=pause_mode)

    def catch_up_async(self, instance_id: str, *, timeout_s: float | None = None,
                       pause_mode: PauseMode = PauseMode.KEEP) -> Future[CatchUpReport]:
        """`catch_up()` on a thread of the fleet's own: the trainer goes on (training, or
        anything but another call on this fleet) while the bytes move between two engines.
        The next epoch (or `catch_up()`) waits for it first: a peer cannot take the next
        version into its copy while it serves this one.

        Returns:
            A future of the `CatchUpReport` (or its `CatchUpError`).

        Raises:
            CatchUpError: NO_CATCH_UP_PEER, at once.
        """
        return membership.catch_up_async(self, instance_id, timeout_s=timeout_s,
                                         pause_mode=pause_mode)

    def _current_links(self) -> list[WorkerLink]:
        return [self._workers[i] for i in self._current()]

    def _member_links(self, indexes: Sequence[int] | None = None) -> list[WorkerLink]:
        return [self._workers[i] for i in (self._members if indexes is None else indexes)]

    @property
    def inference_world_size(self) -> int:
        """The engines' ranks in the group: members x `engine_world_size`."""
        return len(self._members) * self.config.engine_world_size

    @property
    def sender_spec(self) -> Packing:
        """The packing contract, without I/O.

        Returns:
            The configured packing, or the one `negotiate_packing()` (which `prepare()` calls)
            agreed with the shims.

        Raises:
            FleetStateError: FLEET_NOT_PREPARED, the packing is not known yet.
        """
        if self._packing is None:
            raise FleetStateError("the packing is not known yet: pass packing= to Fleet, or "
                                  "call prepare() or negotiate_packing() first",
                                  reason=Reason.FLEET_NOT_PREPARED)
        return self._packing

    def negotiate_packing(self) -> Packing:
        """The packing every receiver splits buckets by, agreed once with the shims.

        Returns:
            The configured packing, or the one every shim offers (one Describe round).

        Raises:
            FleetError: the shims offer different packings (receivers would mis-split bytes
                silently), or a Describe failed.
        """
        if self._packing is None:
            offers = {(d.packing.buffer_size_bytes, d.packing.num_buffers)
                      for d in self.describe(weights_digest=False)}
            if len(offers) != 1:
                raise FleetError(f"shims offer different packings {sorted(offers)}; "
                                 "pass packing= to Fleet", [])
            size, n = offers.pop()
            self._packing = Packing(size, n)
        return self._packing

    @property
    def plan(self) -> RefitPlan | None:
        """The plan of the last `prepare()`, or None before it."""
        return self._plan

    @property
    def group_id(self) -> str | None:
        """The data group of the last `init_collective()` (its store prefix).

        Returns:
            What a trainer rank joining on its own needs (`collective.Group.join`); None before
            any formation, or after a failed epoch.
        """
        return self._group_id

    def prepare(self, state_dict_info: Mapping[str, tuple[Sequence[int], Any]]) -> RefitPlan:
        """Store the plan on every shim.

        Args:
            state_dict_info: `{name: (shape, dtype)}` in packing order (dtype a torch.dtype or
                its name).

        Returns:
            The plan, whose digest every shim computed alike.

        Raises:
            FleetStateError: FLEET_CLOSED.
            InvalidArgumentError: no plan (INVALID_PLAN) or a malformed one.
            FleetError: a shim refused or failed, or computed another digest
                (PLAN_DIGEST_MISMATCH).
        """
        refuse_unless(self.state, _OPEN, "prepare()")
        if state_dict_info is None:
            raise InvalidArgumentError("state_dict_info is None", reason=Reason.INVALID_PLAN)
        plan = RefitPlan.from_state_dict_info(state_dict_info, self.negotiate_packing())
        self._prepare_on(plan, self._member_links())
        self._plan = plan
        return plan

    def _prepare_request(self, plan: RefitPlan | None = None) -> pb.PrepareRequest:
        plan = plan or self._plan
        assert plan is not None
        return pb.PrepareRequest(
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=DTYPE_TO_PROTO[s.dtype])
                     for s in plan.tensors],
            packing=pb.Packing(buffer_size_bytes=plan.packing.buffer_size_bytes,
                               num_buffers=plan.packing.num_buffers))

    def _prepare_on(self, plan: RefitPlan, links: Sequence[WorkerLink]) -> None:
        """Prepare `plan` on `links` (a no-op on a shim that holds it already)."""
        request = self._prepare_request(plan)
        answers = self.calls.all("Prepare", links, lambda w: request, "prepare failed")
        self._check_prepared(links, answers, plan)

    def _check_prepared(self, links: Sequence[WorkerLink],
                        answers: Sequence[pb.PrepareResponse],
                        plan: RefitPlan | None = None) -> None:
        """Every shim computed the driver's plan digest (else PLAN_DIGEST_MISMATCH)."""
        plan = plan or self._plan
        assert plan is not None
        bad = [WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                             grpc.StatusCode.FAILED_PRECONDITION, Reason.PLAN_DIGEST_MISMATCH,
                             f"shim computed {a.plan_digest[:16]}, driver {plan.digest[:16]}")
               for w, a in zip(links, answers) if a.plan_digest != plan.digest]
        if bad:
            raise FleetError("shims disagree on the plan digest", bad,
                             reason=Reason.PLAN_DIGEST_MISMATCH)

    def init_collective(self, ip: str, port: int, world_size: int, *,
                        train_world_size: int, group_id: str | None = None) -> list[Future]:
        """Ask every shim to join the group, without waiting: the rendezvous completes only once
        the trainer ranks join too.

        Args:
            ip: the trainer's rank 0 address, where its store listens.
            port: where that store already listens, or will: shims retry until it does, within
                the join deadline. To leave no window between picking a port and binding it,
                bind first (`collective.bind_master_store(ip, 0, ...)`, then `store.port`);
                `connect()` does that itself.
            world_size: `train_world_size + inference_world_size`.
            train_world_size: the trainer's ranks (they come first).
            group_id: the group's name (its store prefix, what every rank joins under); by
                default a fresh random one per call. A caller that passes its own must keep it
                unique per formation (docs/protocol.md, "Group names").

        Returns:
            One future per worker, in fleet order, resolving to its JOINED message or raising
            `FleetError` naming it.

        Raises:
            FleetStateError: no plan (FLEET_NOT_PREPARED) or FLEET_CLOSED.
            InvalidArgumentError: an empty group_id, a port out of range or a world size that
                does not add up.
            MembershipRefusedError: the workers changed since the last formation.
        """
        if group_id is not None and not group_id:
            raise InvalidArgumentError("group_id is empty", reason=Reason.INVALID_GROUP_ID)
        if not 0 < port < 65536:
            raise InvalidArgumentError(
                f"master_port {port} out of range: init_collective needs the port the trainer's "
                "store listens on (connect() binds one itself with port 0)",
                reason=Reason.INVALID_MASTER_PORT)
        plan = self._plan_for("init_collective()", _PREPARED)
        if world_size != train_world_size + self.inference_world_size:
            raise InvalidArgumentError(
                f"world_size {world_size} != train_world_size {train_world_size} + "
                f"inference_world_size {self.inference_world_size}",
                reason=Reason.INVALID_WORLD_SIZE)
        self._check_membership()
        links = self._member_links()
        self._joined_instances = tuple(d.instance_id for d in self.calls.all(
            "Describe", links, lambda w: pb.DescribeRequest(skip_weights_digest=True),
            "describe failed"))
        group_id = group_id or f"refit-{uuid.uuid4().hex[:12]}"
        requests = [pb.InitCollectiveRequest(
            master_address=ip, master_port=port, world_size=world_size,
            rank_offset=train_world_size + i * self.config.engine_world_size,
            backend=BACKEND_FROM_NAME[self.config.backend], group_id=group_id,
            plan_digest=plan.digest) for i in range(len(links))]
        futures = self.calls.join(links, requests)
        self._group_id = group_id
        self._group_members = tuple(self._members)
        return futures

    def connect(self, ip: str, port: int = 0, *, train_world_size: int = 1,
                device: torch.device | int | None = None) -> TrainerLink:
        """Form the group: every shim joins (InitCollective) and this process joins as trainer
        rank 0, through the project's own group (gloo) or vLLM's NCCL rendezvous (nccl).

        Args:
            ip: this process's address, where its rendezvous store listens.
            port: the store's port, bound before any shim is told where; with 0, the default,
                the kernel picks a free port as the store binds it, so no other process can
                take it in between.
            train_world_size: must be 1 (several trainer ranks: `init_collective()`).
            device: nccl only, the GPU to send from.

        Returns:
            The trainer's end of the group (`link.port` says the port); pass it to `refit()`.

        Raises:
            FleetStateError: no plan (FLEET_NOT_PREPARED) or FLEET_CLOSED.
            InvalidArgumentError: train_world_size other than 1, or nccl without CUDA
                (BACKEND_UNAVAILABLE).
            FleetError: a shim or this process could not join (the fleet is aborted first).
        """
        if train_world_size != 1:
            raise InvalidArgumentError("connect() joins as the only trainer rank; with several "
                                       "trainer ranks call init_collective() and join each rank")
        if self.config.backend == "nccl" and not torch.cuda.is_available():
            # Before any shim is asked to join: they would wait for a rank 0 that never comes.
            raise InvalidArgumentError("backend nccl needs CUDA in the trainer",
                                       reason=Reason.BACKEND_UNAVAILABLE)
        plan = self._plan_for("connect()", _PREPARED)
        world = train_world_size + self.inference_world_size
        # This process's end of the rendezvous listens before any shim is told where.
        store: TCPStore | None = None
        listener: socket.socket | None = None
        if self.config.backend == "nccl":
            from refit_grpc.driver.nccl import NcclLink, NcclSender, listen

            listener = listen(ip, port)  # vLLM's store takes it over
            port = listener.getsockname()[1]
        else:
            store = bind_master_store(ip, port, world, self.config.join_timeout_s)
            port = store.port
        links = self._member_links()
        try:
            futures = self.init_collective(ip, port, world, train_world_size=train_world_size)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        # The first shim whose join fails ends the trainer's wait for the others at once
        # (gloo: `Group.join`'s cancel), and is named first.
        failed_first = _FailureOrder(futures)
        try:
            if listener is not None:
                link: TrainerLink = NcclLink(NcclSender.connect(
                    ip, port, world, plan, self.config.join_timeout_s, device, listen_socket=listener),
                    port)
            else:
                link = GlooLink(Group.join(GroupSpec(ip, port, world, 0, self.config.backend,
                                                     self._group_id or ""),
                                           self.config.join_timeout_s, store=store,
                                           cancel=failed_first.any_failed), plan)
        except RefitError as e:
            causes = failed_first.futures()
            self.abort("trainer failed to join")
            failures = self._join_failures(futures, links, causes, e, train_world_size)
            if causes:
                message = (f"{failures[0].instance_id}'s join failed, so the trainer gave the "
                           f"rendezvous up: {failures[0].message}")
            else:
                message = f"trainer rank 0 could not join: {e}"
            raise FleetError(message, failures,
                             reason=failures[0].reason if causes else e.reason) from e
        failures = self._collect(futures, self.config.join_timeout_s, links)
        if failures:
            link.close()
            self.abort("join failed")
            raise FleetError("InitCollective failed", failures, reason=failures[0].reason)
        return link

    def update_weights(self, version: int | None = None,
                       pause_mode: PauseMode = PauseMode.KEEP,
                       on_progress: ProgressCallback | None = None, *,
                       verify_weights: bool = False,
                       canary: Canary | None = None,
                       mode: EpochMode = EpochMode.IN_PLACE) -> EpochHandle:
        """Open an epoch on every shim, without waiting for it.

        Args:
            version: the epoch's version; by default the last one + 1.
            pause_mode: how the engines pause their requests for the epoch.
            on_progress: called for each PROGRESS message (a bucket applied).
            verify_weights: every engine reports its weights digest in COMMITTED (it reads
                every weight).
            canary: every engine computes its log-probabilities after the commit and reports
                them in COMMITTED (`check_canary` compares them).
            mode: IN_PLACE, or STAGED: the streams end at STAGED (`EpochHandle.settle()`) and
                each engine switches only at its Flip (`refit(mode=STAGED)` does it all).

        Returns:
            The handle the trainer waits on while it broadcasts (`wait_accepted()`, then
            `result()`, or `settle()` for a staged epoch).

        Raises:
            FleetStateError: not CONNECTED (FLEET_NOT_PREPARED, FLEET_NOT_CONNECTED,
                FLEET_CLOSED).
            MembershipRefusedError: the workers changed since the group formed.
        """
        return self._open_epoch(version, pause_mode, on_progress, verify_weights, canary,
                                EpochMode(mode))

    def _open_epoch(self, version: int | None, pause_mode: PauseMode,
                    on_progress: ProgressCallback | None, verify_weights: bool,
                    canary: Canary | None, mode: EpochMode,
                    delta_base: tuple[int, str] | None = None) -> EpochHandle:
        plan = self._plan_for("update_weights()", (FleetState.CONNECTED,))
        membership.settle_catch_ups(self)
        self._check_membership()
        self._committed = None  # the epoch overwrites (staged) or ends (in place) the copies
        version = self._version + 1 if version is None else version
        # Opened, not committed: the default of the next epoch moves on either way, since a shim
        # refuses a repeated version only once it has committed it.
        self._version = max(self._version, version)
        # Each shim checks it is still the instance that joined (no Describe round trip first).
        links = self._member_links(self._group_members)
        joined = self._joined_instances or ("",) * len(links)
        requests = [pb.UpdateWeightsRequest(version=version, plan_digest=plan.digest,
                                            group_id=self._group_id,
                                            pause_mode=PAUSE_MODE_TO_PROTO[pause_mode],
                                            instance_id=instance_id,
                                            verify_weights=verify_weights,
                                            canary=canary.to_proto() if canary else None,
                                            mode=EPOCH_MODE_TO_PROTO[mode],
                                            flip_timeout_s=self.config.flip_timeout_s
                                            if mode is EpochMode.STAGED else 0.0,
                                            delta_base_version=delta_base[0] if delta_base
                                            else 0,
                                            delta_base_digest=delta_base[1] if delta_base
                                            else "")
                    for instance_id in joined]
        refuse_unless(self.state, (FleetState.CONNECTED,), "update_weights()")
        handle = EpochHandle(links, version, requests, self.config.epoch_timeout_s,
                             self._abort_epoch, on_progress, streams=self.calls.streams)
        with self._epochs_lock:
            # Finished epochs are dropped here, so a long run keeps only the open ones.
            self._epochs = [e for e in self._epochs if not e.closed] + [handle]
        return handle

    def refit(self, link: TrainerLink, tensors: Mapping[str, torch.Tensor],
              version: int | None = None, *, flush: bool = True,
              pause_mode: PauseMode = PauseMode.KEEP,
              on_progress: ProgressCallback | None = None,
              verify_weights: bool = False,
              canary: Canary | None = None,
              mode: EpochMode | str = EpochMode.IN_PLACE,
              min_engines: int | None = None, delta: bool = False) -> EpochReport:
        """One whole epoch, in place or staged.

        In place (the default): UpdateWeights everywhere, wait for every ACCEPTED, broadcast,
        wait for every COMMITTED, then (by default) flush so engines serve the new weights.
        Every engine stops generating for the whole transfer; no extra memory.

        Staged (`mode="staged"`): the engines keep serving the old version while the bytes land
        in their staging copies; once at least `min_engines` STAGED the trainer's staged digest,
        each is told to flip (pause, load, resume: the stall is the flip alone). A failure
        before that costs nothing: the engines serve the old version, never paused. An engine
        that fails before its flip (dead, refusing, a wrong digest) is left behind
        (`left_behind`, the report's `left_behind`) and the others go on: those that had not
        staged yet get the bytes again over a group re-formed without it.

        Args:
            link: the trainer's end of the group, from `connect()`.
            tensors: the weights, `{name: tensor}` as the plan names them.
            version: the epoch's version; by default the last one + 1.
            flush: in place: flush every engine after the commit, so it serves the new weights
                (a staged flip clears the caches and resumes itself).
            pause_mode: how the engines pause their requests (in place: for the epoch;
                staged: for the flip).
            on_progress: called for each PROGRESS message (a bucket applied or staged).
            verify_weights: every engine computes its weights digest at commit (staged: at the
                flip); engines that disagree raise WeightsMismatchError, before any engine
                serves the new weights: they stay paused on it until the operator decides.
            canary: after the commit (staged: after the flip's load), before any engine serves
                again, every engine computes the canary's teacher-forced log-probabilities;
                each engine's gap is in the report (`WorkerReport.canary_gap`).
            mode: `EpochMode.IN_PLACE` / "in_place" or `EpochMode.STAGED` / "staged".
            min_engines: staged only: how many engines must stage the new version for the
                fleet to flip; by default every member.
            delta: staged only: send each bucket as what changed since the last staged epoch
                (`refit_grpc.delta`) when every member's committed copy is that epoch's (its
                version and staged digest, fenced by the shims too); otherwise, and on the
                first such epoch, a full one. The fleet then keeps one copy of the last version
                sent (`delta_base_bytes`).

        Returns:
            The epoch's report: version, bytes, times, one `WorkerReport` per engine that
            committed, and (staged) the engines left behind.

        Raises:
            InvalidArgumentError: tensors that do not match the plan (before any shim pauses),
                a bad `mode` or `min_engines` (INVALID_MIN_ENGINES).
            FleetStateError: not CONNECTED.
            EpochRefusedError: in place: refused before any byte moved
                (`MembershipRefusedError` when a worker restarted since the group formed); the
                group is dropped.
            EpochFailedError: in place: failed mid-broadcast; the fleet is aborted.
            QuorumError: staged: fewer than `min_engines` staged the new version (nothing
                flipped), or fewer flipped.
            FleetTimeoutError: the epoch ran past `epoch_timeout_s`.
            WeightsMismatchError: engines' digests disagree (`verify_weights`).
            CanaryMismatchError: an engine farther from the trainer's log-probabilities than
                `canary.tolerance` at any position, or unable to compute them.
            FleetError: the flush failed.
        """
        try:
            mode = EpochMode(mode)
        except ValueError:
            raise InvalidArgumentError(f"mode must be one of {[m.value for m in EpochMode]}, "
                                       f"got {mode!r}", reason=Reason.INVALID_EPOCH_MODE) from None
        link.sender.check_tensors(tensors)  # refuse bad input before any shim pauses
        if delta and mode is not EpochMode.STAGED:
            raise InvalidArgumentError("delta=True is for staged epochs (mode=\"staged\")",
                                       reason=Reason.INVALID_DELTA)
        membership.settle_catch_ups(self)
        gone: dict[int, WorkerFailure] = {}
        if self.state is FleetState.CONNECTED and self._group_members != tuple(self._members):
            # Members changed (added, removed, left behind, caught up): the group is formed
            # again of the members (the trainer calls nothing else; only the gloo link can). A
            # staged epoch leaves behind the members that cannot take part any more.
            gone = staged.reform(self, link, self._members, leave_behind=mode is EpochMode.STAGED)
        if mode is EpochMode.STAGED:
            return staged.refit_staged(self, link, tensors, version, pause_mode, on_progress,
                                       verify_weights, canary, min_engines, delta, gone)
        if min_engines is not None:
            raise InvalidArgumentError("min_engines is for staged epochs: an in-place epoch "
                                       "cannot leave an engine behind unharmed",
                                       reason=Reason.INVALID_MIN_ENGINES)
        t0 = time.monotonic()
        handle = self.update_weights(version, pause_mode, on_progress,
                                     verify_weights=verify_weights, canary=canary)
        links = self._member_links(self._group_members)
        try:
            handle.wait_accepted()
        except FleetError:
            link.close()  # the shims tore their ends down; this group is finished
            self._drop_group()
            raise
        deadline = handle.send_deadline()
        try:
            stats = link.sender.send(tensors, deadline)
        except RefitError as e:
            link.close()
            self._drop_group()
            handle.abort(f"epoch {handle.version}: broadcast failed")
            try:
                handle.result(timeout_s=5.0)
            except FleetError as fe:
                raise EpochFailedError(f"broadcast failed ({e})", fe.failures,
                                       reason=e.reason) from e
            raise EpochFailedError(f"broadcast failed ({e})", [], reason=e.reason) from e
        try:
            committed = handle.result()
        except FleetError:
            link.close()
            self._drop_group()
            raise
        seconds = time.monotonic() - t0
        if verify_weights:
            self._check_same_weights(handle.version, committed, links)
        if canary is not None:
            self.check_canary(handle.version, canary, committed, links)
        if flush:
            self.flush_cache()
        return EpochReport(
            version=handle.version, bytes=stats.bytes, seconds=seconds,
            broadcast_seconds=stats.seconds,
            workers=tuple(WorkerReport(w.endpoint.instance_id, m.seconds, m.bytes_received,
                                       m.weights_digest,
                                       canary.gap(m.canary) if canary else None,
                                       m.canary.seconds if canary else None)
                          for w, m in zip(links, committed)))

    @property
    def delta_base_bytes(self) -> int:
        """Host memory the fleet keeps for delta epochs: one copy of the last version sent
        (`refit(delta=True)`); 0 when none."""
        return staged.delta_base_bytes(self)

    def flip(self, handle: EpochHandle, staged_digest: str | None = None, *,
             min_engines: int | None = None, pause_mode: PauseMode = PauseMode.KEEP,
             verify_weights: bool = False, canary: Canary | None = None) -> EpochReport:
        """End a staged epoch opened with `update_weights(mode=STAGED)`, for trainers that
        broadcast themselves (several trainer ranks, the Ray channel): wait for its streams,
        then flip every engine that STAGED `staged_digest` when at least `min_engines` did.
        Unlike `refit(mode="staged")` it cannot send again, so the engines that failed are left
        behind without another round.

        Args:
            handle: the staged epoch.
            staged_digest: the trainer's digest of what it sent (`refit_grpc.staging`, e.g. the
                `StagedDigest` given to `Sender.send(checksums=...)`); None: the digest most
                engines staged (they agree with each other, not proven equal to the trainer).
            min_engines: how many must have staged it; by default every engine of the epoch.
            pause_mode: how the engines pause their requests for the flip.
            verify_weights: as the epoch was opened (every engine's digest compared).
            canary: the canary the epoch was opened with, if any (its tolerance is applied).

        Returns:
            The epoch's report (`EpochReport.left_behind` names who did not flip).

        Raises:
            InvalidArgumentError: not a staged epoch, or `min_engines` out of range.
            QuorumError: fewer than `min_engines` staged it (nothing flipped) or flipped.
            WeightsMismatchError, CanaryMismatchError: as `refit()`.
        """
        return staged.flip_epoch(self, handle, staged_digest, min_engines=min_engines,
                                 pause_mode=pause_mode, verify_weights=verify_weights,
                                 canary=canary)

    def flush_cache(self, mode: PauseMode = PauseMode.WAIT) -> bool:
        """Drain, clear the KV/prefix cache and resume, on every shim in parallel.

        Args:
            mode: how in-flight requests are paused while the cache is cleared.

        Returns:
            True (NeMo RL's channel's return), once every shim resumed.

        Raises:
            FleetError: every shim that failed, together (a BROKEN shim refuses to resume).
        """
        request = pb.FlushRequest(mode=PAUSE_MODE_TO_PROTO[mode])
        self.calls.all("Flush", self._member_links(), lambda w: request, "flush failed")
        return True

    def describe(self, weights_digest: bool = True) -> list[pb.DescribeResponse]:
        """Describe on every shim in parallel.

        Args:
            weights_digest: each shim also computes its engine's weights digest (reads every
                weight).

        Returns:
            One answer per worker, in fleet order.

        Raises:
            FleetError: every shim that failed, together (`describe_each()` does not raise).
        """
        request = pb.DescribeRequest(skip_weights_digest=not weights_digest)
        return self.calls.all("Describe", self._current_links(), lambda w: request,
                              "describe failed")

    def describe_each(self, weights_digest: bool = True) -> list[pb.DescribeResponse | WorkerFailure]:
        """Describe on every shim in parallel, for status views, where one dead shim must not hide
        the others; `describe()` raises instead.

        Args:
            weights_digest: each shim also computes its engine's weights digest.

        Returns:
            One entry per worker, in fleet order: its answer, or the `WorkerFailure` that says
            why there is none.
        """
        request = pb.DescribeRequest(skip_weights_digest=not weights_digest)
        return self.calls.each("Describe", self._current_links(), lambda w: request)

    def abort(self, reason: str = "aborted by driver") -> list[pb.AbortResponse | None]:
        """Abort on every shim in parallel; best effort, never raises, never retries, and bounded
        by `abort_timeout_s`: a dead or frozen shim must not hold up the others' abort.

        Args:
            reason: recorded by every shim (its logs and Describe).

        Returns:
            One entry per worker, in fleet order: its answer, or None when it did not answer.
        """
        return self.calls.abort(reason, self._current_links())

    def _abort_epoch(self, reason: str, links: Sequence[WorkerLink]
                     ) -> list[pb.AbortResponse | None]:
        """An epoch gave up: the shims it aborts drop their group, so this fleet has none either
        (the next epoch needs init_collective/connect first, said before any RPC)."""
        self._drop_group()
        return self.calls.abort(reason, links)

    def close(self) -> None:
        """End every open epoch (its streams cancelled, its threads joined), then the channels."""
        self._closed = True
        with self._epochs_lock:
            epochs, self._epochs = self._epochs, []
        for epoch in epochs:
            epoch.close()
        self._catch_up_pool.shutdown(wait=False, cancel_futures=True)
        # Every consumer has ended when its epoch closed (bounded); then only idle threads are
        # left, and waiting for them is immediate. A consumer still running is not waited for.
        self.calls.close(wait_for_streams=all(e.closed for e in epochs))

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------------

    def _join_failures(self, futures: list[Future], links: Sequence[WorkerLink],
                       causes: Sequence[Future], error: RefitError,
                       train_world_size: int) -> list[WorkerFailure]:
        """Why a formation failed, the causes first: the shims whose joins failed before the
        trainer gave up (in the order they failed), then those that never reached the
        trainer's store (`RendezvousTimeoutError.missing_ranks`), then the rest (those the
        abort ended, root causes first)."""
        first = {id(f) for f in causes}
        missing: list[WorkerFailure] = []
        seen: set[int] = set()
        for rank in getattr(error, "missing_ranks", ()):
            i = (rank - train_world_size) // self.config.engine_world_size
            if 0 <= i < len(links) and i not in seen and id(futures[i]) not in first:
                seen.add(i)
                e = links[i].endpoint
                missing.append(WorkerFailure(
                    e.instance_id, e.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                    Reason.RENDEZVOUS_TIMEOUT,
                    f"rank {rank} never reached the trainer's rendezvous store"))
        order = {id(f): k for k, f in enumerate(causes)}
        by_future = sorted(range(len(futures)), key=lambda i: order.get(id(futures[i]),
                                                                          len(order) + i))
        end = time.monotonic() + 5.0  # one bound for all: the abort ended every join
        cause_failures: list[WorkerFailure] = []
        rest: list[WorkerFailure] = []
        for i in by_future:
            if i in seen:
                continue
            got = self._collect([futures[i]], max(end - time.monotonic(), 0.001), [links[i]])
            (cause_failures if id(futures[i]) in first else rest).extend(got)
        return cause_failures + missing + root_causes_first(rest)

    def _collect(self, futures: list[Future], timeout_s: float,
                 links: Sequence[WorkerLink]) -> list[WorkerFailure]:
        failures = []
        end = time.monotonic() + timeout_s
        for w, f in zip(links, futures):
            try:
                f.result(timeout=max(end - time.monotonic(), 0.001))
            except FleetError as e:
                failures += e.failures or [WorkerFailure(
                    w.endpoint.instance_id, w.endpoint.address, grpc.StatusCode.UNKNOWN,
                    e.reason, e.message)]
            except TimeoutError:
                failures.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                              grpc.StatusCode.DEADLINE_EXCEEDED,
                                              Reason.JOIN_TIMEOUT,
                                              "no JOINED in time"))
        return failures

    def check_canary(self, version: int, canary: Canary,
                     committed: Sequence[pb.UpdateWeightsResponse],
                     links: Sequence[WorkerLink] | None = None) -> None:
        """Compare every engine's canary log-probabilities with the trainer's.

        Args:
            version: the epoch's version, for the message.
            canary: the canary the epoch carried (the trainer's log-probabilities, the
                tolerance).
            committed: one COMMITTED per worker, in fleet order.
            links: the workers `committed` answers for; by default the group's members.

        Raises:
            CanaryMismatchError: naming every engine whose canary log-probabilities are farther
                than `canary.tolerance` from the trainer's (or missing), with every engine's gap.
        """
        links = self._member_links(self._group_members) if links is None else links
        gaps = {w.endpoint.instance_id: canary.gap(m.canary) for w, m in zip(links, committed)}
        odd = []
        for w, m in zip(links, committed):
            gap = gaps[w.endpoint.instance_id]
            if gap <= canary.tolerance:
                continue
            why = (f"no canary computed: {m.canary.error}" if m.canary.error
                   else f"log-probabilities {gap:.3g} from the trainer's at worst "
                        f"(tolerance {canary.tolerance:g})")
            odd.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                     grpc.StatusCode.DATA_LOSS, Reason.CANARY_MISMATCH,
                                     f"version {version}: {why}"))
        if odd:
            raise CanaryMismatchError(
                f"epoch {version}: engines compute other log-probabilities than the trainer's; "
                "left paused, not flushed", odd, gaps=gaps)

    def _check_same_weights(self, version: int, committed: Sequence[pb.UpdateWeightsResponse],
                            links: Sequence[WorkerLink]) -> None:
        """Every engine of the epoch must report the same weights digest. The largest group of
        equal digests is taken as the fleet's; every other engine is named (with two engines
        that disagree, both are)."""
        digests = [m.weights_digest for m in committed]
        majority, odd_indexes = odd_digests(digests)
        if not odd_indexes:
            return
        odd = [WorkerFailure(links[i].endpoint.instance_id,
                             links[i].endpoint.address, grpc.StatusCode.DATA_LOSS,
                             Reason.WEIGHTS_MISMATCH,
                             f"weights digest {digests[i][:16] or '(none)'} at version {version}"
                             + (f", the fleet's is {majority[:16]}" if majority else ""))
               for i in odd_indexes]
        raise WeightsMismatchError(f"epoch {version}: engines hold different weights; left "
                                   "paused, not flushed", odd)

    def _check_membership(self) -> None:
        """Refuse a fleet whose membership changed since InitCollective (docs/protocol.md,
        invariant 5), as the `validate_workers` hook sees it. A shim restarted since it joined
        refuses the epoch itself (UpdateWeightsRequest.instance_id)."""
        if self.validate_workers is not None:
            original = [{"instance_id": e.instance_id, "address": e.address}
                        for e in self.endpoints]
            current = self.validate_workers([dict(m) for m in original])
            changed = [WorkerFailure(str(c.get("instance_id")), str(c.get("address")),
                                     grpc.StatusCode.FAILED_PRECONDITION,
                                     Reason.MEMBERSHIP_CHANGED,
                                     "validate_workers reported a change")
                       for o, c in zip(original, current) if dict(o) != dict(c)]
            if len(current) != len(original) or changed:
                raise MembershipChangedError(
                    "membership changed after collective setup: "
                    + ("; ".join(map(str, changed)) if changed else str(current)))
