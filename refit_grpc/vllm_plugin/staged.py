"""One vLLM worker's staged receive: a background thread that fills the staging copy while the
worker keeps serving (docs/vllm.md, Staged epochs).

vLLM runs a worker's RPCs one at a time on its main thread, the one that also runs every forward
step. A receive inside an RPC would therefore stop generation for as long as the bytes take. A
staged epoch instead starts the receive on a thread of its own (`StagedReceive.start`, one short
RPC) and returns; the worker's main thread goes back to its engine loop, and the shim polls
`status` (another short RPC) until every bucket has landed. The bytes land in a
`refit_grpc.dataplane.staging.StagingCopy` in plan layout (each bucket received in place, no bucket
buffers), each bucket's checksum is folded into the staged digest as it lands, and the live weights
are not touched: loading the copy is the flip's job (`LayerwiseReceiver`, `source="staged"`).

The committed copy: the flip loads the copy into the model and leaves it as it was, so once the
flip is finished (`committed`) the copy equals the live weights at the flip's version. It stays
the engine's committed copy (one host copy, the same memory staging uses) until an in-place
receive changes the live weights (`forget_committed`) or the next staged epoch overwrites it.
Two things read it: a delta epoch (`start(..., delta=True)`: each bucket's delta is applied onto
the committed copy, `refit_grpc.dataplane.delta.receive_delta`, and the flip loads the result) and a
catch-up (`serve`: the engine's rank-0 worker broadcasts the copy to a newcomer's group while
the engine keeps serving; docs/protocol.md, Catch-up from a peer).

Ending a staged receive early: `drop` sets its cancel flag (every wait of the receive notices it
within `refit_grpc.common.CANCEL_POLL_S`), and `shutdown_weight_transfer_engine` closes the group
(its pending waits fail at once). Unlike an in-place receive, no abort key is needed: the
worker's main thread is free to take either RPC. A receive that fails closes its group, as an
in-place one does (a peer left, or receives are still posted on it).

Thread safety: `start`, `status`, `drop`, `take` and `consumed` run on the worker's main thread
(vLLM's RPCs), the receive on its own; the shared fields are guarded by one lock.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from refit_grpc.common import Deadline
from refit_grpc.dataplane.delta import receive_delta
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.staging import StagedDigest, StagingCopy
from refit_grpc.dataplane.transfer import broadcast_buckets, receive
from refit_grpc.plan import Bucket, RefitPlan, TensorSpec
from refit_grpc.wire.worker import (
    SERVE_DONE,
    SERVE_FAILED,
    SERVE_RUNNING,
    STAGE_FAILED,
    STAGE_IDLE,
    STAGE_RECEIVING,
    STAGE_STAGED,
    ServeInfo,
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
        self._serve = _Serve()

    @property
    def running(self) -> bool:
        """Whether a staged receive is in flight."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, group: Group, plan: RefitPlan, deadline: Deadline, rank: int,
              on_failure: Callable[[], None], delta: bool = False,
              keep_previous: bool = False,
              on_complete: Callable[[RefitPlan, str], None] | None = None) -> StageStatus:
        """Start receiving `plan` from `group` into the copy; returns at once.

        Args:
            group: the joined data group.
            plan: the epoch's plan.
            deadline: when every bucket must have landed.
            rank: this worker's rank in the group (reported in the status).
            on_failure: runs on the receive's thread when it fails (closes the group).
            delta: the buckets come as deltas against the committed copy, which must be laid
                out by the same plan (the shim checked its digest is the trainer's base).
            keep_previous: a reversible epoch: the committed copy is kept as the previous copy
                and the receive lands beside it (`StagingCopy.allocate`).
            on_complete: runs on the receive's thread once the copy is complete, with the plan
                and the staged digest, before the status says staged (the flip's preparation,
                `prepared.prepare`); what it raises is logged, never a failed stage.

        Returns:
            The status right after the start (`STAGE_RECEIVING`).

        Raises:
            RuntimeError: a staged receive is still running, a serve reads the copy, or a
                delta has no committed copy of this plan to apply to.
        """
        with self._lock:
            if self.running:
                raise RuntimeError("refit_grpc gloo: a staged receive is still running; "
                                   "drop it first")
            if self._serve.running:
                raise RuntimeError("refit_grpc gloo: the committed copy is being served to a "
                                   "peer; a staged receive would overwrite it")
            if delta and not self._holds_committed(plan):
                raise RuntimeError("refit_grpc gloo: a delta needs a committed copy of this "
                                   "plan to apply to; this worker has none")
            # Kept when the plan is the same; invalid until complete.
            self.copy.allocate(plan, keep_previous=keep_previous, delta=delta)
            self._plan, self._deadline, self.rank = plan, deadline, rank
            self._state, self._landed, self._digest = STAGE_RECEIVING, 0, ""
            self._error = self._reason = ""
            thread = threading.Thread(target=self._run,
                                      args=(group, plan, deadline, on_failure, delta,
                                            on_complete),
                                      daemon=True, name="refit-staged-receive")
            self._thread = thread
        thread.start()
        return self.status()

    def _holds_committed(self, plan: RefitPlan) -> bool:
        held = self.copy.plan
        return bool(self.copy.live_version and self.copy.digest and held is not None
                    and held.digest == plan.digest)

    def _run(self, group: Group, plan: RefitPlan, deadline: Deadline,
             on_failure: Callable[[], None], delta: bool,
             on_complete: Callable[[RefitPlan, str], None] | None) -> None:
        digest = StagedDigest(plan)
        copy = self.copy

        def on_bucket(bucket: Bucket) -> None:
            digest.add(bucket, copy.bucket_view(bucket))
            with self._lock:
                self._landed = bucket.index + 1

        log.info("refit_grpc gloo: rank %d staging %d buckets, %d bytes%s, beside the engine "
                 "loop", self.rank, len(plan.buckets), plan.total_bytes,
                 " as deltas onto the committed copy" if delta else "")
        t0 = time.monotonic()
        try:
            if delta:
                receive_delta(group, plan, deadline, copy.bucket_view, on_bucket)
            else:
                # Every bucket is received straight into its place in the copy (nothing
                # serves from it, so from the first one): no bucket buffers, no unpacking.
                receive(group, plan, deadline, _never_applied, on_bucket,
                        land=copy.bucket_view, land_from_first=True)
            staged = digest.hexdigest()
        except BaseException as e:  # noqa: BLE001  (reported through status, never lost)
            copy.drop_pending()  # a committed copy set aside as the previous one is back
            with self._lock:
                self._state = STAGE_FAILED
                self._error = f"{type(e).__name__}: {e}"[:800]
                self._reason = str(getattr(e, "reason", "") or "")
            log.warning("refit_grpc gloo: staged receive failed after %d buckets: %s",
                        self._landed, self._error)
            on_failure()
            return
        copy.complete(staged)
        log.info("refit_grpc gloo: staged %d buckets, %d bytes in %.3fs, digest %s",
                 len(plan.buckets), plan.total_bytes, time.monotonic() - t0, staged[:12])
        if on_complete is not None:
            try:
                on_complete(plan, staged)
            except Exception:  # noqa: BLE001  (the flip loads everything itself then)
                log.exception("refit_grpc gloo: preparing the flip failed; the flip will load "
                              "every layer")
        with self._lock:
            self._state, self._digest = STAGE_STAGED, staged

    def status(self) -> StageStatus:
        """What the staged receive is doing, or what it ended with."""
        with self._lock:
            plan = self._plan
            committed = self.copy.live_version
            previous = self.copy.previous
            serve = self._serve.snapshot()
            return StageStatus(rank=self.rank, state=self._state, landed=self._landed,
                               total=len(plan.buckets) if plan is not None else 0,
                               digest=self._digest, error=self._error, reason=self._reason,
                               staging_bytes=self.copy.nbytes,
                               committed_version=committed,
                               committed_digest=(self.copy.digest or "") if committed else "",
                               serve_state=serve[0], served=serve[1], serve_error=serve[2],
                               previous_version=previous[0] if previous else 0,
                               previous_digest=previous[1] if previous else "")

    def drop(self) -> StageStatus:
        """Forget a pending copy (its memory is kept; a committed copy stays) and end a
        receive in flight (cancelled; it closes its group as it fails). Waits at most
        `DROP_WAIT_S` for the receive to end."""
        with self._lock:
            thread, deadline = self._thread, self._deadline
        if thread is not None and thread.is_alive() and deadline is not None:
            deadline.cancel.set()
            thread.join(DROP_WAIT_S)
        self.copy.drop_pending()
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

    def committed(self, version: int | None) -> None:
        """A flip loaded the copy into the live weights and finished: it is no longer a
        pending version but the committed copy of `version` (None: a caller that does not
        say which version, the copy is forgotten; its memory is kept either way)."""
        if version:
            self.copy.mark_live(version)
        else:
            self.copy.invalidate()
        with self._lock:
            self._state, self._digest = STAGE_IDLE, ""

    def restore_previous(self) -> StageStatus:
        """A rollback: the previous copy becomes the staged copy (STAGED, its digest), which
        the flip then loads at its version (`committed`); `drop` puts both back.

        Raises:
            RuntimeError: a receive or serve runs, or no previous copy is kept.
        """
        with self._lock:
            if self.running or self._serve.running:
                raise RuntimeError("refit_grpc gloo: a staged receive or a serve is running; "
                                   "no rollback now")
            try:
                _, digest = self.copy.restore_previous()
            except ValueError as e:
                raise RuntimeError(f"refit_grpc gloo: {e}") from None
            self._state, self._digest, self._error, self._reason = STAGE_STAGED, digest, "", ""
        return self.status()

    def forget_committed(self) -> None:
        """The live weights change without the copy (an in-place receive): it is no longer
        the committed copy."""
        self.copy.invalidate()

    # --- catch-up: serving the committed copy to a newcomer -------------------------------

    def serve(self, info: ServeInfo) -> StageStatus:
        """Broadcast the committed copy to the newcomer's group as its rank 0, on a thread of
        its own; returns at once (`status().serve_state` follows it). The shim hosts the
        group's rendezvous; this worker connects to it.

        Raises:
            RuntimeError: no committed copy, a staged receive or another serve runs.
        """
        with self._lock:
            if self.running:
                raise RuntimeError("refit_grpc gloo: a staged receive is running; it is "
                                   "overwriting the copy a catch-up would read")
            plan = self.copy.plan
            if not self.copy.live_version or not self.copy.digest or plan is None:
                raise RuntimeError("refit_grpc gloo: this worker holds no committed copy to "
                                   "serve")
            self._serve.start(info, plan, self.copy.bucket_view)
        return self.status()

    def cancel_serve(self) -> StageStatus:
        """End a serve in flight (its group closes; the newcomer's receive fails at once)."""
        self._serve.cancel()
        return self.status()

    def release(self) -> None:
        """End any receive or serve and give the copy's memory back (the engine shuts
        down)."""
        self._serve.cancel()
        self.drop()
        self.copy.release()


