"""The base of every engine the shim reaches over local HTTP admin routes (vLLM, Dynamo, next SGLang).

An engine of this kind receives in its own workers: the shim only posts routes. What every such
engine shares lives here, so a new one writes only its routes:

    options         `HttpEngineOptions` (url, timeouts, abort grace, checkpoint directory, the
                    loopback override), extended by each engine's own frozen options class
    loopback        the engine's admin routes are unauthenticated, so its URL must be loopback
                    unless `allow_remote_engine=true`; the shim is the authenticated front door
    state           paused (last known), receiving, touched (`partial_on_failure`), the group
    pause/resume    the engine's route (`_post_pause` / `_post_resume`), then the paused flag
    finish          the engine's route (`_post_finish`), then the weights are whole again
    receive         `_watched_receive`: the one blocking call, an abort key in the trainer's
                    TCPStore set when the epoch is aborted (the only way to reach a worker
                    blocked inside the receive), the `refit_grpc[applied=0/N]` marker that
                    proves the weights untouched, no commit of a call that outlived an abort
    abort_transfer  pending calls cancelled, then the engine's teardown route (`_teardown`) on
                    a background thread, which the next init waits for (`_join_teardown`)
    checkpoint      the names and shapes of a local checkpoint directory, read once
    staged epochs   `_await_staged`: the poll of the workers' staged receives (PROGRESS as
                    buckets land everywhere, their digests must agree, typed failures); each
                    engine says how it starts and reads them (vLLM: /collective_rpc; Dynamo:
                    its update route, then the trainer's TCPStore); `drop_staged` on a
                    background thread (`_post_drop_staged`, the engine's call), which the next
                    stage waits for (`_join_drop`); `staging_bytes` as the workers reported

Also here: `worker_timeout`, the bound a worker is given for a join or a receive. The HTTP client
is `http_client.py`, the checkpoint index `checkpoint.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Bucket, Packing, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine
from refit_grpc.shim.engines.checkpoint import CheckpointIndex
from refit_grpc.shim.engines.http_client import (
    CallKind,
    EngineHttpClient,
    Reply,
    error_for,
    is_loopback,
    is_timeout_text,
)
from refit_grpc.shim.engines.options import EngineOptions
from refit_grpc.wire.worker import (
    APPLIED_RE,
    STAGE_FAILED,
    STAGE_IDLE,
    STAGE_STAGED,
    StageStatus,
)

log = logging.getLogger(__name__)


# How often a stage polls the workers' staged receives: PROGRESS at this granularity (on vLLM
# each poll is a /collective_rpc, answered between two engine steps: a few ms of the engine loop
# per second; on Dynamo a read of the trainer's TCPStore, nothing of the engine's).
STAGE_POLL_S = 0.1


def stage_error(failed: list[StageStatus]) -> RefitError:
    """The typed error of a stage whose workers failed, by the reason the first one reported.

    Args:
        failed: the failed workers' statuses.

    Returns:
        `EpochAbortedError` (aborted, group closed), `RefitTimeoutError`, else `CollectiveError`
        with the worker's reason (RECEIVE_FAILED when it named none).
    """
    first = failed[0]
    message = "stage: " + "; ".join(f"rank {s.rank} failed after {s.landed}/{s.total} "
                                    f"buckets: {s.error}" for s in failed)
    if first.reason == Reason.EPOCH_ABORTED or first.reason == Reason.GROUP_CLOSED:
        return EpochAbortedError(message, reason=first.reason)
    if first.reason == Reason.DEADLINE_EXCEEDED or is_timeout_text(first.error):
        return RefitTimeoutError(message)
    if first.reason in Reason.__members__:
        return CollectiveError(message, reason=Reason(first.reason))
    return CollectiveError(message, reason=Reason.RECEIVE_FAILED)


def worker_timeout(left_s: float) -> float:
    """The worker's own bound: a little inside the shim's, so its error (with its cause) arrives
    before the shim's HTTP call gives up."""
    return round(max(min(left_s - 1.0, left_s * 0.9), 0.5), 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpEngineOptions(EngineOptions):
    """What every HTTP engine takes (`--engine-option KEY=VALUE`; `url` is `--engine-url`)."""

    url: str = "http://127.0.0.1:8000"
    request_timeout_s: float = 30.0  # the cap of a short call (and of the background teardown)
    status_timeout_s: float = 2.0    # the cap of a health probe
    abort_grace_s: float = 3.0       # how long an aborted receive may take to answer
    checkpoint_dir: str | None = None  # the engine's checkpoint, for check_plan's names
    allow_remote_engine: bool = False  # allow a URL that is not loopback


class HttpEngine(Engine):
    """An engine behind local HTTP admin routes; subclasses name them.

    Constructed from its options class: `Engine(url, packing, **fields)` with typed values, or
    `Engine(options=..., packing=...)` (the registry's factory, after `options_cls.parse`)."""

    options_cls: ClassVar[type[HttpEngineOptions]] = HttpEngineOptions
    engine_name: ClassVar[str] = "engine"            # in the client's messages
    admin_routes: ClassVar[str] = "the engine's admin routes"  # in the loopback refusal
    reached: ClassVar[str] = "engine"                 # what the shim reaches on loopback
    teardown_route: ClassVar[str] = "teardown"        # what `_teardown` posts, for messages

    def __init__(self, url: str | None = None, packing: Packing = Packing(), *,
                 options: HttpEngineOptions | None = None, **fields: Any):
        if url is not None:
            fields["url"] = url
        base = options if options is not None else self.options_cls()
        self.options = dataclasses.replace(base, **fields) if fields else base
        o = self.options
        self.request_timeout_s = o.request_timeout_s
        self.status_timeout_s = o.status_timeout_s
        self.abort_grace_s = o.abort_grace_s
        self._http = EngineHttpClient(o.url, request_timeout_s=o.request_timeout_s,
                                      abort_grace_s=o.abort_grace_s, name=self.engine_name,
                                      error_mapper=self._error_for)
        if not is_loopback(self._http.host) and not o.allow_remote_engine:
            raise ValueError(
                f"engine url {o.url!r} is not loopback: {self.admin_routes} are "
                f"unauthenticated, so the shim reaches its {self.reached} on loopback only "
                "(engine option allow_remote_engine=true overrides)")
        self.url = self._http.url
        self.offered_packing = packing
        self.checkpoint_dir = o.checkpoint_dir
        self._checkpoint: CheckpointIndex | None = None
        self._lock = threading.Lock()
        self._paused = False          # last known (set by pause/resume)
        self._group: GroupSpec | None = None
        self._receiving = False
        self._touched = False         # weights may differ from the last committed version
        self._teardown_thread: threading.Thread | None = None
        # Staged epochs: what stage() returned (for flip), the background drop, and the host
        # memory the workers' staged copies hold as they last reported it.
        self._staged: tuple[RefitPlan, str] | None = None
        self._drop_thread: threading.Thread | None = None
        self._staging_bytes = 0

    @classmethod
    def from_options(cls, options: HttpEngineOptions, packing: Packing) -> HttpEngine:
        return cls(packing=packing, options=options)

    # --- what each engine writes: its routes ----------------------------------------------

    def _error_for(self, reply: Reply, what: str, kind: CallKind) -> RefitError:
        """The typed error for an answer that is not a success (vLLM's rules by default)."""
        return error_for(reply, what, kind)

    @abstractmethod
    def _post_pause(self, mode: PauseMode, deadline: Deadline) -> None: ...

    @abstractmethod
    def _post_resume(self, deadline: Deadline) -> None: ...

    @abstractmethod
    def _post_finish(self, version: int, deadline: Deadline) -> None: ...

    @abstractmethod
    def _teardown(self, deadline: Deadline) -> None:
        """Tear the engine's data group down (`teardown_route`)."""

    @abstractmethod
    def weight_version(self, deadline: Deadline | None = None) -> Any:
        """The weight version the engine declares (set by `finish`), None if undeclared: for
        trainers, tests and demos."""

    # --- the shared lifecycle --------------------------------------------------------------

    @property
    def partial_on_failure(self) -> bool:
        with self._lock:
            return self._receiving or self._touched

    def pause(self, mode: PauseMode, deadline: Deadline) -> None:
        self._post_pause(mode, deadline)
        with self._lock:
            self._paused = True

    def resume(self, deadline: Deadline) -> None:
        self._post_resume(deadline)
        with self._lock:
            self._paused = False

    def finish(self, version: int, deadline: Deadline) -> str:
        self._post_finish(version, deadline)
        with self._lock:
            self._touched = False  # the new version is whole
        return ""

    def abort_transfer(self) -> None:
        self._http.cancel_pending()
        with self._lock:
            if self._teardown_thread is not None and self._teardown_thread.is_alive():
                return
            thread = threading.Thread(target=self._background_teardown, daemon=True,
                                      name=f"{self.kind}-{self.teardown_route}")
            self._teardown_thread = thread
        thread.start()

    def close(self) -> None:
        self.abort_transfer()
        thread = self._teardown_thread
        if thread is not None:
            thread.join(min(self.request_timeout_s, 5.0))

    def _background_teardown(self) -> None:
        try:
            self._teardown(Deadline(self.request_timeout_s))
        except RefitError as e:
            log.info("background %s: %s", self.teardown_route, e)

    def _join_teardown(self, deadline: Deadline) -> None:
        """A teardown posted by an earlier abort must reach the engine before the next init."""
        thread = self._teardown_thread
        if thread is not None and thread.is_alive():
            thread.join(max(min(deadline.remaining(), self.request_timeout_s), 0.0))
            if thread.is_alive():
                raise EngineUnavailableError(f"the previous {self.teardown_route} is still "
                                             "unanswered")

    def _abort_key(self, group: GroupSpec | None) -> str | None:
        """A fresh key for one receive, in the group's namespace of the trainer's TCPStore."""
        return (f"refit_grpc/{group.group_id}/abort/{uuid.uuid4().hex}"
                if group is not None else None)

    def _watched_receive(self, call: Callable[[Callable[[], None] | None], Any], what: str,
                         deadline: Deadline, gen: int, group: GroupSpec | None,
                         abort_key: str | None) -> None:
        """Run the receive's one blocking call, `call(on_cancel)`. An abort sets `abort_key`
        (the worker polls it); an error saying nothing reached the model
        (`refit_grpc[applied=0/N]`: rolled back) clears `touched`; a call that finished after
        an abort is not committed."""
        try:
            call((lambda: self._signal_abort(group, abort_key))
                 if group is not None and abort_key else None)
        except RefitError as e:
            m = APPLIED_RE.search(e.message)
            if m and int(m.group(1)) == 0:
                with self._lock:
                    self._touched = False  # rolled back with nothing loaded: old weights intact
            raise
        if deadline.cancel.is_set() or gen != self._http.generation:
            raise EpochAbortedError(f"{what} finished after an abort; not committing",
                                    reason=Reason.EPOCH_ABORTED)

    def _signal_abort(self, group: GroupSpec, key: str) -> None:
        """Set the receive's abort key in the trainer's TCPStore (the worker polls it): the only
        way to reach a worker blocked inside a receive (engines run worker RPCs one at a time).
        Best effort, bounded."""
        from refit_grpc.collective import set_store_key  # torch, only when it is needed

        if set_store_key(group.master_address, group.master_port, key,
                         min(self.abort_grace_s, 2.0)):
            log.info("abort key set for the worker: %s", key)
        else:
            log.info("abort key not set: the worker fails with the trainer")

    # --- staged epochs: the poll every HTTP engine shares ----------------------------------

    @property
    def staging_bytes(self) -> int:
        """Host memory the workers' staged copies hold (one copy of the plan per worker), as
        they last reported it; 0 before the first staged epoch."""
        with self._lock:
            return self._staging_bytes

    def drop_staged(self) -> None:
        """Forget the staged copy on every worker and end a staged receive in flight (on a
        background thread: never blocks; the next stage waits for it, `_join_drop`)."""
        with self._lock:
            self._staged = None
            if self._drop_thread is not None and self._drop_thread.is_alive():
                return
            thread = threading.Thread(target=self._background_drop, daemon=True,
                                      name=f"{self.kind}-drop_staged")
            self._drop_thread = thread
        thread.start()

    def _background_drop(self) -> None:
        try:
            self._post_drop_staged(Deadline(self.request_timeout_s))
        except RefitError as e:
            log.info("background drop_staged: %s", e)

    def _post_drop_staged(self, deadline: Deadline) -> None:
        """The engine's call that makes every worker forget its staged copy (and end a staged
        receive in flight); an engine that does not stage has nothing to drop."""

    def _join_drop(self, deadline: Deadline) -> None:
        thread = self._drop_thread
        if thread is not None and thread.is_alive():
            thread.join(max(min(deadline.remaining(), self.request_timeout_s), 0.0))

    def _await_staged(self, plan: RefitPlan, deadline: Deadline,
                      on_bucket: Callable[[Bucket], None], gen: int,
                      statuses: list[StageStatus],
                      poll: Callable[[Deadline], list[StageStatus]]) -> str:
        """Follow the workers' staged receives (just started, `statuses`) until every bucket
        landed everywhere; `on_bucket` runs once per bucket landed on every worker.

        Args:
            plan: the epoch's plan.
            deadline: the stage's deadline (and its cancel flag).
            on_bucket: the shim's PROGRESS relay.
            gen: the HTTP client's generation when the stage began (an abort changes it).
            statuses: every worker's status right after the start.
            poll: reads every worker's status again.

        Returns:
            The staged digest, which every worker holds.

        Raises:
            RefitError: a worker failed (`stage_error`), the workers staged different bytes
                (RECEIVE_FAILED), the copies were dropped or the epoch aborted
                (EPOCH_ABORTED), or the deadline passed.
        """
        reported = 0
        while True:
            failed = [s for s in statuses if s.state == STAGE_FAILED]
            if failed:
                raise stage_error(failed)
            landed = min(s.landed for s in statuses)
            for bucket in plan.buckets[reported:landed]:
                on_bucket(bucket)
            reported = max(reported, landed)
            if all(s.state == STAGE_STAGED for s in statuses):
                digests = {s.digest for s in statuses}
                if len(digests) != 1:
                    raise CollectiveError(
                        "stage: the workers staged different bytes: "
                        + ", ".join(f"rank {s.rank} {s.digest[:12]}" for s in statuses),
                        reason=Reason.RECEIVE_FAILED)
                (digest,) = digests
                return digest
            if any(s.state == STAGE_IDLE for s in statuses):
                raise EpochAbortedError("stage: dropped while receiving",
                                        reason=Reason.EPOCH_ABORTED)
            deadline.cancel.wait(min(STAGE_POLL_S, max(deadline.remaining(), 0.0)))
            deadline.check("stage")
            if gen != self._http.generation:  # abort_transfer: the workers' group is closing
                raise EpochAbortedError("stage: aborted while receiving",
                                        reason=Reason.EPOCH_ABORTED)
            statuses = poll(deadline)

    # --- checkpoint names (check_plan) -----------------------------------------------------

    def _read_checkpoint(self, directory: str) -> CheckpointIndex | None:
        """The index of `directory`, read once; None (logged) where it cannot be read or holds
        no safetensors checkpoint: the names are then not checked."""
        if self._checkpoint is None:
            try:
                self._checkpoint = CheckpointIndex.read(directory)
            except (OSError, ValueError) as e:
                log.warning("plan names not checked: cannot read %s (%s)", directory, e)
                return None
            if self._checkpoint is None:
                log.info("plan names not checked: %s holds no safetensors checkpoint", directory)
        return self._checkpoint


__all__ = ["HttpEngine", "HttpEngineOptions", "worker_timeout"]
