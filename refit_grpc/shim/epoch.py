"""One UpdateWeights epoch on the shim: what it asks for, what it needs of the shim, and its run
(pause in place, receive, then commit, or hold the staged version for its Flip; a failure
leaves the engine as invariants 1 and 8 say). The receive itself runs on its own thread
(`shim/receive.py`); the facts it changes are `ShimCore`'s.

Refinement of the design: an epoch that fails before any byte reached the engine leaves the
weights intact, so the engine is resumed and the shim returns to PREPARED (group torn down), not
BROKEN. That is what lets one worker's refusal abort the others without taking them offline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from refit_grpc.common import Deadline, PauseMode
from refit_grpc.dataplane.staging import STAGED_CHECKSUM
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError, RefitError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.canary import check_canary
from refit_grpc.shim.config import ShimConfig
from refit_grpc.shim.core import ShimCore
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.fields import (
    check_digest_shape,
    check_group_id,
    check_instance_id,
    check_version,
    epoch_mode,
    flip_timeout,
    pause_mode,
)
from refit_grpc.shim.receive import Epoch, EpochReceive, Received

log = logging.getLogger(__name__)


def epoch_from_request(core: ShimCore, request: pb.UpdateWeightsRequest,
                       deadline: Deadline) -> tuple[Epoch, PauseMode]:
    """The epoch an UpdateWeights asks for, every field and what it needs of the engine
    (canary, staging, delta) checked; the shim's state is the admission's and
    `check_epoch_locked`'s."""
    engine, config = core.engine, core.config
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
    staged = epoch_mode(request.mode) == pb.EPOCH_MODE_STAGED
    if request.resume_on_commit:  # the request's own fields, before what the engine can do
        _check_resume_on_commit(staged, canary)
    if canary is not None:
        check_canary(canary, engine)
    flip_timeout_s = flip_timeout(request.flip_timeout_s, config.default_flip_timeout_s,
                                  config.max_flip_timeout_s) if staged else 0.0
    if staged and not engine.capabilities.staging:
        raise FailedPreconditionError(
            f"the {engine.kind} engine cannot stage an epoch; open it IN_PLACE",
            reason=Reason.STAGING_UNSUPPORTED)
    if staged and request.staged_checksum and request.staged_checksum != STAGED_CHECKSUM:
        # Bytes staged under another checksum could never match the driver's digest at the
        # Flip: refused before any byte moves (a driver and shims of different releases).
        raise FailedPreconditionError(
            f"the driver's staged digest uses checksum {request.staged_checksum[:64]!r}, this shim's "
            f"{STAGED_CHECKSUM!r}: run one refit_grpc release on both ends",
            reason=Reason.STAGING_UNSUPPORTED)
    delta = bool(request.delta_base_version or request.delta_base_digest)
    if delta:
        _check_delta_request(request, staged, engine)
    # Reversible where the engine can keep a previous copy; what it kept, Describe and the
    # FlipResponse say (an engine that cannot, or has no committed copy, keeps none).
    reversible = staged and request.reversible and engine.capabilities.rollback
    return Epoch(request.version, deadline, request.verify_weights, canary, staged=staged,
                 delta=delta, reversible=reversible, flip_timeout_s=flip_timeout_s,
                 resume_on_commit=request.resume_on_commit), mode


def _check_resume_on_commit(staged: bool, canary: pb.Canary | None) -> None:
    """Resuming at the commit is an in-place epoch's, without a canary: a staged epoch never
    pauses (its Flip resumes), and a canary is compared by the trainer before any engine may
    serve what it computed."""
    if staged:
        raise InvalidArgumentError(
            "resume_on_commit is for an in-place epoch: a staged one never pauses (its Flip "
            "resumes, unless stay_paused)", reason=Reason.INVALID_RESUME_ON_COMMIT)
    if canary is not None:
        raise InvalidArgumentError(
            "resume_on_commit with a canary: the trainer compares the canary before the "
            "engine serves again; Flush after the check instead",
            reason=Reason.INVALID_RESUME_ON_COMMIT)