class _Serve:
    """One serve of the committed copy at a time: its thread, its group and how it went.

    The copy is not written meanwhile: `StagedReceive.start` refuses while a serve runs (and
    the shim admits no epoch during a catch-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline: Deadline | None = None
        self._group: Group | None = None
        self._state, self._served, self._error = "", 0, ""

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def snapshot(self) -> tuple[str, int, str]:
        with self._lock:
            return self._state, self._served, self._error

    def start(self, info: ServeInfo, plan: RefitPlan,
              bucket_bytes: Callable[[Bucket], torch.Tensor]) -> None:
        with self._lock:
            if self.running:
                raise RuntimeError("refit_grpc gloo: a serve of the committed copy is "
                                   "already running")
            deadline = Deadline(info.timeout_s)
            self._deadline, self._state, self._served, self._error = (
                deadline, SERVE_RUNNING, 0, "")
            thread = threading.Thread(target=self._run, args=(info, plan, bucket_bytes, deadline),
                                      daemon=True, name="refit-serve-copy")
            self._thread = thread
        thread.start()

    def _run(self, info: ServeInfo, plan: RefitPlan,
             bucket_bytes: Callable[[Bucket], torch.Tensor], deadline: Deadline) -> None:
        def sent(bucket: Bucket) -> None:
            with self._lock:
                self._served = bucket.index + 1

        t0 = time.monotonic()
        try:
            store = dist.TCPStore(info.master_address, info.master_port, is_master=False,
                                  wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=min(info.timeout_s, 10.0)))
            group = Group.join(info.spec(), deadline.check("catch-up rendezvous"), store=store,
                               cancel=deadline.cancel)
            with self._lock:
                self._group = group
            try:
                broadcast_buckets(group, plan, bucket_bytes, deadline, sent)
            finally:
                with self._lock:
                    self._group = None
                group.close()
        except BaseException as e:  # noqa: BLE001  (reported through status, never lost)
            with self._lock:
                self._state, self._error = SERVE_FAILED, f"{type(e).__name__}: {e}"[:800]
            log.warning("refit_grpc gloo: serving the committed copy failed after %d buckets: "
                        "%s", self._served, self._error)
            return
        with self._lock:
            self._state = SERVE_DONE
        log.info("refit_grpc gloo: served the committed copy, %d buckets, %d bytes in %.3fs",
                 len(plan.buckets), plan.total_bytes, time.monotonic() - t0)

    def cancel(self) -> None:
        with self._lock:
            deadline, group = self._deadline, self._group
        if deadline is not None:
            deadline.cancel.set()
        if group is not None:
            group.close()  # never blocks; the pending broadcasts fail at once
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(DROP_WAIT_S)


def _never_applied(bucket: Bucket, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
    raise AssertionError("a staged receive lands every bucket in the staging copy")


__all__ = ["DROP_WAIT_S", "StagedReceive"]
