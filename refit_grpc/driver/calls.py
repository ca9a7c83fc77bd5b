"""Every call the driver makes to its shims goes through one `ShimCalls`: the channels and
stubs, the deadlines and retries, and the one place where a call's failure becomes a
`WorkerFailure` naming its shim.

Callers say what to ask of which shims; `ShimCalls` decides how it runs: every call is a
coroutine on the driver's one I/O thread (`IoLoop`, grpc.aio), the unary fan-outs, a
formation's joins (each waits until the whole group has formed) and an epoch's streams alike, so
the trainer's threads do not grow with its fleet and no pool bounds how many shims wait at once.
The methods callers use are blocking (the driver's API is synchronous) or return
`concurrent.futures.Future`s.

Retry policy: idempotent unary calls (Describe, Prepare, Flush) retry on UNAVAILABLE with
exponential backoff and jitter (tenacity), within `control_timeout_s`. Abort, Flip and the
probes of a failed round are tried once, bounded (`once`). InitCollective and UpdateWeights
are never retried alone: a failed epoch is aborted fleet-wide and re-run as a whole.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
import tenacity

from refit_grpc.common import PauseMode
from refit_grpc.driver.config import FleetConfig
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import (
    FleetError,
    FleetTimeoutError,
    WorkerFailure,
    failure_from_rpc,
    failure_from_status,
)
from refit_grpc.driver.io_loop import IoLoop
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb, pb_grpc
from refit_grpc.reasons import Reason

T = TypeVar("T")

# The request for one shim, made from its link (most fan-outs ask every shim the same).
RequestFor = Callable[["WorkerLink"], Any]


@dataclass(frozen=True)
class WorkerLink:
    """The stub to one shim (grpc.aio: its calls are awaited on the driver's I/O loop), with
    the metadata (bearer token) every call carries."""

    endpoint: WorkerEndpoint
    stub: pb_grpc.RefitServiceStub
    metadata: tuple[tuple[str, str], ...]


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class ShimCalls:
    """The calls to a fleet's shims (module docstring). Thread-safe; `close()` once."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.io = IoLoop()
        self._channels: list[grpc.aio.Channel] = []

    def open(self, endpoint: WorkerEndpoint) -> WorkerLink:
        """A link to one shim: its channel (kept until `close()`, made on the I/O loop, which
        it belongs to) and stub."""
        async def make() -> grpc.aio.Channel:
            return self.config.security.open_aio(endpoint.address)

        channel = self.io.run(make())
        self._channels.append(channel)
        return WorkerLink(endpoint, pb_grpc.RefitServiceStub(channel),
                          self.config.security.metadata())

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run a coroutine of calls (an epoch's stream, a catch-up) on the I/O loop."""
        return self.io.submit(coro)

    # --- unary calls ----------------------------------------------------------------------

    async def call(self, link: WorkerLink, method: str, request: Any) -> Any:
        """One idempotent unary call with `control_timeout_s`, retried on UNAVAILABLE
        (exponential backoff, jitter). Raises grpc.RpcError."""
        method_of = getattr(link.stub, method)
        started = time.monotonic()
        try:  # the first attempt without tenacity's machinery: most calls need no retry, and
            # at a thousand engines its per-call cost showed in the trainer's CPU
            return await method_of(request, timeout=self.config.control_timeout_s,
                                   metadata=link.metadata)
        except grpc.RpcError as e:
            if not _unavailable(e) or self.config.retry_attempts <= 1:
                raise
        retry = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(_unavailable),
            # Long enough to outlast the channel's reconnect backoff (max 1 s): a shim that just
            # restarted must be reached, not declared gone after a burst of instant failures
            # (a channel in backoff fails every call at once). Growing for sure, jittered a
            # little: fully random waits could all come out short (seen once in CI: a
            # restarted shim refused a catch-up's Prepare, every retry inside the backoff).
            wait=(tenacity.wait_exponential(multiplier=0.1, max=2.0)
                  + tenacity.wait_random(0, 0.1)),
            stop=(tenacity.stop_after_attempt(self.config.retry_attempts - 1)
                  | tenacity.stop_after_delay(self.config.control_timeout_s
                                              - (time.monotonic() - started))),
            reraise=True)
        await asyncio.sleep(random.uniform(0, 0.1))  # the first retry's backoff
        async for attempt in retry:
            with attempt:
                return await method_of(request, timeout=self.config.control_timeout_s,
                                       metadata=link.metadata)
        raise AssertionError("unreachable: tenacity reraises the last failure")

    def each(self, method: str, links: Sequence[WorkerLink], request_for: RequestFor
             ) -> list[Any]:
        """`call()` on every link at once: one entry per link, in order, its answer or the
        `WorkerFailure` that says why there is none."""
        return self.io.run(self._answers(
            links, [self.call(w, method, request_for(w)) for w in links]))

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
        """Every link at once, each tried once within `timeout_s` (no retry: a call that must
        not be repeated, or a probe where a dead or frozen shim must not hold the others up):
        its answer or its `WorkerFailure`."""
        async def one(w: WorkerLink) -> Any:
            return await getattr(w.stub, method)(request_for(w), timeout=timeout_s,
                                                 metadata=w.metadata)

        return self.io.run(self._answers(links, [one(w) for w in links]))

    def flips(self, links: Sequence[WorkerLink], requests: Sequence[pb.FlipRequest],
              bundles: Sequence[Sequence[int]], timeout_s: float) -> list[Any]:
        """Flip on every link at once, each tried once within `timeout_s` (a Flip that reached
        its shim is never repeated); the links of one bundle (engines of one shim process
        sharing a rank) in one FlipEngines call to the first of them. One entry per link: its
        FlipResponse or the `WorkerFailure` naming it (an engine's own status decoded as its
        Flip's would be; a failed FlipEngines call names every engine it carried)."""
        bundled = {i for b in bundles for i in b}
        singles = [i for i in range(len(links)) if i not in bundled]

        async def one(i: int) -> Any:
            w = links[i]
            try:
                return await w.stub.Flip(requests[i], timeout=timeout_s, metadata=w.metadata)
            except grpc.RpcError as e:
                return failure_from_rpc(w.endpoint, e)

        async def together(indexes: Sequence[int]) -> list[Any]:
            head = links[indexes[0]]
            try:
                answer = await head.stub.FlipEngines(
                    pb.FlipEnginesRequest(engines=[requests[i] for i in indexes]),
                    timeout=timeout_s, metadata=head.metadata)
            except grpc.RpcError as e:
                return [failure_from_rpc(links[i].endpoint, e) for i in indexes]
            by_id = {flipped.instance_id: flipped for flipped in answer.engines}
            out: list[Any] = []
            for i in indexes:
                w, flipped = links[i], by_id.get(requests[i].instance_id)
                if flipped is None:
                    out.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                             grpc.StatusCode.UNKNOWN, Reason.DRIVER_ERROR,
                                             "its process's FlipEngines did not answer for it"))
                else:
                    out.append(failure_from_status(w.endpoint, flipped.status)
                               if flipped.status else flipped.flip)
            return out

        async def run() -> list[Any]:
            answers = await asyncio.gather(*(one(i) for i in singles),
                                           *(together(b) for b in bundles))
            out: list[Any] = [None] * len(links)
            for i, answer in zip(singles, answers):
                out[i] = answer
            for b, grouped in zip(bundles, answers[len(singles):]):
                for i, answer in zip(b, grouped):
                    out[i] = answer
            return out

        return self.io.run(run())

    def abort(self, reason: str, links: Sequence[WorkerLink], *, keep_staged: bool = False
              ) -> list[pb.AbortResponse | None]:
        """Abort on every link at once; best effort, never raises, never retries, bounded by
        `abort_timeout_s`: one entry per link, its answer or None. `keep_staged`: a shim whose
        staged copy is complete keeps it (AbortRequest.keep_staged)."""
        request = pb.AbortRequest(reason=reason, keep_staged=keep_staged)
        return [None if isinstance(a, WorkerFailure) else a
                for a in self.once("Abort", links, lambda w: request,
                                   self.config.abort_timeout_s)]

    def flush(self, links: Sequence[WorkerLink], mode: PauseMode = PauseMode.WAIT,
              what: str = "flush failed") -> None:
        """Flush on every link at once (drain, clear the caches, resume); raises as `all()`."""
        request = pb.FlushRequest(mode=PAUSE_MODE_TO_PROTO[mode])
        self.all("Flush", links, lambda w: request, what)

    @staticmethod
    async def _answers(links: Sequence[WorkerLink],
                       calls: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: list[Any] = []
        for w, r in zip(links, results):
            if isinstance(r, grpc.RpcError):
                out.append(failure_from_rpc(w.endpoint, r))
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append(r)
        return out

    # --- group formation ------------------------------------------------------------------

    def join(self, links: Sequence[WorkerLink], requests: Sequence[pb.InitCollectiveRequest]
             ) -> list[Future]:
        """InitCollective on every link: one future per link, resolving to its JOINED message
        or raising `FleetError` naming it. Each join waits until the whole group has formed:
        a coroutine each on the I/O loop, however wide the fleet."""
        return [self.io.submit(self._join_one(w, r)) for w, r in zip(links, requests)]

    async def _join_one(self, w: WorkerLink, request: pb.InitCollectiveRequest
                        ) -> pb.InitCollectiveResponse:
        last = None
        try:
            async for msg in w.stub.InitCollective(request, timeout=self.config.join_timeout_s,
                                                   metadata=w.metadata):
                last = msg
        except grpc.RpcError as e:
            f = failure_from_rpc(w.endpoint, e)
            raise FleetError("InitCollective failed", [f], reason=f.reason) from None
        if last is None or last.phase != pb.INIT_COLLECTIVE_PHASE_JOINED:
            raise FleetError("InitCollective ended without JOINED", [])
        return last

    # --- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Close every channel (calls still open are cancelled), then the I/O loop."""
        async def close_channels() -> None:
            await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)

        if not self.io.on_loop:
            try:
                self.io.submit(close_channels()).result(timeout=5.0)
            except Exception:  # noqa: BLE001  (closing: the loop's end cancels what is left)
                pass
        self.io.close()
