"""The shim process: a gRPC server with RefitService, health, reflection (v1 and v1alpha),
optional Prometheus metrics and graceful SIGTERM."""

from __future__ import annotations

import faulthandler
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from refit_grpc.common import MAX_MESSAGE_BYTES, Deadline
from refit_grpc.errors import InvalidArgumentError, RefitError, ResourceExhaustedError
from refit_grpc.proto import pb, pb_grpc, ref_pb, ref_pb_grpc
from refit_grpc.reasons import Reason
from refit_grpc.shim import reflection
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.service import RefitServicer, ShimConfig
from refit_grpc.shim.status import status_for, status_on_error
from refit_grpc.signals import StopSignals

log = logging.getLogger(__name__)

# After a stop signal, beyond the grace: the server's own stop (2 s, waited up to 7 s), the
# metrics endpoint's and the engine's close (an engine's teardown is bounded by its own timeouts).
_EXIT_BUDGET_S = 30.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RefitService"].full_name


@dataclass(frozen=True)
class ServerOptions:
    address: str = "127.0.0.1:50051"
    max_workers: int = 32
    # Beyond this many RPCs in flight, new ones get RESOURCE_EXHAUSTED (reason TOO_MANY_CALLS)
    # instead of queueing; health checks are not counted.
    max_concurrent_rpcs: int = 64
    grace_s: float = 30.0
    health_poll_s: float = 1.0
    # Larger requests get RESOURCE_EXHAUSTED (reason MESSAGE_TOO_LARGE) before any handler
    # runs. gRPC's own transport limit is twice this (at most 2 GiB): above that, gRPC answers
    # RESOURCE_EXHAUSTED itself, without a reason.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # HOST:PORT (or a port alone: loopback) of the Prometheus endpoint; None: no metrics.
    metrics_address: str | None = None


# Calls the admission bound does not count or refuse: orchestrators' probes.
UNCOUNTED_PREFIXES = ("/grpc.health.v1.Health/",)

_HANDLER_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class _Refused:
    """What the admission's deserializer hands the handler instead of a request it refuses."""

    def __init__(self, status: grpc.Status):
        self.status = status


class _Ticket:
    """One admitted call's place; `release` runs once: when the call ends, or, for a call that
    ended before its handler ever ran, when the last reference to the ticket goes."""

    def __init__(self, release: Callable[[], None]):
        self.release = weakref.finalize(self, release)


class AdmissionInterceptor(grpc.ServerInterceptor):
    """The shim's own bounds, refused with a reason like every other refusal (gRPC's
    `maximum_concurrent_rpcs` and message limit answer without ErrorInfo):

    - more than `max_calls` calls in flight (queued or running): RESOURCE_EXHAUSTED,
      TOO_MANY_CALLS;
    - a request over `max_message_bytes`: RESOURCE_EXHAUSTED, MESSAGE_TOO_LARGE;
    - request bytes that are not the method's message: INVALID_ARGUMENT, MALFORMED_REQUEST
      (gRPC would answer INTERNAL).
    Costs a lock, a counter and a weakref per call."""

    def __init__(self, max_calls: int, max_message_bytes: int):
        self._max_calls = max_calls
        self._max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(UNCOUNTED_PREFIXES):
            return handler
        with self._lock:
            admitted = self._in_flight < self._max_calls
            if admitted:
                self._in_flight += 1
        if not admitted:
            return _refusing(handler, status_for(ResourceExhaustedError(
                f"more than {self._max_calls} calls in flight on this shim; retry later",
                reason=Reason.TOO_MANY_CALLS)))
        ticket = _Ticket(self._release)
        inner = handler.unary_unary or handler.unary_stream or handler.stream_unary \
            or handler.stream_stream

        def behaviour(request, context):
            release = ticket.release  # the closure holds the ticket until the call is done
            if not context.add_callback(release):
                release()  # already over
            if isinstance(request, _Refused):
                context.abort_with_status(request.status)
            return inner(request, context)

        deserializer = handler.request_deserializer
        if not handler.request_streaming:
            deserializer = self._checking(deserializer)
        return _HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)](
            behaviour, request_deserializer=deserializer,
            response_serializer=handler.response_serializer)

    def _checking(self, deserializer: Callable | None) -> Callable:
        limit = self._max_message_bytes

        def deserialize(raw: bytes):
            if len(raw) > limit:
                return _Refused(status_for(ResourceExhaustedError(
                    f"request of {len(raw)} bytes is over this shim's limit of {limit}",
                    reason=Reason.MESSAGE_TOO_LARGE)))
            if deserializer is None:
                return raw
            try:
                return deserializer(raw)
            except Exception as e:  # noqa: BLE001  (protobuf's DecodeError, bad UTF-8, ...)
                return _Refused(status_for(InvalidArgumentError(
                    f"request is not a valid message of this method: {type(e).__name__}",
                    reason=Reason.MALFORMED_REQUEST)))

        return deserialize


