"""The trainer's view of the fleet: one stub per shim, deadlines, retries, epochs.

Its surface mirrors NeMo RL's `DynamoRefitChannel` (`nemo_rl.models.generation.dynamo.refit`:
the HTTP-JSON refit over Dynamo's RL routes that this project replaces; the code and docs call
it "NeMo RL's channel") so trainer code written for it can switch:
`client_copy()`, `inference_world_size`, `sender_spec`, `prepare()`, `init_collective()` and
`update_weights()` returning handles, `flush_cache()`. On top: `connect()` (group + trainer join),
`refit()` (one whole epoch), `flip()`, membership (`add`, `remove`, `sync`, `readmit`,
`catch_up`), `describe()`, `abort()`.

`Fleet` is a facade: it checks the fleet's state and delegates to the collaborators that own
the state (who owns what: the `refit_grpc.driver` package docstring).

Retry policy: idempotent unary calls (Describe, Prepare, Flush) retry on UNAVAILABLE with
exponential backoff and jitter (`calls.py`). InitCollective and UpdateWeights are never retried
alone: a failed epoch is aborted fleet-wide and must be re-run as a whole (connect, then refit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from refit_grpc.canary import Canary
from refit_grpc.common import PauseMode
from refit_grpc.driver.calls import ShimCalls
from refit_grpc.driver.catch_up import CatchUpReport, CatchUps
from refit_grpc.driver.checks import Checks, canary_close
from refit_grpc.driver.config import FleetConfig, FleetState, FleetStateError, refuse_unless
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.epochs import Epochs
from refit_grpc.driver.failures import WorkerFailure
from refit_grpc.driver.groups import GroupFormation, check_formation
from refit_grpc.driver.in_place import InPlaceRound
from refit_grpc.driver.links import TrainerLink
from refit_grpc.driver.membership import Member, Membership, ValidateWorkers
from refit_grpc.driver.membership import links as links_of
from refit_grpc.driver.options import Epoch, Staged, options, reopened
from refit_grpc.driver.plans import negotiate_packing, prepare_on
from refit_grpc.driver.reports import EpochReport, RollbackReport, WorkerReport
from refit_grpc.driver.rollback import Rollbacks
from refit_grpc.driver.staged import StagedRound
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.plan import AdapterSpec, Packing, RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

# States in which a call may run: any but CLOSED; with a plan; with a group.
_OPEN = (FleetState.EMPTY, FleetState.PREPARED, FleetState.CONNECTED)
_PREPARED = (FleetState.PREPARED, FleetState.CONNECTED)
_CONNECTED = (FleetState.CONNECTED,)


class Fleet:
    """The trainer's fleet of shims: stubs with deadlines and retries, the plan, the data group
    and the epochs (module docstring; docs/trainer.md, A trainer using `Fleet`).

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
                 validate_workers: ValidateWorkers | None = None, **overrides: Any):
        if overrides.get("security", ...) is None:
            del overrides["security"]  # None: the default, as callers with no TLS pass it
        self.config = replace(config or FleetConfig(), **overrides)
        self._packing = self.config.packing  # the configured one, or negotiated once
        self._plan: RefitPlan | None = None
        self._closed = False
        self.calls = ShimCalls(self.config)
        self.membership = Membership(workers, self.calls.open, validate_workers)
        self.formation = GroupFormation(self.config, self.calls, self.membership)
        self.catch_ups = CatchUps(self.calls, self.membership)
        self.epochs = Epochs(self.config, self.calls, self.membership, self.formation,
                             self.catch_ups)
        self._in_place = InPlaceRound(self.calls, self.membership, self.formation, self.epochs)
        self._staged = StagedRound(self.calls, self.membership, self.formation, self.epochs)
        self._rollbacks = Rollbacks(self.calls, self.epochs)

    @property
    def validate_workers(self) -> ValidateWorkers | None:
        """NeMo RL's membership hook (`Membership.check_unchanged`)."""
        return self.membership.validate_workers

    @validate_workers.setter
    def validate_workers(self, hook: ValidateWorkers | None) -> None:
        self.membership.validate_workers = hook

    @property
    def state(self) -> FleetState:
        """The fleet's state, derived from what it holds, never stored: CLOSED, else CONNECTED
        with a data group, else PREPARED with a plan, else EMPTY."""
        if self._closed:
            return FleetState.CLOSED
        if self.formation.group_id is not None:
            return FleetState.CONNECTED
        return FleetState.PREPARED if self._plan is not None else FleetState.EMPTY

    def _plan_for(self, what: str, allowed: tuple[FleetState, ...]) -> RefitPlan:
        """The prepared plan, for a call allowed in `allowed` states (else FleetStateError)."""
        refuse_unless(self.state, allowed, what)
        assert self._plan is not None  # every state a plan-needing call allows has one
        return self._plan

    # --- NeMo RL's channel's surface ------------------------------------------------------

    def client_copy(self) -> Fleet:
        """A copy to ship to rollout actors: a new `Fleet` on the same shims, with endpoints
        and configuration only (no validator, plan or group)."""
        return Fleet(self.endpoints, self.config)

    def __getstate__(self) -> dict:
        return {"endpoints": self.endpoints, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        Fleet.__init__(self, state["endpoints"], state["config"])

    @property
    def inference_world_size(self) -> int:
        """The engines' ranks in the group: members x `engine_world_size`, where engines that
        share a receiving rank (a shim process serving several, Describe's `shared_rank`) count
        once. Which do is learned by the last formation's Describe round (`connect()`,
        `init_collective()`); before one, every engine counts, so a trainer whose engines share
        ranks forms with `connect()`, which counts them itself."""
        members = self.membership.members
        layout = self.formation.last_layout
        if layout is not None and layout.instances == [m.endpoint.instance_id for m in members]:
            return layout.inference_world_size
        return len(members) * self.config.engine_world_size

    @property
    def sender_spec(self) -> Packing:
        """The packing contract, without I/O: the configured packing, or the one
        `negotiate_packing()` (which `prepare()` calls) agreed with the shims.

        Raises:
            FleetStateError: FLEET_NOT_PREPARED, the packing is not known yet.
        """
        if self._packing is None:
            raise FleetStateError("the packing is not known yet: pass packing= to Fleet, or "
                                  "call prepare() or negotiate_packing() first",
                                  reason=Reason.FLEET_NOT_PREPARED)
        return self._packing

    def negotiate_packing(self) -> Packing:
        """The packing every receiver splits buckets by, agreed once with the shims: the
        configured one, or the one every shim offers (one Describe round).

        Raises:
            FleetError: the shims offer different packings (receivers would mis-split bytes
                silently), or a Describe failed.
        """
        if self._packing is None:
            self._packing = negotiate_packing(self.calls, links_of(self.membership.current))
        return self._packing

    @property
    def plan(self) -> RefitPlan | None:
        """The plan of the last `prepare()`, or None before it."""
        return self._plan

    @property
    def group_id(self) -> str | None:
        """The data group's name (its store prefix): what a trainer rank joining on its own
        needs (`dataplane.group.Group.join`); None before any formation, or after a failed epoch."""
        return self.formation.group_id

    def prepare(self, state_dict_info: Mapping[str, tuple[Sequence[int], Any]], *,
                adapter: AdapterSpec | None = None) -> RefitPlan:
        """Store the plan (`state_dict_info`: `{name: (shape, dtype)}` in packing order, dtype
        a torch.dtype or its name) on every member; returns it, its digest every shim's.

        `adapter`: the plan is a LoRA adapter's (its tensors only, PEFT's names), loaded or
        replaced in every engine under `adapter.name` by each epoch's flip, without pausing
        the engine (docs/adapters.md). Its epochs are staged.

        Raises:
            FleetStateError: FLEET_CLOSED.
            InvalidArgumentError: no plan (INVALID_PLAN) or a malformed one.
            FleetError: a shim refused or failed, or computed another digest
                (PLAN_DIGEST_MISMATCH).
        """
        refuse_unless(self.state, _OPEN, "prepare()")
        if state_dict_info is None:
            raise InvalidArgumentError("state_dict_info is None", reason=Reason.INVALID_PLAN)
        plan = RefitPlan.from_state_dict_info(state_dict_info, self.negotiate_packing(),
                                              adapter)
        prepare_on(self.calls, plan, links_of(self.membership.members))
        self._plan = plan
        return plan

    def init_collective(self, ip: str, port: int, world_size: int, *,
                        train_world_size: int, group_id: str | None = None) -> list[Future]:
        """Ask every member to join the group, without waiting: the rendezvous completes only
        once the trainer ranks join too.

        Args:
            ip: the trainer's rank 0 address, where its store listens.
            port: where that store listens, or will (shims retry within the join deadline;
                bind first, `dataplane.rendezvous.bind_master_store(ip, 0, ...)`, to leave no window).
            world_size: `train_world_size + inference_world_size`.
            train_world_size: the trainer's ranks (they come first).
            group_id: the group's name; by default a fresh random one, and a caller's own
                must be unique per formation (docs/protocol.md, "Group names").

        Returns:
            One future per member, resolving to its JOINED or raising `FleetError` naming it.

        Raises:
            FleetStateError: no plan (FLEET_NOT_PREPARED) or FLEET_CLOSED.
            InvalidArgumentError: an empty group_id, a port out of range or a world size that
                does not add up.
            MembershipChangedError: `validate_workers` reports a change.
        """
        check_formation(group_id, port)
        plan = self._plan_for("init_collective()", _PREPARED)
        return self.formation.start(self.membership.members, plan, ip, port, world_size,
                                    train_world_size, group_id)

    def connect(self, ip: str, port: int = 0, *, train_world_size: int = 1,
                device: torch.device | int | None = None) -> TrainerLink:
        """Form the group of the members: every one joins (InitCollective) and this process
        joins as trainer rank 0, through the project's own group (gloo) or vLLM's NCCL
        rendezvous (nccl).

        Args:
            ip: this process's address, where its rendezvous store listens.
            port: the store's port, bound before any shim is told where (0: the kernel's).
            train_world_size: must be 1 (several trainer ranks: `init_collective()`).
            device: nccl only, the GPU to send from.

        Returns:
            The trainer's end of the group (`link.port`); pass it to `refit()`.

        Raises:
            FleetStateError: no plan (FLEET_NOT_PREPARED), FLEET_CLOSED, or every worker is
                left behind (NO_MEMBERS).
            InvalidArgumentError: train_world_size other than 1, or nccl without CUDA
                (BACKEND_UNAVAILABLE).
            FleetError: a shim or this process could not join (the fleet is aborted first).
        """
        if train_world_size != 1:
            raise InvalidArgumentError("connect() joins as the only trainer rank; with several "
                                       "trainer ranks call init_collective() and join each rank")
        self.formation.check_backend()
        plan = self._plan_for("connect()", _PREPARED)
        return self.formation.form(self.membership.members, plan, ip, port, device=device)

    # --- epochs ---------------------------------------------------------------------------

    def update_weights(self, version: int | None = None,
                       pause_mode: PauseMode = PauseMode.KEEP,
                       on_progress: ProgressCallback | None = None, *,
                       epoch: Epoch | None = None, checks: Checks | None = None,
                       **deprecated: Any) -> EpochHandle:
        """Open an epoch on every member of the group, without waiting for it.

        Args:
            version, pause_mode, on_progress: as `refit()`'s.
            epoch: `InPlace()` (the default; the flush is the caller's, `flush_cache()`) or
                `Staged(min_engines=...)`: the streams end at STAGED, then `flip()`.
            checks: what every engine reports at commit (staged: checked at the flip).
            **deprecated: `verify_weights`, `canary`, `mode`, as before `epoch=`/`checks=`.

        Returns:
            The handle the trainer waits on while it broadcasts (`wait_accepted()`, then
            `result()`, or `flip()`).

        Raises:
            FleetStateError: not CONNECTED (FLEET_NOT_PREPARED, FLEET_NOT_CONNECTED,
                FLEET_CLOSED).
            MembershipChangedError: `validate_workers` reports a change.
        """
        epoch, checks = options("update_weights", epoch, checks, deprecated,
                                adapter=self._plan is not None and self._plan.adapter is not None)
        if isinstance(epoch, Staged):
            epoch.check_pause_mode(pause_mode)
        plan = self._plan_for("update_weights()", _CONNECTED)
        return self.epochs.open(plan, version, epoch=epoch, checks=checks,
                                pause_mode=pause_mode, on_progress=on_progress)

    def refit(self, link: TrainerLink, tensors: Mapping[str, torch.Tensor],
              version: int | None = None, *, epoch: Epoch | None = None,
              checks: Checks | None = None, pause_mode: PauseMode = PauseMode.KEEP,
              on_progress: ProgressCallback | None = None, **deprecated: Any) -> EpochReport:
        """One whole epoch (`InPlace` and `Staged` say what each does; docs/protocol.md):
        in place, every engine stops for the transfer; staged, the engines serve the old
        version while the bytes land and stall only for the flip, and one that fails before
        it is left behind while the others go on over a group re-formed without it.

        Args:
            link: the trainer's end of the group, from `connect()`.
            tensors: the weights, `{name: tensor}` as the plan names them.
            version: the epoch's version; by default the last one + 1.
            epoch: `InPlace(flush=True)` (the default) or `Staged(min_engines=, delta=)`.
            checks: `Checks(verify=, canary=)`, run before any engine serves the new version
                (engines that fail them stay paused).
            pause_mode: how the engines pause their requests (in place: for the epoch;
                staged: for the flip).
            on_progress: called for each PROGRESS message (a bucket applied or staged).
            **deprecated: `flush`, `verify_weights`, `canary`, `mode`, `min_engines`, `delta`
                (a DeprecationWarning; never with `epoch=`/`checks=`).

        Returns:
            The epoch's report: one `WorkerReport` per engine that committed, and (staged)
            the engines left behind.

        Raises:
            InvalidArgumentError: tensors that do not match the plan (before any shim pauses),
                a bad `epoch` or `min_engines` (INVALID_MIN_ENGINES).
            FleetStateError: not CONNECTED (after a staged epoch that flipped, a gloo link's
                group is formed again, even when that epoch's abort ended it).
            EpochRefusedError: in place: refused before any byte moved (`MembershipRefusedError`:
                every refusal MEMBERSHIP_CHANGED); the group is dropped.
            EpochFailedError: in place: failed mid-broadcast; the fleet is aborted.
            QuorumError: staged: fewer than `min_engines` staged (nothing flipped) or flipped.
            FleetTimeoutError: the epoch ran past `epoch_timeout_s`.
            WeightsMismatchError, CanaryMismatchError: a check failed; engines left paused.
            FleetError: the flush failed.
        """
        epoch, checks = options("refit", epoch, checks, deprecated,
                                adapter=self._plan is not None and self._plan.adapter is not None)
        if isinstance(epoch, Staged):
            epoch.check_pause_mode(pause_mode)
        link.sender.check_tensors(tensors)  # refuse bad input before any shim pauses
        self.catch_ups.settle()
        gone: dict[Member, WorkerFailure] = {}
        owed = self.formation.owes_reform(link)
        if owed or (self.state is FleetState.CONNECTED
                    and not self.membership.group_is_members()):
            # Members changed (added, removed, left behind, caught up), or the last staged
            # epoch flipped with its group gone: the group is formed again of the members (the
            # trainer calls nothing else; only the gloo link can). A staged epoch leaves
            # behind the members that cannot take part any more.
            gone = self.formation.reform(link, self.membership.members,
                                         self._plan_for("refit()", _PREPARED if owed
                                                        else _CONNECTED),
                                         leave_behind=isinstance(epoch, Staged))
        plan = self._plan_for("refit()", _CONNECTED)
        if isinstance(epoch, Staged):
            return self._staged.run(link, tensors, plan, version, epoch=epoch, checks=checks,
                                    pause_mode=pause_mode, on_progress=on_progress, gone=gone)
        return self._in_place.run(link, tensors, plan, version, epoch=epoch, checks=checks,
                                  pause_mode=pause_mode, on_progress=on_progress)

    def flip(self, handle: EpochHandle, staged_digest: str | None = None,
             **deprecated: Any) -> EpochReport:
        """End a staged epoch opened with `update_weights(epoch=Staged(...))` (a trainer that
        broadcasts itself) as it was opened (its `min_engines`, `pause_mode`, `checks`): wait
        for its streams, then flip every engine that STAGED `staged_digest` (the trainer's,
        `refit_grpc.dataplane.staging`; None: the one most staged) when at least `min_engines` did. It
        cannot send again: the engines that failed are left behind.

        Args:
            **deprecated: `min_engines`, `pause_mode`, `verify_weights`, `canary`, replacing
                what the epoch was opened with (a DeprecationWarning).

        Returns:
            The epoch's report (`EpochReport.left_behind` names who did not flip).

        Raises:
            InvalidArgumentError: not a staged epoch, or `min_engines` out of range.
            QuorumError: fewer than `min_engines` staged it (nothing flipped) or flipped.
            WeightsMismatchError, CanaryMismatchError: as `refit()`.
        """
        if not isinstance(handle.epoch, Staged):
            raise InvalidArgumentError("flip() ends a staged epoch; this one is in place",
                                       reason=Reason.INVALID_EPOCH_MODE)
        if deprecated:
            reopened(handle, deprecated)
        return self._staged.flip(handle, self._plan_for("flip()", _PREPARED), staged_digest)

    def rollback(self, pause_mode: PauseMode = PauseMode.KEEP) -> RollbackReport:
        """Take the fleet back to the version before its last flip: every member loads its
        previous copy (kept by a reversible staged epoch, `Staged(reversible=True)`), held
        paused until all did, then all resume together (docs/protocol.md, "Rollback"). The
        next epoch's version must still be newer than the one rolled back from (the default
        moves on); the next delta epoch is a full one.

        Returns:
            What was done (`RollbackReport`).

        Raises:
            RollbackError: refused before anything moved (a member that does not answer, does
                not serve the fleet's version, or keeps no previous copy: NO_PREVIOUS_COPY,
                ROLLBACK_VERSION_MISMATCH, each named), or some engines failed to roll back
                (`error.report`: the others did, and serve the old version).
            FleetStateError: the fleet is closed.
        """
        refuse_unless(self.state, _OPEN, "rollback()")
        self.catch_ups.settle()
        return self._rollbacks.fleet(self.membership.members, pause_mode)

    @property
    def delta_base_bytes(self) -> int:
        """Host memory the fleet keeps for delta epochs: one copy of the last version sent
        (`refit(delta=True)`); 0 when none."""
        base = self.epochs.delta_base
        return 0 if base is None else base.nbytes

    def check_canary(self, version: int, canary: Canary,
                     committed: Sequence[pb.UpdateWeightsResponse],
                     links: Sequence[Any] | None = None) -> None:
        """Compare every engine's canary log-probabilities (one COMMITTED per engine of
        `links`, by default the group's) with the trainer's (`checks.canary_close`).

        Raises:
            CanaryMismatchError: naming every engine out of tolerance, with every gap.
        """
        canary_close(version, canary, committed,
                     links_of(self.membership.group) if links is None else links)

    # --- membership -----------------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[WorkerEndpoint, ...]:
        """The fleet's workers, in the order they were given or added (removed ones gone)."""
        return self.membership.endpoints

    @property
    def members(self) -> tuple[WorkerEndpoint, ...]:
        """The workers the data group is formed of: every worker but those `left_behind`."""
        return tuple(m.endpoint for m in self.membership.members)

    @property
    def left_behind(self) -> dict[str, WorkerFailure]:
        """Workers a staged epoch went on without, with why; they serve the version they had
        and are left out of every later group until `readmit()`."""
        return self.membership.left_behind

    def add(self, worker: WorkerEndpoint | Mapping[str, Any]) -> None:
        """Add a worker (its endpoint, or Dynamo-style metadata): the next `refit()` prepares
        it and forms the group again with it, and its first epoch brings it up to date.

        Raises:
            InvalidArgumentError: an instance id the fleet already has.
            FleetStateError: FLEET_CLOSED.
        """
        refuse_unless(self.state, _OPEN, "add()")
        self.membership.add(worker)

    def remove(self, instance_id: str) -> None:
        """Remove a worker; it leaves at the next epoch boundary (the next `refit()` forms the
        group without it). It is not called again: it keeps serving what it holds.

        Raises:
            InvalidArgumentError: no such worker, or it is the last one.
        """
        self.membership.remove(instance_id)

    def sync(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]]
             ) -> tuple[list[str], list[str]]:
        """Follow a discovered membership (a workers file, Dynamo's worker list): add the
        workers that appeared, remove those that disappeared (one whose address changed is
        removed and added again). Takes effect at the next epoch boundary.

        Returns:
            (instance ids added, instance ids removed).
        """
        return self.membership.sync(workers)

    def readmit(self, instance_id: str) -> None:
        """Bring a worker left behind back: the next `refit()` prepares it and forms the group
        with it (its next epoch is a full one, bringing it to the fleet's version).

        Raises:
            InvalidArgumentError: the worker is not left behind.
        """
        self.membership.readmit(instance_id)

    def catch_up(self, instance_id: str, *, timeout_s: float | None = None,
                 pause_mode: PauseMode = PauseMode.KEEP) -> CatchUpReport:
        """Bring a worker (added, restarted or left behind) to the fleet's version from a
        member's committed copy, without the trainer in the transfer (docs/protocol.md,
        "Catch-up from a peer"; `CatchUps.start`): the last epoch must have been staged.
        `timeout_s`: each attempt's (default: the epoch timeout); `pause_mode`: for the load.

        Raises:
            CatchUpError: NO_CATCH_UP_PEER or CATCH_UP_FAILED (every peer tried, named).
            FleetStateError: no plan, or the fleet is closed.
        """
        report = self.catch_up_async(instance_id, timeout_s=timeout_s,
                                     pause_mode=pause_mode).result()
        self.catch_ups.settle()
        return report

    def catch_up_async(self, instance_id: str, *, timeout_s: float | None = None,
                       pause_mode: PauseMode = PauseMode.KEEP) -> Future[CatchUpReport]:
        """`catch_up()` on a thread of the fleet's own, while the trainer goes on (anything but
        another call on this fleet); the next epoch (or `catch_up()`) waits for it first.

        Returns:
            A future of the `CatchUpReport` (or its `CatchUpError`).

        Raises:
            CatchUpError: NO_CATCH_UP_PEER, at once.
        """
        plan = self._plan_for("catch_up()", _PREPARED)
        return self.catch_ups.start(instance_id, plan, self.epochs.committed,
                                    latest=self.epochs.latest,
                                    timeout_s=timeout_s or self.config.epoch_timeout_s,
                                    pause_mode=pause_mode)

    # --- every shim -----------------------------------------------------------------------

    def flush_cache(self, mode: PauseMode = PauseMode.WAIT) -> bool:
        """Drain (`mode`), clear the KV/prefix cache and resume, on every member in parallel;
        True (NeMo RL's channel's return) once every one resumed.

        Raises:
            FleetError: every shim that failed, together (a BROKEN shim refuses to resume).
        """
        self.calls.flush(links_of(self.membership.members), mode)
        return True

    def describe(self, weights_digest: bool = True) -> list[pb.DescribeResponse]:
        """Describe on every shim in parallel (`weights_digest`: each also computes its
        engine's weights digest, reading every weight): one answer per worker, in order.

        Raises:
            FleetError: every shim that failed, together (`describe_each()` does not raise).
        """
        request = pb.DescribeRequest(skip_weights_digest=not weights_digest)
        return self.calls.all("Describe", links_of(self.membership.current), lambda w: request,
                              "describe failed")

    def describe_each(self, weights_digest: bool = True) -> list[pb.DescribeResponse | WorkerFailure]:
        """Describe on every shim in parallel, for status views where one dead shim must not
        hide the others: one entry per worker, its answer or the `WorkerFailure` why none."""
        request = pb.DescribeRequest(skip_weights_digest=not weights_digest)
        return self.calls.each("Describe", links_of(self.membership.current), lambda w: request)

    def abort(self, reason: str = "aborted by driver") -> list[pb.AbortResponse | None]:
        """Abort on every shim in parallel; best effort, never raises, never retries, bounded
        by `abort_timeout_s`: one entry per worker, its answer or None."""
        return self.calls.abort(reason, links_of(self.membership.current))

    def close(self) -> None:
        """End every open epoch (its streams cancelled, its consumers ended, bounded), the
        catch-ups under way, then the channels and the driver's I/O loop."""
        self._closed = True
        self.epochs.close()
        self.catch_ups.close()
        self.calls.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EpochReport", "Fleet", "WorkerReport"]
