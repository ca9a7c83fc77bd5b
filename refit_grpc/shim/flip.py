"""A staged version's Flip on the shim: which staged version a Flip may load, and the load itself
(pause, the engine's flip, the canary, caches cleared, resume), which CatchUp runs too once a
peer's copy landed, and Rollback once the engine made its previous copy the staged one. The
facts it changes are `ShimCore`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from refit_grpc.common import Deadline, PauseMode
from refit_grpc.errors import (
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    RefitError,
)
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.canary import score_canary
from refit_grpc.shim.core import ShimCore, StagedVersion
from refit_grpc.shim.engines.base import Engine, LoopFlipTimes

log = logging.getLogger(__name__)


def take_staged_locked(core: ShimCore, request: pb.FlipRequest) -> tuple[StagedVersion, bool]:
    """The staged version a Flip names, taken (its timer stopped), and whether its digest is
    the trainer's. Refusals before that change nothing; a digest other than the staged one
    drops the copy (`refuse_mismatch`): those bytes are not what the trainer sent."""
    staged = core.staged
    if staged is None:
        why = f" (last error: {core.last_error})" if core.last_error else ""
        raise FailedPreconditionError(
            f"nothing staged to flip in state {pb.ShimState.Name(core.state_locked())}{why}",
            reason=Reason.NOT_STAGED)
    if request.version != staged.version:
        raise FailedPreconditionError(
            f"Flip of version {request.version}, staged is {staged.version}",
            reason=Reason.STAGED_VERSION_MISMATCH)
    core.take_staged_locked()
    if request.staged_digest != staged.digest:
        core.last_error = f"STAGED_DIGEST_MISMATCH: staged version {staged.version} dropped"
        return staged, False
    return staged, True


def check_keep_cache(engine: Engine, keep_cache: bool, mode: PauseMode) -> None:
    """A Flip that keeps the caches: only KEEP parks requests whose KV cache there is to keep,
    and only an engine that can keep it across its load (refused before anything changes)."""
    if not keep_cache:
        return
    if mode is not PauseMode.KEEP:
        raise InvalidArgumentError(
            f"keep_cache keeps the KV cache of the requests a KEEP pause parks; pause_mode "
            f"{mode.value} parks none", reason=Reason.INVALID_KEEP_CACHE)
    if not engine.capabilities.keep_cache:
        raise FailedPreconditionError(
            f"the {engine.kind} engine cannot keep its caches across a flip",
            reason=Reason.KEEP_CACHE_UNSUPPORTED)


def refuse_mismatch(core: ShimCore, staged: StagedVersion,
                    trainers: str) -> FailedPreconditionError:
    """Drop the engine's staged copy whose digest is not the trainer's; the error to raise."""
    core.engine.drop_staged()
    return FailedPreconditionError(
        f"staged digest {staged.digest[:16]} != the trainer's {trainers[:16]!r}: the bytes this "
        f"engine staged are not the ones sent; version {staged.version} dropped, serving "
        f"{core.version}", reason=Reason.STAGED_DIGEST_MISMATCH)


def check_rollback_locked(core: ShimCore, request: pb.RollbackRequest) -> tuple[int, str]:
    """The previous copy a Rollback names: (version, staged digest). Refusals change
    nothing."""
    engine = core.engine
    if not engine.capabilities.rollback:
        raise FailedPreconditionError(f"the {engine.kind} engine cannot roll back",
                                      reason=Reason.ROLLBACK_UNSUPPORTED)
    if request.version != core.version:
        raise FailedPreconditionError(
            f"Rollback from version {request.version}, this engine serves {core.version}",
            reason=Reason.ROLLBACK_VERSION_MISMATCH)
    previous = engine.previous_copy
    if previous is None:
        raise FailedPreconditionError(
            f"no previous copy to roll back to from version {core.version} (the epoch that "
            "committed it was not a reversible staged one, or the weights changed since)",
            reason=Reason.NO_PREVIOUS_COPY)
    if request.to_version and request.to_version != previous[0]:
        raise FailedPreconditionError(
            f"Rollback to version {request.to_version}, the previous copy holds {previous[0]}",
            reason=Reason.ROLLBACK_VERSION_MISMATCH)
    return previous


def roll_back(core: ShimCore, request: pb.RollbackRequest, mode: PauseMode,
              deadline: Deadline) -> pb.RollbackResponse:
    """Load the previous copy as a Flip loads a staged one (`load`): the engine makes it its
    staged copy, then pause, load, clear caches, resume. Before the load nothing changed (a
    failed pause gives both copies back); a failed load leaves the engine BROKEN, as a flip's
    does."""
    left = core.version
    version, digest = core.engine.restore_previous(deadline)
    previous = StagedVersion(version, digest, request.verify_weights, None, None)
    done = load(core, previous, mode, request.stay_paused, deadline)
    log.warning("rolled back from version %d to %d", left, version)
    return pb.RollbackResponse(version=version, rolled_back_from=left, staged_digest=digest,
                               stall_seconds=done.stall_seconds, load_seconds=done.load_seconds,
                               weights_digest=done.weights_digest, resumed=done.resumed)


def load(core: ShimCore, staged: StagedVersion, mode: PauseMode, stay_paused: bool,
         deadline: Deadline, *, resume_paused: bool = False,
         keep_cache: bool = False) -> pb.FlipResponse:
    """Pause, load the staged copy, (canary,) clear caches, resume. `resume_paused`: resume even
    an engine that was paused before (a BROKEN one that a catch-up made whole). `keep_cache`
    (checked by `check_keep_cache`): the parked requests keep their KV cache and the prefix
    cache stays, so they go on after the resume without recomputing (off-policy tokens)."""
    engine = core.engine
    if core.plan is not None and core.plan.adapter is not None:
        return _commit_adapter(core, staged, deadline)
    if _in_one_turn(engine, staged, mode, stay_paused, resume_paused):
        return _load_in_loop(core, staged, keep_cache, deadline)
    was_paused = engine.is_paused() and not resume_paused
    t_pause = time.monotonic()
    try:
        engine.pause(mode, deadline, keep_cache=keep_cache)
    except RefitError:
        # Not paused, nothing loaded: the engine serves the old version, whole.
        engine.drop_staged()
        raise
    digest, load_s = _load_or_break(core, staged, deadline)
    canary_result = score_canary(engine, staged.canary, deadline) if staged.canary else None
    with core.lock:
        core.commit_locked(staged.version, canary_result)
    if not keep_cache and not engine.pause_clears_cache:
        # The caches hold values computed with the old weights (an engine whose pause cleared
        # them had nothing computed since: it was paused).
        engine.reset_cache(deadline)
    resumed = not stay_paused and not was_paused
    if resumed:
        engine.resume(deadline)
    stall = time.monotonic() - t_pause
    with core.lock:
        core.last_stall_s = stall
    log.info("flipped to version %d: stall %.3fs (load %.3fs)", staged.version, stall, load_s)
    previous = engine.previous_copy
    return pb.FlipResponse(version=staged.version, stall_seconds=stall, load_seconds=load_s,
                           weights_digest=digest, canary=canary_result, resumed=resumed,
                           previous_copy_version=previous[0] if previous else 0)


def _in_one_turn(engine: Engine, staged: StagedVersion, mode: PauseMode, stay_paused: bool,
                 resume_paused: bool) -> bool:
    """Whether the load may run in one turn of the engine's loop, without a pause: the engine
    can (`Capabilities.flip_in_loop`), serves now, and nothing is asked of it between the load
    and the resume (no canary to score, no digest to check before it serves, no staying
    paused); KEEP only (an ABORT pause ends the running requests, a WAIT pause drains them)."""
    return (engine.capabilities.flip_in_loop and mode is PauseMode.KEEP and not stay_paused
            and not resume_paused and staged.canary is None and not staged.verify_weights
            and not engine.is_paused())


def _load_in_loop(core: ShimCore, staged: StagedVersion, keep_cache: bool,
                  deadline: Deadline) -> pb.FlipResponse:
    """The load in one turn of the engine's loop (`Engine.flip_in_loop`): caches reset (unless
    kept), label set and staged copy loaded between two steps. The stall is the turn, as the
    loop timed it; the round trip around it is not, the engine generates meanwhile."""
    engine = core.engine
    times: list[LoopFlipTimes] = []

    def flip() -> str:
        times.append(engine.flip_in_loop(staged.version, keep_cache, deadline))
        return ""

    _load_or_break(core, staged, deadline, flip)
    with core.lock:
        core.commit_locked(staged.version, None)
        core.last_stall_s = times[0].stall_s
    log.info("flipped to version %d in one turn of the engine loop: stall %.3fs (load %.3fs)",
             staged.version, times[0].stall_s, times[0].load_s)
    previous = engine.previous_copy
    return pb.FlipResponse(version=staged.version, stall_seconds=times[0].stall_s,
                           load_seconds=times[0].load_s, resumed=True,
                           previous_copy_version=previous[0] if previous else 0)


def _commit_adapter(core: ShimCore, staged: StagedVersion,
                    deadline: Deadline) -> pb.FlipResponse:
    """An adapter epoch's flip: the engine loads or replaces the adapter from its staged copy
    while it serves. Nothing is paused: requests for the base model and other adapters go on,
    those naming this one use the new version from their next step. The engine builds the new
    adapter before it lets the old one go, so a failed commit leaves the old one serving and
    the base model untouched: the shim stays whole (not BROKEN), the staged copy is dropped."""
    engine = core.engine
    t_load = time.monotonic()
    try:
        engine.flip(staged.version, deadline)
    except BaseException:
        engine.drop_staged()
        raise
    load_s = time.monotonic() - t_load
    with core.lock:
        core.commit_locked(staged.version, None)
        core.last_stall_s = 0.0
    log.info("adapter epoch: version %d committed in %.3fs, nothing paused", staged.version,
             load_s)
    return pb.FlipResponse(version=staged.version, stall_seconds=0.0, load_seconds=load_s,
                           resumed=False)


def _load_or_break(core: ShimCore, staged: StagedVersion, deadline: Deadline,
                   flip: Callable[[], str] | None = None) -> tuple[str, float]:
    """The engine's flip and its seconds (then the digest the epoch asked for); a failure
    leaves the weights partly loaded: BROKEN, paused until a full update, the group torn
    down."""
    engine = core.engine
    try:
        t_load = time.monotonic()
        digest = flip() if flip is not None else engine.flip(staged.version, deadline)
        load_s = time.monotonic() - t_load
        if staged.verify_weights and not digest:
            digest = engine.weights_digest(deadline)
        return digest, load_s
    except BaseException as e:
        with core.lock:
            core.weights_intact = False  # partly loaded: paused until a full update
            core.group = None
        engine.abort_transfer()
        log.error("flip of version %d failed: %s", staged.version, e)
        if isinstance(e, RefitError):
            raise
        raise EpochAbortedError(f"flip of version {staged.version} failed: "
                                f"{type(e).__name__}: {e}", reason=Reason.FLIP_FAILED) from e


__all__ = ["check_rollback_locked", "load", "refuse_mismatch", "roll_back",
           "take_staged_locked"]
