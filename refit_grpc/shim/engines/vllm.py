"""The vLLM engine: a vLLM OpenAI server on the same host, driven through its own admin routes.

    refit-grpc shim --engine vllm --engine-url http://127.0.0.1:8000

The receive is done by vLLM itself (its native weight-transfer engine: the project's `gloo`
backend from `refit_grpc.vllm_plugin` on CPUs, vLLM's own `nccl` backend on GPUs); this module
only translates the shim's engine calls into HTTP calls (standard library only):

    status          GET /is_paused (the EngineCore answers it: alive and pause state), else
                    GET /health; GET /get_world_size once
    pause(mode)     POST /pause?mode=keep|wait|abort&clear_cache=true
    resume          POST /resume
    reset_cache     POST /reset_prefix_cache (retried while running requests still hold blocks)
    init_transfer   POST /shutdown_weight_transfer_engine, then /init_weight_transfer_engine
                    (rank offset, world size, packing, group id, a timeout from the deadline);
                    blocks until the trainer's rank 0 has joined
    receive         POST /start_weight_update, then /update_weights (blocks while the trainer
                    broadcasts); `on_bucket` runs for every bucket once that call succeeded, since
                    vLLM reports nothing per bucket (PROGRESS arrives in one burst)
    finish(v)       POST /finish_weight_update {"weight_version": "v"}
    abort_transfer  POST /shutdown_weight_transfer_engine on a background thread; a blocked
                    /update_weights is told through the trainer's TCPStore (an abort key the
                    gloo backend polls: vLLM runs worker RPCs one at a time, so no route can
                    reach a worker inside a receive), answers within `abort_grace_s` with what
                    it applied, or the shim stops waiting for it

Rules:
- every call has a timeout derived from the caller's Deadline, capped by `request_timeout_s` for
  the short ones. A timeout at the cap means the engine does not answer: EngineUnavailableError
  (UNAVAILABLE), as is a refused or reset connection; a timeout at the deadline is
  RefitTimeoutError (DEADLINE_EXCEEDED). Nothing here waits without a bound.
- a fresh connection per call (`Connection: close`): vLLM closes keep-alive connections after a
  500, and every worker-side error is a 500.
- the engine's admin routes are unauthenticated (`--api-key` covers /v1 only), so the engine URL
  must be loopback unless `allow_remote_engine=true`; the shim is the authenticated front door.
- `partial_on_failure` is True whenever this process cannot prove the weights untouched: once
  /start_weight_update has been accepted, unless the session was ended with nothing loaded, or
  the project's gloo backend reported `refit_grpc[applied=0/N]` (it rolled every layer back).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import math
import socket
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refit_grpc.collective import Deadline, GroupSpec
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidPlanError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import DTYPE_NAMES, Bucket, Packing, RefitPlan
from refit_grpc.shim.engines.base import Engine, EngineStatus, PauseMode
from refit_grpc.vllm_plugin import APPLIED_RE

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclass(frozen=True)
class _Reply:
    status: int
    body: Any  # parsed JSON, or text when the body is not JSON


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _error_text(body: Any) -> str:
    """vLLM answers errors as {"error": {"message": ...}}, {"error": "..."} or {"detail": ...}."""
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:800]
    return str(body)[:800]


def _is_timeout_text(text: str) -> bool:
    low = text.lower()
    return "timed out" in low or "timeout" in low


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class VLLMEngine(Engine):
    kind = "vllm"

    def __init__(self, url: str = "http://127.0.0.1:8000", packing: Packing = Packing(), *,
                 request_timeout_s: float | str = 30.0, status_timeout_s: float | str = 2.0,
                 abort_grace_s: float | str = 3.0, checkpoint_dir: str | None = None,
                 check_names: bool | str = True, allow_remote_engine: bool | str = False):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine url must be http(s)://host:port, got {url!r}")
        if not _is_loopback(parts.hostname) and not _truthy(allow_remote_engine):
            raise ValueError(
                f"engine url {url!r} is not loopback: vLLM's admin routes are unauthenticated, "
                "so the shim reaches its engine on loopback only (engine option "
                "allow_remote_engine=true overrides)")
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self.offered_packing = packing
        self.request_timeout_s = float(request_timeout_s)
        self.status_timeout_s = float(status_timeout_s)
        self.abort_grace_s = float(abort_grace_s)
        self.checkpoint_dir = checkpoint_dir
        self.check_names = _truthy(check_names)
        self._lock = threading.Lock()
        self._paused = False          # last known; /is_paused cannot answer during a weight RPC
        self._busy = 0                # init/update calls in flight (the EngineCore is inside one)
        self._world_size: int | None = None
        self._backend = "gloo"
        self._group: GroupSpec | None = None
        self._receiving = False
        self._touched = False         # weights may differ from the last committed version
        self._abort_gen = 0
        self._shutdown_thread: threading.Thread | None = None
        self._checkpoint: dict[str, tuple[int, ...]] | None = None
        self._checkpoint_dir_used: str | None = None
        self._tied_embeddings = False

    # --- the engine interface --------------------------------------------------------------

    @property
    def partial_on_failure(self) -> bool:  # type: ignore[override]
        return self._receiving or self._touched

    @property
    def world_size(self) -> int:  # type: ignore[override]
        if self._world_size is None:
            self._refresh_world_size()
        return self._world_size or 1

    def status(self, with_digest: bool = False) -> EngineStatus:
        # /is_paused is answered by the EngineCore itself, so an answer proves it alive: one
        # request instead of two on the refit path. While a weight RPC runs, the EngineCore
        # cannot answer it; /health (answered by the API server) decides then, or on failure.
        if not self._busy:
            try:
                body = self._call("GET", "/is_paused", None, what="is_paused",
                                  cap_s=self.status_timeout_s)
                self._paused = bool(body["is_paused"])
                if self._world_size is None:
                    self._refresh_world_size()
                return EngineStatus(healthy=True, paused=self._paused, weights_digest="")
            except (RefitError, KeyError, TypeError):
                pass
        try:
            healthy = self._roundtrip("GET", "/health", None, None, self.status_timeout_s,
                                      "health", at_deadline=False).status == 200
        except RefitError:
            healthy = False
        # No digest: a checksum inside the worker misses the repacked linear layers on CPU.
        return EngineStatus(healthy=healthy, paused=self._paused, weights_digest="")

    def check_plan(self, plan: RefitPlan) -> None:
        """vLLM loads checkpoint names (`model.layers.0.self_attn.q_proj.weight`), fusing them
        itself; where the engine's checkpoint is a local directory (GET /v1/models `root`, or
        the `checkpoint_dir` option), every name and shape is checked against its safetensors
        headers. dtypes may differ (vLLM's loaders cast)."""
        for s in plan.tensors:
            if s.name != s.name.strip():
                raise InvalidPlanError(f"tensor name {s.name!r} has surrounding whitespace",
                                       reason="UNKNOWN_TENSOR")
        if not self.check_names:
            return
        index = self._checkpoint_index()
        if index is None:
            return
        for s in plan.tensors:
            shape = index.get(s.name)
            if shape is None:
                if s.name == "lm_head.weight" and self._tied_embeddings:
                    # Tied: one parameter under two names (a checkpoint stores it once); the
                    # trainer may send either or both (docs/vllm.md, Tied embeddings).
                    continue
                raise InvalidPlanError(
                    f"vLLM loads checkpoint names and {s.name!r} is not one of the "
                    f"{len(index)} tensors of {self._checkpoint_dir_used}",
                    reason="UNKNOWN_TENSOR")
            if shape != s.shape:
                raise InvalidPlanError(
                    f"tensor {s.name!r}: checkpoint has shape {shape}, plan says {s.shape}",
                    reason="TENSOR_MISMATCH")

    def pause(self, mode: PauseMode, deadline: Deadline) -> None:
        # Draining (wait) takes as long as the requests in flight: bounded by the deadline only.
        self._call("POST", "/pause", deadline, what=f"pause({mode.value})",
                    query={"mode": mode.value, "clear_cache": "true"},
                    cap_s=math.inf if mode is PauseMode.WAIT else None)
        self._paused = True

    def resume(self, deadline: Deadline) -> None:
        self._call("POST", "/resume", deadline, what="resume")
        self._paused = False

    def reset_cache(self, deadline: Deadline) -> bool:
        # vLLM refuses (success=false) while running requests still hold blocks; after a
        # drain that is a matter of milliseconds.
        for _ in range(20):
            body = self._call("POST", "/reset_prefix_cache", deadline, what="reset_prefix_cache")
            if isinstance(body, dict) and body.get("success"):
                return True
            if deadline.remaining() < 0.2:
                break
            time.sleep(0.05)
        return False

    def check_backend(self, backend: str) -> None:
        """vLLM's workers join the group, not this process: whether they can use `backend` is
        theirs to say (/init_weight_transfer_engine fails with their reason)."""

    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        if spec.backend == "nccl":
            from refit_grpc.vllm_plugin.nccl_sender import misaligned

            problem = misaligned(plan)
            if problem:
                raise InvalidPlanError(f"vLLM's nccl receiver cannot unpack this plan: {problem}"
                                       "; reorder the tensors (larger element sizes first)",
                                       reason="UNALIGNED_FOR_NCCL")
        self._join_background_shutdown(deadline)
        self._shutdown_transfer(deadline, end_stale_update=True)
        left = deadline.check("init_weight_transfer_engine")
        info = init_info_for(spec, plan, _worker_timeout(left))
        with self._lock:
            self._busy += 1
        try:
            self._call("POST", "/init_weight_transfer_engine", deadline, kind="join",
                       what="init_weight_transfer_engine", body={"init_info": info},
                       cap_s=math.inf, extra_s=1.0, watch=deadline)
        finally:
            with self._lock:
                self._busy -= 1
        self._backend, self._group = spec.backend, spec

    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        gen = self._abort_gen
        with self._lock:
            self._receiving, self._touched = True, False
            self._busy += 1
        try:
            self._check_live(deadline, gen, "start_weight_update")
            self._touched = True  # from here vLLM's layerwise session may move layers
            self._start_update(deadline)
            if deadline.cancel.is_set() or gen != self._abort_gen:
                self._end_untouched_session()
                raise EpochAbortedError("aborted before /update_weights", reason="EPOCH_ABORTED")
            left = deadline.check("update_weights")
            group = self._group
            abort_key = (f"refit_grpc/{group.group_id}/abort/{uuid.uuid4().hex}"
                         if group is not None and self._backend == "gloo" else None)
            update = update_info_for(plan, self._backend, _worker_timeout(left), abort_key)
            try:
                self._call("POST", "/update_weights", deadline, kind="receive",
                           what="update_weights", body={"update_info": update},
                           cap_s=math.inf, extra_s=1.0, watch=deadline, gen=gen,
                           on_cancel=(lambda: self._signal_abort(group, abort_key))
                           if abort_key else None)
            except RefitError as e:
                m = APPLIED_RE.search(e.message)
                if m and int(m.group(1)) == 0:
                    self._touched = False  # rolled back with nothing loaded: old weights intact
                raise
            if deadline.cancel.is_set() or gen != self._abort_gen:
                raise EpochAbortedError("update_weights finished after an abort; not committing",
                                        reason="EPOCH_ABORTED")
        finally:
            with self._lock:
                self._busy -= 1
                self._receiving = False
        for bucket in plan.buckets:
            on_bucket(bucket)

    def finish(self, version: int, deadline: Deadline) -> str:
        self._call("POST", "/finish_weight_update", deadline, what="finish_weight_update",
                   body={"weight_version": str(version)})
        self._touched = False  # the new version is whole
        return ""

    def abort_transfer(self) -> None:
        with self._lock:
            self._abort_gen += 1
            if self._shutdown_thread is not None and self._shutdown_thread.is_alive():
                return
            thread = threading.Thread(target=self._background_shutdown, daemon=True,
                                      name="vllm-shutdown-transfer")
            self._shutdown_thread = thread
        thread.start()

    def close(self) -> None:
        self.abort_transfer()
        thread = self._shutdown_thread
        if thread is not None:
            thread.join(min(self.request_timeout_s, 5.0))

    # --- extras for trainers, tests and the demo -------------------------------------------

    def weight_info(self, deadline: Deadline | None = None) -> str | None:
        body = self._call("GET", "/weight_info", deadline, what="weight_info")
        return body.get("weight_version") if isinstance(body, dict) else None

    # --- weight-transfer helpers -----------------------------------------------------------

    def _start_update(self, deadline: Deadline) -> None:
        try:
            self._call("POST", "/start_weight_update", deadline, what="start_weight_update")
        except FailedPreconditionError as e:
            if "already active" not in e.message:
                raise
            # A session left open by an update that never reached the worker: end it (nothing
            # loaded, so finalize puts the old kernel tensors back) and start afresh.
            log.warning("ending a weight-update session left open: %s", e.message[:200])
            self._call("POST", "/finish_weight_update", deadline, what="finish (stale session)")
            self._call("POST", "/start_weight_update", deadline, what="start_weight_update")

    def _end_untouched_session(self) -> None:
        """After /start_weight_update and before any byte: finalize with nothing loaded restores
        every layer, so the weights are provably the old ones again."""
        try:
            self._call("POST", "/finish_weight_update", Deadline(self.request_timeout_s),
                       what="finish (aborted session)")
            self._touched = False
        except RefitError as e:
            log.warning("could not end the aborted weight-update session: %s", e)

    def _shutdown_transfer(self, deadline: Deadline, end_stale_update: bool) -> None:
        try:
            self._call("POST", "/shutdown_weight_transfer_engine", deadline,
                       what="shutdown_weight_transfer_engine")
        except FailedPreconditionError as e:
            if not end_stale_update or "during a weight update" not in e.message:
                raise
            log.warning("ending a weight-update session left open before re-initialising")
            self._call("POST", "/finish_weight_update", deadline, what="finish (stale session)")
            self._call("POST", "/shutdown_weight_transfer_engine", deadline,
                       what="shutdown_weight_transfer_engine")

    def _background_shutdown(self) -> None:
        try:
            self._shutdown_transfer(Deadline(self.request_timeout_s), end_stale_update=False)
        except RefitError as e:
            log.info("background shutdown_weight_transfer_engine: %s", e)

    def _join_background_shutdown(self, deadline: Deadline) -> None:
        """A shutdown posted by an earlier abort must reach vLLM before the next init."""
        thread = self._shutdown_thread
        if thread is not None and thread.is_alive():
            thread.join(max(min(deadline.remaining(), self.request_timeout_s), 0.0))
            if thread.is_alive():
                raise EngineUnavailableError("the previous shutdown_weight_transfer_engine is "
                                             "still unanswered")

    def _signal_abort(self, group: GroupSpec, key: str) -> None:
        """Set the receive's abort key in the trainer's TCPStore (the worker polls it): the only
        way to reach a vLLM worker blocked in /update_weights. Best effort, bounded."""
        import datetime

        import torch.distributed as dist

        try:
            store = dist.TCPStore(group.master_address, group.master_port, is_master=False,
                                  wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=min(self.abort_grace_s, 2)))
            store.set(key, b"1")
            log.info("abort key set for the worker: %s", key)
        except (RuntimeError, dist.DistError) as e:  # the trainer's store is gone already
            log.info("abort key not set (%s): the worker fails with the trainer", e)

    def _check_live(self, deadline: Deadline, gen: int, what: str) -> None:
        deadline.check(what)
        if gen != self._abort_gen:
            raise EpochAbortedError(f"{what}: aborted", reason="EPOCH_ABORTED")

    def _refresh_world_size(self) -> None:
        try:
            body = self._call("GET", "/get_world_size", None, what="get_world_size",
                              query={"include_dp": "true"}, cap_s=self.status_timeout_s)
            self._world_size = int(body["world_size"])
        except (RefitError, KeyError, TypeError, ValueError):
            pass

    # --- checkpoint names (check_plan) -----------------------------------------------------

    def _checkpoint_index(self) -> dict[str, tuple[int, ...]] | None:
        if self._checkpoint is not None:
            return self._checkpoint
        directory = self.checkpoint_dir
        if directory is None:
            try:
                body = self._call("GET", "/v1/models", None, what="models",
                                  cap_s=self.status_timeout_s)
                directory = body["data"][0]["root"]
            except (RefitError, KeyError, IndexError, TypeError) as e:
                log.info("plan names not checked: engine model unknown (%s)", e)
                return None
        path = Path(directory)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            log.info("plan names not checked: %s holds no safetensors checkpoint", directory)
            return None
        index: dict[str, tuple[int, ...]] = {}
        try:
            for f in files:
                index.update(_safetensors_shapes(f))
            config = path / "config.json"
            if config.is_file():
                cfg = json.loads(config.read_text())
                self._tied_embeddings = bool(cfg.get("tie_word_embeddings", False))
        except (OSError, ValueError) as e:
            log.warning("plan names not checked: cannot read %s (%s)", directory, e)
            return None
        self._checkpoint, self._checkpoint_dir_used = index, str(path)
        return index

    # --- HTTP ------------------------------------------------------------------------------

    def _call(self, method: str, path: str, deadline: Deadline | None, *, what: str,
              query: dict | None = None, body: Any = None, cap_s: float | None = None,
              extra_s: float = 0.0, kind: str = "control", watch: Deadline | None = None,
              gen: int | None = None, on_cancel: Callable[[], None] | None = None) -> Any:
        """One request; returns the parsed JSON body of a 2xx or raises a typed RefitError."""
        left = deadline.check(what) + extra_s if deadline is not None else math.inf
        cap = self.request_timeout_s if cap_s is None else cap_s
        timeout = min(left, cap)
        if math.isinf(timeout):
            timeout = self.request_timeout_s
        reply = self._roundtrip(method, path, query, body, timeout, what,
                                at_deadline=timeout >= left, watch=watch,
                                gen=self._abort_gen if gen is None else gen, on_cancel=on_cancel)
        if 200 <= reply.status < 300:
            return reply.body
        raise self._error_for(reply, what, kind)

    def _roundtrip(self, method: str, path: str, query: dict | None, body: Any, timeout: float,
                   what: str, *, at_deadline: bool, watch: Deadline | None = None,
                   gen: int = 0, on_cancel: Callable[[], None] | None = None) -> _Reply:
        target = self._prefix + path
        if query:
            target += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Connection": "close", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        cls = http.client.HTTPSConnection if self._scheme == "https" else \
            http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=max(timeout, 0.001))

        def run() -> _Reply:
            conn.request(method, target, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = raw.decode(errors="replace")
            return _Reply(resp.status, parsed)

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

    def _run_cancellable(self, run: Callable[[], _Reply], conn, watch: Deadline, gen: int,
                         what: str, on_cancel: Callable[[], None] | None) -> _Reply:
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
            if thread.is_alive() and (watch.cancel.is_set() or gen != self._abort_gen):
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
                    raise EpochAbortedError(f"{what}: aborted; vLLM had not answered within "
                                            f"{self.abort_grace_s:.1f}s", reason="EPOCH_ABORTED")
        if "error" in box:
            raise box["error"]
        return box["reply"]

    def _error_for(self, reply: _Reply, what: str, kind: str) -> RefitError:
        text = _error_text(reply.body)
        where = f"{what}: vLLM at {self.url} answered HTTP {reply.status}: {text}"
        if reply.status == 404:
            return FailedPreconditionError(
                f"{where} (start vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                "to expose the admin routes)", reason="ENGINE_ROUTE_MISSING")
        if reply.status in (400, 422):
            return InvalidArgumentError(where, reason="ENGINE_REJECTED")
        if reply.status == 503:
            return EngineUnavailableError(where)
        if "Weight transfer not configured" in text:
            return FailedPreconditionError(
                f"{where} (start vLLM with --weight-transfer-config '{{\"backend\": \"gloo\"}}')",
                reason="WEIGHT_TRANSFER_NOT_CONFIGURED")
        if kind == "join":
            if _is_timeout_text(text):
                return RefitTimeoutError(where, reason="RENDEZVOUS_TIMEOUT")
            return CollectiveError(where, reason="RENDEZVOUS_FAILED")
        if kind == "receive":
            if _is_timeout_text(text):
                return RefitTimeoutError(where)
            return CollectiveError(where)
        return FailedPreconditionError(where, reason="ENGINE_ERROR")


def init_info_for(spec: GroupSpec, plan: RefitPlan, timeout_s: float) -> dict[str, Any]:
    """`init_info` of /init_weight_transfer_engine: the project's gloo backend
    (`refit_grpc.vllm_plugin.engine.RefitGlooInitInfo`) or vLLM's nccl backend."""
    if spec.backend == "nccl":
        from refit_grpc.vllm_plugin.nccl_sender import worker_init_info

        return worker_init_info(spec.master_address, spec.master_port, spec.world_size,
                                spec.rank, plan.packing)
    return {"master_address": spec.master_address, "master_port": spec.master_port,
            "rank_offset": spec.rank, "world_size": spec.world_size,
            "group_id": spec.group_id,  # PrefixStore refit_grpc/<group_id>, as Group.join
            "packed": True,
            "packed_buffer_size_bytes": plan.packing.buffer_size_bytes,
            "packed_num_buffers": plan.packing.num_buffers,
            "timeout_s": timeout_s}


def update_info_for(plan: RefitPlan, backend: str, timeout_s: float,
                    abort_key: str | None = None) -> dict[str, Any]:
    """`update_info` of /update_weights: the plan in vLLM's field names; the gloo backend also
    takes this epoch's deadline, the plan digest (it refuses a plan that would cut buckets
    differently from the sender's) and the key that aborts it.

    Every plan tensor is named, `lm_head.weight` of a tied model included: the receiver cuts
    the broadcast bytes by these names and shapes (vLLM's nccl consumer as well), so a dropped
    name would shift every tensor after it. Which of a tied parameter's two names is loaded is
    the worker's decision (docs/vllm.md, Tied embeddings)."""
    info: dict[str, Any] = {"names": [s.name for s in plan.tensors],
                            "dtype_names": [DTYPE_NAMES[s.dtype] for s in plan.tensors],
                            "shapes": [list(s.shape) for s in plan.tensors]}
    if backend == "gloo":
        info["timeout_s"] = timeout_s
        info["plan_digest"] = plan.digest
        if abort_key:
            info["abort_key"] = abort_key
    return info


def _worker_timeout(left_s: float) -> float:
    """The worker's own bound: a little inside the shim's, so its error (with its cause) arrives
    before the shim's HTTP call gives up."""
    return round(max(min(left_s - 1.0, left_s * 0.9), 0.5), 3)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: implausible header length {n}")
        header = json.loads(f.read(n))
    return {name: tuple(int(d) for d in meta["shape"])
            for name, meta in header.items() if name != "__metadata__"}
