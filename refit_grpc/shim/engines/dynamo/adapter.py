"""The Dynamo engine: one NVIDIA Dynamo vLLM worker (`python -m dynamo.vllm --enable-rl`), driven
through its system server's RL admin routes, `{system_url}/engine/<route>`.

    refit-grpc shim --engine dynamo --engine-url http://127.0.0.1:8081

The receive is done inside the worker by the project's vLLM worker extension
(`refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension`, started with
`--worker-extension-cls`), to which Dynamo forwards the weight-transfer routes; this module only
translates the shim's engine calls into those routes (`refit_grpc.wire.dynamo` builds the
bodies), over the shared cancellable HTTP client (`refit_grpc.shim.engines.http_client`). The
lifecycle every HTTP engine shares (options, the loopback rule, paused/receiving state, the
abort key, the background teardown) is `HttpEngine`'s; this module holds Dynamo's routes only:

    status          POST liveness_probe (the engine's own health check), 2 s cap
    pause(mode)     POST pause_generation {"mode": keep|wait|abort, "clear_cache": true}
    resume          POST resume_generation
    reset_cache     POST flush_cache (not after a pause, which clears more: pause_clears_cache)
    init_transfer   POST destroy_weights_update_group, then init_weights_update_group (the gloo
                    init info; the join bounded below DYN_RL_INIT_WEIGHTS_TIMEOUT_S)
    receive         POST update_weights_from_distributed (start, receive, finish in the worker;
                    blocks while the trainer broadcasts; Dynamo resets the prefix cache after)
    finish(v)       POST set_weight_version {"weight_version": v}
    abort_transfer  the update's abort key set in the trainer's TCPStore (the worker polls it),
                    then destroy_weights_update_group on a background thread
    stage           POST update_weights_from_distributed {"engine_rpc": "refit_grpc_stage",
                    "allow_unpaused": true, "reset_prefix_cache": false, the plan, a status
                    key}: every worker starts its staged receive beside the engine loop and
                    answers at once; then each worker's status is read every 0.1 s from the
                    trainer's TCPStore, where the worker publishes it (Dynamo discards what a
                    forwarded call returns). The engine serves the old version meanwhile
    flip(v)         POST update_weights_from_distributed (paused) with `source: "staged"` in
                    the update_info (the workers load their copies through the receive's own
                    loader), then set_weight_version
    drop_staged     POST update_weights_from_distributed {"engine_rpc":
                    "refit_grpc_drop_staged", "allow_unpaused": true}, on a background thread
    committed copy  the copy a flip loaded stays on the workers (`HttpEngine`): a delta stage
                    says `delta: true`, and
    adapters        an adapter plan's Prepare: POST update_weights_from_distributed
                    {"engine_rpc": "refit_grpc_check_adapter", the plan, a store this shim
                    hosts}; its flip: {"engine_rpc": "refit_grpc_commit_adapter"}, then POST
                    load_lora {"lora_name", "source": {"uri": adapter_path(name, version)}}
                    (Dynamo's hot swap for a later version; never paused)
    serve_copy      POST update_weights_from_distributed {"engine_rpc": "refit_grpc_serve",
                    "allow_unpaused": true, the group, a status key}: the engine's rank-0
                    worker broadcasts its committed copy to the newcomer's group and publishes
                    the serve's status in the catch-up's rendezvous store (this shim hosts it)

Errors: Dynamo answers a failed handler with HTTP 200 and `{"status": "error", "message"}`; that
is typed like vLLM's HTTP 500 (`dynamo_error`), by what the call was doing. A worker that does
not answer, or that vanished mid-call, is UNAVAILABLE / ENGINE_UNAVAILABLE, and `status` then
reports it unhealthy, so the shim's health goes NOT_SERVING.

Group init and Dynamo's shutdown: Dynamo kills the whole worker (`os._exit(1)`) when
`init_weights_update_group` outlives `DYN_RL_INIT_WEIGHTS_TIMEOUT_S` (30 s default). The shim
never lets a join run that long: the worker's join timeout is bounded by
`wire.dynamo.join_limit_s(init_weights_timeout_s)` (engine option, which must match the worker's
environment; 30 s by default), so a trainer that never comes gives RENDEZVOUS_TIMEOUT and a live
worker. The extension applies the same bound from the worker's own environment. Should the
worker die anyway, the call fails ENGINE_UNAVAILABLE with that cause named, and health goes
NOT_SERVING.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import socket
import time
import urllib.parse
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    FailedPreconditionError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Capabilities, EngineStatus
from refit_grpc.shim.engines.http_client import (
    CallKind,
    Reply,
    error_text,
    status_error,
    worker_error,
)
from refit_grpc.shim.engines.http_engine import (
    HttpEngine,
    HttpEngineOptions,
    StagePoll,
    UpdateCall,
)
from refit_grpc.shim.engines.options import EngineKind
from refit_grpc.wire import dynamo as routes
from refit_grpc.wire.worker import (
    STAGE_IDLE,
    STAGE_RECEIVING,
    ServeInfo,
    StageStatus,
    WorkerInfo,
)

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

# How many times Describe asks the workers what they are before giving up (`quantization` "").
_INFO_TRIES = 3


def dynamo_error(reply: Reply, what: str, kind: CallKind) -> RefitError:
    """The typed error for a Dynamo answer that is not `{"status": "ok"}`: a non-2xx status, or
    HTTP 200 with `{"status": "error", "message"}` (how Dynamo reports a failed handler)."""
    text = error_text(reply.body.get("message", reply.body)
                      if isinstance(reply.body, dict) else reply.body)
    where = f"{what} answered HTTP {reply.status}: {text}"
    by_status = status_error(reply.status, where,
                             "start the worker with --enable-rl for the /engine routes")
    if by_status is not None:
        return by_status
    if "must be paused" in text:
        return FailedPreconditionError(where, reason=Reason.NOT_PAUSED)
    if "has no attribute" in text and any(rpc in text for rpc in (
            routes.INIT_RPC, routes.UPDATE_RPC, routes.DESTROY_RPC)):
        return FailedPreconditionError(
            f"{where} (start the worker with --worker-extension-cls {routes.WORKER_EXTENSION})",
            reason=Reason.WEIGHT_TRANSFER_NOT_CONFIGURED)
    return worker_error(where, text, kind, abort_text=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamoOptions(HttpEngineOptions):
    """The dynamo engine's options: `HttpEngineOptions`, Dynamo's group-init limit (must match
    the worker's DYN_RL_INIT_WEIGHTS_TIMEOUT_S) and the ranks the worker takes."""

    url: str = "http://127.0.0.1:8081"
    init_weights_timeout_s: float = routes.INIT_TIMEOUT_DEFAULT_S
    world_size: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.init_weights_timeout_s > 0:
            raise ValueError(f"init_weights_timeout_s must be > 0, got "
                             f"{self.init_weights_timeout_s}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")


class DynamoEngine(HttpEngine):
    kind = "dynamo"
    options_cls = DynamoOptions
    engine_name = "Dynamo worker"
    admin_routes = "Dynamo's /engine routes"
    reached = "worker"
    teardown_route = routes.DESTROY_GROUP
    update_route = routes.UPDATE_DISTRIBUTED
    options: DynamoOptions

    def __init__(self, url: str | None = None, packing: Packing = Packing(), *,
                 options: DynamoOptions | None = None, **fields: Any):
        super().__init__(url, packing, options=options, **fields)
        self.init_weights_timeout_s = self.options.init_weights_timeout_s
        self._world_size = self.options.world_size
        # The workers' `WorkerInfo.quantization` (fixed for the engine's life): None until read
        # (`_read_worker_info`), "" where they cannot say (an extension without the call).
        self._quantization: str | None = None
        self._info_tries = 0

    def _error_for(self, reply: Reply, what: str, kind: CallKind) -> RefitError:
        return dynamo_error(reply, what, kind)

    # --- the engine interface --------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """Staging: the worker extension's workers receive on a thread beside the engine loop
        (gloo only, which init_transfer enforces). No canary (Dynamo's frontend is not this
        shim's to reach). The workers keep the copy a flip loaded as their committed copy:
        delta epochs apply onto it and catch-ups are served from it. Adapter epochs through
        Dynamo's LoRA route (`_flip_adapter`)."""
        return Capabilities(staging=True, delta=True, serving_copy=True, rollback=True,
                            keep_cache=True, adapters=True)

    @property
    def world_size(self) -> int:
        return self._world_size

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

    @property
    def quantization(self) -> str:
        """vLLM's `--quantization` as the worker's workers hold it, asked of them by the first
        Describe that finds no weight call in flight (`_read_worker_info`), then kept (it is
        fixed for the engine's life); "" until then, and where they cannot say."""
        if self._quantization is None and self._info_tries < _INFO_TRIES \
                and not self._weight_calls:
            self._read_worker_info()
        return self._quantization or ""

    def _read_worker_info(self) -> None:
        """Every worker's `WorkerInfo` (`_ask_workers`, `refit_grpc_engine_info`), within the
        status timeout: the quantization, and the adapters the workers already built. Tried
        `_INFO_TRIES` times at most (a worker that never answers costs the first Describes a
        status timeout each, not every one)."""
        import torch.distributed as dist

        self._info_tries += 1
        try:
            answers = self._ask_workers(routes.engine_info_body, "engine_info",
                                        Deadline(self.status_timeout_s))
            infos = [WorkerInfo.from_wire(a) for a in answers]
            names = {info.quantization for info in infos}
        except FailedPreconditionError as e:
            if "has no attribute" in e.message:
                self._quantization = ""  # an extension without the call: asking again is no use
            return
        except (RefitError, RuntimeError, dist.DistError, TypeError, ValueError) as e:
            log.warning("engine_info: the workers' answer could not be read (%s)", e)
            return
        # Every worker of one engine loads one model config (as the vLLM adapter reads it).
        self._quantization = names.pop() if len(names) == 1 else ""
        # The adapters the workers built before this shim started (a restart): what the
        # engine serves, as vLLM's model list says it for the vLLM engine; this shim's own
        # flips are the later word. Every worker builds every adapter: the first one says.
        with self._lock:
            self._adapters = {**(infos[0].adapters if infos else {}), **self._adapters}

    def _ask_workers(self, body_for: Callable[[str, int, str], dict[str, Any]], what: str,
                     deadline: Deadline) -> list[dict[str, Any]]:
        """Every worker's answer to one question the engine keeps serving through: Dynamo
        discards what a forwarded call returns (as for a staged receive's status), so each
        worker publishes its answer (JSON) under `engine_info_key(key, rank)` in a store this
        shim hosts, at the local address that routes to the worker. `body_for(address, port,
        key)` is the update_weights_from_distributed body that asks.

        Raises:
            RefitTimeoutError: not every worker answered by `deadline` (ENGINE_UNAVAILABLE).
            RefitError: the call failed, typed as Dynamo answered it; or no store could be
                hosted here (COLLECTIVE_FAILED, ENGINE_ERROR).
        """
        from refit_grpc.dataplane.rendezvous import bind_master_store

        local = _local_address_towards(urllib.parse.urlsplit(self.url).hostname or "127.0.0.1")
        key = f"refit_grpc/{what}/{uuid.uuid4().hex}"
        try:
            store = bind_master_store(local, 0, 1 + self._world_size,
                                      max(deadline.remaining(), 0.001))
        except OSError as e:
            raise RefitError(f"{what}: no store for the workers' answers ({e})",
                             reason=Reason.ENGINE_ERROR) from e
        self._post(routes.UPDATE_DISTRIBUTED, body_for(local, store.port, key), deadline,
                   cap_s=max(deadline.remaining(), 0.001))
        keys = [routes.engine_info_key(key, rank) for rank in range(self._world_size)]
        while not store.check(keys):
            if deadline.remaining() <= 0:
                raise RefitTimeoutError(f"{what}: not every worker of the Dynamo worker at "
                                        f"{self.url} answered in time",
                                        reason=Reason.ENGINE_UNAVAILABLE)
            time.sleep(0.02)
        return [json.loads(store.get(k)) for k in keys]

    def check_plan(self, plan: RefitPlan) -> None:
        """Names and shapes against the worker's checkpoint, where the `checkpoint_dir` option
        names it (Dynamo's routes do not say where the model lives); an adapter plan is asked
        of the workers (`_check_adapter`)."""
        if plan.adapter is not None:
            self._check_adapter(plan)
            return
        if self.checkpoint_dir is None:
            return
        index = self._read_checkpoint(self.checkpoint_dir)
        if index is None:
            return
        index.check_plan(plan, engine="Dynamo's vLLM worker")

    # --- adapter epochs (docs/adapters.md, Dynamo) -------------------------------------------

    def _check_adapter(self, plan: RefitPlan) -> None:
        """Prepare of an adapter plan: every worker says whether it can serve the adapter
        (`refit_grpc_check_adapter`: vLLM's own checks as on the vLLM engine, and Dynamo's
        LoRA settings), answered through `_ask_workers`; the first problem is the refusal.
        Nothing is loaded."""
        assert plan.adapter is not None

        def body(address: str, port: int, key: str) -> dict[str, Any]:
            return routes.check_adapter_body(plan, address, port, key)

        try:
            answers = self._ask_workers(body, "check_adapter", Deadline(self.request_timeout_s))
        except FailedPreconditionError as e:
            _raise_if_without_rpc(e, routes.CHECK_ADAPTER_RPC, "adapter epochs",
                                  Reason.ADAPTER_UNSUPPORTED)
            raise
        self._refuse_adapter_problems(answers)
        if self.checkpoint_dir is not None:
            index = self._read_checkpoint(self.checkpoint_dir)
            if index is not None:
                index.check_adapter(plan)

    def _flip_adapter(self, plan: RefitPlan, digest: str, version: int,
                      deadline: Deadline) -> None:
        """An adapter epoch's flip, while the engine serves: every worker makes its staged copy
        the adapter's pending version in memory (`refit_grpc_commit_adapter`), then Dynamo's
        LoRA route loads it under the adapter's name from `adapter_path(name, version)`, which
        the project's LoRA source resolves to the workers' memory (`vllm_plugin.dynamo_lora`).
        A later version is Dynamo's hot swap: it waits until no request of that adapter runs,
        removes the old version, adds the new one and resets the prefix cache; a failed add
        puts the old one back (Dynamo's own rollback)."""
        assert plan.adapter is not None
        name = plan.adapter.name
        self._post(routes.UPDATE_DISTRIBUTED, routes.commit_adapter_body(digest, version),
                   deadline)
        what = f"{routes.LOAD_LORA}({name!r}, version {version})"
        reply = self._http.roundtrip("POST", f"/engine/{routes.LOAD_LORA}", None,
                                     routes.load_lora_body(name, version),
                                     min(deadline.check(what), self.request_timeout_s), what,
                                     at_deadline=False)
        body = reply.body if isinstance(reply.body, dict) else {}
        if reply.status == 404:
            raise FailedPreconditionError(
                f"{what}: the Dynamo worker at {self.url} has no LoRA route (start it with "
                "--enable-lora)", reason=Reason.ADAPTER_UNSUPPORTED)
        if not 200 <= reply.status < 300 or body.get("status") != "success":
            raise RefitError(f"{what}: Dynamo answered HTTP {reply.status}: "
                             f"{error_text(body.get('message', reply.body))}",
                             reason=Reason.ENGINE_REJECTED)
        with self._lock:
            loaded_before = name in self._adapters
        if loaded_before and body.get("hot_swap") is not True:
            # Dynamo without hot swap answers a second load "already loaded" and keeps the
            # first version: Prepare refuses such a worker, so this is a worker restarted
            # with other settings since.
            raise FailedPreconditionError(
                f"{what}: Dynamo kept the adapter's earlier version ({body.get('message')}); "
                f"start the worker with {routes.LORA_HOTSWAP_ENV}=true",
                reason=Reason.ADAPTER_UNSUPPORTED)

    def _post_pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool) -> None:
        # keep_cache (a staged flip that keeps the parked requests' KV cache): Dynamo's
        # pause_generation passes clear_cache to vLLM's, and the flip skips flush_cache.
        self._post(routes.PAUSE, {"mode": mode.value, "clear_cache": not keep_cache}, deadline,
                   cap_s=math.inf if mode is PauseMode.WAIT else None)

    def _post_resume(self, deadline: Deadline) -> None:
        self._post(routes.RESUME, {}, deadline)

    @property
    def pause_clears_cache(self) -> bool:
        """The pause clears every cache, so a flip (and an in-place epoch's resume at its
        commit) need not post `flush_cache` after it: one round trip less in the stall. Read in
        Dynamo 1.6.1 and its vLLM 0.31: `pause_generation {"clear_cache": true}` calls
        AsyncLLM.pause_generation(clear_cache=True), whose EngineCore `_finish_pause` resets the
        prefix cache with the running requests' blocks and any KV connector, the multimodal
        and the encoder caches: more than `flush_cache` (`reset_prefix_cache()` alone). Nothing
        is scheduled until the resume, so nothing fills them meanwhile."""
        return True

    def reset_cache(self, deadline: Deadline) -> bool:
        self._post(routes.FLUSH_CACHE, {}, deadline)
        return True

    def check_backend(self, backend: str) -> None:
        if backend != "gloo":
            raise InvalidArgumentError(
                f"backend {backend}: the dynamo engine's worker extension receives over gloo "
                "only; NCCL on GPUs is Dynamo's own path (docs/dynamo.md)",
                reason=Reason.BACKEND_UNAVAILABLE)

    def _post_join(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline,
                   timeout_s: float) -> None:
        """init_weights_update_group, the join bounded below Dynamo's limit (module
        docstring): a trainer that never comes gives RENDEZVOUS_TIMEOUT and a live worker."""
        limit = self.join_limit_s
        timeout = min(timeout_s, limit)
        try:
            self._post(routes.INIT_GROUP, routes.init_body(spec, plan, timeout), deadline,
                       kind=CallKind.JOIN, cap_s=timeout + 5.0, extra_s=1.0, watch=deadline)
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

    def _post_update(self, call: UpdateCall) -> None:
        """update_weights_from_distributed (start, receive, finish in the worker; paused), or
        with `source: "staged"` a flip's load of the workers' copies through the same
        loader."""
        if call.staged_digest is None:
            body = routes.update_body(call.plan, call.timeout_s, call.abort_key)
        else:
            body = routes.flip_body(call.plan, call.timeout_s, call.staged_digest, call.version)
        try:
            self._post(routes.UPDATE_DISTRIBUTED, body, call.deadline, kind=CallKind.RECEIVE,
                       cap_s=math.inf, extra_s=1.0, watch=call.deadline, gen=call.gen,
                       on_cancel=call.on_cancel)
        except EngineUnavailableError as e:
            raise self._gone(e, f"during {routes.UPDATE_DISTRIBUTED}"
                             if call.staged_digest is None else "during the flip's load") from e

    def _post_finish(self, version: int, deadline: Deadline) -> None:
        self._post(routes.SET_VERSION, {"weight_version": version}, deadline)

    def _post_teardown(self, deadline: Deadline, *, before_join: bool = False) -> None:
        self._post(routes.DESTROY_GROUP, routes.destroy_body(), deadline)

    # --- staged epochs (docs/dynamo.md, Staged epochs) -------------------------------------

    def _start_stage(self, plan: RefitPlan, deadline: Deadline, timeout_s: float,
                     delta: bool, keep_previous: bool) -> tuple[list[StageStatus], StagePoll]:
        """update_weights_from_distributed with the extension's `refit_grpc_stage` and
        `allow_unpaused` (the call answers at once); the workers' statuses are then read from
        the trainer's TCPStore, where they publish them.

        Raises:
            RefitError: no group (NO_GROUP), the trainer's store is gone, or the worker's
                extension has no staged receive (STAGING_UNSUPPORTED).
        """
        group = self._group
        if group is None:
            raise FailedPreconditionError("stage: no weight-update group; InitCollective first",
                                          reason=Reason.NO_GROUP)
        status_key = f"refit_grpc/{group.group_id}/staged/{uuid.uuid4().hex}"
        try:
            self._post(routes.UPDATE_DISTRIBUTED,
                       routes.stage_body(plan, timeout_s, status_key, delta, keep_previous),
                       deadline)
        except FailedPreconditionError as e:
            _raise_if_without_rpc(e, routes.STAGE_RPC, "staged receive",
                                  Reason.STAGING_UNSUPPORTED)
            raise
        except EngineUnavailableError as e:
            raise self._gone(e, "starting the staged receive") from e
        store = _connect_store(group, min(self.request_timeout_s,
                                          max(deadline.remaining(), 0.001)))
        ranks = range(group.rank, group.rank + self._world_size)

        def poll(d: Deadline) -> list[StageStatus]:
            return _read_statuses(store, status_key, ranks, len(plan.buckets))

        return poll(deadline), poll

    def _post_drop_staged(self, deadline: Deadline) -> list[StageStatus] | None:
        self._post(routes.UPDATE_DISTRIBUTED, routes.drop_staged_body(), deadline)
        return None

    def _start_serve(self, info: ServeInfo, store: Any,
                     deadline: Deadline) -> Callable[[Deadline], StageStatus]:
        """update_weights_from_distributed with the extension's `refit_grpc_serve` (answered
        at once); the serving worker publishes its status in the catch-up's rendezvous store,
        which this shim hosts (`store`), and it is read there."""
        import torch.distributed as dist

        status_key = f"refit_grpc/{info.group_id}/serve/{uuid.uuid4().hex}"
        try:
            self._post(routes.UPDATE_DISTRIBUTED, routes.serve_body(info, status_key), deadline)
        except EngineUnavailableError as e:
            raise self._gone(e, "starting the serve of its committed copy") from e
        key = routes.serve_status_key(status_key)

        def poll(_: Deadline) -> StageStatus:
            try:
                if not store.check([key]):
                    return StageStatus(rank=0, state=STAGE_IDLE)  # not published yet
                return StageStatus.from_wire(json.loads(store.get(key)))
            except (RuntimeError, dist.DistError) as e:
                raise CollectiveError(f"serve_copy: the catch-up's rendezvous store no longer "
                                      f"answers ({e})", reason=Reason.COLLECTIVE_FAILED) from e
            except (TypeError, ValueError) as e:
                raise RefitError(f"serve_copy: the worker's status is unreadable ({e})",
                                 reason=Reason.ENGINE_ERROR) from e

        return poll

    def _cancel_serve(self, deadline: Deadline) -> None:
        self._post(routes.UPDATE_DISTRIBUTED, routes.cancel_serve_body(), deadline)

    def _post_restore_previous(self, deadline: Deadline) -> None:
        self._post(routes.UPDATE_DISTRIBUTED, routes.restore_body(), deadline)

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


def _raise_if_without_rpc(error: FailedPreconditionError, rpc: str, lacks: str,
                          reason: Reason) -> None:
    """Where `error` is the worker's answer to a call its extension does not have (`rpc`;
    Dynamo answers "has no attribute"), raise it typed `reason`, saying how to start the
    worker; any other failure is the caller's to raise."""
    if "has no attribute" in error.message and rpc in error.message:
        raise FailedPreconditionError(
            f"{error.message} (the worker's extension has no {lacks}; start it with "
            f"--worker-extension-cls {routes.WORKER_EXTENSION})", reason=reason) from error


def _local_address_towards(host: str) -> str:
    """The local address this host routes to `host` from (where a worker there reaches this
    shim): a UDP connect sends nothing, it only picks the route."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _read_statuses(store: dist.Store, status_key: str, ranks: range,
                   buckets: int) -> list[StageStatus]:
    """Every worker's published status; a worker that has published nothing yet is receiving
    (its start call answered ok)."""
    import torch.distributed as dist

    statuses = []
    try:
        for rank in ranks:
            key = routes.stage_status_key(status_key, rank)
            if store.check([key]):
                statuses.append(StageStatus.from_wire(json.loads(store.get(key))))
            else:
                statuses.append(StageStatus(rank=rank, state=STAGE_RECEIVING, total=buckets))
    except (RuntimeError, dist.DistError) as e:
        raise CollectiveError(f"stage: the trainer's TCPStore, where the workers publish "
                              f"their staged receive, no longer answers ({e})",
                              reason=Reason.COLLECTIVE_FAILED) from e
    except (TypeError, ValueError) as e:
        raise RefitError(f"stage: a worker's staged status is unreadable ({e})",
                         reason=Reason.ENGINE_ERROR) from e
    return statuses


def _connect_store(group: GroupSpec, timeout_s: float) -> dist.Store:
    """A client of the trainer's TCPStore, which must answer within `timeout_s` (probed first:
    torch's client retries a failed connect after a random delay of seconds)."""
    import torch.distributed as dist

    try:
        with socket.create_connection((group.master_address, group.master_port),
                                      timeout=min(timeout_s, 1.0)):
            pass
        return dist.TCPStore(group.master_address, group.master_port, is_master=False,
                             wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (OSError, RuntimeError, dist.DistError) as e:
        raise CollectiveError(f"stage: the trainer's TCPStore at {group.master_address}:"
                              f"{group.master_port}, where the workers publish their staged "
                              f"receive, does not answer ({e})",
                              reason=Reason.COLLECTIVE_FAILED) from e


ENGINE = EngineKind(DynamoOptions, DynamoEngine.from_options)
