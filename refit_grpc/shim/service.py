"""RefitService: the shim's state machine around one engine.

The state is derived, never stored, so it cannot drift from the facts it summarises:
    RECEIVING  an in-place epoch is in flight (engine paused)
    STAGING    a staged epoch is in flight (engine serving the previous version)
    CATCHING_UP  CatchUp is receiving a peer's committed copy (engine serving what it had)
    BROKEN     weights were partly overwritten by a failed epoch or flip (engine stays paused)
    EMPTY      no plan
    STAGED     a staged version waits for its Flip (engine serving the previous version)
    READY      plan + joined data group
    PREPARED   plan, no group
Every RPC is admitted by one table (`shim/admission.py`: which state, BUSY for what, draining,
instance id) under one lock; the long parts (rendezvous, receive) run outside it, marked by
`Busy` so no two of them overlap, and one release (`_hold_locked`) ends each. The invariants
this upholds are listed, numbered, in docs/protocol.md.

This module owns the state and its transitions; the rest of the shim's work lives beside it:
`fields` (what each request field may hold, proto to plan), `receive` (an epoch's receive
thread), `canary` (checking and scoring a canary), `catch_up` (both ends of a peer's
rendezvous).

Refinement of the design: an epoch that fails before any byte reached the engine leaves the
weights intact, so the engine is resumed and the shim returns to PREPARED (group torn down), not
BROKEN. That is what lets one worker's refusal abort the others without taking them offline.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from refit_grpc.common import (
    MAX_ENGINE_WORLD_SIZE,
    MAX_REASON_CHARS,
    MAX_WORLD_SIZE,
    Deadline,
    GroupSpec,
    PauseMode,
)
from refit_grpc.errors import (
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    RefitError,
)
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import BACKEND_NAMES, pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim import catch_up
from refit_grpc.shim.admission import ADMISSIONS, Busy, refusal
from refit_grpc.shim.canary import check_canary, score_canary
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.fields import (
    check_digest_shape,
    check_group_id,
    check_instance_id,
    check_master,
    check_not_own_port,
    check_version,
    epoch_mode,
    flip_timeout,
    packing_pb,
    pause_mode,
    plan_from_request,
    printable,
)
from refit_grpc.shim.receive import Epoch, EpochReceive, Received
from refit_grpc.shim.status import status_on_error

log = logging.getLogger(__name__)

State = pb.ShimState  # one of its values (plain ints at runtime)


@dataclass(frozen=True)
class ShimConfig:
    max_epoch_s: float = 600.0        # cap when the caller set no deadline (or a longer one)
    max_join_s: float = 300.0
    max_control_s: float = 60.0
    # An epoch's PROGRESS: the first bucket at once, then at most one per interval (the newest
    # applied). The trainer reads every engine's stream: one message per bucket per engine
    # made its control cost grow with engines x buckets (`shim.receive.EpochReceive.buckets`).
    progress_interval_s: float = 0.2
    # How long a staged copy waits for its Flip when the epoch does not say (flip_timeout_s),
    # and the most it may ask: past it the copy is dropped, the engine serving the old version.
    default_flip_timeout_s: float = 120.0
    max_flip_timeout_s: float = 3600.0
    max_plan_tensors: int = 1_000_000
    max_plan_bytes: int = 1 << 40
    # Masters the shim may join; a hostile caller must not point the engine at its own rendezvous.
    allowed_master_networks: Sequence[str] = ("127.0.0.0/8", "::1/128")
    instance_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:12]}")


@dataclass
class _Staged:
    """A staged version waiting for its Flip: what the epoch asked for at the flip, and the
    timer that drops it when no Flip comes."""

    version: int
    digest: str
    verify_weights: bool
    canary: pb.Canary | None
    expiry: threading.Timer | None  # None: a catch-up's copy, flipped at once


class RefitServicer(pb_grpc.RefitServiceServicer):
    def __init__(self, engine: Engine, config: ShimConfig | None = None):
        self.engine = engine
        self.config = config or ShimConfig()
        self._networks = [ipaddress.ip_network(n) for n in self.config.allowed_master_networks]
        self._lock = threading.Lock()
        self._plan: RefitPlan | None = None
        self._group: GroupSpec | None = None
        self._weights_intact = True
        self._version = 0
        self._last_error = ""
        self._busy: Busy | None = None
        self._epoch: Epoch | None = None
        self._last_canary: tuple[int, float] = (0, -1.0)  # (version, max_abs_gap) of the last
        self._staged: _Staged | None = None
        self._last_stall_s = 0.0
        self._join_deadline: Deadline | None = None
        self._catch_up: catch_up.CatchUp | None = None
        self._shutting_down = False
        # The shim's own listening ports (gRPC, metrics), never a rendezvous (set by ShimServer).
        self.own_ports: frozenset[int] = frozenset()

    # --- state -----------------------------------------------------------------------------

    def state(self) -> State:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> State:
        if self._epoch is not None:
            return pb.SHIM_STATE_STAGING if self._epoch.staged else pb.SHIM_STATE_RECEIVING
        if self._busy is Busy.CATCH_UP:
            return pb.SHIM_STATE_CATCHING_UP
        if not self._weights_intact:
            return pb.SHIM_STATE_BROKEN
        if self._plan is None:
            return pb.SHIM_STATE_EMPTY
        if self._staged is not None or self._busy is Busy.FLIP:
            return pb.SHIM_STATE_STAGED
        if self._group is not None:
            return pb.SHIM_STATE_READY
        return pb.SHIM_STATE_PREPARED

    def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to `grace_s` for a running epoch or join. True if idle."""
        with self._lock:
            self._shutting_down = True
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            with self._lock:
                if self._busy is None:
                    return True
            time.sleep(0.02)
        return False

    def abort_all(self, reason: str) -> None:
        self._abort(reason)

    def _admit_locked(self, rpc: str, instance_id: str = "") -> None:
        """Refuse `rpc` unless the admission table admits it now (state, busy, draining,
        instance id). A handler's own checks follow under the same lock hold, then
        `_hold_locked` if it runs a long operation."""
        refused = refusal(rpc, state=self._state_locked(), busy=self._busy,
                          draining=self._shutting_down, instance_id=instance_id,
                          own_instance_id=self.config.instance_id)
        if refused is not None:
            raise refused

    def _hold_locked(self, rpc: str) -> contextlib.AbstractContextManager[None]:
        """Mark the shim busy with `rpc`'s long operation; the context manager returned ends
        it, whatever happens, forgetting what it carried (epoch, join deadline, catch-up). One
        long operation runs at a time, so the release clears them all."""
        busy = ADMISSIONS[rpc].holds
        assert busy is not None and self._busy is None, (rpc, self._busy)
        self._busy = busy
        return self._release_at_end()

    @contextlib.contextmanager
    def _release_at_end(self) -> Iterator[None]:
        try:
            yield
        finally:
            with self._lock:
                self._busy = None
                self._epoch = None
                self._join_deadline = None
                self._catch_up = None

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def last_canary(self) -> tuple[int, float]:
        """(version, max_abs_gap) of the last canary; (0, -1.0) when none ran."""
        with self._lock:
            return self._last_canary

    @property
    def staging(self) -> tuple[int, float]:
        """(the version staged and waiting for its flip, 0 when none; the last flip's stall in
        seconds, 0.0 before any)."""
        with self._lock:
            return (self._staged.version if self._staged else 0), self._last_stall_s

    # --- RPCs ------------------------------------------------------------------------------

    def Describe(self, request, context):
        with status_on_error(context):
            return self._describe(request)

    def _describe(self, request) -> pb.DescribeResponse:
        status = self.engine.status(with_digest=not request.skip_weights_digest)
        copy = self.engine.committed_copy
        with self._lock:
            self._admit_locked("Describe")
            return pb.DescribeResponse(
                instance_id=self.config.instance_id,
                engine_kind=self.engine.kind,
                engine_world_size=self.engine.world_size,
                state=self._state_locked(),
                weight_version=self._version,
                plan_digest=self._plan.digest if self._plan else "",
                group_id=self._group.group_id if self._group else "",
                packing=packing_pb(self.engine.offered_packing),
                last_error=self._last_error,
                weights_digest=status.weights_digest,
                paused=status.paused,
                engine_healthy=status.healthy,
                rank_offset=self._group.rank if self._group else -1,
                last_canary_version=self._last_canary[0],
                last_canary_gap=self._last_canary[1],
                staged_version=self._staged.version if self._staged else 0,
                staged_digest=self._staged.digest if self._staged else "",
                staging_bytes=self.engine.staging_bytes,
                last_stall_seconds=self._last_stall_s,
                committed_copy_version=copy[0] if copy else 0,
                committed_copy_digest=copy[1] if copy else "",
                serving_catch_up_to=self._catch_up.other
                if self._catch_up and self._catch_up.serving else "",
                catching_up_from=self._catch_up.other
                if self._catch_up and not self._catch_up.serving else "",
                catch_up_bytes_received=self._catch_up.bytes_received
                if self._catch_up and not self._catch_up.serving else 0,
            )

    def Prepare(self, request, context):
        with status_on_error(context):
            plan = plan_from_request(request, self.config.max_plan_tensors)
            plan.validate(self.config.max_plan_bytes, self.config.max_plan_tensors)
            self.engine.check_plan(plan)
            with self._lock:
                self._admit_locked("Prepare")
                if self._staged is not None and self._plan is not None \
                        and self._plan.digest != plan.digest:
                    raise FailedPreconditionError(
                        f"Prepare of another plan refused: version {self._staged.version} is "
                        "staged under the current one (Flip it, or Abort to drop it)",
                        reason=Reason.WRONG_STATE)
                if self._plan is None or self._plan.digest != plan.digest:
                    # A new plan invalidates the group, which was formed against the old digest.
                    self._drop_group_locked()
                    self._plan = plan
            log.info("prepared plan %s: %d tensors, %d bytes, %d buckets", plan.digest[:12],
                     len(plan.tensors), plan.total_bytes, len(plan.buckets))
            return pb.PrepareResponse(plan_digest=plan.digest, total_bytes=plan.total_bytes,
                                      bucket_count=len(plan.buckets),
                                      packing=packing_pb(plan.packing))

    def InitCollective(self, request, context) -> Iterator:
        t0 = time.monotonic()
        with status_on_error(context):
            deadline = self._deadline(context, self.config.max_join_s)
            check_digest_shape(request.plan_digest, "plan_digest")
            check_group_id(request.group_id)
            backend = BACKEND_NAMES.get(request.backend)
            if backend is None:
                raise InvalidArgumentError("backend must be GLOO or NCCL", reason=Reason.INVALID_BACKEND)
            check_master(request.master_address, self._networks)
            spec = GroupSpec(request.master_address, request.master_port, request.world_size,
                             request.rank_offset, backend, request.group_id)
            spec.validate()
            if request.world_size > MAX_WORLD_SIZE:
                raise InvalidArgumentError(
                    f"world_size {request.world_size} is over {MAX_WORLD_SIZE}",
                    reason=Reason.INVALID_WORLD_SIZE)
            check_not_own_port(request.master_address, request.master_port, self.own_ports)
            self.engine.check_backend(backend)
            if request.rank_offset < 1:
                raise InvalidArgumentError("rank_offset must be >= 1: rank 0 is the trainer",
                                           reason=Reason.INVALID_RANK)
            if request.rank_offset + self.engine.world_size > request.world_size:
                raise InvalidArgumentError(
                    f"ranks [{request.rank_offset}, {request.rank_offset + self.engine.world_size})"
                    f" do not fit world_size {request.world_size}", reason=Reason.INVALID_RANK)
            with self._lock:
                self._admit_locked("InitCollective")
                plan = self._check_digest(request.plan_digest)
                self._drop_group_locked()
                self._join_deadline = deadline
                joining = self._hold_locked("InitCollective")
            context.add_callback(deadline.cancel.set)  # a caller that goes away cancels the join
            with joining:
                try:
                    yield pb.InitCollectiveResponse(phase=pb.INIT_COLLECTIVE_PHASE_ACCEPTED,
                                                    seconds=time.monotonic() - t0)
                    self.engine.init_transfer(spec, plan, deadline)
                    with self._lock:
                        deadline.check("InitCollective")  # an Abort during the join wins
                        self._group = spec
                    log.info("joined group %s as rank %d/%d", spec.group_id, spec.rank,
                             spec.world_size)
                except BaseException:
                    self.engine.abort_transfer()
                    raise
            yield pb.InitCollectiveResponse(phase=pb.INIT_COLLECTIVE_PHASE_JOINED,
                                            seconds=time.monotonic() - t0)

    def UpdateWeights(self, request, context) -> Iterator:
        t0 = time.monotonic()
        with status_on_error(context, self._record_error):
            epoch, mode = self._epoch_from_request(request, context)
            with self._lock:
                self._admit_locked("UpdateWeights", request.instance_id)
                plan = self._check_epoch_locked(request, epoch)
                self._epoch = epoch
                receiving = self._hold_locked("UpdateWeights")
            # A caller that goes away (trainer crash) cancels the receive; the deadline is the
            # watchdog that ends it even when no cancellation ever arrives.
            context.add_callback(epoch.deadline.cancel.set)
            yield from self._run_epoch(epoch, plan, mode, receiving, t0)

    def _epoch_from_request(self, request, context) -> tuple[Epoch, PauseMode]:
        """The epoch an UpdateWeights asks for, every field and what it needs of the engine
        (canary, staging, delta) checked; the shim's state is the admission's and
        `_check_epoch_locked`'s."""
        deadline = self._deadline(context, self.config.max_epoch_s)
        check_version(request.version, "version")
        check_digest_shape(request.plan_digest, "plan_digest")
        check_group_id(request.group_id, required=False)
        check_instance_id(request.instance_id, "instance_id")
        if request.delta_base_version:
            check_version(request.delta_base_version, "delta_base_version",
                          reason=Reason.INVALID_DELTA)
        check_digest_shape(request.delta_base_digest, "delta_base_digest")
        mode = pause_mode(request.pause_mode, PauseMode.KEEP)
        canary = request.canary if request.HasField("canary") else None
        if canary is not None:
            check_canary(canary, self.engine)
        staged = epoch_mode(request.mode) == pb.EPOCH_MODE_STAGED
        flip_timeout_s = flip_timeout(request.flip_timeout_s, self.config.default_flip_timeout_s,
                                      self.config.max_flip_timeout_s) if staged else 0.0
        if staged and not self.engine.capabilities.staging:
            raise FailedPreconditionError(
                f"the {self.engine.kind} engine cannot stage an epoch; open it IN_PLACE",
                reason=Reason.STAGING_UNSUPPORTED)
        delta = bool(request.delta_base_version or request.delta_base_digest)
        if delta:
            self._check_delta_request(request, staged)
        return Epoch(request.version, deadline, request.verify_weights, canary, staged=staged,
                     delta=delta, flip_timeout_s=flip_timeout_s), mode

    def _check_epoch_locked(self, request, epoch: Epoch) -> RefitPlan:
        """What an admitted epoch needs of this shim: its delta base, the joined group, a newer
        version, the prepared plan (returned)."""
        if epoch.delta:
            self._check_delta_base(request)
        if self._group is None:
            raise FailedPreconditionError("no data group: call InitCollective first",
                                          reason=Reason.NO_GROUP)
        self._check_newer(request.version)
        plan = self._check_digest(request.plan_digest)
        if request.group_id != self._group.group_id:
            raise FailedPreconditionError(
                f"group_id {request.group_id!r} != joined {self._group.group_id!r}",
                reason=Reason.GROUP_MISMATCH)
        return plan

    def _run_epoch(self, epoch: Epoch, plan: RefitPlan, mode: PauseMode,
                   receiving: contextlib.AbstractContextManager[None],
                   t0: float) -> Iterator[pb.UpdateWeightsResponse]:
        """Pause (in place only), receive, then commit or hold the staged version; a failure
        is `_fail_epoch`'s, while the shim is still RECEIVING (or STAGING)."""
        committed = False
        was_paused = self.engine.is_paused()
        receive = EpochReceive(self.engine, plan, epoch,
                               progress_interval_s=self.config.progress_interval_s)
        try:
            with receiving:
                try:
                    if not epoch.staged:  # a staged epoch never pauses: the engine serves
                        self.engine.pause(mode, epoch.deadline)
                    t_accept = time.monotonic()
                    receive.start()
                    yield pb.UpdateWeightsResponse(phase=pb.UPDATE_WEIGHTS_PHASE_ACCEPTED,
                                                   version=epoch.version,
                                                   bucket_count=len(plan.buckets),
                                                   seconds=t_accept - t0)
                    for bucket in receive.buckets():
                        yield pb.UpdateWeightsResponse(
                            phase=pb.UPDATE_WEIGHTS_PHASE_PROGRESS, version=epoch.version,
                            bucket_index=bucket.index, bucket_count=len(plan.buckets),
                            bytes_received=epoch.bytes_applied,
                            seconds=time.monotonic() - t_accept)
                    assert receive.result is not None
                    last = self._end_epoch(epoch, plan, receive.result, t_accept)
                    committed = True
                    yield last
                finally:
                    if not committed:
                        epoch.deadline.cancel.set()
                        self.engine.abort_transfer()
                        receive.join()
                        self._fail_epoch(epoch, was_paused)
        finally:
            if not committed:
                log.warning("epoch %d failed after %d bytes; state now %s", epoch.version,
                            epoch.bytes_applied, pb.ShimState.Name(self.state()))

    def _end_epoch(self, epoch: Epoch, plan: RefitPlan, received: Received,
                   t_accept: float) -> pb.UpdateWeightsResponse:
        """A receive that ended well: hold the staged version for its Flip (STAGED), or commit
        the version (COMMITTED). An Abort that raced the last bucket wins."""
        if epoch.staged:
            with self._lock:
                epoch.deadline.check("staged")
                self._hold_staged_locked(epoch, received.digest)
            seconds = time.monotonic() - t_accept
            log.info("staged version %d (%d bytes, %.3fs; digest %s), flip within %.0fs",
                     epoch.version, plan.total_bytes, seconds, received.digest[:12],
                     epoch.flip_timeout_s)
            return pb.UpdateWeightsResponse(
                phase=pb.UPDATE_WEIGHTS_PHASE_STAGED, version=epoch.version,
                bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
                seconds=seconds, staged_digest=received.digest)
        with self._lock:
            epoch.deadline.check("commit")
            self._version = epoch.version
            self._weights_intact = True
            self._last_error = ""
            if received.canary is not None:
                self._last_canary = (epoch.version, received.canary.max_abs_gap)
        seconds = time.monotonic() - t_accept
        log.info("committed version %d (%d bytes, %.3fs)", epoch.version, plan.total_bytes,
                 seconds)
        return pb.UpdateWeightsResponse(
            phase=pb.UPDATE_WEIGHTS_PHASE_COMMITTED, version=epoch.version,
            bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
            seconds=seconds, weights_digest=received.digest, canary=received.canary)

    def Flip(self, request, context):
        """Switch a STAGED engine to its staged version: pause, load the staged copy, (canary,)
        clear the cache, resume. Refusals change nothing, but a digest other than the staged
        one drops the copy: those bytes are not what the trainer sent."""
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            check_version(request.version, "version")
            check_digest_shape(request.staged_digest, "staged_digest")
            check_instance_id(request.instance_id, "instance_id")
            mode = pause_mode(request.pause_mode, PauseMode.KEEP)
            dropped = None
            with self._lock:
                self._admit_locked("Flip", request.instance_id)
                staged = self._staged
                if staged is None:
                    why = f" (last error: {self._last_error})" if self._last_error else ""
                    raise FailedPreconditionError(
                        f"nothing staged to flip in state "
                        f"{pb.ShimState.Name(self._state_locked())}{why}",
                        reason=Reason.NOT_STAGED)
                if request.version != staged.version:
                    raise FailedPreconditionError(
                        f"Flip of version {request.version}, staged is {staged.version}",
                        reason=Reason.STAGED_VERSION_MISMATCH)
                if request.staged_digest != staged.digest:
                    dropped = self._take_staged_locked()
                    self._last_error = (f"STAGED_DIGEST_MISMATCH: staged version "
                                        f"{staged.version} dropped")
                else:
                    self._take_staged_locked()
                    flipping = self._hold_locked("Flip")
            if dropped is not None:
                self.engine.drop_staged()
                raise FailedPreconditionError(
                    f"staged digest {staged.digest[:16]} != the trainer's "
                    f"{request.staged_digest[:16]!r}: the bytes this engine staged are not the "
                    f"ones sent; version {staged.version} dropped, serving "
                    f"{self._version}", reason=Reason.STAGED_DIGEST_MISMATCH)
            with flipping:
                done = self._flip(staged, mode, request.stay_paused, deadline)
            done.state = self.state()
            return done

    def _flip(self, staged: _Staged, mode: PauseMode, stay_paused: bool,
              deadline: Deadline, *, resume_paused: bool = False) -> pb.FlipResponse:
        """Pause, load the staged copy, (canary,) clear caches, resume. `resume_paused`: resume
        even an engine that was paused before (a BROKEN one that a catch-up made whole)."""
        was_paused = self.engine.is_paused() and not resume_paused
        t_pause = time.monotonic()
        try:
            self.engine.pause(mode, deadline)
        except RefitError:
            # Not paused, nothing loaded: the engine serves the old version, whole.
            self.engine.drop_staged()
            raise
        try:
            t_load = time.monotonic()
            digest = self.engine.flip(staged.version, deadline)
            load_s = time.monotonic() - t_load
            if staged.verify_weights and not digest:
                digest = self.engine.weights_digest(deadline)
        except BaseException as e:
            with self._lock:
                self._weights_intact = False  # partly loaded: paused until a full update
                self._group = None
            self.engine.abort_transfer()
            log.error("flip of version %d failed: %s", staged.version, e)
            if isinstance(e, RefitError):
                raise
            raise EpochAbortedError(f"flip of version {staged.version} failed: "
                                    f"{type(e).__name__}: {e}", reason=Reason.FLIP_FAILED) from e
        canary_result = score_canary(self.engine, staged.canary, deadline) \
            if staged.canary else None
        with self._lock:
            self._version = staged.version
            self._weights_intact = True
            self._last_error = ""
            if canary_result is not None:
                self._last_canary = (staged.version, canary_result.max_abs_gap)
        # The caches hold values computed with the old weights.
        self.engine.reset_cache(deadline)
        resumed = not stay_paused and not was_paused
        if resumed:
            self.engine.resume(deadline)
        stall = time.monotonic() - t_pause
        with self._lock:
            self._last_stall_s = stall
        log.info("flipped to version %d: stall %.3fs (load %.3fs)", staged.version, stall, load_s)
        return pb.FlipResponse(version=staged.version, stall_seconds=stall,
                               load_seconds=load_s, weights_digest=digest, canary=canary_result,
                               resumed=resumed)

    # --- catch-up from a peer (docs/protocol.md, "Catch-up from a peer") ----------------------

    def ServeCatchUp(self, request, context) -> Iterator:
        """Send this engine's committed copy to one engine catching up: host a two-rank
        rendezvous, say where (LISTENING), broadcast the copy, end with SENT. The engine keeps
        serving; no epoch, join or flip runs meanwhile (BUSY), so the copy cannot change."""
        t0 = time.monotonic()
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            world = self._check_serve_request(request)
            target = request.target_instance_id or "an engine catching up"
            with self._lock:
                self._admit_locked("ServeCatchUp", request.instance_id)
                plan = self._check_digest(request.plan_digest)
                held = self.engine.committed_copy
                if held != (request.version, request.staged_digest):
                    have = f"version {held[0]} ({held[1][:16]})" if held else "none"
                    raise FailedPreconditionError(
                        f"asked to serve version {request.version} "
                        f"({request.staged_digest[:16]}); this engine's committed copy: {have}",
                        reason=Reason.PEER_COPY_MISMATCH)
                self._catch_up = catch_up.CatchUp(deadline, serving=True, other=target)
                serving = self._hold_locked("ServeCatchUp")
            context.add_callback(deadline.cancel.set)  # the driver going away ends the serve
            with serving:
                server = catch_up.CopyServer(self.engine, request.listen_address, world,
                                             request.group_id, deadline)
                log.info("serving version %d to %s: rendezvous at %s:%d", request.version,
                         target, request.listen_address, server.port)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_LISTENING,
                                              master_port=server.port,
                                              seconds=time.monotonic() - t0)
                server.serve()
                del server  # closes the rendezvous: the newcomer has every byte
                log.info("served version %d to %s: %d bytes, %.3fs", request.version, target,
                         plan.total_bytes, time.monotonic() - t0)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_SENT,
                                              bytes_sent=plan.total_bytes,
                                              seconds=time.monotonic() - t0)

    def _check_serve_request(self, request) -> int:
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
        check_master(request.listen_address, self._networks)
        world = request.world_size or 2
        if not 2 <= world <= 1 + MAX_ENGINE_WORLD_SIZE:
            raise InvalidArgumentError(
                f"world_size must be 1 + the newcomer's engine ranks (2 to "
                f"{1 + MAX_ENGINE_WORLD_SIZE}; 0 means 2), got {world}",
                reason=Reason.INVALID_WORLD_SIZE)
        if not self.engine.capabilities.serving_copy:
            raise FailedPreconditionError(
                f"the {self.engine.kind} engine cannot serve its committed copy; catch the "
                "engine up from another peer or by the next epoch",
                reason=Reason.CATCH_UP_UNSUPPORTED)
        return world

    def CatchUp(self, request, context):
        """Receive a peer's committed copy into the staging copy (the peer's group, not the
        fleet's: this engine leaves its data group), check the staged digest, load it as a Flip
        does. Before the load nothing changes: a dead peer, a wrong digest or an Abort leave the
        engine as it was (serving what it had; a BROKEN one stays paused)."""
        t0 = time.monotonic()
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            spec, mode = self._catch_up_group(request)
            peer = request.peer_instance_id or f"{request.master_address}:{request.master_port}"
            with self._lock:
                self._admit_locked("CatchUp", request.instance_id)
                self._check_newer(request.version)
                plan = self._check_digest(request.plan_digest)
                broken = not self._weights_intact
                # The fleet forms its group again with this engine once it caught up.
                self._drop_group_locked()
                record = self._catch_up = catch_up.CatchUp(deadline, serving=False, other=peer)
                catching_up = self._hold_locked("CatchUp")
            context.add_callback(deadline.cancel.set)
            loading = False
            with catching_up:
                try:
                    digest = catch_up.fetch_copy(self.engine, spec, plan, record, peer)
                    transfer_s = time.monotonic() - t0
                    if digest != request.staged_digest:
                        raise FailedPreconditionError(
                            f"catch-up from peer {peer}: staged digest {digest[:16]} != the "
                            f"peer copy's {request.staged_digest[:16]}; nothing loaded",
                            reason=Reason.STAGED_DIGEST_MISMATCH)
                    loading = True
                    # Once loading, nothing cancels it (a caller gone, an Abort): a load cut
                    # short would leave partial weights. It has its deadline's time, and at
                    # least 10 s.
                    load_deadline = Deadline(max(deadline.remaining(), 10.0))
                    done = self._flip(_Staged(request.version, digest, False, None, None), mode,
                                      stay_paused=False, deadline=load_deadline,
                                      resume_paused=broken)
                finally:
                    if not loading:
                        self.engine.drop_staged()
            log.info("caught up to version %d from %s: %d bytes, transfer %.3fs, stall %.3fs",
                     request.version, peer, record.bytes_received, transfer_s,
                     done.stall_seconds)
            return pb.CatchUpResponse(version=request.version, state=self.state(),
                                      bytes_received=record.bytes_received,
                                      seconds=time.monotonic() - t0,
                                      transfer_seconds=transfer_s,
                                      stall_seconds=done.stall_seconds,
                                      load_seconds=done.load_seconds,
                                      weights_digest=done.weights_digest)

    def _catch_up_group(self, request) -> tuple[GroupSpec, PauseMode]:
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
        check_master(request.master_address, self._networks)
        spec = GroupSpec(request.master_address, request.master_port,
                         1 + self.engine.world_size, 1, "gloo", request.group_id)
        spec.validate()
        check_not_own_port(request.master_address, request.master_port, self.own_ports)
        if not self.engine.capabilities.staging:
            raise FailedPreconditionError(
                f"the {self.engine.kind} engine cannot stage, so it cannot catch up from a "
                "peer; the next epoch brings it to the fleet's version",
                reason=Reason.CATCH_UP_UNSUPPORTED)
        return spec, mode

    def Flush(self, request, context):
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_control_s)
            mode = pause_mode(request.mode, PauseMode.WAIT)
            with self._lock:
                self._admit_locked("Flush")
            self.engine.pause(mode, deadline)
            cleared = self.engine.reset_cache(deadline)
            with self._lock:
                # Re-check: an epoch may have failed meanwhile; never resume partial weights.
                resume = self._weights_intact and self._epoch is None
            if resume:
                self.engine.resume(deadline)
            return pb.FlushResponse(cache_cleared=cleared, resumed=resume, state=self.state())

    def Abort(self, request, context):
        """Never refused: any reason is taken, the first MAX_REASON_CHARS characters kept
        (control characters escaped) for last_error and the log."""
        with status_on_error(context):
            with self._lock:
                self._admit_locked("Abort")
            reason = printable(request.reason[:MAX_REASON_CHARS])
            if len(request.reason) > MAX_REASON_CHARS:
                reason += f"...({len(request.reason)} chars)"
            epoch = self._abort(reason or "Abort called")
            # The epoch's own handler finishes the transition; wait briefly so the answer is
            # final.
            end = time.monotonic() + 5.0
            while self.state() == pb.SHIM_STATE_RECEIVING and time.monotonic() < end:
                time.sleep(0.01)
            return pb.AbortResponse(state=self.state(), epoch_aborted=epoch is not None)

    def _abort(self, reason: str) -> Epoch | None:
        with self._lock:
            epoch = self._epoch
            if epoch is not None:
                epoch.abort_reason = reason
                epoch.deadline.cancel.set()
            if self._join_deadline is not None:
                self._join_deadline.cancel.set()
            if self._catch_up is not None:
                self._catch_up.deadline.cancel.set()
            self._last_error = f"aborted: {reason}"
            self._group = None
            staged = self._take_staged_locked()
        self.engine.abort_transfer()  # unblocks a pending receive or join on every peer
        if staged is not None:
            self.engine.drop_staged()
            log.warning("abort: dropped staged version %d", staged.version)
        log.warning("abort: %s (epoch in flight: %s)", reason, epoch is not None)
        return epoch

    # --- helpers ---------------------------------------------------------------------------

    def _hold_staged_locked(self, epoch: Epoch, digest: str) -> None:
        """Keep a staged version for its Flip, for at most its flip timeout."""
        expiry = threading.Timer(epoch.flip_timeout_s, self._expire_staged,
                                 args=(epoch.version,))
        expiry.daemon = True
        expiry.name = f"flip-timeout-v{epoch.version}"
        self._staged = _Staged(epoch.version, digest, epoch.verify_weights, epoch.canary, expiry)
        expiry.start()

    def _take_staged_locked(self) -> _Staged | None:
        staged, self._staged = self._staged, None
        if staged is not None and staged.expiry is not None:
            staged.expiry.cancel()
        return staged

    def _expire_staged(self, version: int) -> None:
        """No Flip came in time (the trainer died, or gave up on this engine): drop the copy;
        the engine serves the old version as it did throughout."""
        with self._lock:
            if self._staged is None or self._staged.version != version:
                return
            self._take_staged_locked()
            self._last_error = f"staged version {version} dropped: no Flip in time"
        self.engine.drop_staged()
        log.warning("staged version %d dropped: no Flip within its flip timeout", version)

    def _check_delta_request(self, request, staged: bool) -> None:
        """A delta epoch is staged, on an engine that applies deltas, and names its base."""
        if not staged:
            raise InvalidArgumentError("a delta epoch is a staged one (mode EPOCH_MODE_STAGED)",
                                       reason=Reason.INVALID_DELTA)
        if not (request.delta_base_version and request.delta_base_digest):
            raise InvalidArgumentError("a delta epoch names its base by version and digest",
                                       reason=Reason.INVALID_DELTA)
        if not self.engine.capabilities.delta:
            raise FailedPreconditionError(f"the {self.engine.kind} engine cannot apply a delta; "
                                          "send a full epoch", reason=Reason.DELTA_UNSUPPORTED)

    def _check_delta_base(self, request) -> None:
        """A delta goes only onto exactly the committed copy this engine holds (version and
        staged digest): applied to anything else it would produce other weights (invariant
        11). Under the lock, once admitted: a restarted shim holds no copy, and its answer is
        MEMBERSHIP_CHANGED."""
        held = self.engine.committed_copy
        if held != (request.delta_base_version, request.delta_base_digest):
            have = f"version {held[0]} ({held[1][:16]})" if held else "none"
            raise FailedPreconditionError(
                f"delta base version {request.delta_base_version} "
                f"({request.delta_base_digest[:16]}) is not this engine's committed copy: "
                f"{have}; send a full epoch", reason=Reason.DELTA_BASE_MISMATCH)

    def _fail_epoch(self, epoch: Epoch, was_paused: bool) -> None:
        self.engine.abort_transfer()
        if epoch.staged:
            # Only the staging copy was written: the live weights are the old version, whole,
            # and the engine was never paused by this epoch.
            self.engine.drop_staged()
            with self._lock:
                self._group = None
            return
        with self._lock:
            self._group = None
            if epoch.bytes_applied > 0 or self.engine.partial_on_failure:
                self._weights_intact = False
        if epoch.bytes_applied == 0 and not self.engine.partial_on_failure and not was_paused:
            try:
                self.engine.resume(Deadline(self.config.max_control_s))
            except RefitError as e:
                log.warning("resume after refused epoch failed: %s", e)

    def _record_error(self, err: RefitError) -> None:
        with self._lock:
            self._last_error = f"{err.reason}: {err.message}"

    def _deadline(self, context, cap_s: float) -> Deadline:
        remaining = context.time_remaining()
        seconds = cap_s if remaining is None else min(remaining, cap_s)
        return Deadline(seconds)

    def _check_newer(self, version: int) -> None:
        """Versions only move forward (invariant 4); under the lock."""
        if version <= self._version:
            raise FailedPreconditionError(
                f"version {version} is not newer than applied {self._version}",
                reason=Reason.STALE_VERSION)

    def _check_digest(self, digest: str) -> RefitPlan:
        """The prepared plan, if `digest` names it."""
        if not self._plan:
            raise FailedPreconditionError("no plan prepared", reason=Reason.WRONG_STATE)
        if digest != self._plan.digest:
            raise FailedPreconditionError(
                f"plan_digest {digest[:16]!r} != prepared {self._plan.digest[:16]!r}",
                reason=Reason.PLAN_DIGEST_MISMATCH)
        return self._plan

    def _drop_group_locked(self) -> None:
        if self._group is not None:
            self._group = None
            self.engine.abort_transfer()

__all__ = ["Busy", "RefitServicer", "ShimConfig"]
