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

Refinement of the design: an epoch that fails before any byte reached the engine leaves the
weights intact, so the engine is resumed and the shim returns to PREPARED (group torn down), not
BROKEN. That is what lets one worker's refusal abort the others without taking them offline.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from refit_grpc.canary import canary_problem
from refit_grpc.collective import bind_master_store, set_store_key
from refit_grpc.common import (
    MAX_ENGINE_WORLD_SIZE,
    MAX_ID_BYTES,
    MAX_REASON_CHARS,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME_BYTES,
    MAX_VERSION,
    MAX_WORLD_SIZE,
    Deadline,
    GroupSpec,
    PauseMode,
    clip,
    digest_problem,
    text_problem,
)
from refit_grpc.errors import (
    CollectiveError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidPlanError,
    PlanTooLargeError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import DTYPES, Packing, RefitPlan, TensorSpec
from refit_grpc.proto import BACKEND_NAMES, DTYPE_FROM_PROTO, PAUSE_MODE_FROM_PROTO, pb, pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim.admission import ADMISSIONS, Busy, refusal
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.status import status_on_error

log = logging.getLogger(__name__)

State = pb.ShimState  # one of its values (plain ints at runtime)


@dataclass(frozen=True)
class ShimConfig:
    max_epoch_s: float = 600.0        # cap when the caller set no deadline (or a longer one)
    max_join_s: float = 300.0
    max_control_s: float = 60.0
    # How long a staged copy waits for its Flip when the epoch does not say (flip_timeout_s),
    # and the most it may ask: past it the copy is dropped, the engine serving the old version.
    default_flip_timeout_s: float = 120.0
    max_flip_timeout_s: float = 3600.0
    max_plan_tensors: int = 1_000_000
    max_plan_bytes: int = 1 << 40
    # Masters the shim may join; a hostile caller must not point the engine at its own rendezvous.
    allowed_master_networks: Sequence[str] = ("127.0.0.0/8", "::1/128")
    instance_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:12]}")


class ReceiveEvent(enum.Enum):
    """What the receive thread hands to the UpdateWeights stream."""

    BUCKET = "bucket"  # one bucket applied (value: the Bucket)
    DONE = "done"      # every bucket applied and committed by the engine (value: its digest)
    ERROR = "error"    # the receive failed (value: the RefitError)


@dataclass
class _Epoch:
    version: int
    deadline: Deadline
    verify_weights: bool = False
    canary: pb.Canary | None = None  # computed after the commit, before COMMITTED
    staged: bool = False  # a staged epoch: bytes land in the staging copy, never paused
    delta: bool = False   # its buckets are deltas against the committed copy
    flip_timeout_s: float = 0.0
    bytes_applied: int = 0
    abort_reason: str = ""


@dataclass
class _Staged:
    """A staged version waiting for its Flip: what the epoch asked for at the flip, and the
    timer that drops it when no Flip comes."""

    version: int
    digest: str
    verify_weights: bool
    canary: pb.Canary | None
    expiry: threading.Timer | None  # None: a catch-up's copy, flipped at once


