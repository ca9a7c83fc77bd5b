"""One UpdateWeights epoch as the trainer sees it: a stream per worker (or per shim process
for engines sharing a rank), consumed on the driver's I/O loop, and the two waits of the
two-phase start (every ACCEPTED, then every COMMITTED, or for a staged epoch every STAGED:
`settle()`)."""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import grpc.aio

from refit_grpc.common import Deadline, PauseMode
from refit_grpc.driver.calls import WorkerLink
from refit_grpc.driver.checks import Checks
from refit_grpc.driver.failures import (
    EpochFailedError,
    EpochRefusedError,
    FleetTimeoutError,
    MembershipRefusedError,
    WorkerFailure,
    explained_by_abort,
    failure_from_rpc,
    failure_from_status,
    root_causes_first,
)
from refit_grpc.driver.io_loop import IoLoop
from refit_grpc.driver.options import Epoch, InPlace, Staged
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

# (instance_id, bucket_index, bucket_count), called after each PROGRESS a shim sends, on the
# driver's I/O thread: it must not block, nor call the fleet (hand such work to a thread).
ProgressCallback = Callable[[str, int, int], None]
# Aborts the given workers (keeping complete staged copies when told); returns one answer per
# worker, None where none came.
AbortFleet = Callable[[str, Sequence["WorkerLink"], bool], Sequence[object | None]]

# How long an epoch waits for streams to settle after it aborted the fleet: every failure that
# arrives by then is collected, so the worker that caused the others is named even when a
# survivor's consequence (its collective reset by the dead peer) reached the driver first.
_SETTLE_AFTER_REFUSAL_S = 2.0
_SETTLE_AFTER_FAILURE_S = 5.0


class StreamPhase(enum.Enum):
    """How far one worker's UpdateWeights stream has come."""

    OPEN = "open"
    ACCEPTED = "accepted"
    COMMITTED = "committed"
    STAGED = "staged"  # a staged epoch's stream ends here
    FAILED = "failed"


