"""Prometheus metrics for one shim: `refit-grpc shim --metrics-address HOST:PORT` (off by default).

Everything is measured where the shim already speaks, never on the data path:
- a gRPC server interceptor times every RPC and counts its status code and ErrorInfo reason;
- on UpdateWeights it reads the stream's own messages (ACCEPTED, PROGRESS per bucket, COMMITTED)
  for the epoch's outcome, its phases and the bytes received: one counter increment per bucket,
  on the RPC thread that relays the bucket, never on the receive thread;
- the state and the committed weight version are read from the servicer at scrape time, so they
  cannot drift from what Describe says.

Each shim has its own `CollectorRegistry`, so several shims in one process do not collide.

The metrics (docs/operations.md, "Metrics", has the table):
    refit_shim_epochs_total{outcome}           committed, failed (after ACCEPTED), refused (before)
    refit_shim_epoch_seconds{outcome}          histogram, request to end of stream
    refit_shim_epoch_phase_seconds{phase}      accept (request -> ACCEPTED), receive (ACCEPTED ->
                                               last bucket), commit (last bucket -> COMMITTED)
    refit_shim_received_bytes_total
    refit_shim_weight_version                  the last committed version
    refit_shim_state{state}                    1 for the current state, 0 for the others
    refit_shim_errors_total{reason}            a Reason, or the code's name without ErrorInfo
    refit_shim_rpc_seconds{method}             histogram
    refit_shim_rpcs_total{method,code}
    refit_shim_info{instance_id,engine}        1
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

import grpc
from google.rpc import error_details_pb2, status_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from refit_grpc.errors import ERROR_DOMAIN
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.auth import is_loopback

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
UPDATE_WEIGHTS = "/" + pb.DESCRIPTOR.services_by_name["RefitService"].full_name + "/UpdateWeights"
OUTCOMES = ("committed", "failed", "refused")
PHASES = ("accept", "receive", "commit")
STATES = {v: n.removeprefix("SHIM_STATE_") for n, v in pb.ShimState.items()
          if v != pb.SHIM_STATE_UNSPECIFIED}
EPOCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
               30, 60, 300)


class MetricsAddressError(ValueError):
    pass


def parse_metrics_address(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `[V6]:PORT`, or a port alone (`9464` or `:9464`), which binds loopback."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise MetricsAddressError(f"--metrics-address {value!r}: expected HOST:PORT or PORT") from None
    if not 0 <= number <= 65535:
        raise MetricsAddressError(f"--metrics-address {value!r}: port outside 0-65535")
    return host, number


def check_metrics_exposure(host: str, *, allow_insecure: bool) -> None:
    """The metrics endpoint has no TLS and no token: beyond loopback only when told to."""
    if is_loopback(f"{host}:0"):
        return
    if not allow_insecure:
        raise MetricsAddressError(
            f"refusing to serve metrics on {host} (not loopback): the endpoint has neither TLS "
            "nor a token. Bind it to loopback for a node-local scraper, or pass --insecure-listen "
            "to accept the risk.")
    log.warning("serving metrics on %s without TLS or token (--insecure-listen)", host)


class _StateCollector:
    """State (one-hot), weight version and identity, read from the servicer at scrape time."""

    def __init__(self, servicer, engine_kind: str):
        self.servicer = servicer
        self.engine_kind = engine_kind

    def collect(self):
        state = self.servicer.state()
        g = GaugeMetricFamily("refit_shim_state", "1 for the shim's current state, 0 otherwise",
                              labels=["state"])
        for value, name in STATES.items():
            g.add_metric([name], 1.0 if value == state else 0.0)
        yield g
        yield GaugeMetricFamily("refit_shim_weight_version",
                                "the last committed weight version (0: none yet)",
                                value=self.servicer.weight_version)
        canary_version, canary_gap = self.servicer.last_canary
        yield GaugeMetricFamily("refit_shim_canary_gap",
                                "max |engine - trainer| log-probability of the last canary "
                                "(-1: none ran, or it carried no expectation)",
                                value=canary_gap if canary_version else -1.0)
        yield GaugeMetricFamily("refit_shim_canary_version",
                                "the version the last canary ran at (0: none)",
                                value=canary_version)
        staged_version, stall_s = self.servicer.staging
        yield GaugeMetricFamily("refit_shim_staged_version",
                                "the version staged and waiting for its flip (0: none)",
                                value=staged_version)
        yield GaugeMetricFamily("refit_shim_last_stall_seconds",
                                "how long the last flip stopped generation, pause to resume "
                                "(0: no flip yet)", value=stall_s)
        info = GaugeMetricFamily("refit_shim_info", "this shim", labels=["instance_id", "engine"])
        info.add_metric([self.servicer.config.instance_id, self.engine_kind], 1.0)
        yield info


class ShimMetrics:
    """The registry, the metrics and the interceptor of one shim; `serve()` starts the HTTP
    endpoint, `close()` stops it."""

    def __init__(self, servicer, engine_kind: str):
        r = self.registry = CollectorRegistry()
        self.epochs = Counter("refit_shim_epochs", "UpdateWeights epochs by outcome",
                              ["outcome"], registry=r)
        self.epoch_seconds = Histogram("refit_shim_epoch_seconds",
                                       "UpdateWeights epochs, request to end of stream",
                                       ["outcome"], buckets=EPOCH_BUCKETS, registry=r)
        self.phase_seconds = Histogram("refit_shim_epoch_phase_seconds",
                                       "committed epochs' phases: accept, receive, commit",
                                       ["phase"], buckets=EPOCH_BUCKETS, registry=r)
        self.received_bytes = Counter("refit_shim_received_bytes",
                                      "weight bytes received and applied", registry=r)
        self.errors = Counter("refit_shim_errors", "RPCs that ended in an error, by reason",
                              ["reason"], registry=r)
        self.rpc_seconds = Histogram("refit_shim_rpc_seconds", "RPC latency, start to status",
                                     ["method"], buckets=RPC_BUCKETS, registry=r)
        self.rpcs = Counter("refit_shim_rpcs", "RPCs by method and status code",
                            ["method", "code"], registry=r)
        # Every series exists from the start, so rate() and alerts see a zero, not a gap.
        for outcome in OUTCOMES:
            self.epochs.labels(outcome)
            self.epoch_seconds.labels(outcome)
        for phase in PHASES:
            self.phase_seconds.labels(phase)
        for reason in Reason:
            self.errors.labels(str(reason))
        r.register(_StateCollector(servicer, engine_kind))
        self.interceptor = MetricsInterceptor(self)
        self._httpd: WSGIServer | None = None
        self.address: str | None = None

    def serve(self, address: str) -> str:
        """Start the HTTP endpoint (`/metrics`, any path); returns the bound `host:port`."""
        host, port = parse_metrics_address(address)
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._httpd.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        return self.address

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    # --- what the interceptor reports ------------------------------------------------------

    def rpc_done(self, method: str, seconds: float, code: grpc.StatusCode,
                 reason: str | None) -> None:
        self.rpc_seconds.labels(method).observe(seconds)
        self.rpcs.labels(method, code.name).inc()
        if code is not grpc.StatusCode.OK:
            self.errors.labels(reason or code.name).inc()

    def watch_epoch(self, responses: Iterator, t0: float) -> Iterator:
        """Relay an UpdateWeights stream, reading its outcome, phases and bytes on the way."""
        outcome, accepted, last_bucket, seen = "refused", None, None, 0
        try:
            for r in responses:
                now = time.monotonic()
                if r.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED:
                    accepted, outcome = now, "failed"
                    self.phase_seconds.labels("accept").observe(now - t0)
                elif r.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS:
                    self.received_bytes.inc(max(r.bytes_received - seen, 0))
                    seen, last_bucket = max(r.bytes_received, seen), now
                elif r.phase == pb.UPDATE_WEIGHTS_PHASE_COMMITTED:
                    self.received_bytes.inc(max(r.bytes_received - seen, 0))
                    start = accepted if accepted is not None else t0
                    received = last_bucket if last_bucket is not None else start
                    self.phase_seconds.labels("receive").observe(received - start)
                    self.phase_seconds.labels("commit").observe(now - received)
                    outcome = "committed"
                yield r
        finally:
            self.epochs.labels(outcome).inc()
            self.epoch_seconds.labels(outcome).observe(time.monotonic() - t0)


def _status_of(context, error: BaseException | None) -> tuple[grpc.StatusCode, str | None]:
    """The status an RPC ended with, and its ErrorInfo reason (refit_grpc's domain) if any."""
    code = context.code()
    if code is None:
        if error is None:
            code = grpc.StatusCode.OK
        elif isinstance(error, GeneratorExit):
            code = grpc.StatusCode.CANCELLED  # the caller went away mid-stream
        else:
            code = grpc.StatusCode.UNKNOWN
    if not isinstance(code, grpc.StatusCode):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if code is grpc.StatusCode.OK:
        return code, None
    for key, value in context.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                    return code, info.reason
    return code, None


class MetricsInterceptor(grpc.ServerInterceptor):
    """Times every RPC and records its status; relays UpdateWeights through `watch_epoch`.
    Installed first, so it also sees the calls the token check refuses."""

    def __init__(self, metrics: ShimMetrics):
        self.metrics = metrics

    def intercept_service(self, continuation: Callable, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        full = handler_call_details.method
        method = full.lstrip("/")
        m = self.metrics
        epoch = full == UPDATE_WEIGHTS

        if handler.response_streaming:
            inner = handler.unary_stream or handler.stream_stream

            def behaviour(request, context):
                t0, error = time.monotonic(), None
                try:
                    responses = inner(request, context)
                    yield from (m.watch_epoch(responses, t0) if epoch else responses)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    m.rpc_done(method, time.monotonic() - t0, *_status_of(context, error))
        else:
            inner = handler.unary_unary or handler.stream_unary

            def behaviour(request, context):
                t0, error = time.monotonic(), None
                try:
                    return inner(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    m.rpc_done(method, time.monotonic() - t0, *_status_of(context, error))

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(behaviour, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


__all__ = ["MetricsAddressError", "MetricsInterceptor", "ShimMetrics", "check_metrics_exposure",
           "parse_metrics_address"]