@dataclass
class _CatchUp:
    """A catch-up this shim takes part in: its deadline (Abort cancels it) and the other end."""

    deadline: Deadline
    serving: bool  # True on the peer (ServeCatchUp), False on the engine catching up
    other: str     # the other engine's instance id
    bytes_received: int = 0  # the engine catching up: what landed so far


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
        self._epoch: _Epoch | None = None
        self._last_canary: tuple[int, float] = (0, -1.0)  # (version, max_abs_gap) of the last
        self._staged: _Staged | None = None
        self._last_stall_s = 0.0
        self._join_deadline: Deadline | None = None
        self._catch_up: _CatchUp | None = None
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
                packing=_packing_pb(self.engine.offered_packing),
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
            plan = self._plan_from_request(request)
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
                                      packing=_packing_pb(plan.packing))

    def InitCollective(self, request, context) -> Iterator:
        t0 = time.monotonic()
        with status_on_error(context):
            deadline = self._deadline(context, self.config.max_join_s)
            _check_digest_shape(request.plan_digest, "plan_digest")
            _check_group_id(request.group_id)
            backend = BACKEND_NAMES.get(request.backend)
            if backend is None:
                raise InvalidArgumentError("backend must be GLOO or NCCL", reason=Reason.INVALID_BACKEND)
            self._check_master(request.master_address)
            spec = GroupSpec(request.master_address, request.master_port, request.world_size,
                             request.rank_offset, backend, request.group_id)
            spec.validate()
            if request.world_size > MAX_WORLD_SIZE:
                raise InvalidArgumentError(
                    f"world_size {request.world_size} is over {MAX_WORLD_SIZE}",
                    reason=Reason.INVALID_WORLD_SIZE)
            self._check_not_own_port(request.master_address, request.master_port)
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
            deadline = self._deadline(context, self.config.max_epoch_s)
            _check_version(request.version, "version")
            _check_digest_shape(request.plan_digest, "plan_digest")
            _check_group_id(request.group_id, required=False)
            _check_instance_id(request.instance_id, "instance_id")
            if request.delta_base_version:
                _check_version(request.delta_base_version, "delta_base_version",
                               reason=Reason.INVALID_DELTA)
            _check_digest_shape(request.delta_base_digest, "delta_base_digest")
            mode = _pause_mode(request.pause_mode, PauseMode.KEEP)
            canary = request.canary if request.HasField("canary") else None
            if canary is not None:
                problem = canary_problem(canary.token_ids, canary.expected_logprobs)
                if not problem and not all(math.isfinite(x) for x in canary.expected_logprobs):
                    problem = "expected log-probabilities must be finite"
                if problem:
                    raise InvalidArgumentError(f"canary: {problem}",
                                               reason=Reason.INVALID_CANARY)
                if not self.engine.supports_canary:
                    raise FailedPreconditionError(
                        f"the {self.engine.kind} engine cannot compute a canary; open the epoch "
                        "without one", reason=Reason.CANARY_UNSUPPORTED)
            staged = _epoch_mode(request.mode) == pb.EPOCH_MODE_STAGED
            flip_timeout_s = self._flip_timeout(request.flip_timeout_s) if staged else 0.0
            if staged and not self.engine.supports_staging:
                raise FailedPreconditionError(
                    f"the {self.engine.kind} engine cannot stage an epoch; open it IN_PLACE",
                    reason=Reason.STAGING_UNSUPPORTED)
            delta = bool(request.delta_base_version or request.delta_base_digest)
            if delta:
                self._check_delta_request(request, staged)
            with self._lock:
                self._admit_locked("UpdateWeights", request.instance_id)
                if delta:
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
                epoch = _Epoch(request.version, deadline, request.verify_weights, canary,
                               staged=staged, delta=delta, flip_timeout_s=flip_timeout_s)
                self._epoch = epoch
                receiving = self._hold_locked("UpdateWeights")
            # A caller that goes away (trainer crash) cancels the receive; the deadline is the
            # watchdog that ends it even when no cancellation ever arrives.
            context.add_callback(deadline.cancel.set)
            committed = False
            was_paused = self.engine.is_paused()
            receiver: threading.Thread | None = None
            try:
                with receiving:  # released after the failure's clean-up: RECEIVING until then
                    try:
                        if not staged:  # a staged epoch never pauses: the engine serves throughout
                            self.engine.pause(mode, deadline)
                        # The receive runs on its own thread so a slow client reading PROGRESS can never
                        # stall the collective; the stream just relays its events. It starts before
                        # ACCEPTED goes out, so its first receives are already posted when the trainer,
                        # having every ACCEPTED, starts to send: no thread start on the critical path.
                        events: queue.Queue = queue.Queue()
                        receiver = threading.Thread(
                            target=self._receive, args=(plan, epoch, events), daemon=True,
                            name=f"receive-v{request.version}")
                        t_accept = time.monotonic()
                        receiver.start()
                        yield pb.UpdateWeightsResponse(phase=pb.UPDATE_WEIGHTS_PHASE_ACCEPTED,
                                                       version=request.version,
                                                       bucket_count=len(plan.buckets),
                                                       seconds=t_accept - t0)
                        while True:
                            try:
                                kind, value = events.get(timeout=max(deadline.remaining(), 0.0) + 5.0)
                            except queue.Empty:
                                raise RefitTimeoutError("receive outlived its deadline") from None
                            if kind is ReceiveEvent.ERROR:
                                raise value
                            if kind is ReceiveEvent.BUCKET:
                                if not events.empty():
                                    # Behind the receive: only the newest bucket is news (PROGRESS is
                                    # "applied up to here"), and COMMITTED, if it is already queued,
                                    # says everything. One message less per bucket on a loaded host.
                                    continue
                                yield pb.UpdateWeightsResponse(
                                    phase=pb.UPDATE_WEIGHTS_PHASE_PROGRESS, version=request.version,
                                    bucket_index=value.index, bucket_count=len(plan.buckets),
                                    bytes_received=epoch.bytes_applied,
                                    seconds=time.monotonic() - t_accept)
                                continue
                            digest, canary_result = value
                            break
                        if staged:
                            with self._lock:
                                deadline.check("staged")  # an Abort that raced the last bucket wins
                                self._hold_staged_locked(epoch, digest)
                                committed = True
                            log.info("staged version %d (%d bytes, %.3fs; digest %s), flip within %.0fs",
                                     request.version, plan.total_bytes, time.monotonic() - t_accept,
                                     digest[:12], flip_timeout_s)
                            yield pb.UpdateWeightsResponse(
                                phase=pb.UPDATE_WEIGHTS_PHASE_STAGED, version=request.version,
                                bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
                                seconds=time.monotonic() - t_accept, staged_digest=digest)
                            return
                        with self._lock:
                            deadline.check("commit")  # an Abort that raced the last bucket wins
                            self._version = request.version
                            self._weights_intact = True
                            self._last_error = ""
                            if canary_result is not None:
                                self._last_canary = (request.version, canary_result.max_abs_gap)
                            committed = True
                        log.info("committed version %d (%d bytes, %.3fs)", request.version,
                                 plan.total_bytes, time.monotonic() - t_accept)
                        yield pb.UpdateWeightsResponse(
                            phase=pb.UPDATE_WEIGHTS_PHASE_COMMITTED, version=request.version,
                            bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
                            seconds=time.monotonic() - t_accept, weights_digest=digest,
                            canary=canary_result)
                    finally:
                        if not committed:
                            deadline.cancel.set()
                            self.engine.abort_transfer()
                            if receiver is not None:
                                # Closing the group fails the pending receive at once; the
                                # bound is a guard.
                                receiver.join(timeout=10.0)
                            self._fail_epoch(epoch, was_paused)
            finally:
                if not committed:
                    log.warning("epoch %d failed after %d bytes; state now %s", epoch.version,
                                epoch.bytes_applied, pb.ShimState.Name(self.state()))

    def _receive(self, plan: RefitPlan, epoch: _Epoch, events: queue.Queue) -> None:
        def on_bucket(bucket) -> None:
            epoch.bytes_applied += bucket.nbytes
            events.put((ReceiveEvent.BUCKET, bucket))

        try:
            if epoch.staged:
                staged_digest = self.engine.stage(plan, epoch.deadline, on_bucket,
                                                  delta=epoch.delta)
                events.put((ReceiveEvent.DONE, (staged_digest, None)))
                return
            self.engine.receive(plan, epoch.deadline, on_bucket)
            digest = self.engine.finish(epoch.version, epoch.deadline)
            if epoch.verify_weights and not digest:
                digest = self.engine.weights_digest(epoch.deadline)
            canary = self._run_canary(epoch.canary, epoch.deadline) if epoch.canary else None
            events.put((ReceiveEvent.DONE, (digest, canary)))
        except BaseException as e:  # relayed to the handler thread, which owns the status
            if epoch.deadline.cancel.is_set() and epoch.deadline.remaining() > 0:
                # Whatever the teardown made the receive trip over, the cause is the abort.
                why = f"Abort: {epoch.abort_reason}" if epoch.abort_reason else str(e)
                e = EpochAbortedError(f"epoch {epoch.version} aborted ({why})",
                                      reason=Reason.EPOCH_ABORTED)
            elif not isinstance(e, RefitError):
                log.exception("receive failed")
                e = EpochAbortedError(f"receive failed: {type(e).__name__}: {e}",
                                      reason=Reason.RECEIVE_FAILED)
            events.put((ReceiveEvent.ERROR, e))

    def _run_canary(self, canary: pb.Canary, deadline: Deadline) -> pb.CanaryResult:
        """The engine's log-probabilities of the canary, with the weights just committed and
        before it serves again. A failure to compute them is reported, not raised: the weights
        are whole and committed; the driver decides (it names the engine and keeps the fleet
        paused)."""
        t0 = time.monotonic()
        try:
            logprobs = self.engine.canary_logprobs(list(canary.token_ids), deadline)
        except Exception as e:  # noqa: BLE001  (any engine failure is the canary's result)
            log.warning("canary failed: %s", e)
            return pb.CanaryResult(max_abs_gap=-1.0, seconds=time.monotonic() - t0,
                                   error=f"{type(e).__name__}: {e}")
        gap = -1.0
        expected = canary.expected_logprobs
        if expected:
            if len(logprobs) != len(expected):
                return pb.CanaryResult(max_abs_gap=-1.0, seconds=time.monotonic() - t0,
                                       error=f"engine computed {len(logprobs)} positions, "
                                             f"expected {len(expected)}")
            gap = max(abs(a - b) for a, b in zip(logprobs, expected))
        seconds = time.monotonic() - t0
        log.info("canary: %d positions in %.3fs, max gap %s", len(logprobs), seconds,
                 f"{gap:.2e}" if gap >= 0 else "(no expectation)")
        return pb.CanaryResult(logprobs=logprobs, max_abs_gap=gap, seconds=seconds)

    def Flip(self, request, context):
        """Switch a STAGED engine to its staged version: pause, load the staged copy, (canary,)
        clear the cache, resume. Refusals change nothing, but a digest other than the staged
        one drops the copy: those bytes are not what the trainer sent."""
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            _check_version(request.version, "version")
            _check_digest_shape(request.staged_digest, "staged_digest")
            _check_instance_id(request.instance_id, "instance_id")
            mode = _pause_mode(request.pause_mode, PauseMode.KEEP)
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
        canary_result = self._run_canary(staged.canary, deadline) if staged.canary else None
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
            _check_instance_id(request.instance_id, "instance_id")
            _check_instance_id(request.target_instance_id, "target_instance_id")
            _check_digest_shape(request.staged_digest, "staged_digest")
            _check_digest_shape(request.plan_digest, "plan_digest")
            if request.version < 1 or not request.staged_digest or not request.group_id:
                raise InvalidArgumentError("ServeCatchUp needs version >= 1, the committed "
                                           "copy's staged digest and a group id",
                                           reason=Reason.INVALID_CATCH_UP)
            _check_version(request.version, "version")
            _check_group_id(request.group_id)
            if not request.listen_address:
                raise InvalidArgumentError("ServeCatchUp needs the listen_address the newcomer "
                                           "reaches this engine at",
                                           reason=Reason.INVALID_CATCH_UP)
            self._check_master(request.listen_address)
            world = request.world_size or 2
            if not 2 <= world <= 1 + MAX_ENGINE_WORLD_SIZE:
                raise InvalidArgumentError(
                    f"world_size must be 1 + the newcomer's engine ranks (2 to "
                    f"{1 + MAX_ENGINE_WORLD_SIZE}; 0 means 2), got {world}",
                    reason=Reason.INVALID_WORLD_SIZE)
            if not self.engine.supports_serving_copy:
                raise FailedPreconditionError(
                    f"the {self.engine.kind} engine cannot serve its committed copy; catch the "
                    "engine up from another peer or by the next epoch",
                    reason=Reason.CATCH_UP_UNSUPPORTED)
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
                self._catch_up = _CatchUp(deadline, serving=True, other=target)
                serving = self._hold_locked("ServeCatchUp")
            context.add_callback(deadline.cancel.set)  # the driver going away ends the serve
            with serving:
                store = bind_master_store(request.listen_address, 0, world,
                                          deadline.check("catch-up rendezvous"))
                spec = GroupSpec(request.listen_address, store.port, world, 0, "gloo",
                                 request.group_id)
                log.info("serving version %d to %s: rendezvous at %s:%d", request.version,
                         target, request.listen_address, store.port)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_LISTENING,
                                              master_port=store.port,
                                              seconds=time.monotonic() - t0)
                # Wait for the newcomer's word before forming the group: gloo's own wait for
                # the other ranks cannot be cancelled, and a newcomer that refused or died must
                # not hold this engine busy until the deadline.
                key = _newcomer_key(request.group_id)
                while not _store_has(store, key):
                    time.sleep(min(0.02, deadline.check("waiting for the newcomer")))
                self.engine.serve_copy(spec, store, deadline)
                # Kept open until the newcomer has it all: its watch reads this rendezvous
                # closing as this engine's death.
                key = _received_key(request.group_id)
                while not _store_has(store, key):
                    time.sleep(min(0.02, deadline.check("waiting for the newcomer's receipt")))
                del store
                log.info("served version %d to %s: %d bytes, %.3fs", request.version, target,
                         plan.total_bytes, time.monotonic() - t0)
                yield pb.ServeCatchUpResponse(phase=pb.SERVE_CATCH_UP_PHASE_SENT,
                                              bytes_sent=plan.total_bytes,
                                              seconds=time.monotonic() - t0)

    def CatchUp(self, request, context):
        """Receive a peer's committed copy into the staging copy (the peer's group, not the
        fleet's: this engine leaves its data group), check the staged digest, load it as a Flip
        does. Before the load nothing changes: a dead peer, a wrong digest or an Abort leave the
        engine as it was (serving what it had; a BROKEN one stays paused)."""
        t0 = time.monotonic()
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_epoch_s)
            _check_instance_id(request.instance_id, "instance_id")
            _check_instance_id(request.peer_instance_id, "peer_instance_id")
            _check_digest_shape(request.staged_digest, "staged_digest")
            _check_digest_shape(request.plan_digest, "plan_digest")
            mode = _pause_mode(request.pause_mode, PauseMode.KEEP)
            if request.version < 1 or not request.staged_digest or not request.group_id:
                raise InvalidArgumentError("CatchUp needs version >= 1, the peer copy's staged "
                                           "digest and a group id", reason=Reason.INVALID_CATCH_UP)
            _check_version(request.version, "version")
            _check_group_id(request.group_id)
            self._check_master(request.master_address)
            spec = GroupSpec(request.master_address, request.master_port,
                             1 + self.engine.world_size, 1, "gloo", request.group_id)
            spec.validate()
            self._check_not_own_port(request.master_address, request.master_port)
            if not self.engine.supports_staging:
                raise FailedPreconditionError(
                    f"the {self.engine.kind} engine cannot stage, so it cannot catch up from a "
                    "peer; the next epoch brings it to the fleet's version",
                    reason=Reason.CATCH_UP_UNSUPPORTED)
            peer = request.peer_instance_id or f"{request.master_address}:{request.master_port}"
            with self._lock:
                self._admit_locked("CatchUp", request.instance_id)
                self._check_newer(request.version)
                plan = self._check_digest(request.plan_digest)
                broken = not self._weights_intact
                # The fleet forms its group again with this engine once it caught up.
                self._drop_group_locked()
                record = self._catch_up = _CatchUp(deadline, serving=False, other=peer)
                catching_up = self._hold_locked("CatchUp")
            context.add_callback(deadline.cancel.set)

            def landed(bucket) -> None:
                record.bytes_received += bucket.nbytes

            loading = False
            watch = _PeerWatch(spec.master_address, spec.master_port, deadline,
                               self.engine.abort_transfer)
            with catching_up:
                try:
                    try:
                        if not set_store_key(spec.master_address, spec.master_port,
                                             _newcomer_key(spec.group_id),
                                             min(deadline.check("catch-up rendezvous"), 10.0)):
                            raise CollectiveError(
                                f"the peer's rendezvous at {spec.master_address}:"
                                f"{spec.master_port} does not answer", reason=Reason.RENDEZVOUS_FAILED)
                        watch.start()
                        self.engine.init_transfer(spec, plan, deadline)
                        digest = self.engine.stage(plan, deadline, landed)
                        watch.stop()
                        # The peer holds its rendezvous open until this word: until then, its going
                        # away means it died (`_PeerWatch`), not that it finished.
                        set_store_key(spec.master_address, spec.master_port,
                                      _received_key(spec.group_id), 5.0)
                    except RefitError as e:
                        err: RefitError = CollectiveError(
                            "the peer went away (its rendezvous closed) mid-transfer",
                            reason=Reason.COLLECTIVE_FAILED) if watch.peer_lost else e
                        cause = "aborted" if deadline.cancel.is_set() and deadline.remaining() > 0 \
                            and not watch.peer_lost else err.message
                        raise type(err)(f"catch-up from peer {peer} failed after "
                                        f"{record.bytes_received} of {plan.total_bytes} bytes: "
                                        f"{cause}", reason=err.reason) from e
                    finally:
                        watch.stop()
                        self.engine.abort_transfer()  # the two-rank group is done either way
                    transfer_s = time.monotonic() - t0
                    if digest != request.staged_digest:
                        raise FailedPreconditionError(
                            f"catch-up from peer {peer}: staged digest {digest[:16]} != the peer "
                            f"copy's {request.staged_digest[:16]}; nothing loaded",
                            reason=Reason.STAGED_DIGEST_MISMATCH)
                    loading = True
                    # Once loading, nothing cancels it (a caller gone, an Abort): a load cut short
                    # would leave partial weights. It has its deadline's time, and at least 10 s.
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

    def Flush(self, request, context):
        with status_on_error(context, self._record_error):
            deadline = self._deadline(context, self.config.max_control_s)
            mode = _pause_mode(request.mode, PauseMode.WAIT)
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
            reason = _printable(request.reason[:MAX_REASON_CHARS])
            if len(request.reason) > MAX_REASON_CHARS:
                reason += f"...({len(request.reason)} chars)"
            epoch = self._abort(reason or "Abort called")
            # The epoch's own handler finishes the transition; wait briefly so the answer is
            # final.
            end = time.monotonic() + 5.0
            while self.state() == pb.SHIM_STATE_RECEIVING and time.monotonic() < end:
                time.sleep(0.01)
            return pb.AbortResponse(state=self.state(), epoch_aborted=epoch is not None)

    def _abort(self, reason: str) -> _Epoch | None:
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

    def _hold_staged_locked(self, epoch: _Epoch, digest: str) -> None:
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
        if not self.engine.supports_delta:
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

    def _flip_timeout(self, requested: float) -> float:
        if requested < 0 or requested != requested or requested == float("inf"):
            raise InvalidArgumentError(f"flip_timeout_s must be >= 0 and finite, got {requested}",
                                       reason=Reason.INVALID_FLIP_TIMEOUT)
        if requested == 0:
            return self.config.default_flip_timeout_s
        return min(requested, self.config.max_flip_timeout_s)

    def _fail_epoch(self, epoch: _Epoch, was_paused: bool) -> None:
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

    def _check_master(self, address: str) -> None:
        """A peer's or a trainer's rendezvous address (or where this shim listens for one): an
        IP literal (no host name, no zone), unicast, within the allowed networks."""
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
        if not any(ip in net for net in self._networks):
            raise FailedPreconditionError(
                f"master_address {address} is outside the allowed networks "
                f"{[str(n) for n in self._networks]}", reason=Reason.MASTER_NOT_ALLOWED)

    def _check_not_own_port(self, address: str, port: int) -> None:
        """A rendezvous on this host is never at one of the shim's own ports (gRPC, metrics):
        the store client would talk to the shim's own server."""
        if port in self.own_ports and ipaddress.ip_address(address).is_loopback:
            raise InvalidArgumentError(
                f"master_port {port} is this shim's own gRPC or metrics port, not a rendezvous",
                reason=Reason.INVALID_MASTER_PORT)

    def _drop_group_locked(self) -> None:
        if self._group is not None:
            self._group = None
            self.engine.abort_transfer()

    def _plan_from_request(self, request) -> RefitPlan:
        if len(request.tensors) > self.config.max_plan_tensors:
            raise PlanTooLargeError(f"plan has {len(request.tensors)} tensors, limit "
                                    f"{self.config.max_plan_tensors}")
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
        return RefitPlan(tuple(specs), packing)


