"""UpdateEngines and FlipEngines: one call for several engines of this shim process.

A process that serves several engines (`refit-grpc shim --engines K`) receives the trainer's
broadcast once, on the rank they share (`refit_grpc.dataplane.shared_rank`); this is the same for their
control: the trainer opens one stream to the process instead of one per engine. At a thousand
engines, one stream per engine per epoch was the floor of the trainer's control cost (a grpc.aio
stream costs about 0.2 ms of its CPU; docs/scale.md).

Nothing about an engine's epoch changes: each engine runs exactly its `UpdateWeights` handler
(admission, checks, receive, phases, errors), on a thread of its own, with a call context of its
own (`EngineCallContext`) whose end is the shared stream's. What the handlers yield is batched:
the stream sends whatever every engine said since its last message, in one message. An engine's
end travels in-band: `EngineUpdate.ended`, with the status its UpdateWeights would have ended
with (the same encoder, `status.status_for`), so the driver decodes both the same way.
FlipEngines is the same for a staged epoch's flips: each engine's Flip handler at once, one
answer holding each engine's FlipResponse or status.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import grpc
from google.rpc import status_pb2

from refit_grpc.errors import InternalError, InvalidArgumentError, RefitError, RefitTimeoutError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.status import status_for

# The key gRPC carries a serialized google.rpc.Status under (what `rpc_status.to_status` sets).
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
# How often the stream's handler looks whether its caller is still there while no engine speaks.
_IDLE_POLL_S = 0.5


class EngineServicer(Protocol):
    """An engine's servicer, as an UpdateEngines stream runs it (`RefitServicer`)."""

    def UpdateWeights(self, request: Any, context: Any) -> Iterator[Any]: ...  # noqa: N802

    def Flip(self, request: Any, context: Any) -> Any: ...  # noqa: N802


class _EngineEnded(Exception):
    """Raised by `EngineCallContext.abort_with_status`: one engine's handler ended with a
    status (the serialized google.rpc.Status), as gRPC raises to unwind an aborted handler."""

    def __init__(self, status: bytes):
        super().__init__("engine epoch ended with a status")
        self.status = status


class EngineCallContext:
    """The call context one engine's UpdateWeights handler runs with inside an UpdateEngines
    stream: the stream's deadline and end (its callbacks run when the stream ends, however it
    ends: a trainer that goes away cancels every engine's receive), its own status."""

    def __init__(self, stream: grpc.ServicerContext):
        self._stream = stream
        self._code: grpc.StatusCode | None = None
        self._callbacks: list[Callable[[], Any]] = []
        self._lock = threading.Lock()
        self._ended = False

    def time_remaining(self) -> float | None:
        return self._stream.time_remaining()

    def is_active(self) -> bool:
        return self._stream.is_active()

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        callback()  # the stream already ended: as gRPC, the callback is not kept; run it now
        return True

    def stream_ended(self) -> None:
        """The shared stream ended: every callback an engine's handler registered runs."""
        with self._lock:
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort_with_status(self, status: grpc.Status) -> None:
        self._code = status.code
        raise _EngineEnded(_serialized(status))

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise _EngineEnded(status_pb2.Status(code=code.value[0], message=details)
                           .SerializeToString())

    def invocation_metadata(self) -> Any:
        return self._stream.invocation_metadata()

    def peer(self) -> str:
        return self._stream.peer()


def _ended_with(exc: BaseException) -> bytes:
    """The serialized status an engine's handler ended with, for what it raised."""
    if isinstance(exc, _EngineEnded):
        return exc.status
    err = exc if isinstance(exc, RefitError) else InternalError(
        f"internal error: {type(exc).__name__}: {str(exc)[:300]}")
    return _serialized(status_for(err))


def _serialized(status: grpc.Status) -> bytes:
    """The google.rpc.Status a handler's status carries (`status_for` puts it there)."""
    details = dict(status.trailing_metadata or ()).get(_STATUS_DETAILS_KEY, b"")
    return details.encode() if isinstance(details, str) else bytes(details)


