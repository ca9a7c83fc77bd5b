"""The Dynamo engine: one NVIDIA Dynamo vLLM worker (`python -m dynamo.vllm --enable-rl`), driven
through its system server's RL admin routes, `{system_url}/engine/<route>`.

    refit-grpc shim --engine dynamo --engine-url http://127.0.0.1:8081

The receive is done inside the worker by the project's vLLM worker extension
(`refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension`, started with
`--worker-extension-cls`), to which Dynamo forwards the weight-transfer routes; this module only
translates the shim's engine calls into those routes (`refit_grpc.dynamo_info` builds the
bodies), over the vLLM engine's cancellable HTTP client:

    status          POST liveness_probe (the engine's own health check), 2 s cap
    pause(mode)     POST pause_generation {"mode": keep|wait|abort, "clear_cache": true}
    resume          POST resume_generation
    reset_cache     POST flush_cache
    init_transfer   POST destroy_weights_update_group, then init_weights_update_group (the gloo
                    init info; the join bounded below DYN_RL_INIT_WEIGHTS_TIMEOUT_S)
    receive         POST update_weights_from_distributed (start, receive, finish in the worker;
                    blocks while the trainer broadcasts; Dynamo resets the prefix cache after)
    finish(v)       POST set_weight_version {"weight_version": v}
    abort_transfer  the update's abort key set in the trainer's TCPStore (the worker polls it),
                    then destroy_weights_update_group on a background thread

Errors: Dynamo answers a failed handler with HTTP 200 and `{"status": "error", "message"}`; that
is typed like vLLM's HTTP 500 (`dynamo_error`), by what the call was doing. A worker that does
not answer, or that vanished mid-call, is UNAVAILABLE / ENGINE_UNAVAILABLE, and `status` then
reports it unhealthy, so the shim's health goes NOT_SERVING.

Group init and Dynamo's shutdown: Dynamo kills the whole worker (`os._exit(1)`) when
`init_weights_update_group` outlives `DYN_RL_INIT_WEIGHTS_TIMEOUT_S` (30 s default). The shim
never lets a join run that long: the worker's join timeout is bounded by
`dynamo_info.join_limit_s(init_weights_timeout_s)` (engine option, which must match the worker's
environment; 30 s by default), so a trainer that never comes gives RENDEZVOUS_TIMEOUT and a live
worker. The extension applies the same bound from the worker's own environment. Should the
worker die anyway, the call fails ENGINE_UNAVAILABLE with that cause named, and health goes
NOT_SERVING.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable
from typing import Any

from refit_grpc import dynamo_info as routes
from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Bucket, Packing, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine, EngineStatus
from refit_grpc.shim.engines.vllm.adapter import _worker_timeout
from refit_grpc.shim.engines.vllm.checkpoint import CheckpointIndex
from refit_grpc.shim.engines.vllm.http import (
    CallKind,
    EngineHttpClient,
    Reply,
    error_text,
    is_loopback,
    is_timeout_text,
)
from refit_grpc.vllm_info import APPLIED_RE

log = logging.getLogger(__name__)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def dynamo_error(reply: Reply, what: str, kind: CallKind) -> RefitError:
    """The typed error for a Dynamo answer that is not `{"status": "ok"}`: a non-2xx status, or
    HTTP 200 with `{"status": "error", "message"}` (how Dynamo reports a failed handler)."""
    text = error_text(reply.body.get("message", reply.body)
                      if isinstance(reply.body, dict) else reply.body)
    where = f"{what} answered HTTP {reply.status}: {text}"
    if reply.status == 404:
        return FailedPreconditionError(
            f"{where} (start the worker with --enable-rl for the /engine routes)",
            reason=Reason.ENGINE_ROUTE_MISSING)
    if reply.status in (400, 422):
        return InvalidArgumentError(where, reason=Reason.ENGINE_REJECTED)
    if reply.status == 503:
        return EngineUnavailableError(where)
    if "must be paused" in text:
        return FailedPreconditionError(where, reason=Reason.NOT_PAUSED)
    if "has no attribute" in text and any(rpc in text for rpc in (
            routes.INIT_RPC, routes.UPDATE_RPC, routes.DESTROY_RPC)):
        return FailedPreconditionError(
            f"{where} (start the worker with --worker-extension-cls {routes.WORKER_EXTENSION})",
            reason=Reason.WEIGHT_TRANSFER_NOT_CONFIGURED)
    if kind is CallKind.JOIN:
        if is_timeout_text(text):
            return RefitTimeoutError(where, reason=Reason.RENDEZVOUS_TIMEOUT)
        return CollectiveError(where, reason=Reason.RENDEZVOUS_FAILED)
    if kind is CallKind.RECEIVE:
        if "abort requested" in text or "aborted" in text.lower():
            return EpochAbortedError(where, reason=Reason.EPOCH_ABORTED)
        if is_timeout_text(text):
            return RefitTimeoutError(where)
        return CollectiveError(where)
    return FailedPreconditionError(where, reason=Reason.ENGINE_ERROR)


class DynamoEngine(Engine):
    kind = "dynamo"

    def __init__(self, url: str = "http://127.0.0.1:8081", packing: Packing = Packing(), *,
                 request_timeout_s: float | str = 30.0, status_timeout_s: float | str = 2.0,
                 abort_grace_s: float | str = 3.0,
                 init_weights_timeout_s: float | str = routes.INIT_TIMEOUT_DEFAULT_S,
                 world_size: int | str = 1, checkpoint_dir: str | None = None,
                 allow_remote_engine: bool | str = False):
        self.request_timeout_s = float(request_timeout_s)
        self.status_timeout_s = float(status_timeout_s)
        self.abort_grace_s = float(abort_grace_s)
        self.init_weights_timeout_s = float(init_weights_timeout_s)
        if not self.init_weights_timeout_s > 0:
            raise ValueError(f"init_weights_timeout_s must be > 0, got {init_weights_timeout_s}")
        self._world_size = int(world_size)
        if self._world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._http = EngineHttpClient(url, request_timeout_s=self.request_timeout_s,
                                      abort_grace_s=self.abort_grace_s, name="Dynamo worker",
                                      error_mapper=dynamo_error)
        if not is_loopback(self._http.host) and not _truthy(allow_remote_engine):
            raise ValueError(
                f"engine url {url!r} is not loopback: Dynamo's /engine routes are "
                "unauthenticated, so the shim reaches its worker on loopback only (engine "
                "option allow_remote_engine=true overrides)")
        self.url = self._http.url
        self.offered_packing = packing
        self.checkpoint_dir = checkpoint_dir
        self._checkpoint: CheckpointIndex | None = None
        self._lock = threading.Lock()
        self._paused = False          # last known: Dynamo has no route that reports it
        self._group: GroupSpec | None = None
        self._receiving = False
        self._touched = False         # weights may differ from the last committed version
        self._cleanup_thread: threading.Thread | None = None

    # --- the engine interface --------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def partial_on_failure(self) -> bool:
        with self._lock:
            return self._receiving or self._touched

    @property
    def join_limit_s(self) -> float:
        return routes.join_limit_s(self.init_weights_timeout_s)

    def status(self, with_digest: bool = False) -> EngineStatus:
        # liveness_probe runs the engine's own health check and takes no lock in Dynamo, so it
        # answers during a weight update too. No weights digest: Dynamo has no checker route.
        try:
            body = self._post(routes.LIVENESS, None, cap_s=self.status_timeout_s)
            healthy = bool(body.get("alive", True))
        except RefitError:
            healthy = False
        return EngineStatus(healthy=healthy, paused=self._paused, weights_digest="")

    def check_plan(self, plan: RefitPlan) -> None:
        """Names and shapes against the worker's checkpoint, where the `checkpoint_dir` option
        names it (Dynamo's routes do not say where the model lives)."""
        if self.checkpoint_dir is None:
            return
        if self._checkpoint is None:
            try:
                self._checkpoint = CheckpointIndex.read(self.checkpoint_dir)
            except (OSError, ValueError) as e:
                log.warning("plan names not checked: cannot read %s (%s)", self.checkpoint_dir, e)
                return
        index = self._checkpoint
        if index is None:
            return
        index.check_plan(plan, engine="Dynamo's vLLM worker")

    def pause(self, mode: PauseMode, deadline: Deadline) -> None:
        self._post(routes.PAUSE, {"mode": mode.value, "clear_cache": True}, deadline,
                   cap_s=math.inf if mode is PauseMode.WAIT else None)
        with self._lock:
            self._paused = True

    def resume(self, deadline: Deadline) -> None:
        self._post(routes.RESUME, {}, deadline)
        with self._lock:
            self._paused = False

    def reset_cache(self, deadline: Deadline) -> bool:
        self._post(routes.FLUSH_CACHE, {}, deadline)
        return True

    def check_backend(self, backend: str) -> None:
        if backend != "gloo":
            raise InvalidArgumentError(
                f"backend {backend}: the dynamo engine's worker extension receives over gloo "
                "only; NCCL on GPUs is Dynamo's own path (docs/dynamo.md)",
                reason=Reason.BACKEND_UNAVAILABLE)

    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        self.check_backend(spec.backend)
        self._join_cleanup(deadline)
        self._post(routes.DESTROY_GROUP, routes.destroy_body(), deadline)
        left = deadline.check(routes.INIT_GROUP)
        limit = self.join_limit_s
        timeout = min(_worker_timeout(left), limit)
        body = routes.init_body(spec, plan, timeout)
        try:
            self._post(routes.INIT_GROUP, body, deadline, kind=CallKind.JOIN,
                       cap_s=timeout + 5.0, extra_s=1.0, watch=deadline)
        except RefitTimeoutError as e:
            if timeout >= limit and e.reason == Reason.RENDEZVOUS_TIMEOUT:
                raise RefitTimeoutError(
                    f"{e.message} (the join was bounded at {limit:.1f}s so that Dynamo's "
                    f"{routes.INIT_TIMEOUT_ENV}={self.init_weights_timeout_s:g}s does not shut "
                    "the worker down)", reason=Reason.RENDEZVOUS_TIMEOUT) from e
            raise
        except EngineUnavailableError as e:
            raise self._gone(e, f"during {routes.INIT_GROUP}: Dynamo shuts a worker down when "
                                f"the group init outlives {routes.INIT_TIMEOUT_ENV}") from e
        with self._lock:
            self._group = spec

    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        gen = self._http.generation
        group = self._group
        with self._lock:
            self._receiving, self._touched = True, True
        try:
            left = deadline.check(routes.UPDATE_DISTRIBUTED)
            if gen != self._http.generation:
                raise EpochAbortedError("aborted before the update", reason=Reason.EPOCH_ABORTED)
            abort_key = (f"refit_grpc/{group.group_id}/abort/{uuid.uuid4().hex}"
                         if group is not None else None)
            body = routes.update_body(plan, _worker_timeout(left), abort_key)
            try:
                self._post(routes.UPDATE_DISTRIBUTED, body, deadline, kind=CallKind.RECEIVE,
                           cap_s=math.inf, extra_s=1.0, watch=deadline, gen=gen,
                           on_cancel=(lambda: self._signal_abort(group, abort_key))
                           if group is not None and abort_key else None)
            except RefitError as e:
                m = APPLIED_RE.search(e.message)
                if m and int(m.group(1)) == 0:
                    with self._lock:
                        self._touched = False  # rolled back with nothing loaded
                if isinstance(e, EngineUnavailableError):
                    raise self._gone(e, f"during {routes.UPDATE_DISTRIBUTED}") from e
                raise
            if deadline.cancel.is_set() or gen != self._http.generation:
                raise EpochAbortedError("the update finished after an abort; not committing",
                                        reason=Reason.EPOCH_ABORTED)
        finally:
            with self._lock:
                self._receiving = False
        for bucket in plan.buckets:
            on_bucket(bucket)

    def finish(self, version: int, deadline: Deadline) -> str:
        self._post(routes.SET_VERSION, {"weight_version": version}, deadline)
        with self._lock:
            self._touched = False
        return ""

    def abort_transfer(self) -> None:
        self._http.cancel_pending()
        with self._lock:
            if self._cleanup_thread is not None and self._cleanup_thread.is_alive():
                return
            thread = threading.Thread(target=self._background_destroy, daemon=True,
                                      name="dynamo-destroy-group")
            self._cleanup_thread = thread
        thread.start()

    def close(self) -> None:
        self.abort_transfer()
        thread = self._cleanup_thread
        if thread is not None:
            thread.join(min(self.request_timeout_s, 5.0))

    # --- extras for trainers, tests and the demo -------------------------------------------

    def weight_version(self, deadline: Deadline | None = None) -> Any:
        """Dynamo's declared weight version (`get_weight_version`), None if undeclared."""
        return self._post(routes.GET_VERSION, {}, deadline).get("version")

    # --- helpers ---------------------------------------------------------------------------

    def _post(self, route: str, body: Any, deadline: Deadline | None = None, *,
              kind: CallKind = CallKind.CONTROL, cap_s: float | None = None,
              extra_s: float = 0.0, watch: Deadline | None = None, gen: int | None = None,
              on_cancel: Callable[[], None] | None = None) -> dict:
        """POST {system_url}/engine/<route>; the body of `{"status": "ok", ...}` or a typed
        error (Dynamo's failures come as HTTP 200 with `"status": "error"`)."""
        reply = self._http.call("POST", f"/engine/{route}", deadline, what=route,
                                body={} if body is None else body, cap_s=cap_s,
                                extra_s=extra_s, kind=kind, watch=watch, gen=gen,
                                on_cancel=on_cancel)
        if not isinstance(reply, dict) or reply.get("status") != "ok":
            raise dynamo_error(Reply(200, reply), f"{route}: Dynamo worker at {self.url}", kind)
        return reply

    def _gone(self, error: EngineUnavailableError, context: str) -> EngineUnavailableError:
        """The error for a worker that stopped answering mid-call, saying whether it is gone."""
        alive = self.status().healthy
        state = "still answers its liveness probe" if alive else "is gone (no liveness answer)"
        return EngineUnavailableError(f"{error.message}; the worker {state} {context}")

    def _signal_abort(self, group: GroupSpec, key: str) -> None:
        """Set the update's abort key in the trainer's TCPStore: the only way to reach a worker
        blocked inside the update (Dynamo serialises the weight routes, and vLLM runs worker
        RPCs one at a time). Best effort, bounded."""
        from refit_grpc.collective import set_store_key  # torch, only when it is needed

        if set_store_key(group.master_address, group.master_port, key,
                         min(self.abort_grace_s, 2.0)):
            log.info("abort key set for the worker: %s", key)
        else:
            log.info("abort key not set: the worker fails with the trainer")

    def _background_destroy(self) -> None:
        try:
            self._post(routes.DESTROY_GROUP, routes.destroy_body(),
                       Deadline(self.request_timeout_s))
        except RefitError as e:
            log.info("background destroy_weights_update_group: %s", e)

    def _join_cleanup(self, deadline: Deadline) -> None:
        """A destroy posted by an earlier abort must reach the worker before the next init."""
        thread = self._cleanup_thread
        if thread is not None and thread.is_alive():
            thread.join(max(min(deadline.remaining(), self.request_timeout_s), 0.0))
            if thread.is_alive():
                raise EngineUnavailableError("the previous destroy_weights_update_group is "
                                             "still unanswered")