class EpochHandle:
    """One UpdateWeights epoch, as `Fleet.update_weights()` returns it: wait with
    `wait_accepted()`, broadcast, then `result()`.

    One UpdateWeights stream per worker, each consumed by a coroutine on the driver's I/O
    loop (`io`): no thread per worker, however wide the fleet. Workers that are engines of one
    shim process sharing a receiving rank (`bundles`) share one UpdateEngines stream instead:
    one stream per process, what the trainer's control cost per engine is made of.

    `close()` cancels every stream still open and waits for its consumers; `Fleet.close()`
    closes every epoch it opened, then the loop.

    The handle carries what the epoch was opened with (`epoch`, `checks`, `pause_mode`), so
    `Fleet.flip()` ends a staged one as it was opened, with nothing repeated.
    """

    def __init__(self, workers: Sequence[WorkerLink], version: int,
                 requests: Sequence[pb.UpdateWeightsRequest], timeout_s: float,
                 abort_fleet: AbortFleet, on_progress: ProgressCallback | None = None, *,
                 io: IoLoop, epoch: Epoch | None = None, checks: Checks | None = None,
                 pause_mode: PauseMode = PauseMode.KEEP,
                 bundles: Sequence[Sequence[int]] = ()):
        self.version = version
        self.started_at = time.monotonic()
        self.deadline_at = self.started_at + timeout_s
        self._workers = list(workers)
        self._abort_fleet = abort_fleet
        # A staged epoch's abort spares the workers that already STAGED: their copies wait for
        # the flip (or the trainer drops them), and only unfinished receives need tearing down.
        if epoch is None:
            epoch = Staged() if requests and requests[0].mode == pb.EPOCH_MODE_STAGED \
                else InPlace()
        self.epoch: Epoch = epoch
        self.staged = isinstance(epoch, Staged)
        self.checks = checks or Checks()
        self.pause_mode = pause_mode
        self._on_progress = on_progress
        # Workers (indexes) whose epochs run over one stream to their shim process
        # (UpdateEngines): engines sharing a receiving rank. Every other worker has its own.
        self._bundles = [list(b) for b in bundles]
        n = len(self._workers)
        self._phase = [StreamPhase.OPEN] * n
        self._accepted_ever = [False] * n
        self._committed: list[pb.UpdateWeightsResponse | None] = [None] * n
        self._failures: list[WorkerFailure | None] = [None] * n
        self._failure_order: list[int] = []  # worker indexes, in the order their failures came
        # Counted, so a waiter wakes at a stream's end or a failure and checks in O(1), not at
        # each of a thousand engines' messages to scan them all again.
        self._done = [False] * n
        self._done_count = 0
        self._accepted_count = 0
        self._changed = threading.Condition()
        self._aborted = False
        self._unresponsive: set[int] = set()
        # Buckets each worker reported applied (PROGRESS) so far in this epoch.
        self.buckets_applied = [0] * n
        # Set by the first worker failure: the sender watches it, so a lost peer stops the
        # broadcast in seconds rather than at the epoch deadline.
        self.failed = threading.Event()
        # Each stream is opened by its consumer, on the loop: the shims answer the first ones
        # while later ones open.
        self._io = io
        self._calls: list[grpc.aio.UnaryStreamCall | None] = [None] * n
        self._cancelled = False
        # One hand-off to the loop for the whole fleet (one per stream cost the caller's thread
        # about 0.1 ms each).
        self._consumers = [io.submit(self._consume_all(requests))]

    # --- public surface ----------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left before the epoch's deadline.

        Returns:
            The seconds left, negative once past.
        """
        return self.deadline_at - time.monotonic()

    def send_deadline(self) -> Deadline:
        """The sender's deadline.

        Returns:
            The epoch's deadline, cancelled by the first worker failure.
        """
        return Deadline(max(self.remaining(), 0.001), cancel=self.failed)

    def phases(self) -> list[StreamPhase]:
        """Each worker's stream phase, in fleet order."""
        with self._changed:
            return list(self._phase)

    def wait_accepted(self, timeout_s: float | None = None) -> None:
        """Block until every worker said ACCEPTED.

        The first failure aborts the fleet; the refusal then names every worker that failed
        until the streams settle (bounded by _SETTLE_AFTER_REFUSAL_S), root causes first: a
        dead shim's UNAVAILABLE can arrive after a survivor's COLLECTIVE_FAILED (its receive
        reset by that dead peer), and it is the dead one that must lead. Failures that the
        driver's own Abort explains (`explained_by_abort`) and that came after it name no one.

        Args:
            timeout_s: the most to wait; by default until the epoch's deadline.

        Raises:
            EpochRefusedError: a worker refused (the fleet aborted first).
            FleetTimeoutError: a worker stayed silent past the timeout.
        """
        end = min(self.deadline_at, time.monotonic() + (timeout_s or float("inf")))
        with self._changed:
            while True:
                if self._failure_order:
                    break
                if self._accepted_count == len(self._workers):
                    return
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            before_abort = set(self._failure_order)
            silent = [self._workers[i].endpoint for i, a in enumerate(self._accepted_ever)
                      if not a and self._failures[i] is None]
        self.abort(f"epoch {self.version} refused")
        self._settle(_SETTLE_AFTER_REFUSAL_S)
        # No failure before the abort: the wait timed out, and what the streams say now is the
        # abort's (or the deadline's) doing; the silent workers are named below.
        refused = root_causes_first(
            f for i, f in self._failures_so_far()
            if i in before_abort or (before_abort and not explained_by_abort(f)))
        if refused and all(f.reason == Reason.MEMBERSHIP_CHANGED for f in refused):
            raise MembershipRefusedError(f"epoch {self.version} refused: restarted since the "
                                         "group was formed", refused)
        if refused:
            raise EpochRefusedError(f"epoch {self.version} refused before any byte moved",
                                    refused, reason=refused[0].reason)
        raise FleetTimeoutError(
            f"epoch {self.version}: no ACCEPTED within the deadline",
            [WorkerFailure(e.instance_id, e.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                           Reason.ACCEPT_TIMEOUT, "no ACCEPTED") for e in silent])

    def result(self, timeout_s: float | None = None) -> list[pb.UpdateWeightsResponse]:
        """Block until every worker COMMITTED.

        The first failure aborts the fleet at once: survivors blocked in a collective with a dead
        peer would otherwise wait out their whole deadline.

        Args:
            timeout_s: the most to wait; by default the epoch's deadline (plus 2 s).

        Returns:
            Each worker's COMMITTED message, in fleet order.

        Raises:
            EpochFailedError: a worker failed; names each failure, root causes first.
            FleetTimeoutError: the only failures are workers with no COMMITTED in time.
        """
        if self._wait_until_ended(timeout_s):
            with self._changed:
                return [c for c in self._committed if c is not None]
        failures, silent = self._failures_after_abort()
        cls = FleetTimeoutError if silent and len(failures) == silent else EpochFailedError
        raise cls(f"epoch {self.version} failed", failures)

    def abort(self, reason: str) -> None:
        """Abort the epoch's workers once (every later call is a no-op): all of them, or in a
        staged epoch those that have not STAGED.

        Args:
            reason: recorded by every shim.
        """
        with self._changed:
            if self._aborted:
                return
            self._aborted = True
            targets = [i for i, p in enumerate(self._phase)
                       if not (self.staged and p is StreamPhase.STAGED)]
        # A staged epoch's Abort keeps complete copies: a receive that finished after this
        # driver last heard (its STAGED on the way) must not lose its copy to an Abort meant
        # for the unfinished ones (measured at 64 shims under load: 31 of 47 copies lost so).
        answers = self._abort_fleet(reason, [self._workers[i] for i in targets], self.staged)
        # A shim that cannot even answer Abort (frozen, partitioned, dead) is the likeliest
        # cause when every stream merely timed out: it is named first.
        with self._changed:
            self._unresponsive = {i for i, a in zip(targets, answers) if a is None}

    def settle(self, timeout_s: float | None = None
               ) -> tuple[list[pb.UpdateWeightsResponse | None], list[WorkerFailure]]:
        """Wait for every stream to end, for a staged epoch: it never raises, so the driver
        can flip the engines that STAGED when enough did.

        The first failure aborts the workers that have not STAGED (their receives would wait
        on the broken group) and the streams settle (bounded by _SETTLE_AFTER_FAILURE_S).

        Args:
            timeout_s: the most to wait; by default the epoch's deadline (plus 2 s).

        Returns:
            Each worker's last message (STAGED, or None where its stream failed or never
            ended), in fleet order; and the failures, root causes first, a worker with no
            STAGED in time named COMMIT_TIMEOUT.
        """
        failures = [] if self._wait_until_ended(timeout_s) else self._failures_after_abort()[0]
        with self._changed:
            finals = [m if done and self._failures[i] is None else None
                      for i, (m, done) in enumerate(zip(self._committed, self._done))]
        return finals, failures

    def _wait_until_ended(self, timeout_s: float | None) -> bool:
        """Block until every stream ended or one failed (bounded by `timeout_s`, by default
        the epoch's deadline plus 2 s); True when every stream ended and none failed."""
        end = min(self.deadline_at + 2.0, time.monotonic() + (timeout_s or float("inf")))
        n = len(self._workers)
        with self._changed:
            while self._done_count < n:
                if self._failure_order:
                    break
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            return self._done_count == n and not self._failure_order

    def _failures_after_abort(self) -> tuple[list[WorkerFailure], int]:
        """The epoch failed: abort it (`abort`), let the streams settle, cancel the rest.

        Returns:
            Every failure, root causes first, a worker whose stream is still open named
            COMMIT_TIMEOUT; and how many of those silent workers there are.
        """
        reason = f"epoch {self.version} failed"
        self.abort(reason)
        self._settle(_SETTLE_AFTER_FAILURE_S)
        self.cancel()
        self._ask_the_silent_again(reason)
        failures = [f for _, f in self._failures_so_far()]
        failed_ids = {f.instance_id for f in failures}
        final = "STAGED" if self.staged else "COMMITTED"
        silent = [WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                grpc.StatusCode.DEADLINE_EXCEEDED, Reason.COMMIT_TIMEOUT,
                                f"no {final} within the deadline")
                  for w, done in zip(self._workers, self._done)
                  if not done and w.endpoint.instance_id not in failed_ids]
        return root_causes_first(failures + silent), len(silent)

    def _ask_the_silent_again(self, reason: str) -> None:
        """When several workers did not answer the Abort, ask those again, once (Abort is
        idempotent): a worker that answers now was alive but slow (its stream had merely timed
        out waiting on the frozen peer, and a loaded host delayed its answer past the abort
        timeout), and is no longer named UNRESPONSIVE before the one that still does not answer
        (seen once in CI: a frozen shim's two survivors all UNRESPONSIVE, named in the order
        their streams ended). One worker alone is named first anyway: no second wait."""
        with self._changed:
            again = sorted(self._unresponsive)
        if len(again) < 2:
            return
        answers = self._abort_fleet(reason, [self._workers[i] for i in again], self.staged)
        with self._changed:
            self._unresponsive = {i for i, a in zip(again, answers) if a is None}

    def cancel(self) -> None:
        """Cancel every stream still open (the shims see their caller go away)."""
        with self._changed:
            self._cancelled = True
            calls = [c for c in self._calls if c is not None]
        # grpc.aio calls are touched only on their loop.
        for call in calls:
            self._io.call_soon(call.cancel)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel what is still open and wait (bounded) for the stream consumers to end.

        Args:
            timeout_s: the most to wait for the consumers.
        """
        self.cancel()
        futures.wait(self._consumers, timeout=timeout_s)

    @property
    def closed(self) -> bool:
        """Every stream consumer has ended."""
        return all(f.done() for f in self._consumers)

    # --- the streams -------------------------------------------------------------------------

    async def _consume_all(self, requests: Sequence[pb.UpdateWeightsRequest]) -> None:
        bundled = {i for indexes in self._bundles for i in indexes}
        await asyncio.gather(
            *(self._consume(i, w, r) for i, (w, r) in enumerate(zip(self._workers, requests))
              if i not in bundled),
            *(self._consume_bundle(indexes, requests) for indexes in self._bundles))

    async def _consume(self, i: int, w: WorkerLink, request: pb.UpdateWeightsRequest) -> None:
        """One worker's UpdateWeights stream."""
        failure: WorkerFailure | None = None
        try:
            call = w.stub.UpdateWeights(
                request, timeout=max(self.deadline_at - time.monotonic(), 0.001),
                metadata=w.metadata)
            self._opened([i], call)
            async for msg in call:
                self._said(i, msg)
            failure = self._ended_well(i)
        except BaseException as e:  # noqa: BLE001  (a failure of this worker; see _failure)
            failure = self._failure(w, e)
        finally:
            self._end(i, failure)

    async def _consume_bundle(self, indexes: Sequence[int],
                              requests: Sequence[pb.UpdateWeightsRequest]) -> None:
        """The workers of one shim process sharing a rank: one UpdateEngines stream, opened
        to the first of them, carrying each one's epoch (its messages and its end in-band).
        The stream's own failure is every worker's whose epoch had not ended, each named."""
        head = self._workers[indexes[0]]
        index_of = {requests[i].instance_id: i for i in indexes}
        ended: set[int] = set()
        try:
            call = head.stub.UpdateEngines(
                pb.UpdateEnginesRequest(engines=[requests[i] for i in indexes]),
                timeout=max(self.deadline_at - time.monotonic(), 0.001), metadata=head.metadata)
            self._opened(indexes, call)
            async for batch in call:
                for update in batch.updates:
                    i = index_of.get(update.instance_id, -1)
                    if i < 0 or i in ended:
                        continue  # not an engine this stream asked for: nothing to record
                    if not update.ended:
                        self._said(i, update.update)
                        continue
                    ended.add(i)
                    self._end(i, failure_from_status(self._workers[i].endpoint, update.status)
                              if update.status else self._ended_well(i))
            for i in indexes:
                if i not in ended:
                    ended.add(i)
                    w = self._workers[i]
                    self._end(i, WorkerFailure(
                        w.endpoint.instance_id, w.endpoint.address, grpc.StatusCode.UNKNOWN,
                        Reason.DRIVER_ERROR, "its process's UpdateEngines stream ended without "
                        "this engine's end"))
        except BaseException as e:  # noqa: BLE001  (a failure of every worker not ended)
            for i in indexes:
                if i not in ended:
                    ended.add(i)
                    self._end(i, self._failure(self._workers[i], e))

    def _opened(self, indexes: Sequence[int], call: grpc.aio.UnaryStreamCall) -> None:
        with self._changed:
            for i in indexes:
                self._calls[i] = call
            cancelled = self._cancelled
        if cancelled:  # cancel() ran while this stream was opening
            call.cancel()

    def _said(self, i: int, msg: pb.UpdateWeightsResponse) -> None:
        """One message of worker `i`'s epoch."""
        with self._changed:
            if msg.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED:
                if not self._accepted_ever[i]:
                    self._accepted_ever[i] = True
                    self._accepted_count += 1
                    if self._accepted_count == len(self._workers):
                        self._changed.notify_all()
                self._phase[i] = StreamPhase.ACCEPTED
            elif msg.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS:
                self.buckets_applied[i] = msg.bucket_index + 1
            elif msg.phase == pb.UPDATE_WEIGHTS_PHASE_COMMITTED:
                self._committed[i] = msg
                self._phase[i] = StreamPhase.COMMITTED
            elif msg.phase == pb.UPDATE_WEIGHTS_PHASE_STAGED:
                self._committed[i] = msg
                self._phase[i] = StreamPhase.STAGED
        if self._on_progress and msg.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS:
            self._on_progress(self._workers[i].endpoint.instance_id, msg.bucket_index,
                              msg.bucket_count)

    def _ended_well(self, i: int) -> WorkerFailure | None:
        """Worker `i`'s epoch ended without an error: a failure only if it never said its
        last phase."""
        if self._committed[i] is not None:
            return None
        w = self._workers[i]
        return WorkerFailure(w.endpoint.instance_id, w.endpoint.address, grpc.StatusCode.UNKNOWN,
                             Reason.DRIVER_ERROR, "stream ended without COMMITTED"
                             + (" or STAGED" if self.staged else ""))

    @staticmethod
    def _failure(w: WorkerLink, e: BaseException) -> WorkerFailure:
        """What a stream's exception says of worker `w`."""
        if isinstance(e, grpc.RpcError):
            return failure_from_rpc(w.endpoint, e)
        if isinstance(e, asyncio.CancelledError):
            # grpc.aio ends a stream this driver cancelled (`cancel()`, the fleet closing) this
            # way, where a blocking stream raised CANCELLED: recorded as that, the consumer ends.
            return WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                 grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED.name,
                                 "cancelled by the driver")
        return WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                             grpc.StatusCode.UNKNOWN, Reason.DRIVER_ERROR, str(e))

    def _end(self, i: int, failure: WorkerFailure | None) -> None:
        """Worker `i`'s epoch ended, well or with `failure`."""
        with self._changed:
            if failure is not None:
                self._failures[i] = failure
                self._failure_order.append(i)
                self._phase[i] = StreamPhase.FAILED
                self.failed.set()
            self._done[i] = True
            self._done_count += 1
            # Every end wakes the waiters (one wake per stream, each check O(1)): `_settle`
            # after an abort waits for streams that may end well, not only for failures.
            self._changed.notify_all()

    def _failures_so_far(self) -> list[tuple[int, WorkerFailure]]:
        """(worker index, failure) in the order the failures came; a worker that did not even
        answer Abort, and whose stream did not end with a reason of its own either, is
        UNRESPONSIVE.

        A shim that ended its stream with its own reason (COLLECTIVE_FAILED: its receive was
        reset) was alive and answering: its Abort may still time out when the whole fleet tears
        its group down on a loaded host (measured: 3 of 59 survivors past the 1 s abort timeout
        at 64 shims on 2 cores), and naming it UNRESPONSIVE would put it before the shims that
        really died."""
        out = []
        with self._changed:
            order, unresponsive = list(self._failure_order), set(self._unresponsive)
            failed = [(i, f) for i in order if (f := self._failures[i]) is not None]
        for i, f in failed:
            if i in unresponsive and not f.reported_by_worker:
                f = WorkerFailure(f.instance_id, f.address, grpc.StatusCode.UNAVAILABLE,
                                  Reason.UNRESPONSIVE, f"did not answer Abort; stream: "
                                  f"{f.reason}: {f.message}")
            out.append((i, f))
        return out

    def _settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        with self._changed:
            while self._done_count < len(self._workers):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(left)