def engines_asked(rpc: str, requests: Sequence[Any],
                  engines: Mapping[str, EngineServicer]) -> list[tuple[EngineServicer, Any]]:
    """Each of an `rpc` call's requests (UpdateEngines, FlipEngines) with the engine it names,
    checked before any engine's call starts.

    Raises:
        InvalidArgumentError: no request, a request without an instance_id, one naming an engine
            this process does not serve, or an engine named twice (INVALID_INSTANCE_ID).
    """
    if not requests:
        raise InvalidArgumentError(f"{rpc} names no engine", reason=Reason.INVALID_INSTANCE_ID)
    out, seen = [], set()
    for k, one in enumerate(requests):
        name = one.instance_id
        if not name:
            raise InvalidArgumentError(f"engines[{k}]: instance_id is required",
                                       reason=Reason.INVALID_INSTANCE_ID)
        if name in seen:
            raise InvalidArgumentError(f"engines[{k}]: engine {name[:128]!r} named twice",
                                       reason=Reason.INVALID_INSTANCE_ID)
        servicer = engines.get(name)
        if servicer is None:
            raise InvalidArgumentError(
                f"engines[{k}]: this process serves no engine {name[:128]!r} sharing its rank "
                f"(it serves {len(engines)})", reason=Reason.INVALID_INSTANCE_ID)
        seen.add(name)
        out.append((servicer, one))
    return out


def run_engines(asked: list[tuple[EngineServicer, Any]], stream: grpc.ServicerContext
                ) -> Iterator[pb.UpdateEnginesResponse]:
    """Run every asked engine's UpdateWeights at once; yield what they say, batched, until
    every engine's epoch ended (module docstring)."""
    said: queue.SimpleQueue[tuple[int, pb.UpdateWeightsResponse | None, bytes]] = \
        queue.SimpleQueue()
    contexts = _contexts(stream, len(asked))

    def run(k: int, servicer: EngineServicer, one: Any) -> None:
        try:
            for message in servicer.UpdateWeights(one, contexts[k]):
                said.put((k, message, b""))
        except BaseException as e:  # noqa: BLE001  (every end is reported in-band)
            said.put((k, None, _ended_with(e)))
            return
        said.put((k, None, b""))

    names = [one.instance_id for _, one in asked]
    for k, (servicer, one) in enumerate(asked):
        threading.Thread(target=run, args=(k, servicer, one), daemon=True,
                         name=f"update-engines-{k}").start()
    running = len(asked)
    while running:
        try:
            batch = [said.get(timeout=_IDLE_POLL_S)]
        except queue.Empty:
            if not stream.is_active():
                return  # the caller went away: its end cancelled every engine's epoch
            continue
        while True:
            try:
                batch.append(said.get_nowait())
            except queue.Empty:
                break
        updates = []
        for k, message, status in batch:
            if message is not None:
                updates.append(pb.EngineUpdate(instance_id=names[k], update=message))
            else:
                updates.append(pb.EngineUpdate(instance_id=names[k], ended=True, status=status))
                running -= 1
        yield pb.UpdateEnginesResponse(updates=updates)


def flip_engines(asked: list[tuple[EngineServicer, Any]], call: grpc.ServicerContext
                 ) -> pb.FlipEnginesResponse:
    """Every asked engine's Flip at once, each on a thread of its own; the answer holds each
    one's FlipResponse or the status its Flip ended with, in the request's order. Each Flip is
    bounded by its own deadline (the call's, capped by the shim's epoch limit); an engine still
    flipping past the call's deadline is reported DEADLINE_EXCEEDED, not waited for."""
    contexts = _contexts(call, len(asked))
    outcomes: list[pb.EngineFlip | None] = [None] * len(asked)

    def run(k: int, servicer: EngineServicer, one: Any) -> None:
        try:
            outcomes[k] = pb.EngineFlip(instance_id=one.instance_id,
                                        flip=servicer.Flip(one, contexts[k]))
        except BaseException as e:  # noqa: BLE001  (every end is reported in the answer)
            outcomes[k] = pb.EngineFlip(instance_id=one.instance_id, status=_ended_with(e))

    threads = [threading.Thread(target=run, args=(k, servicer, one), daemon=True,
                                name=f"flip-engines-{k}")
               for k, (servicer, one) in enumerate(asked)]
    for t in threads:
        t.start()
    for t in threads:
        left = call.time_remaining()
        t.join(None if left is None else max(left, 0.0))
    return pb.FlipEnginesResponse(engines=[
        o if o is not None else pb.EngineFlip(instance_id=one.instance_id, status=_ended_with(
            RefitTimeoutError("the flip outlived the call's deadline",
                              reason=Reason.DEADLINE_EXCEEDED)))
        for o, (_, one) in zip(outcomes, asked)])


def _contexts(call: grpc.ServicerContext, count: int) -> list[EngineCallContext]:
    """One call context per engine, each ended (its callbacks run) when `call` ends."""
    contexts = [EngineCallContext(call) for _ in range(count)]

    def call_ended() -> None:
        for context in contexts:
            context.stream_ended()

    call.add_callback(call_ended)
    return contexts


__all__ = ["EngineCallContext", "engines_asked", "flip_engines", "run_engines"]
