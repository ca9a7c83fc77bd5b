"""One vLLM worker's staged receive: a background thread that fills the staging copy while the
worker keeps serving (docs/vllm.md, Staged epochs).

vLLM runs a worker's RPCs one at a time on its main thread, the one that also runs every forward
step. A receive inside an RPC would therefore stop generation for as long as the bytes take. A
staged epoch instead starts the receive on a thread of its own (`StagedReceive.start`, one short
RPC) and returns; the worker's main thread goes back to its engine loop, and the shim polls
`status` (another short RPC) until every bucket has landed. The bytes land in a
`refit_grpc.staging.StagingCopy` in plan layout (each bucket received in place, no bucket
buffers), each bucket's CRC-32 is folded into the staged digest as it lands, and the live weights
are not touched: loading the copy is the flip's job (`LayerwiseReceiver`, `source="staged"`).

Ending a staged receive early: `drop` sets its cancel flag (every wait of the receive notices it
within `refit_grpc.common.CANCEL_POLL_S`), and `shutdown_weight_transfer_engine` closes the group
(its pending waits fail at once). Unlike an in-place receive, no abort key is needed: the
worker's main thread is free to take either RPC. A receive that fails closes its group, as an
in-place one does (a peer left, or receives are still posted on it).

Thread safety: `start`, `status`, `drop`, `take` and `consumed` run on the worker's main thread
(vLLM's RPCs), the receive on its own; the shared fields are guarded by one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import torch

from refit_grpc.collective import Group, receive
from refit_grpc.common import Deadline
from refit_grpc.plan import Bucket, RefitPlan, TensorSpec
from refit_grpc.staging import StagedDigest, StagingCopy
from refit_grpc.wire.worker import (
    STAGE_FAILED,
    STAGE_IDLE,
    STAGE_RECEIVING,
    STAGE_STAGED,
    StageStatus,
)

log = logging.getLogger("vllm.refit_grpc")

# How long `drop` waits for a cancelled receive to end before it answers: the receive notices
# the flag within 50 ms, so this is only reached when a wait is stuck in a slow kernel call.
DROP_WAIT_S = 2.0


class StagedReceive:
    """The staging copy of one worker and the receive that fills it (module docstring).

    Args:
        pin_memory: page-locked copy (a CUDA worker's; the gloo backend's is host memory).
    """

    def __init__(self, pin_memory: bool = False):
        self.copy = StagingCopy(pin_memory=pin_memory)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline: Deadline | None = None
        self._plan: RefitPlan | None = None
        self._state = STAGE_IDLE
        self._landed = 0
        self._digest = ""
        self._error = ""
        self._reason = ""
        self.rank = -1

    @property
    def running(self) -> bool:
        """Whether a staged receive is in flight."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, group: Group, plan: RefitPlan, deadline: Deadline, rank: int,
              on_failure: Callable[[], None]) -> StageStatus:
        """Start receiving `plan` from `group` into the copy; returns at once.

        Args:
            group: the joined data group.
            plan: the epoch's plan.
            deadline: when every bucket must have landed.
            rank: this worker's rank in the group (reported in the status).
            on_failure: runs on the receive's thread when it fails (closes the group).

        Returns:
            The status right after the start (`STAGE_RECEIVING`).

        Raises:
            RuntimeError: a staged receive is still running.
        """
        with self._lock:
            if self.running:
                raise RuntimeError("refit_grpc gloo: a staged receive is still running; "
                                   "drop it first")
            self.copy.allocate(plan)  # kept when the plan is the same; invalid until complete
            self._plan, self._deadline, self.rank = plan, deadline, rank
            self._state, self._landed, self._digest = STAGE_RECEIVING, 0, ""
            self._error = self._reason = ""
            thread = threading.Thread(target=self._run, args=(group, plan, deadline, on_failure),
                                      daemon=True, name="refit-staged-receive")
            self._thread = thread
        thread.start()
        return self.status()

    def _run(self, group: Group, plan: RefitPlan, deadline: Deadline,
             on_failure: Callable[[], None]) -> None:
        digest = StagedDigest(plan)
        copy = self.copy

        def on_bucket(bucket: Bucket) -> None:
            digest.add(bucket, copy.bucket_view(bucket))
            with self._lock:
                self._landed = bucket.index + 1

        log.info("refit_grpc gloo: rank %d staging %d buckets, %d bytes, beside the engine "
                 "loop", self.rank, len(plan.buckets), plan.total_bytes)
        try:
            # Every bucket is received straight into its place in the copy (nothing serves
            # from it, so from the first one): no bucket buffers, no unpacking.
            stats = receive(group, plan, deadline, _never_applied, on_bucket,
                            land=copy.bucket_view, land_from_first=True)
            staged = digest.hexdigest()
        except BaseException as e:  # noqa: BLE001  (reported through status, never lost)
            copy.invalidate()
            with self._lock:
                self._state = STAGE_FAILED
                self._error = f"{type(e).__name__}: {e}"[:800]
                self._reason = str(getattr(e, "reason", "") or "")
            log.warning("refit_grpc gloo: staged receive failed after %d buckets: %s",
                        self._landed, self._error)
            on_failure()
            return
        copy.complete(staged)
        with self._lock:
            self._state, self._digest = STAGE_STAGED, staged
        log.info("refit_grpc gloo: staged %d buckets, %d bytes in %.3fs, digest %s",
                 stats.buckets, stats.bytes, stats.seconds, staged[:12])

    def status(self) -> StageStatus:
        """What the staged receive is doing, or what it ended with."""
        with self._lock:
            plan = self._plan
            return StageStatus(rank=self.rank, state=self._state, landed=self._landed,
                               total=len(plan.buckets) if plan is not None else 0,
                               digest=self._digest, error=self._error, reason=self._reason,
                               staging_bytes=self.copy.nbytes)

    def drop(self) -> StageStatus:
        """Forget the copy (its memory is kept) and end a receive in flight (cancelled; it
        closes its group as it fails). Waits at most `DROP_WAIT_S` for the receive to end."""
        with self._lock:
            thread, deadline = self._thread, self._deadline
        if thread is not None and thread.is_alive() and deadline is not None:
            deadline.cancel.set()
            thread.join(DROP_WAIT_S)
        self.copy.invalidate()
        with self._lock:
            if not self.running:
                self._state, self._digest, self._error, self._reason = STAGE_IDLE, "", "", ""
        return self.status()

    def take(self, staged_digest: str) -> RefitPlan:
        """The plan of the copy, which must hold exactly `staged_digest` (a flip's).

        Raises:
            RuntimeError: nothing complete is staged, a receive runs, or another digest is.
        """
        plan, held = self.copy.plan, self.copy.digest
        if self.running or held is None or plan is None:
            raise RuntimeError("refit_grpc gloo: nothing is staged (never staged, dropped, "
                               "failed, or already loaded)")
        if held != staged_digest:
            raise RuntimeError(f"refit_grpc gloo: the staged copy holds digest {held[:12]}, "
                               f"not {staged_digest[:12]}")
        return plan

    def consumed(self) -> None:
        """The copy was loaded into the live weights: it is no longer a pending version (its
        memory is kept for the next staged epoch)."""
        self.copy.invalidate()
        with self._lock:
            self._state, self._digest = STAGE_IDLE, ""

    def release(self) -> None:
        """End any receive and give the copy's memory back (the engine shuts down)."""
        self.drop()
        self.copy.release()


def _never_applied(bucket: Bucket, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
    raise AssertionError("a staged receive lands every bucket in the staging copy")


__all__ = ["DROP_WAIT_S", "StagedReceive"]
