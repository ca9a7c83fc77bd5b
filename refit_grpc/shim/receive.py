"""One UpdateWeights epoch's receive, on a thread of its own, and what it tells the stream.

The receive runs on its own thread so a slow client reading PROGRESS can never stall the
collective; the stream only relays its events. It starts before ACCEPTED goes out, so its first
receives are already posted when the trainer, having every ACCEPTED, starts to send: no thread
start on the critical path. The servicer owns the state: it opens the epoch, and commits it or
fails it when the receive ends.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from refit_grpc.common import Deadline
from refit_grpc.errors import EpochAbortedError, RefitError, RefitTimeoutError
from refit_grpc.plan import Bucket, RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.canary import score_canary
from refit_grpc.shim.engines.base import Engine

log = logging.getLogger(__name__)


@dataclass
class Epoch:
    """One epoch in flight: what it asked for, and how far its receive got."""

    version: int
    deadline: Deadline
    verify_weights: bool = False
    canary: pb.Canary | None = None  # computed after the commit, before COMMITTED
    staged: bool = False  # a staged epoch: bytes land in the staging copy, never paused
    delta: bool = False   # its buckets are deltas against the committed copy
    reversible: bool = False  # keep the committed copy as the previous one (Rollback)
    flip_timeout_s: float = 0.0
    resume_on_commit: bool = False  # in place: Flush's work right after the commit
    bytes_applied: int = 0
    abort_reason: str = ""


@dataclass(frozen=True)
class Received:
    """What a receive that ended well hands back: the weights digest (in place) or the staged
    digest (staged), and the canary's result (in place, when the epoch carried one)."""

    digest: str
    canary: pb.CanaryResult | None


class _Event(enum.Enum):
    BUCKET = "bucket"  # one bucket applied (value: the Bucket)
    DONE = "done"      # every bucket applied and committed by the engine (value: Received)
    ERROR = "error"    # the receive failed (value: the RefitError)


class EpochReceive:
    """The receive thread of one epoch: `start()`, then `buckets()` until it ends, `result`."""

    def __init__(self, engine: Engine, plan: RefitPlan, epoch: Epoch, *,
                 progress_interval_s: float = 0.0):
        self._engine = engine
        self._plan = plan
        self._epoch = epoch
        self._progress_interval_s = progress_interval_s
        self._events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"receive-v{epoch.version}")
        self.result: Received | None = None

    def start(self) -> None:
        self._thread.start()

    def buckets(self) -> Iterator[Bucket]:
        """The buckets worth a PROGRESS as they land; `result` is set when it ends. Raises the
        receive's error, or RefitTimeoutError when the receive outlives its deadline.

        Coalesced, because the trainer reads every engine's stream: the first bucket at once
        (the trainer, and tests, learn the transfer reached this engine), then at most one
        every `progress_interval_s`, the newest applied (PROGRESS is "applied up to here"); a
        bucket held back is reported when the interval has passed even if no other lands, and
        COMMITTED or STAGED says the rest. A bucket behind the receive is no news either."""
        deadline = self._epoch.deadline
        interval = self._progress_interval_s
        held: Bucket | None = None  # applied, not yet reported
        last_sent: float | None = None
        while True:
            wait = max(deadline.remaining(), 0.0) + 5.0
            if held is not None and last_sent is not None:
                wait = min(wait, max(last_sent + interval - time.monotonic(), 0.0))
            try:
                kind, value = self._events.get(timeout=wait)
            except queue.Empty:
                if held is None:
                    raise RefitTimeoutError("receive outlived its deadline") from None
                last_sent, bucket, held = time.monotonic(), held, None
                yield bucket
                continue
            if kind is _Event.ERROR:
                raise value
            if kind is _Event.DONE:
                self.result = value
                return
            held = value
            now = time.monotonic()
            if self._events.empty() and (last_sent is None or now - last_sent >= interval):
                last_sent, bucket, held = now, held, None
                yield bucket

    def join(self) -> None:
        """Wait for a thread that was started; closing the group fails its pending receive at
        once, so the bound is a guard."""
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        epoch, engine = self._epoch, self._engine

        def on_bucket(bucket: Bucket) -> None:
            epoch.bytes_applied += bucket.nbytes
            self._events.put((_Event.BUCKET, bucket))

        try:
            if epoch.staged:
                staged_digest = engine.stage(self._plan, epoch.deadline, on_bucket,
                                             delta=epoch.delta,
                                             keep_previous=epoch.reversible)
                self._events.put((_Event.DONE, Received(staged_digest, None)))
                return
            engine.receive(self._plan, epoch.deadline, on_bucket)
            digest = engine.finish(epoch.version, epoch.deadline)
            if epoch.verify_weights and not digest:
                digest = engine.weights_digest(epoch.deadline)
            canary = score_canary(engine, epoch.canary, epoch.deadline) if epoch.canary else None
            self._events.put((_Event.DONE, Received(digest, canary)))
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
            self._events.put((_Event.ERROR, e))


__all__ = ["Epoch", "EpochReceive", "Received"]