def _check_delta_request(request: pb.UpdateWeightsRequest, staged: bool, engine: Engine) -> None:
    """A delta epoch is staged, on an engine that applies deltas, and names its base."""
    if not staged:
        raise InvalidArgumentError("a delta epoch is a staged one (mode EPOCH_MODE_STAGED)",
                                   reason=Reason.INVALID_DELTA)
    if not (request.delta_base_version and request.delta_base_digest):
        raise InvalidArgumentError("a delta epoch names its base by version and digest",
                                   reason=Reason.INVALID_DELTA)
    if not engine.capabilities.delta:
        raise FailedPreconditionError(f"the {engine.kind} engine cannot apply a delta; "
                                      "send a full epoch", reason=Reason.DELTA_UNSUPPORTED)


def check_epoch_locked(core: ShimCore, request: pb.UpdateWeightsRequest,
                       epoch: Epoch) -> RefitPlan:
    """What an admitted epoch (its version is newer: the admission checked it) needs of this
    shim: its delta base, the joined group, the prepared plan (returned)."""
    if epoch.delta:
        _check_delta_base(core.engine, request)
    if core.group is None:
        raise FailedPreconditionError("no data group: call InitCollective first",
                                      reason=Reason.NO_GROUP)
    plan = core.check_digest_locked(request.plan_digest)
    if request.group_id != core.group.group_id:
        raise FailedPreconditionError(
            f"group_id {request.group_id!r} != joined {core.group.group_id!r}",
            reason=Reason.GROUP_MISMATCH)
    if plan.adapter is not None:
        _check_adapter_epoch(plan, epoch)
    return plan


def _check_adapter_epoch(plan: RefitPlan, epoch: Epoch) -> None:
    """An adapter's epoch is staged, full and without a canary (docs/adapters.md): its flip
    replaces the adapter while the engine serves, so there is no pause to run an in-place
    receive or a canary in, and no committed copy to apply a delta to."""
    assert plan.adapter is not None
    name = plan.adapter.name
    if not epoch.staged:
        raise FailedPreconditionError(
            f"adapter {name!r}: an adapter epoch is staged (mode EPOCH_MODE_STAGED); its flip "
            "replaces the adapter without pausing the engine", reason=Reason.ADAPTER_NOT_STAGED)
    if epoch.delta:
        raise FailedPreconditionError(f"adapter {name!r}: adapter epochs are full, not deltas",
                                      reason=Reason.DELTA_UNSUPPORTED)
    if epoch.canary is not None:
        raise FailedPreconditionError(
            f"adapter {name!r}: no canary on an adapter epoch (nothing is paused to hold a "
            "failed one back)", reason=Reason.CANARY_UNSUPPORTED)


def _check_delta_base(engine: Engine, request: pb.UpdateWeightsRequest) -> None:
    """A delta goes only onto exactly the committed copy this engine holds (version and staged
    digest): applied to anything else it would produce other weights (invariant 11). Under the
    lock, once admitted: a restarted shim holds no copy, and its answer is MEMBERSHIP_CHANGED."""
    held = engine.committed_copy
    if held != (request.delta_base_version, request.delta_base_digest):
        have = f"version {held[0]} ({held[1][:16]})" if held else "none"
        raise FailedPreconditionError(
            f"delta base version {request.delta_base_version} "
            f"({request.delta_base_digest[:16]}) is not this engine's committed copy: "
            f"{have}; send a full epoch", reason=Reason.DELTA_BASE_MISMATCH)


def run_epoch(core: ShimCore, epoch: Epoch, plan: RefitPlan, mode: PauseMode,
              receiving: contextlib.AbstractContextManager[None],
              t0: float) -> Iterator[pb.UpdateWeightsResponse]:
    """Pause (in place only), receive, then commit or hold the staged version; a failure is
    `_fail_epoch`'s, while the shim is still RECEIVING (or STAGING)."""
    engine = core.engine
    committed = False
    was_paused = engine.is_paused()
    receive = EpochReceive(engine, plan, epoch,
                           progress_interval_s=core.config.progress_interval_s)
    try:
        with receiving:
            try:
                if not epoch.staged:  # a staged epoch never pauses: the engine serves
                    engine.pause(mode, epoch.deadline)
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
                last = _end_epoch(core, epoch, plan, receive.result, t_accept)
                committed = True
                yield last
            finally:
                if not committed:
                    epoch.deadline.cancel.set()
                    engine.abort_transfer()
                    receive.join()
                    _fail_epoch(core, epoch, was_paused)
    finally:
        if not committed:
            log.warning("epoch %d failed after %d bytes; state now %s", epoch.version,
                        epoch.bytes_applied, pb.ShimState.Name(core.state()))


