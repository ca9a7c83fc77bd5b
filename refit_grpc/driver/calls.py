"""Every call the driver makes to its shims goes through one `ShimCalls`: the channels and
stubs, the threads that wait on answers, the deadlines and retries, and the one place where
a call's failure becomes a `WorkerFailure` naming its shim.

Callers say what to ask of which shims; `ShimCalls` decides how it runs (today: a thread per
call in flight for unary fan-outs and joins, a pool of stream consumers for epochs). The
design note in docs/protocol.md ("Group formation") says why a formation's joins get a thread
each; moving these waits onto one event loop (grpc.aio) is a change to this module alone.

Retry policy: idempotent unary calls (Describe, Prepare, Flush) retry on UNAVAILABLE with
exponential backoff and jitter (tenacity), within `control_timeout_s`. Abort, Flip and the
probes of a failed round are tried once, bounded (`once`). InitCollective and UpdateWeights
are never retried alone: a failed epoch is aborted fleet-wide and re-run as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import tenacity

from refit_grpc.common import PauseMode
from refit_grpc.driver.config import FleetConfig
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import (
    FleetError,
    FleetTimeoutError,
    WorkerFailure,
    failure_from_rpc,
)
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb, pb_grpc

# A pool bound no fleet reaches: ThreadPoolExecutor starts a thread only when none is idle.
_NO_BOUND = 1 << 16

# The request for one shim, made from its link (most fan-outs ask every shim the same).
RequestFor = Callable[["WorkerLink"], Any]


@dataclass(frozen=True)
class WorkerLink:
    """The stub to one shim, with the metadata (bearer token) every call carries."""

    endpoint: WorkerEndpoint
    stub: pb_grpc.RefitServiceStub
    metadata: tuple[tuple[str, str], ...]


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class ShimCalls:
    """The calls to a fleet's shims (module docstring). Thread-safe; `close()` once."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self._channels: list[grpc.Channel] = []
        # Unary fan-outs: a thread per call in flight, started on demand. Calls beyond the
        # bound queue (they do not hold anything another call waits for).
        self._unary = ThreadPoolExecutor(max_workers=64, thread_name_prefix="fleet")
        # The consumers of epoch streams (`EpochHandle`), apart from the unary pool so that an
        # epoch's streams can never hold up the calls (Abort) that end it. A consumer holds its
        # thread until its stream ends, so the pool has no bound a fleet could reach (a bound
        # of 4 per worker at construction left workers added later waiting); threads start
        # only when no idle one is left, and later epochs reuse them.
        self.streams = ThreadPoolExecutor(max_workers=_NO_BOUND,
                                          thread_name_prefix="epoch-stream")

    def open(self, endpoint: WorkerEndpoint) -> WorkerLink:
        """A link to one shim: its channel (kept until `close()`) and stub."""
        channel = self.config.security.open(endpoint.address)
        self._channels.append(channel)
        return WorkerLink(endpoint, pb_grpc.RefitServiceStub(channel),
                          self.config.security.metadata())

    # --- unary calls ----------------------------------------------------------------------

    def call(self, link: WorkerLink, method: str, request: Any) -> Any:
        """One idempotent unary call with `control_timeout_s`, retried on UNAVAILABLE
        (exponential backoff, jitter). Raises grpc.RpcError."""
        retry = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_unavailable),
            # Long enough to outlast the channel's reconnect backoff (max 1 s): a shim that just
            # restarted must be reached, not declared gone after a burst of instant failures.
            wait=tenacity.wait_random_exponential(multiplier=0.1, max=2.0),
            stop=(tenacity.stop_after_attempt(self.config.retry_attempts)
                  | tenacity.stop_after_delay(self.config.control_timeout_s)),
            reraise=True)
        return retry(lambda: getattr(link.stub, method)(
            request, timeout=self.config.control_timeout_s, metadata=link.metadata))

    def each(self, method: str, links: Sequence[WorkerLink], request_for: RequestFor
             ) -> list[Any]:
        """`call()` on every link in parallel: one entry per link, in order, its answer or the
        `WorkerFailure` that says why there is none."""
        futures = [self._unary.submit(self.call, w, method, request_for(w)) for w in links]
        return self._answers(links, futures)

    def all(self, method: str, links: Sequence[WorkerLink], request_for: RequestFor,
            what: str) -> list[Any]:
        """`each()`, raising when any failed: `FleetTimeoutError` when every failure is a
        deadline, else `FleetError`, with every failure (the first one's reason)."""
        results = self.each(method, links, request_for)
        failures = [r for r in results if isinstance(r, WorkerFailure)]
        if failures:
            cls = FleetTimeoutError if all(
                f.code == grpc.StatusCode.DEADLINE_EXCEEDED for f in failures) else FleetError
            raise cls(f"{method}: {what}", failures, reason=failures[0].reason)
        return results

    def once(self, method: str, links: Sequence[WorkerLink], request_for: RequestFor,
             timeout_s: float) -> list[Any]:
        """Every link in parallel, each tried once within `timeout_s` (no retry: a call that
        must not be repeated, or a probe where a dead or frozen shim must not hold the others
        up): its answer or its `WorkerFailure`."""
        futures = [self._unary.submit(getattr(w.stub, method), request_for(w),
                                      timeout=timeout_s, metadata=w.metadata) for w in links]
        return self._answers(links, futures)

    def abort(self, reason: str, links: Sequence[WorkerLink]) -> list[pb.AbortResponse | None]:
        """Abort on every link in parallel; best effort, never raises, never retries, bounded
        by `abort_timeout_s`: one entry per link, its answer or None."""
        request = pb.AbortRequest(reason=reason)
        return [None if isinstance(a, WorkerFailure) else a
                for a in self.once("Abort", links, lambda w: request,
                                   self.config.abort_timeout_s)]

    def flush(self, links: Sequence[WorkerLink], mode: PauseMode = PauseMode.WAIT,
              what: str = "flush failed") -> None:
        """Flush on every link in parallel (drain, clear the caches, resume); raises as
        `all()`."""
        request = pb.FlushRequest(mode=PAUSE_MODE_TO_PROTO[mode])
        self.all("Flush", links, lambda w: request, what)

    @staticmethod
    def _answers(links: Sequence[WorkerLink], futures: Sequence[Future]) -> list[Any]:
        out: list[Any] = []
        for w, f in zip(links, futures):
            try:
                out.append(f.result())
            except grpc.RpcError as e:
                out.append(failure_from_rpc(w.endpoint, e))
        return out

    # --- group formation ------------------------------------------------------------------

    def join(self, links: Sequence[WorkerLink], requests: Sequence[pb.InitCollectiveRequest]
             ) -> list[Future]:
        """InitCollective on every link: one future per link, resolving to its JOINED message
        or raising `FleetError` naming it. Each join holds its thread until the whole group has
        formed, so a pool smaller than the fleet would hold every join past its size back until
        the deadline: a thread each, for the formation."""
        joins = ThreadPoolExecutor(max_workers=max(len(links), 1), thread_name_prefix="join")
        futures = [joins.submit(self._join_one, w, r) for w, r in zip(links, requests)]
        joins.shutdown(wait=False)
        return futures

    def _join_one(self, w: WorkerLink, request: pb.InitCollectiveRequest
                  ) -> pb.InitCollectiveResponse:
        last = None
        try:
            for msg in w.stub.InitCollective(request, timeout=self.config.join_timeout_s,
                                             metadata=w.metadata):
                last = msg
        except grpc.RpcError as e:
            f = failure_from_rpc(w.endpoint, e)
            raise FleetError("InitCollective failed", [f], reason=f.reason) from None
        if last is None or last.phase != pb.INIT_COLLECTIVE_PHASE_JOINED:
            raise FleetError("InitCollective ended without JOINED", [])
        return last

    # --- the end --------------------------------------------------------------------------

    def close(self, *, wait_for_streams: bool) -> None:
        """Close every channel and the unary pool; the stream pool too, waiting for its
        threads only when `wait_for_streams` (every consumer has ended: its epoch closed)."""
        for channel in self._channels:
            channel.close()
        self._unary.shutdown(wait=False, cancel_futures=True)
        self.streams.shutdown(wait=wait_for_streams, cancel_futures=True)
