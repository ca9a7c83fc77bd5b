"""A cancellable JSON-over-HTTP client for an engine's local admin routes (standard library only).

Every call has a timeout derived from the caller's Deadline, capped by `request_timeout_s` for
the short ones. A timeout at the cap means the engine does not answer: EngineUnavailableError
(UNAVAILABLE), as is a refused or reset connection; a timeout at the deadline is
RefitTimeoutError (DEADLINE_EXCEEDED). A fresh connection per call (`Connection: close`): vLLM
closes keep-alive connections after a 500, and every worker-side error is a 500.

A long call (a receive) can be watched: it runs on a helper thread, and a cancelled Deadline or a
new `generation` (bumped by `cancel_pending()`) runs `on_cancel` (which tells the engine), gives
the engine `abort_grace_s` to answer, then shuts the socket.
"""

from __future__ import annotations

import enum
import http.client
import ipaddress
import json
import math
import socket
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit_grpc.common import Deadline
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.reasons import Reason

_POLL_S = 0.02


class CallKind(enum.Enum):
    """What a failed call was doing: it decides how an engine-side error is typed."""

    CONTROL = "control"  # pause, resume, caches, session bookkeeping
    JOIN = "join"        # forming the data group
    RECEIVE = "receive"  # receiving weights


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # parsed JSON, or text when the body is not JSON


def error_text(body: Any) -> str:
    """vLLM answers errors as {"error": {"message": ...}}, {"error": "..."} or {"detail": ...}."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:800]
    return str(body)[:800]


def is_timeout_text(text: str) -> bool:
    low = text.lower()
    return "timed out" in low or "timeout" in low


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class EngineHttpClient:
    """`name` (for messages) and `error_mapper` (how a non-2xx answer is typed, default
    `error_for`) let another engine whose admin routes are local JSON over HTTP too (Dynamo's
    `/engine/*`) use this client."""

    def __init__(self, url: str, *, request_timeout_s: float, abort_grace_s: float,
                 name: str = "vLLM",
                 error_mapper: Callable[[Reply, str, CallKind], RefitError] | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine url must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.abort_grace_s = abort_grace_s
        self.name = name
        self._error_for = error_mapper or error_for
        self._lock = threading.Lock()
        # Bumped by cancel_pending(): a watched call started under an older generation gives up.
        self.generation = 0

    def cancel_pending(self) -> None:
        with self._lock:
            self.generation += 1

    def call(self, method: str, path: str, deadline: Deadline | None, *, what: str,
              query: dict | None = None, body: Any = None, cap_s: float | None = None,
              extra_s: float = 0.0, kind: CallKind = CallKind.CONTROL, watch: Deadline | None = None,
              gen: int | None = None, on_cancel: Callable[[], None] | None = None) -> Any:
        """One request; returns the parsed JSON body of a 2xx or raises a typed RefitError."""
        left = deadline.check(what) + extra_s if deadline is not None else math.inf
        cap = self.request_timeout_s if cap_s is None else cap_s
        timeout = min(left, cap)
        if math.isinf(timeout):
            timeout = self.request_timeout_s
        reply = self.roundtrip(method, path, query, body, timeout, what,
                                at_deadline=timeout >= left, watch=watch,
                                gen=self.generation if gen is None else gen, on_cancel=on_cancel)
        if 200 <= reply.status < 300:
            return reply.body
        raise self._error_for(reply, f"{what}: {self.name} at {self.url}", kind)

    def roundtrip(self, method: str, path: str, query: dict | None, body: Any, timeout: float,
                   what: str, *, at_deadline: bool, watch: Deadline | None = None,
                   gen: int = 0, on_cancel: Callable[[], None] | None = None) -> Reply:
        target = self.prefix + path
        if query:
            target += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Connection": "close", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        cls = http.client.HTTPSConnection if self.scheme == "https" else \
            http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=max(timeout, 0.001))

        def run() -> Reply:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = raw.decode(errors="replace")
            return Reply(resp.status, parsed)

        try:
            if watch is None:
                return run()
            return self._run_cancellable(run, conn, watch, gen, what, on_cancel)
        except TimeoutError as e:
            if at_deadline:
                raise RefitTimeoutError(f"{what}: no answer from {self.url} before the "
                                        f"deadline ({timeout:.1f}s)") from e
            raise EngineUnavailableError(f"{what}: {self.url} did not answer within "
                                         f"{timeout:.1f}s") from e
        except (OSError, http.client.HTTPException) as e:
            raise EngineUnavailableError(f"{what}: {self.url} unreachable: "
                                         f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()

    def _run_cancellable(self, run: Callable[[], Reply], conn, watch: Deadline, gen: int,
                         what: str, on_cancel: Callable[[], None] | None) -> Reply:
        """Run a blocking call on a helper thread. An abort (the deadline's cancel flag or
        abort_transfer) runs `on_cancel` (which tells the worker), gives the engine
        `abort_grace_s` to answer (its error says how much was applied), then closes the
        socket."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["reply"] = run()
            except BaseException as e:  # noqa: BLE001  (re-raised on the caller's thread)
                box["error"] = e

        thread = threading.Thread(target=target, daemon=True, name=f"vllm-{what}")
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and (watch.cancel.is_set() or gen != self.generation):
                if on_cancel is not None:
                    on_cancel()
                thread.join(self.abort_grace_s)
                if thread.is_alive():
                    try:
                        if conn.sock is not None:
                            conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    thread.join(1.0)
                    raise EpochAbortedError(f"{what}: aborted; {self.name} had not answered within "
                                            f"{self.abort_grace_s:.1f}s", reason=Reason.EPOCH_ABORTED)
        if "error" in box:
            raise box["error"]
        return box["reply"]