def _end_epoch(core: ShimCore, epoch: Epoch, plan: RefitPlan, received: Received,
               t_accept: float) -> pb.UpdateWeightsResponse:
    """A receive that ended well: hold the staged version for its Flip (STAGED), or commit the
    version (COMMITTED). An Abort that raced the last bucket wins."""
    if epoch.staged:
        with core.lock:
            epoch.deadline.check("staged")
            core.hold_staged_locked(epoch, received.digest)
        seconds = time.monotonic() - t_accept
        log.info("staged version %d (%d bytes, %.3fs; digest %s), flip within %.0fs",
                 epoch.version, plan.total_bytes, seconds, received.digest[:12],
                 epoch.flip_timeout_s)
        return pb.UpdateWeightsResponse(
            phase=pb.UPDATE_WEIGHTS_PHASE_STAGED, version=epoch.version,
            bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
            seconds=seconds, staged_digest=received.digest)
    with core.lock:
        epoch.deadline.check("commit")
        core.commit_locked(epoch.version, received.canary)
    resumed = epoch.resume_on_commit and _resume_committed(core.engine, core.config)
    seconds = time.monotonic() - t_accept
    log.info("committed version %d (%d bytes, %.3fs)%s", epoch.version, plan.total_bytes,
             seconds, ", serving it" if resumed else "")
    return pb.UpdateWeightsResponse(
        phase=pb.UPDATE_WEIGHTS_PHASE_COMMITTED, version=epoch.version,
        bucket_count=len(plan.buckets), bytes_received=epoch.bytes_applied,
        seconds=seconds, weights_digest=received.digest, canary=received.canary,
        resumed=resumed)


def _resume_committed(engine: Engine, config: ShimConfig) -> bool:
    """What Flush does after an in-place epoch (the engine is paused already): clear the
    caches, resume. The weights are committed whatever happens here: a failure leaves the
    engine paused at the new version, and COMMITTED says so (resumed false) for a Flush."""
    deadline = Deadline(config.max_control_s)  # the epoch's own may be nearly spent
    try:
        clear_caches(engine, deadline)
        engine.resume(deadline)
    except Exception as e:  # noqa: BLE001  (whatever it was, the commit stands: a Flush follows)
        log.warning("resume after the commit failed, the engine stays paused: %s", e,
                    exc_info=not isinstance(e, RefitError))
        return False
    return True


def clear_caches(engine: Engine, deadline: Deadline) -> bool:
    """Clear the engine's caches before it serves new weights, unless its pause did already
    (vLLM's and Dynamo's: `pause_clears_cache`), so they are not asked twice. True: they are
    clear."""
    return engine.pause_clears_cache or engine.reset_cache(deadline)


def _fail_epoch(core: ShimCore, epoch: Epoch, was_paused: bool) -> None:
    """A failed staged epoch wrote only the staging copy: dropped, the engine serving the old
    version. A failed in-place one is BROKEN once a byte (or the engine cannot tell) reached
    the weights; else the engine is resumed, its weights whole (the module's refinement)."""
    engine = core.engine
    engine.abort_transfer()
    if epoch.staged:
        engine.drop_staged()
        with core.lock:
            core.group = None
        return
    with core.lock:
        core.group = None
        if epoch.bytes_applied > 0 or engine.partial_on_failure:
            core.weights_intact = False
    if epoch.bytes_applied == 0 and not engine.partial_on_failure and not was_paused:
        try:
            engine.resume(Deadline(core.config.max_control_s))
        except RefitError as e:
            log.warning("resume after refused epoch failed: %s", e)


__all__ = ["check_epoch_locked", "clear_caches", "epoch_from_request", "run_epoch"]
