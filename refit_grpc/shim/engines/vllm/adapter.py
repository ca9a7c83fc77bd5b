"""The vLLM engine: a vLLM OpenAI server on the same host, driven through its own admin routes.

    refit-grpc shim --engine vllm --engine-url http://127.0.0.1:8000

The receive is done by vLLM itself (its native weight-transfer engine: the project's `gloo`
backend from `refit_grpc.vllm_plugin` on CPUs, vLLM's own `nccl` backend on GPUs); this module
only translates the shim's engine calls into HTTP calls (standard library only):

    status          GET /is_paused (the EngineCore answers it: alive and pause state), else
                    GET /health; GET /get_world_size once
    pause(mode)     POST /sleep?level=0&mode=keep|wait|abort (vLLM's scheduler pause; its
                    /pause route ends in a fixed 20 ms sleep, inside every stall), then, unless
                    the caches are kept, reset_cache (what /pause?clear_cache=true does),
                    beside the next call to the paused engine
    resume          the calls started beside, then POST /wake_up?tags=scheduling (level 0's
                    resume; vLLM's sleep gauge agrees)
    reset_cache     POST /reset_prefix_cache?reset_running_requests=true&reset_external=true
                    (the parked requests' blocks included: they recompute after the resume);
                    for a multimodal model also /reset_mm_cache and /reset_encoder_cache
    init_transfer   POST /shutdown_weight_transfer_engine, then /init_weight_transfer_engine
                    (rank offset, world size, packing, group id, a timeout from the deadline);
                    blocks until the trainer's rank 0 has joined
    receive         POST /start_weight_update, then /update_weights (blocks while the trainer
                    broadcasts); `on_bucket` runs for every bucket once that call succeeded, since
                    vLLM reports nothing per bucket (PROGRESS arrives in one burst)
    finish(v)       POST /finish_weight_update {"weight_version": "v"}
    stage           POST /collective_rpc {"method": "weight_transfer_engine", "kwargs": {"op":
                    "stage", ...}}: every worker starts a receive into its staged copy on a
                    thread beside its engine loop and answers at once; then the same route
                    with "stage_status" every 0.1 s until every bucket landed everywhere (the
                    engine serves the old version meanwhile, never paused)
    flip(v)         POST /collective_rpc "flip" {update_info with "source": "staged",
                    "staged_digest"}: each worker's whole weight-update session in one call
                    (its copy through the receive's own loader), with POST
                    /update_weight_version {"new_version": "v"} beside it; on a LoRA engine
                    /start_weight_update, /update_weights (the same update_info),
                    /finish_weight_update {"weight_version": "v"}
    drop_staged     POST /collective_rpc "drop_staged", on a background thread
    committed copy  the copy a flip loaded stays on every worker (`HttpEngine`): a delta epoch
                    is a "stage" with `delta`, applied onto it by the workers, and
    serve_copy      POST /collective_rpc "serve_copy": the engine's rank-0 worker broadcasts it
                    to a newcomer's catch-up group on a thread of its own; "stage_status" every
                    0.1 s until it is sent, "cancel_serve" on an abort
    abort_transfer  POST /shutdown_weight_transfer_engine on a background thread; a blocked
                    /update_weights is told through the trainer's TCPStore (an abort key the
                    gloo backend polls: vLLM runs worker RPCs one at a time, so no route can
                    reach a worker inside a receive), answers within `abort_grace_s` with what
                    it applied, or the shim stops waiting for it

The lifecycle every HTTP engine shares (options, the loopback rule, paused/receiving state, the
abort key, the background teardown) is `HttpEngine`'s (`refit_grpc.shim.engines.http_engine`);
this module holds vLLM's routes only.

Rules:
- every call is bounded (`http_client.py`: the timeout comes from the caller's Deadline; no answer at
  the cap is UNAVAILABLE, at the deadline DEADLINE_EXCEEDED). Nothing here waits without a bound.
- the engine's admin routes are unauthenticated (`--api-key` covers /v1 only), so the engine URL
  must be loopback unless `allow_remote_engine=true`; the shim is the authenticated front door.
- `partial_on_failure` is True whenever this process cannot prove the weights untouched: once
  /start_weight_update has been accepted, unless the session was ended with nothing loaded, or
  the project's gloo backend reported `refit_grpc[applied=0/N]` (it rolled every layer back).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidPlanError,
    RefitError,
)
from refit_grpc.plan import Packing, RefitPlan, dtype_name
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Capabilities, EngineStatus, LoopFlipTimes
from refit_grpc.shim.engines.checkpoint import CheckpointIndex
from refit_grpc.shim.engines.http_client import CallKind, error_text
from refit_grpc.shim.engines.http_engine import (
    HttpEngine,
    HttpEngineOptions,
    StagePoll,
    UpdateCall,
    worker_timeout,
)
from refit_grpc.shim.engines.options import EngineKind
from refit_grpc.wire.vllm import (
    STAGE_OP_CANCEL_SERVE,
    STAGE_OP_CHECK_ADAPTER,
    STAGE_OP_COMMIT_ADAPTER,
    STAGE_OP_DROP,
    STAGE_OP_FLIP,
    STAGE_OP_INFO,
    STAGE_OP_RESTORE,
    STAGE_OP_SERVE,
    STAGE_OP_START,
    STAGE_OP_STATUS,
    GlooUpdateInfo,
    LoopFlip,
    LoopFlipDone,
    adapter_path,
    flip_info_for,
    init_info_for,
    nccl_misalignment,
    parse_adapter_path,
    stage_rpc_body,
    update_info_for,
)
from refit_grpc.wire.worker import ServeInfo, StageStatus, WorkerInfo

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMOptions(HttpEngineOptions):
    """The vllm engine's options: `HttpEngineOptions`, and whether check_plan checks names."""

    url: str = "http://127.0.0.1:8000"
    check_names: bool = True  # check the plan's names and shapes against the checkpoint