def status_error(status: int, where: str, routes_hint: str) -> RefitError | None:
    """The typed error an HTTP status alone decides, or None: 404 is a missing route (`routes_hint`
    says how to start the engine with them), 400/422 a rejected body, 503 an engine not up."""
    if status == 404:
        return FailedPreconditionError(f"{where} ({routes_hint})",
                                       reason=Reason.ENGINE_ROUTE_MISSING)
    if status in (400, 422):
        return InvalidArgumentError(where, reason=Reason.ENGINE_REJECTED)
    if status == 503:
        return EngineUnavailableError(where)
    return None


def worker_error(where: str, text: str, kind: CallKind, *,
                 abort_text: bool = False) -> RefitError:
    """A failure inside the engine's workers, typed by what the call was doing: the join's is
    RENDEZVOUS_TIMEOUT / RENDEZVOUS_FAILED, the receive's a timeout or COLLECTIVE_FAILED (with
    `abort_text`, a message saying the receive was aborted is EPOCH_ABORTED), anything else
    ENGINE_ERROR."""
    if kind is CallKind.JOIN:
        if is_timeout_text(text):
            return RefitTimeoutError(where, reason=Reason.RENDEZVOUS_TIMEOUT)
        return CollectiveError(where, reason=Reason.RENDEZVOUS_FAILED)
    if kind is CallKind.RECEIVE:
        if abort_text and ("abort requested" in text or "aborted" in text.lower()):
            return EpochAbortedError(where, reason=Reason.EPOCH_ABORTED)
        if is_timeout_text(text):
            return RefitTimeoutError(where)
        return CollectiveError(where)
    return FailedPreconditionError(where, reason=Reason.ENGINE_ERROR)


def error_for(reply: Reply, what: str, kind: CallKind) -> RefitError:
    """The typed error for a non-2xx answer of vLLM; `kind` says what a worker-side failure
    means."""
    text = error_text(reply.body)
    where = f"{what} answered HTTP {reply.status}: {text}"
    by_status = status_error(reply.status, where, "start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                             "--weight-transfer-config to expose the admin routes")
    if by_status is not None:
        return by_status
    if "Weight transfer not configured" in text:
        return FailedPreconditionError(
            f"{where} (start vLLM with --weight-transfer-config '{{\"backend\": \"gloo\"}}')",
            reason=Reason.WEIGHT_TRANSFER_NOT_CONFIGURED)
    return worker_error(where, text, kind)