def _newcomer_key(group_id: str) -> str:
    """The key an engine catching up sets in its peer's rendezvous store once it is about to
    join: the peer forms the group only then (ServeCatchUp)."""
    return f"refit_grpc/catch-up/{group_id}/newcomer"


def _received_key(group_id: str) -> str:
    """The key an engine catching up sets once every byte landed: the peer closes its
    rendezvous (and ends ServeCatchUp with SENT) only then."""
    return f"refit_grpc/catch-up/{group_id}/received"


def _store_has(store, key: str) -> bool:
    """Whether the rendezvous store holds `key`; a store that fails (its server dropped the
    connection) is a failed rendezvous, not an unknown error."""
    try:
        return bool(store.check([key]))
    except Exception as e:  # noqa: BLE001  (torch raises DistNetworkError, RuntimeError, ...)
        raise CollectiveError(f"the catch-up rendezvous store failed: {type(e).__name__}: "
                              f"{str(e)[:200]}", reason=Reason.RENDEZVOUS_FAILED) from e


class _PeerWatch:
    """Watches a catch-up's peer while its bytes come: gloo does not fail a pending receive
    when the sending process dies (measured: the receive waits out its deadline), but the
    peer's rendezvous listener, which it keeps open until the newcomer confirms receipt, is
    gone at once. A refused connection there cancels the catch-up and closes its group."""

    def __init__(self, host: str, port: int, deadline: Deadline, close_group) -> None:
        self._address = (host, port)
        self._deadline = deadline
        self._close_group = close_group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="catch-up-watch")
        self.peer_lost = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                socket.create_connection(self._address, timeout=1.0).close()
            except OSError:
                if self._stop.is_set():
                    return
                log.warning("catch-up: the peer's rendezvous at %s:%d is gone", *self._address)
                self.peer_lost = True
                self._deadline.cancel.set()
                self._close_group()
                return