class VLLMEngine(HttpEngine):
    kind = "vllm"
    options_cls = VLLMOptions
    engine_name = "vLLM"
    admin_routes = "vLLM's admin routes"
    reached = "engine"
    teardown_route = "shutdown_weight_transfer_engine"
    update_route = "update_weights"
    options: VLLMOptions

    def __init__(self, url: str | None = None, packing: Packing = Packing(), *,
                 options: VLLMOptions | None = None, **fields: Any):
        super().__init__(url, packing, options=options, **fields)
        self.check_names = self.options.check_names
        self._world_size: int | None = None
        self._model_name: str | None = None  # /v1/models id, for the canary's request
        # The workers' `WorkerInfo.quantization`, asked once (it is fixed for the engine's
        # life); None until asked, "" when the workers cannot say (not the project's backend).
        self._quantization: str | None = None
        # The workers' `WorkerInfo.multimodal`, asked with the quantization; None: unknown.
        self._multimodal: bool | None = None
        # Whether the adapters vLLM already served when this shim started were read (status():
        # `_read_served_adapters` adds them to `_adapters`).
        self._adapters_read = False
        # The workers' `WorkerInfo.flip_in_one_call` and `flip_in_loop`, asked with the
        # quantization.
        self._flip_in_one_call = False
        self._flip_in_loop = False
        # The weight version vLLM declares, as this shim last set or read it: what a failed
        # one-call flip sets back.
        self._version_label: str | None = None
        # Calls to the paused engine that run beside the next ones (`_beside`): the pause's
        # cache reset, a flip's version. Each is joined before the resume (`_settle`).
        self._overlap = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-beside")
        self._beside_calls: list[Future[None]] = []

    # --- the engine interface --------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """A canary (prompt_logprobs); staging over the project's gloo backend, whose workers
        receive on a thread beside the engine loop; vLLM's own nccl backend has no such
        receive (docs/vllm.md, Staged epochs), whose workers keep the copy a flip loaded as
        their committed copy: delta epochs apply onto it and catch-ups are served from it.
        Keeping the caches across a flip is vLLM's own pause (clear_cache=false), any backend.
        A flip in one turn of the engine loop where its EngineCore says it can
        (`WorkerInfo.flip_in_loop`, `vllm_plugin.engine_loop`) and the workers flip in one
        call."""
        with self._lock:
            gloo = self._backend == "gloo"
            in_loop = gloo and self._flip_in_loop and self._flip_in_one_call
        return Capabilities(canary=True, staging=gloo, delta=gloo, serving_copy=gloo,
                            rollback=gloo, keep_cache=True, adapters=gloo,
                            flip_in_loop=in_loop)

    @property
    def world_size(self) -> int:
        if self._world_size is None:
            self._refresh_world_size()
        return self._world_size or 1

    def status(self, with_digest: bool = False) -> EngineStatus:
        # /is_paused is answered by the EngineCore itself, so an answer proves it alive: one
        # request instead of two on the refit path. While a weight RPC runs, the EngineCore
        # cannot answer it; /health (answered by the API server) decides then, or on failure.
        if not self._weight_calls:
            try:
                body = self._http.call("GET", "/is_paused", None, what="is_paused",
                                       cap_s=self.status_timeout_s)
                with self._lock:
                    self._paused = bool(body["is_paused"])
                if self._world_size is None:
                    self._refresh_world_size()
                if self._quantization is None:
                    self._refresh_worker_info()
                if not self._adapters_read:
                    self._read_served_adapters()
                digest = self.weights_digest(Deadline(self.request_timeout_s)) \
                    if with_digest else ""
                return EngineStatus(healthy=True, paused=self._paused, weights_digest=digest)
            except (RefitError, KeyError, TypeError):
                pass
        try:
            healthy = self._http.roundtrip("GET", "/health", None, None, self.status_timeout_s,
                                           "health", at_deadline=False).status == 200
        except RefitError:
            healthy = False
        return EngineStatus(healthy=healthy, paused=self._paused, weights_digest="")

    def is_paused(self) -> bool:
        """The last pause state seen: set by this adapter's own pause/resume and refreshed from
        GET /is_paused by every status() (the shim's health watcher, each second). Saves a
        round trip on every epoch; the shim is the engine's only admin client."""
        with self._lock:
            return self._paused

    def weights_digest(self, deadline: Deadline) -> str:
        """SHA-256 over vLLM's own per-parameter checksums (POST /weight_checker `checksum`: a
        SHA-256 of every parameter's bytes as the engine holds them, keyed by worker rank and
        name). Engines holding the same weights in the same layout agree. On CPU, linear layers
        keep their weights in oneDNN's repacked copy, not in a parameter, so those are not
        covered there (docs/vllm.md); embeddings, norms, biases and the tied head are."""
        body = self._http.call("POST", "/weight_checker", deadline, what="weight_checker",
                               body={"action": "checksum"})
        checksums = body.get("checksums") if isinstance(body, dict) else None
        if not isinstance(checksums, dict) or not checksums:
            raise EngineUnavailableError(f"weight_checker gave no checksums: {body!r:.200}")
        h = hashlib.sha256()
        for name in sorted(checksums):
            h.update(f"{name}:{checksums[name]}\n".encode())
        return h.hexdigest()

    def check_plan(self, plan: RefitPlan) -> None:
        """vLLM loads checkpoint names (`model.layers.0.self_attn.q_proj.weight`), fusing them
        itself; where the engine's checkpoint is a local directory (GET /v1/models `root`, or
        the `checkpoint_dir` option), every name, shape and dtype is checked against its
        safetensors headers (`CheckpointIndex.check_plan`: floating dtypes may differ, vLLM's
        loaders cast them)."""
        for s in plan.tensors:
            if s.name != s.name.strip():
                raise InvalidPlanError(f"tensor name {s.name!r} has surrounding whitespace",
                                       reason=Reason.UNKNOWN_TENSOR)
        if plan.adapter is not None:
            self._check_adapter(plan)
            return
        if not self.check_names:
            return
        index = self._checkpoint_index()
        if index is None:
            return
        index.check_plan(plan, quantization=self.quantization)

    def _post_pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool) -> None:
        # vLLM 0.32's sleep at level 0 is its scheduler pause (`EngineCore.pause_scheduler`),
        # without the 20 ms `asyncio.sleep` that AsyncLLM.pause_generation (POST /pause) adds
        # after it (for the ordering of outputs, "not required for correctness"). Then the
        # caches are cleared as /pause?clear_cache=true clears them inside the pause
        # (`reset_cache`): the parked requests lose their blocks and recompute after the
        # resume, with whatever weights are loaded by then. keep_cache: they keep them and go
        # on without recomputing (vLLM's in-flight weight update). Draining (wait) takes as
        # long as the requests in flight: bounded by the deadline only.
        #
        # The reset runs beside whatever the shim asks of the paused engine next (a flip's
        # load, a receive): nothing is scheduled before the resume, which waits for it
        # (`_settle`), so its order against those calls does not matter, and the stall pays
        # one round trip less.
        self._settle(deadline)  # an earlier pause's reset that failed fails this pause
        self._http.call("POST", "/sleep", deadline, what=f"pause({mode.value})",
                        query={"level": "0", "mode": mode.value},
                        cap_s=math.inf if mode is PauseMode.WAIT else None)
        if not keep_cache:
            # Its own bound, not the epoch's deadline: an abort that cancels the epoch must not
            # cancel the reset of an engine that is paused (its resume waits for the reset).
            reset = Deadline(self.request_timeout_s)
            self._beside(lambda: self._reset_in_pause(mode, reset))

    def _reset_in_pause(self, mode: PauseMode, deadline: Deadline) -> None:
        if not self.reset_cache(deadline):
            # /pause?clear_cache=true fails the same way (`EngineCore._reset_caches`).
            raise RefitError(f"pause({mode.value}): vLLM at {self.url} could not reset its KV "
                             "connector's cache", reason=Reason.ENGINE_REJECTED)

    def _beside(self, call: Callable[[], None]) -> None:
        """Start `call` (one short call to the paused engine) beside the next ones."""
        with self._lock:
            self._beside_calls.append(self._overlap.submit(call))

    def _settle(self, deadline: Deadline) -> None:
        """Wait for the calls started beside (each bounded by its own deadline); raise the
        first one's error."""
        with self._lock:
            calls, self._beside_calls = self._beside_calls, []
        for call in calls:
            try:
                call.result(timeout=max(deadline.remaining(), 0.0) + self.request_timeout_s)
            except FutureTimeout as e:
                raise EngineUnavailableError(f"vLLM at {self.url}: a call to the paused "
                                             "engine did not end") from e

    def _post_resume(self, deadline: Deadline) -> None:
        # The pause's cache reset (and a flip's version) first: they must reach the engine
        # before it schedules again.
        self._settle(deadline)
        # Level 0's wake-up: resumes the scheduler only when no memory of the engine sleeps
        # (someone else's /sleep?level=1 or 2): then it answers "sleeping" and nothing runs.
        body = self._http.call("POST", "/wake_up", deadline, what="resume",
                               query={"tags": "scheduling"})
        if isinstance(body, dict) and body.get("status") == "sleeping":
            raise FailedPreconditionError(
                f"resume: vLLM at {self.url} is asleep (its weights or KV cache were released "
                "by POST /sleep?level=1|2); wake it with POST /wake_up",
                reason=Reason.ENGINE_REJECTED)

    @property
    def pause_clears_cache(self) -> bool:
        """The pause clears every cache, the parked requests' blocks included (`_post_pause`),
        and nothing is scheduled until the resume: a flip need not clear them after its
        load."""
        return True

    def reset_cache(self, deadline: Deadline) -> bool:
        """The prefix cache with the running (parked) requests' blocks: vLLM preempts them, so
        they recompute after the resume (what /pause?clear_cache=true does inside the pause),
        and a connector's external cache. For a multimodal model (or one the workers do not
        describe) also the multimodal and encoder caches, which hold what the old vision tower
        computed. False: vLLM could not reset a connector's cache."""
        body = self._http.call("POST", "/reset_prefix_cache", deadline,
                               what="reset_prefix_cache",
                               query={"reset_running_requests": "true",
                                      "reset_external": "true"})
        if self._multimodal is not False:
            self._http.call("POST", "/reset_mm_cache", deadline, what="reset_mm_cache")
            self._http.call("POST", "/reset_encoder_cache", deadline, what="reset_encoder_cache")
        return bool(isinstance(body, dict) and body.get("success"))

    def check_backend(self, backend: str) -> None:
        """vLLM's workers join the group, not this process: whether they can use `backend` is
        theirs to say (/init_weight_transfer_engine fails with their reason)."""

    def _check_group(self, spec: GroupSpec, plan: RefitPlan) -> None:
        if spec.backend == "nccl":
            problem = nccl_misalignment(plan)
            if problem:
                raise InvalidPlanError(f"vLLM's nccl receiver cannot unpack this plan: {problem}"
                                       "; reorder the tensors (larger element sizes first)",
                                       reason=Reason.UNALIGNED_FOR_NCCL)

    def _post_join(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline,
                   timeout_s: float) -> None:
        self._http.call("POST", "/init_weight_transfer_engine", deadline, kind=CallKind.JOIN,
                        what="init_weight_transfer_engine",
                        body={"init_info": init_info_for(spec, plan, timeout_s)},
                        cap_s=math.inf, extra_s=1.0, watch=deadline)

    def _open_update(self, deadline: Deadline, gen: int, what: str) -> None:
        """/start_weight_update: from here vLLM's layerwise session may move layers (touched);
        an abort that came meanwhile ends the session with nothing loaded."""
        self._check_live(deadline, gen, "start_weight_update")
        self._set_touched(True)
        self._start_update(deadline)
        if deadline.cancel.is_set() or gen != self._http.generation:
            self._end_untouched_session()
            raise EpochAbortedError("aborted before /update_weights", reason=Reason.EPOCH_ABORTED)

    def _post_update(self, call: UpdateCall) -> None:
        """/update_weights: a receive from the group, or with `source: "staged"` a flip's load
        of the workers' staged copies (the receive's own loader)."""
        if call.staged_digest is None:
            info = update_info_for(call.plan, self._backend, call.timeout_s, call.abort_key)
        else:
            info = flip_info_for(call.plan, call.timeout_s, call.staged_digest, call.version)
        self._http.call("POST", "/update_weights", call.deadline, kind=CallKind.RECEIVE,
                        what=self.update_route if call.staged_digest is None
                        else f"{self.update_route}(staged)",
                        body={"update_info": info}, cap_s=math.inf, extra_s=1.0,
                        watch=call.deadline, gen=call.gen, on_cancel=call.on_cancel)

    def _abort_key(self, group: GroupSpec | None) -> str | None:
        """Only the project's gloo backend polls an abort key; vLLM's nccl backend has none."""
        return super()._abort_key(group) if self._backend == "gloo" else None

    def _post_finish(self, version: int, deadline: Deadline) -> None:
        self._http.call("POST", "/finish_weight_update", deadline, what="finish_weight_update",
                        body={"weight_version": str(version)})
        with self._lock:
            self._version_label = str(version)

    def _load_staged(self, plan: RefitPlan, digest: str, version: int,
                     deadline: Deadline) -> str:
        """A flip in one call to the workers (`STAGE_OP_FLIP`: the session of
        /start_weight_update, /update_weights and /finish_weight_update), with the engine's
        weight version set beside it (POST /update_weight_version: the engine is paused, so no
        token is generated under either label meanwhile; a failed load sets the label back,
        and the shim keeps the engine paused until a full update). The pause's cache reset is
        joined before it returns, so a reset's failure is the flip's. Where the workers cannot
        (`WorkerInfo.flip_in_one_call`: a LoRA engine, an older worker), the three routes."""
        if not self._flip_in_one_call:
            result = super()._load_staged(plan, digest, version, deadline)
            self._settle(deadline)
            return result
        what = "flip"
        gen = self._http.generation
        label = self._version_label
        with self._weight_call(receiving=True):
            self._set_touched(True)  # the workers' session may move layers from here
            self._check_live(deadline, gen, what)
            info = flip_info_for(plan, worker_timeout(deadline.check(what)), digest, version)
            label_deadline = Deadline(self.request_timeout_s)  # its own bound, as the reset
            self._beside(lambda: self._set_version_label(str(version), label_deadline))
            try:
                self._watched_receive(
                    lambda _: self._http.call(
                        "POST", "/collective_rpc", deadline, kind=CallKind.RECEIVE, what=what,
                        body=stage_rpc_body(STAGE_OP_FLIP, info),
                        cap_s=math.inf, extra_s=1.0, watch=deadline, gen=gen),
                    what, deadline, gen, None, None)
            except BaseException:
                self._settle_quietly(deadline)
                if label is not None:
                    self._set_version_label_quietly(label)
                raise
        self._settle(deadline)
        with self._lock:
            self._touched = False  # the new version is whole
        return ""

    def _load_in_loop(self, plan: RefitPlan, digest: str, version: int, keep_cache: bool,
                      deadline: Deadline) -> LoopFlipTimes:
        """The workers' one-call flip (`STAGE_OP_FLIP`) with a `LoopFlip`: vLLM's EngineCore
        resets the caches (unless kept), sets the version label and runs the flip in one turn
        of its loop, between two steps (`vllm_plugin.engine_loop`): no pause, no resume, one
        round trip. Its failure leaves the engine paused by its loop (and the label set back)."""
        what = "flip"
        gen = self._http.generation
        self._settle(deadline)  # an earlier pause's reset that failed fails this flip
        loop = LoopFlip(weight_version=str(version), reset_caches=not keep_cache,
                        multimodal=self._multimodal is not False)
        answer: list[Any] = []
        t_call = time.monotonic()
        with self._weight_call(receiving=True):
            self._set_touched(True)
            self._check_live(deadline, gen, what)
            info = flip_info_for(plan, worker_timeout(deadline.check(what)), digest, version)
            try:
                self._watched_receive(
                    lambda _: answer.append(self._http.call(
                        "POST", "/collective_rpc", deadline, kind=CallKind.RECEIVE, what=what,
                        body=stage_rpc_body(STAGE_OP_FLIP, info, loop_flip=loop),
                        cap_s=math.inf, extra_s=1.0, watch=deadline, gen=gen)),
                    what, deadline, gen, None, None)
            except BaseException:
                if answer:
                    # The turn loaded the new version, then the epoch was aborted: not
                    # committed, so not served either (a failed turn paused it itself).
                    self._pause_quietly()
                with self._lock:
                    self._paused = True
                raise
        with self._lock:
            self._touched = False  # the new version is whole
            self._version_label = str(version)
        body = answer[0] if answer else None
        try:
            done = LoopFlipDone.from_wire(body.get("results") if isinstance(body, dict)
                                          else None)
        except ValueError as e:
            # The turn succeeded (HTTP 200): the new version serves. Only its timing is lost;
            # the round trip bounds it.
            round_trip = time.monotonic() - t_call
            log.warning("vLLM at %s: the loop flip's answer is unreadable (%s); its stall is "
                        "taken as the round trip, %.3fs", self.url, e, round_trip)
            return LoopFlipTimes(stall_s=round_trip, load_s=round_trip)
        return LoopFlipTimes(stall_s=done.stall_s, load_s=done.load_s)

    def _pause_quietly(self) -> None:
        try:
            self._http.call("POST", "/sleep", Deadline(self.request_timeout_s),
                            what="pause(keep)", query={"level": "0", "mode": "keep"})
        except RefitError as e:
            log.warning("vLLM at %s could not be paused after an aborted flip: %s", self.url, e)

    def _set_version_label(self, label: str, deadline: Deadline) -> None:
        self._http.call("POST", "/update_weight_version", deadline, what="update_weight_version",
                        body={"new_version": label})
        with self._lock:
            self._version_label = label

    def close(self) -> None:
        super().close()
        self._overlap.shutdown(wait=False, cancel_futures=True)

    def _set_version_label_quietly(self, label: str) -> None:
        try:
            self._set_version_label(label, Deadline(self.request_timeout_s))
        except RefitError as e:
            log.warning("the weight version could not be set back to %s: %s", label, e)

    def _settle_quietly(self, deadline: Deadline) -> None:
        try:
            self._settle(deadline)
        except RefitError as e:
            log.warning("after a failed flip: %s", e)

    def _post_teardown(self, deadline: Deadline, *, before_join: bool = False) -> None:
        self._shutdown_transfer(deadline, end_stale_update=before_join)

    # --- adapter epochs (docs/adapters.md) ---------------------------------------------------

    def _check_adapter(self, plan: RefitPlan) -> None:
        """Prepare of an adapter plan: every worker says whether vLLM can build the adapter
        (LoRA enabled, its rank and config, the modules it targets); the first problem is the
        refusal. Nothing is loaded."""
        assert plan.adapter is not None
        self._check_adapter_name(plan.adapter.name)
        info = GlooUpdateInfo(names=[s.name for s in plan.tensors],
                              dtype_names=[dtype_name(s.dtype) for s in plan.tensors],
                              shapes=[list(s.shape) for s in plan.tensors],
                              adapter=dataclasses.asdict(plan.adapter))
        deadline = Deadline(self.request_timeout_s)
        self._refuse_adapter_problems(
            self._worker_rpc(STAGE_OP_CHECK_ADAPTER, deadline, info.to_wire()))
        # After vLLM's own checks (its rank limit is the clearer message for a wide adapter).
        index = self._checkpoint_index() if self.check_names else None
        if index is not None:
            index.check_adapter(plan)

    def _served_models(self, deadline: Deadline | None) -> list[dict[str, Any]]:
        """GET /v1/models: the base model (no parent) and every adapter vLLM serves, each
        with the path it was last loaded from (`root`)."""
        body = self._http.call("GET", "/v1/models", deadline, what="models",
                               cap_s=self.status_timeout_s)
        models = body.get("data") if isinstance(body, dict) else None
        return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []

    def _read_served_adapters(self) -> None:
        """The adapters of this project's epochs that vLLM serves (their `root` is
        `adapter_path(name, version)`), learned once: a shim started after their epochs (a
        restart) lists them in Describe at the version vLLM serves. Its own flips are the
        later word."""
        try:
            models = self._served_models(None)
        except RefitError:
            return  # read by the next status()
        served = {}
        for model in models:
            parsed = parse_adapter_path(str(model.get("root") or ""))
            if model.get("parent") is not None and parsed is not None:
                served[parsed[0]] = parsed[1]
        with self._lock:
            self._adapters = {**served, **self._adapters}
            self._adapters_read = True

    def _check_adapter_name(self, name: str) -> None:
        """The name must be free for this project's adapter: not the base model's (vLLM routes
        that name to the base model), and not an adapter vLLM serves from a file (an in-place
        load would replace the operator's adapter). vLLM lists both in GET /v1/models; an
        adapter this project loaded has a path of ours there."""
        for model in self._served_models(Deadline(self.request_timeout_s)):
            if model.get("id") != name:
                continue
            root = str(model.get("root") or "")
            if model.get("parent") is None:
                raise InvalidPlanError(f"adapter name {name!r} is the name vLLM serves the base "
                                       "model under; requests for it would never reach the "
                                       "adapter", reason=Reason.INVALID_ADAPTER)
            if parse_adapter_path(root) is None:
                raise InvalidPlanError(
                    f"adapter name {name!r} is taken: vLLM serves an adapter of that name from "
                    f"{root!r}, which an adapter epoch would replace; choose another name",
                    reason=Reason.INVALID_ADAPTER)

    def _flip_adapter(self, plan: RefitPlan, digest: str, version: int,
                      deadline: Deadline) -> None:
        """An adapter epoch's flip, while the engine serves: every worker makes its staged copy
        the adapter's pending version in memory (POST /collective_rpc "commit_adapter"), then
        vLLM's API server loads it in place under the adapter's name (POST
        /v1/load_lora_adapter, `load_inplace`, from `adapter_path(name, version)`, which the
        workers' loader resolves from memory). vLLM builds the new adapter before it drops the
        old one, so a failure leaves the old one serving."""
        assert plan.adapter is not None
        name = plan.adapter.name
        self._stage_rpc(STAGE_OP_COMMIT_ADAPTER, deadline,
                        {"staged_digest": digest, "version": version})
        what = f"load_lora_adapter({name!r}, version {version})"
        reply = self._http.roundtrip(
            "POST", "/v1/load_lora_adapter", None,
            {"lora_name": name, "lora_path": adapter_path(name, version), "load_inplace": True},
            min(deadline.check(what), self.request_timeout_s), what, at_deadline=False)
        if reply.status == 404:
            raise FailedPreconditionError(
                f"{what}: vLLM at {self.url} has no runtime adapter route (start it with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", reason=Reason.ADAPTER_UNSUPPORTED)
        if not 200 <= reply.status < 300:
            raise RefitError(f"{what}: vLLM answered HTTP {reply.status}: "
                             f"{error_text(reply.body)}", reason=Reason.ENGINE_REJECTED)

    # --- staged epochs ---------------------------------------------------------------------

    def _start_stage(self, plan: RefitPlan, deadline: Deadline, timeout_s: float,
                     delta: bool, keep_previous: bool) -> tuple[list[StageStatus], StagePoll]:
        """POST /collective_rpc "stage": every worker starts its receive into its staged copy
        and answers at once; the poll is the same route with "stage_status". What the
        workers say of their engine (`WorkerInfo`: whether they flip in one call) is asked
        here if no status() asked it yet: while the engine serves, not in the flip's stall."""
        if self._quantization is None:
            self._refresh_worker_info()
        update = update_info_for(plan, "gloo", timeout_s)
        if delta:
            update["delta"] = True  # applied onto each worker's committed copy
        if keep_previous:
            update["reversible"] = True  # each worker keeps its committed copy as previous
        return (self._stage_rpc(STAGE_OP_START, deadline, update),
                lambda d: self._stage_rpc(STAGE_OP_STATUS, d))

    def _post_drop_staged(self, deadline: Deadline) -> list[StageStatus] | None:
        return self._stage_rpc(STAGE_OP_DROP, deadline)

    def _start_serve(self, info: ServeInfo, store: Any,
                     deadline: Deadline) -> Callable[[Deadline], StageStatus]:
        """POST /collective_rpc "serve_copy"; the poll is "stage_status" (the engine's rank-0
        worker, first in worker order, is the one serving)."""
        self._stage_rpc(STAGE_OP_SERVE, deadline, info.to_wire())
        return lambda d: self._stage_rpc(STAGE_OP_STATUS, d)[0]

    def _cancel_serve(self, deadline: Deadline) -> None:
        self._stage_rpc(STAGE_OP_CANCEL_SERVE, deadline)

    def _post_restore_previous(self, deadline: Deadline) -> None:
        self._stage_rpc(STAGE_OP_RESTORE, deadline)

    def _stage_rpc(self, op: str, deadline: Deadline,
                   update: dict[str, Any] | None = None) -> list[StageStatus]:
        """One staged-epoch operation on every worker (POST /collective_rpc); their statuses,
        in worker order. Each call is short (the workers answer at once) and bounded."""
        results = self._worker_rpc(op, deadline, update)
        try:
            return [StageStatus.from_wire(r) for r in results]
        except (TypeError, ValueError) as e:
            raise RefitError(f"{op}: the workers' answer is unreadable ({e})",
                             reason=Reason.ENGINE_ERROR) from e

    def _worker_rpc(self, op: str, deadline: Deadline,
                    update: dict[str, Any] | None = None) -> list[Any]:
        """One operation of the project's backend on every worker (POST /collective_rpc);
        their answers as sent, in worker order."""
        cap = min(self.request_timeout_s, max(deadline.remaining(), 0.001))
        try:
            body = self._http.call("POST", "/collective_rpc", deadline, what=f"{op}",
                                   body=stage_rpc_body(op, update, timeout_s=round(cap, 3)))
        except FailedPreconditionError as e:
            if "not callable" in e.message:  # vLLM's nccl backend, or no weight transfer
                raise FailedPreconditionError(
                    f"{e.message} (staged epochs need the project's gloo backend)",
                    reason=Reason.STAGING_UNSUPPORTED) from e
            raise
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results:
            raise RefitError(f"{op}: the workers' answer is unreadable (no results: "
                             f"{body!r:.200})", reason=Reason.ENGINE_ERROR)
        return results

    # --- the canary ------------------------------------------------------------------------

    def canary_logprobs(self, token_ids: Sequence[int], deadline: Deadline) -> list[float]:
        """vLLM's own teacher-forced numbers (`prompt_logprobs` of /v1/completions).

        vLLM's scheduler admits no request while paused, so the canary needs one window of
        service: resume, one prompt_logprobs request, pause again (KEEP, caches cleared).
        Requests queued meanwhile may be scheduled in that window, on weights the canary has
        not yet approved (docs/vllm.md, The canary: the window and how a staged flip closes
        it). The shim asks only after a commit, so the weights are whole either way."""
        self.resume(deadline)
        try:
            body = self._http.call("POST", "/v1/completions", deadline, what="canary", body={
                "model": self._served_model(deadline), "prompt": list(token_ids),
                "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
        finally:
            self.pause(PauseMode.KEEP, deadline)
        try:
            entries = body["choices"][0]["prompt_logprobs"]
            return [float(entry[str(tok)]["logprob"])
                    for entry, tok in zip(entries[1:], token_ids[1:], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise RefitError(f"canary: vLLM's prompt_logprobs unreadable ({type(e).__name__}: "
                             f"{e})", reason=Reason.ENGINE_ERROR) from e

    def _served_model(self, deadline: Deadline) -> str:
        if self._model_name is None:
            body = self._http.call("GET", "/v1/models", deadline, what="models",
                                   cap_s=self.status_timeout_s)
            try:
                self._model_name = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as e:
                raise RefitError(f"canary: vLLM's /v1/models names no model ({e})",
                                 reason=Reason.ENGINE_ERROR) from e
        return self._model_name

    # --- extras for trainers, tests and the demo -------------------------------------------

    def weight_version(self, deadline: Deadline | None = None) -> str | None:
        """vLLM's declared weight version (GET /weight_info), None if undeclared."""
        body = self._http.call("GET", "/weight_info", deadline, what="weight_info")
        return body.get("weight_version") if isinstance(body, dict) else None

    # --- weight-transfer helpers -----------------------------------------------------------

    def _start_update(self, deadline: Deadline) -> None:
        try:
            self._http.call("POST", "/start_weight_update", deadline, what="start_weight_update")
        except FailedPreconditionError as e:
            if "already active" not in e.message:
                raise
            # A session left open by an update that never reached the worker: end it (nothing
            # loaded, so finalize puts the old kernel tensors back) and start afresh.
            log.warning("ending a weight-update session left open: %s", e.message[:200])
            self._http.call("POST", "/finish_weight_update", deadline, what="finish (stale session)")
            self._http.call("POST", "/start_weight_update", deadline, what="start_weight_update")

    def _end_untouched_session(self) -> None:
        """After /start_weight_update and before any byte: finalize with nothing loaded restores
        every layer, so the weights are provably the old ones again."""
        try:
            self._http.call("POST", "/finish_weight_update", Deadline(self.request_timeout_s),
                            what="finish (aborted session)")
            self._set_touched(False)
        except RefitError as e:
            log.warning("could not end the aborted weight-update session: %s", e)

    def _shutdown_transfer(self, deadline: Deadline, end_stale_update: bool) -> None:
        try:
            self._http.call("POST", "/shutdown_weight_transfer_engine", deadline,
                            what="shutdown_weight_transfer_engine")
        except FailedPreconditionError as e:
            if not end_stale_update or "during a weight update" not in e.message:
                raise
            log.warning("ending a weight-update session left open before re-initialising")
            self._http.call("POST", "/finish_weight_update", deadline, what="finish (stale session)")
            self._http.call("POST", "/shutdown_weight_transfer_engine", deadline,
                            what="shutdown_weight_transfer_engine")

    @property
    def quantization(self) -> str:
        """vLLM's `--quantization` (the model config's, as the workers hold it): asked of the
        workers through the project's gloo backend (POST /collective_rpc "engine_info") by the
        first status() that finds the engine up; "" until then, and where the workers cannot
        say (vLLM's own nccl backend)."""
        return self._quantization or ""

    def _refresh_worker_info(self) -> None:
        """The workers' `WorkerInfo` (quantization, multimodal), asked once."""
        try:
            body = self._http.call("POST", "/collective_rpc", None, what="engine_info",
                                   body=stage_rpc_body(STAGE_OP_INFO,
                                                       timeout_s=self.status_timeout_s),
                                   cap_s=self.status_timeout_s)
        except FailedPreconditionError:
            self._quantization = ""  # not callable: another backend; asking again is no use
            return
        except RefitError:
            return  # asked again by the next status()
        results = body.get("results") if isinstance(body, dict) else None
        try:
            if not isinstance(results, list) or not results:
                raise ValueError(f"no results: {body!r:.200}")
            infos = [WorkerInfo.from_wire(r) for r in results]
        except ValueError as e:
            log.warning("engine_info: the workers' answer is unreadable (%s)", e)
            self._quantization = ""
            return
        # Every worker of one engine loads one model config; disagreeing workers are not one
        # engine, and Describe should not pick one of them.
        names = {info.quantization for info in infos}
        self._quantization = names.pop() if len(names) == 1 else ""
        self._multimodal = any(info.multimodal for info in infos)
        self._flip_in_one_call = all(info.flip_in_one_call for info in infos)
        self._flip_in_loop = all(info.flip_in_loop for info in infos)
        try:
            label = self.weight_version(Deadline(self.status_timeout_s))
        except RefitError:
            label = None
        with self._lock:
            if self._version_label is None and label is not None:
                self._version_label = str(label)

    def _refresh_world_size(self) -> None:
        try:
            body = self._http.call("GET", "/get_world_size", None, what="get_world_size",
                                   query={"include_dp": "true"}, cap_s=self.status_timeout_s)
            with self._lock:
                self._world_size = int(body["world_size"])
        except (RefitError, KeyError, TypeError, ValueError):
            pass

    # --- checkpoint names (check_plan) -----------------------------------------------------

    def _checkpoint_index(self) -> CheckpointIndex | None:
        if self._checkpoint is not None:
            return self._checkpoint
        directory = self.checkpoint_dir
        if directory is None:
            try:
                body = self._http.call("GET", "/v1/models", None, what="models",
                                       cap_s=self.status_timeout_s)
                directory = body["data"][0]["root"]
            except (RefitError, KeyError, IndexError, TypeError) as e:
                log.info("plan names not checked: engine model unknown (%s)", e)
                return None
        return self._read_checkpoint(directory)


ENGINE = EngineKind(VLLMOptions, VLLMEngine.from_options)