def _refusing(handler: grpc.RpcMethodHandler, status: grpc.Status) -> grpc.RpcMethodHandler:
    def refuse(request_or_iterator, context):
        context.abort_with_status(status)

    return _HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)](
        refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class ReferenceEngineServicer(ref_pb_grpc.ReferenceEngineServiceServicer):
    def __init__(self, engine, refit: RefitServicer):
        self.engine = engine
        self.refit = refit

    def Generate(self, request, context):
        with status_on_error(context):
            remaining = context.time_remaining()
            deadline = Deadline(60.0 if remaining is None else min(remaining, 600.0))
            tokens, hit = self.engine.generate(list(request.prompt), request.max_new_tokens,
                                               deadline)
            return ref_pb.GenerateResponse(tokens=tokens, weight_version=self.refit.weight_version,
                                           prefix_cache_hit=hit)


class ShimServer:
    def __init__(self, engine: Engine, config: ShimConfig | None = None,
                 options: ServerOptions | None = None,
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: tuple = ()):
        self.engine = engine
        self.options = options or ServerOptions()
        self.servicer = RefitServicer(engine, config)
        self.health = health.HealthServicer()
        self._stop = threading.Event()
        self.metrics = None
        self.admission = AdmissionInterceptor(self.options.max_concurrent_rpcs,
                                              self.options.max_message_bytes)
        # Before the token check, so its bounds hold for every caller.
        interceptors = (self.admission, *interceptors)
        if self.options.metrics_address is not None:
            from refit_grpc.shim.metrics import ShimMetrics

            self.metrics = ShimMetrics(self.servicer, engine.kind)
            # First, so it times every call and sees the ones the token check (and the
            # admission) refuse.
            interceptors = (self.metrics.interceptor, *interceptors)
        # The transport's own limit sits above the shim's, so a request between the two is
        # refused by the admission, with its reason.
        transport_max = min(2 * self.options.max_message_bytes, (1 << 31) - 1)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.options.max_workers,
                                       thread_name_prefix="shim-rpc"),
            interceptors=list(interceptors),
            options=[("grpc.max_receive_message_length", transport_max),
                     ("grpc.max_send_message_length", self.options.max_message_bytes),
                     ("grpc.so_reuseport", 0),
                     # Accept the driver's 1 s keepalive pings (see driver/endpoint.py).
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.min_ping_interval_without_data_ms", 500),
                     ("grpc.http2.max_ping_strikes", 0)],
        )
        pb_grpc.add_RefitServiceServicer_to_server(self.servicer, self._server)
        services = [SERVICE_NAME, health.SERVICE_NAME]
        if hasattr(engine, "generate"):
            ref_pb_grpc.add_ReferenceEngineServiceServicer_to_server(
                ReferenceEngineServicer(engine, self.servicer), self._server)
            services.append(ref_pb.DESCRIPTOR.services_by_name["ReferenceEngineService"].full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(services, self._server)
        if credentials is None:
            self.port = self._server.add_insecure_port(self.options.address)
        else:
            self.port = self._server.add_secure_port(self.options.address, credentials)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.options.address}")
        host = self.options.address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"

    def start(self) -> ShimServer:
        address = self.options.metrics_address
        own = {self.port}
        if self.metrics is not None and address is not None:  # metrics only with an address
            own.add(int(self.metrics.serve(address).rsplit(":", 1)[1]))
        self.servicer.own_ports = frozenset(own)
        self._server.start()
        self._set_health(self.engine.status().healthy)
        threading.Thread(target=self._watch_health, daemon=True, name="health").start()
        log.info("shim %s (%s engine) serving on %s", self.servicer.config.instance_id,
                 self.engine.kind, self.address)
        return self

    def _set_health(self, healthy: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if healthy
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _watch_health(self) -> None:
        while not self._stop.wait(self.options.health_poll_s):
            try:
                healthy = self.engine.status().healthy
            except RefitError:
                healthy = False
            self._set_health(healthy)

    def stop(self, grace_s: float | None = None) -> None:
        """Graceful stop. Health goes NOT_SERVING at once and new epochs and joins are refused
        (UNAVAILABLE/SHUTTING_DOWN), while Describe and health keep answering so operators and
        load balancers can watch the drain. An epoch in flight gets the grace period to commit;
        past it, it is aborted (the engine is then BROKEN or keeps its old weights, never
        half-served). Then the server stops."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.health.enter_graceful_shutdown()
        grace = self.options.grace_s if grace_s is None else grace_s
        if not self.servicer.drain(grace):
            log.warning("epoch still running after %.1fs grace: aborting it", grace)
            self.servicer.abort_all("shim shutting down")
        done = self._server.stop(2.0)
        if not done.wait(7.0):
            log.warning("server did not stop in time")
        if self.metrics is not None:
            self.metrics.close()
        self.engine.close()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def serve_until_signal(self, signals: StopSignals | None = None) -> None:
        """Block until SIGTERM/SIGINT, then stop gracefully (exit status 0). Pass `signals`
        installed before the process announced itself, so that a signal sent at once is not
        fatal. The handlers stay installed to the process's end: a signal during or after the
        stop is recorded, never fatal, so the exit status stays the stop's."""
        signals = signals or StopSignals().install()
        signals.wait()
        log.info("signal %d: stopping (grace %.0fs)", signals.first, self.options.grace_s)
        self.health.enter_graceful_shutdown()  # NOT_SERVING before anything else
        # Nothing blocks forever, the exit included: past the grace and the server's own stop
        # budget, every thread's stack goes to stderr and the process ends with status 1.
        faulthandler.dump_traceback_later(self.options.grace_s + _EXIT_BUDGET_S, exit=True)
        t0 = time.monotonic()
        self.stop()
        log.info("stopped in %.2fs", time.monotonic() - t0)


def serve_all_until_signal(servers: list[ShimServer], signals: StopSignals) -> None:
    """The servers of one process (`refit-grpc shim --engines K`) until SIGTERM/SIGINT, then
    every one stopped gracefully at once (each `ShimServer.stop`: its grace, then its epoch
    aborted), within one exit budget."""
    signals.wait()
    log.info("signal %d: stopping %d engines", signals.first, len(servers))
    for server in servers:
        server.health.enter_graceful_shutdown()
    grace = max(s.options.grace_s for s in servers)
    faulthandler.dump_traceback_later(grace + _EXIT_BUDGET_S, exit=True)
    stops = [threading.Thread(target=s.stop, name=f"stop-{k}", daemon=True)
             for k, s in enumerate(servers)]
    for t in stops:
        t.start()
    for t in stops:
        t.join()