def _check_version(value: int, field: str, reason: Reason = Reason.INVALID_VERSION) -> None:
    """A version is 1 .. MAX_VERSION (a 0 that means "none" is the caller's to allow)."""
    if not 1 <= value <= MAX_VERSION:
        raise InvalidArgumentError(f"{field} must be 1 to {MAX_VERSION}, got {value}",
                                   reason=reason)


def _check_digest_shape(value: str, field: str) -> None:
    problem = digest_problem(value)
    if problem:
        raise InvalidArgumentError(f"{field} {clip(value, 16)!r} {problem}",
                                   reason=Reason.INVALID_DIGEST)


def _check_group_id(value: str, *, required: bool = True) -> None:
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


def _check_instance_id(value: str, field: str) -> None:
    """An instance id (optional everywhere): at most MAX_ID_BYTES, printable."""
    problem = text_problem(value, MAX_ID_BYTES) if value else None
    if problem:
        raise InvalidArgumentError(f"{field} {clip(value)!r} {problem}",
                                   reason=Reason.INVALID_INSTANCE_ID)


def _printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped, for logs."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _pause_mode(value: int, default: PauseMode) -> PauseMode:
    if value == pb.PAUSE_MODE_UNSPECIFIED:
        return default
    if value not in PAUSE_MODE_FROM_PROTO:
        raise InvalidArgumentError(f"unknown pause mode {value}", reason=Reason.INVALID_PAUSE_MODE)
    return PAUSE_MODE_FROM_PROTO[value]


def _epoch_mode(value: int) -> int:
    if value == pb.EPOCH_MODE_UNSPECIFIED:
        return pb.EPOCH_MODE_IN_PLACE
    if value not in (pb.EPOCH_MODE_IN_PLACE, pb.EPOCH_MODE_STAGED):
        raise InvalidArgumentError(f"unknown epoch mode {value}", reason=Reason.INVALID_EPOCH_MODE)
    return value


def _packing_pb(p: Packing):
    return pb.Packing(buffer_size_bytes=p.buffer_size_bytes, num_buffers=p.num_buffers)


__all__ = ["Busy", "RefitServicer", "ShimConfig"]
