"""The shim's facts about one engine, under one lock, and the transitions every handler shares.

The state is derived, never stored, so it cannot drift from the facts it summarises
(`ShimCore.state_locked`):
    RECEIVING  an in-place epoch is in flight (engine paused)
    STAGING    a staged epoch is in flight (engine serving the previous version)
    CATCHING_UP  CatchUp is receiving a peer's committed copy (engine serving what it had)
    BROKEN     weights were partly overwritten by a failed epoch or flip (engine stays paused)
    EMPTY      no plan
    STAGED     a staged version waits for its Flip (engine serving the previous version)
    READY      plan + joined data group
    PREPARED   plan, no group
Every RPC is admitted by one table (`shim/admission.py`: which state, BUSY for what, draining,
instance id) through one path, `admit_locked`; the long parts (rendezvous, receive, load) run
outside the lock, marked by `hold_locked` so no two of them overlap, and the one release it
returns ends each. A staged version waits for its Flip here too, with the timer that drops it
when no Flip comes. The invariants this upholds are listed, numbered, in docs/protocol.md.

The flows that change these facts live beside it: `epoch` (UpdateWeights), `flip` (a staged
version's load), `catch_up` (both ends of a peer's rendezvous); `service` translates proto.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.errors import FailedPreconditionError, RefitError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.admission import ADMISSIONS, Busy, refusal
from refit_grpc.shim.catch_up import CatchUp
from refit_grpc.shim.config import ShimConfig
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.receive import Epoch

log = logging.getLogger(__name__)

State = pb.ShimState  # one of its values (plain ints at runtime)


@dataclass
class StagedVersion:
    """A staged version waiting for its Flip: what the epoch asked for at the flip, and the
    timer that drops it when no Flip comes."""

    version: int
    digest: str
    verify_weights: bool
    canary: pb.Canary | None
    expiry: threading.Timer | None  # None: a catch-up's copy, flipped at once


class ShimCore:
    """The facts (read and written under `lock` only), the derived state, admission, and the
    transitions shared by the handlers and flows (module docstring)."""

    def __init__(self, engine: Engine, config: ShimConfig):
        self.engine = engine
        self.config = config
        self.lock = threading.Lock()
        self.plan: RefitPlan | None = None
        self.group: GroupSpec | None = None
        self.weights_intact = True
        self.version = 0             # the version committed (applied)
        self.highest_version = 0     # the highest ever committed (a rollback goes below it)
        self.last_error = ""
        self.busy: Busy | None = None
        self.epoch: Epoch | None = None
        self.last_canary: tuple[int, float] = (0, -1.0)  # (version, max_abs_gap) of the last
        self.staged: StagedVersion | None = None
        self.last_stall_s = 0.0
        self.join_deadline: Deadline | None = None
        self.catch_up: CatchUp | None = None
        self.shutting_down = False

    # --- the derived state and admission ----------------------------------------------------

    def state(self) -> State:
        with self.lock:
            return self.state_locked()

    def state_locked(self) -> State:
        if self.epoch is not None:
            return pb.SHIM_STATE_STAGING if self.epoch.staged else pb.SHIM_STATE_RECEIVING
        if self.busy is Busy.CATCH_UP:
            return pb.SHIM_STATE_CATCHING_UP
        if not self.weights_intact:
            return pb.SHIM_STATE_BROKEN
        if self.plan is None:
            return pb.SHIM_STATE_EMPTY
        if self.staged is not None or self.busy is Busy.FLIP:
            return pb.SHIM_STATE_STAGED
        if self.group is not None:
            return pb.SHIM_STATE_READY
        return pb.SHIM_STATE_PREPARED

    def admit_locked(self, rpc: str, instance_id: str = "", version: int | None = None
                     ) -> None:
        """Refuse `rpc` unless the admission table admits it now (state, busy, draining,
        instance id, a version newer than any applied). A handler's own checks follow under
        the same lock hold, then `hold_locked` if it runs a long operation."""
        refused = refusal(rpc, state=self.state_locked(), busy=self.busy,
                          draining=self.shutting_down, instance_id=instance_id,
                          own_instance_id=self.config.instance_id, version=version,
                          applied=self.version, highest=self.highest_version)
        if refused is not None:
            raise refused

    def hold_locked(self, rpc: str) -> contextlib.AbstractContextManager[None]:
        """Mark the shim busy with `rpc`'s long operation; the context manager returned ends
        it, whatever happens, forgetting what it carried (epoch, join deadline, catch-up). One
        long operation runs at a time, so the release clears them all."""
        busy = ADMISSIONS[rpc].holds
        assert busy is not None and self.busy is None, (rpc, self.busy)
        self.busy = busy
        return self._release_at_end()

    @contextlib.contextmanager
    def _release_at_end(self) -> Iterator[None]:
        try:
            yield
        finally:
            with self.lock:
                self.busy = None
                self.epoch = None
                self.join_deadline = None
                self.catch_up = None

    def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to `grace_s` for a running epoch or join. True if idle."""
        with self.lock:
            self.shutting_down = True
        end = time.monotonic() + grace_s
        while time.monotonic() < end:
            with self.lock:
                if self.busy is None:
                    return True
            time.sleep(0.02)
        return False

    # --- checks and transitions under the lock ----------------------------------------------

    def check_digest_locked(self, digest: str) -> RefitPlan:
        """The prepared plan, if `digest` names it."""
        if not self.plan:
            raise FailedPreconditionError("no plan prepared", reason=Reason.WRONG_STATE)
        if digest != self.plan.digest:
            raise FailedPreconditionError(
                f"plan_digest {digest[:16]!r} != prepared {self.plan.digest[:16]!r}",
                reason=Reason.PLAN_DIGEST_MISMATCH)
        return self.plan

    def drop_group_locked(self) -> None:
        if self.group is not None:
            self.group = None
            self.engine.abort_transfer()

    def commit_locked(self, version: int, canary: pb.CanaryResult | None) -> None:
        """`version` is whole in the engine's weights (an epoch's commit, a flip's load)."""
        self.version = version
        self.highest_version = max(self.highest_version, version)
        self.weights_intact = True
        self.last_error = ""
        if canary is not None:
            self.last_canary = (version, canary.max_abs_gap)

    def record_error(self, err: RefitError) -> None:
        with self.lock:
            self.last_error = f"{err.reason}: {err.message}"

    # --- a staged version waiting for its Flip ----------------------------------------------

    def hold_staged_locked(self, epoch: Epoch, digest: str) -> None:
        """Keep a staged version for its Flip, for at most its flip timeout."""
        expiry = threading.Timer(epoch.flip_timeout_s, self._expire_staged,
                                 args=(epoch.version,))
        expiry.daemon = True
        expiry.name = f"flip-timeout-v{epoch.version}"
        self.staged = StagedVersion(epoch.version, digest, epoch.verify_weights, epoch.canary,
                                    expiry)
        expiry.start()

    def take_staged_locked(self) -> StagedVersion | None:
        staged, self.staged = self.staged, None
        if staged is not None and staged.expiry is not None:
            staged.expiry.cancel()
        return staged

    def _expire_staged(self, version: int) -> None:
        """No Flip came in time (the trainer died, or gave up on this engine): drop the copy;
        the engine serves the old version as it did throughout."""
        with self.lock:
            if self.staged is None or self.staged.version != version:
                return
            self.take_staged_locked()
            self.last_error = f"staged version {version} dropped: no Flip in time"
        self.engine.drop_staged()
        log.warning("staged version %d dropped: no Flip within its flip timeout", version)

    # --- Abort ------------------------------------------------------------------------------

    def abort(self, reason: str, keep_staged: bool = False) -> Epoch | None:
        """Cancel whatever runs (epoch, join, catch-up), drop the group and, unless
        `keep_staged`, a staged version; the epoch in flight, if any (its own handler finishes
        the transition)."""
        with self.lock:
            epoch = self.epoch
            if epoch is not None:
                epoch.abort_reason = reason
                epoch.deadline.cancel.set()
            if self.join_deadline is not None:
                self.join_deadline.cancel.set()
            if self.catch_up is not None:
                self.catch_up.deadline.cancel.set()
            self.last_error = f"aborted: {reason}"
            self.group = None
            staged = None if keep_staged else self.take_staged_locked()
        self.engine.abort_transfer()  # unblocks a pending receive or join on every peer
        if staged is not None:
            self.engine.drop_staged()
            log.warning("abort: dropped staged version %d", staged.version)
        log.warning("abort: %s (epoch in flight: %s)", reason, epoch is not None)
        return epoch


__all__ = ["ShimCore", "StagedVersion", "State"]
