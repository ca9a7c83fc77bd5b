"""The base of every engine the shim reaches over local HTTP admin routes (vLLM, Dynamo, next SGLang).

An engine of this kind receives in its own workers: the shim only posts routes. `HttpEngine` owns
every step of the engine interface as a template method, and a subclass supplies the routes
(the hooks below, `_post_*` and friends); the package's docstring (`refit_grpc.shim.engines`)
lists exactly what a new engine writes. Owned here:

    options         `HttpEngineOptions` (url, timeouts, abort grace, checkpoint directory, the
                    loopback override), extended by each engine's own frozen options class
    loopback        the engine's admin routes are unauthenticated, so its URL must be loopback
                    unless `allow_remote_engine=true`; the shim is the authenticated front door
    state           paused (last known), receiving, touched (`partial_on_failure`), the group and
                    its backend, the weight calls in flight, the staged plan and digest, the
                    workers' staging bytes: no subclass writes them
    pause/resume    the engine's route (`_post_pause` / `_post_resume`), then the paused flag
    init_transfer   the previous teardown awaited, the group torn down (`_teardown`), then the
                    join (`_post_join`) with a worker timeout from the deadline
    receive, flip   one weight-update session (`_update`): receiving and touched kept,
                    `_open_update` (the engine's session opening, if any), then the one blocking
                    call (`_post_update`: from the group, or for a flip from the staged copy),
                    watched (`_watched_receive`): an abort key in the trainer's TCPStore set when
                    the epoch is aborted (the only way to reach a worker blocked inside the
                    receive), the `refit_grpc[applied=0/N]` marker (`wire.worker`) that proves
                    the weights untouched, no commit of a call that outlived an abort
    finish          the engine's route (`_post_finish`), then the weights are whole again
    stage           the previous drop awaited, `_start_stage` (each engine starts its workers'
                    staged receives and says how to read their `wire.worker.StageStatus`), then
                    `_await_staged`: the poll (PROGRESS as buckets land everywhere, their
                    digests must agree, typed failures)
    drop_staged     `_post_drop_staged` on a background thread, which the next stage awaits
    abort_transfer  pending calls cancelled, then `_teardown` on a background thread, which the
                    next init awaits
    checkpoint      the names and shapes of a local checkpoint directory, read once

    committed copy  the copy a flip loaded stays on the workers as the engine's committed copy
                    (`committed_copy`: the flip's version and digest, recorded here; forgotten
                    as an in-place receive or the next stage starts): a delta epoch reaches
                    `_start_stage(..., delta=True)`, whose workers apply it onto that copy
    serve_copy      the engine's rank-0 worker broadcasts its committed copy to a catch-up's
                    newcomer (`_start_serve`: how it starts and how its status is read), polled
                    until sent; `_cancel_serve` on a failure, an abort or the deadline

Where the next step of issue 23 slots in: a flip that copies straight into the live parameters
is the engine's `_post_update` for a staged source.

Also here: `worker_timeout`, the bound a worker is given for a join or a receive. The HTTP client
is `http_client.py`, the checkpoint index `checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidPlanError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Bucket, Packing, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine, LoopFlipTimes
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
    SERVE_DONE,
    SERVE_RUNNING,
    STAGE_FAILED,
    STAGE_IDLE,
    STAGE_STAGED,
    ServeInfo,
    StageStatus,
)

log = logging.getLogger(__name__)


# How often a stage polls the workers' staged receives: PROGRESS at this granularity (on vLLM
# each poll is a /collective_rpc, answered between two engine steps: a few ms of the engine loop
# per second; on Dynamo a read of the trainer's TCPStore, nothing of the engine's).
STAGE_POLL_S = 0.1

# Reads every worker's staged receive again (`HttpEngine._start_stage` returns one).
StagePoll = Callable[[Deadline], list[StageStatus]]


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


@dataclasses.dataclass(frozen=True)
class UpdateCall:
    """What the one blocking call of a weight-update session (`HttpEngine._post_update`) needs.

    Args:
        plan: the epoch's plan (names, dtypes, shapes: how the bytes split into tensors).
        deadline: the call's deadline (also the watch: its cancel ends the call).
        gen: the HTTP client's generation when the session opened (an abort changes it).
        timeout_s: the worker's own bound (`worker_timeout`).
        abort_key: the key in the trainer's TCPStore whose setting ends the receive, or None.
        on_cancel: what the HTTP client runs when the call is cancelled (sets the abort key).
        staged_digest: None for a receive from the group; for a flip, the digest the worker's
            staged copy must hold (the bytes come from that copy).
        version: a flip's version: the copy it loads stays as the committed copy of it.
    """

    plan: RefitPlan
    deadline: Deadline
    gen: int
    timeout_s: float
    abort_key: str | None = None
    on_cancel: Callable[[], None] | None = None
    staged_digest: str | None = None
    version: int | None = None


class _BackgroundCall:
    """One call on a daemon thread at a time, bounded by `timeout_s`: starting it while it runs
    is a no-op, its failure is logged (abort's teardown, drop_staged)."""

    def __init__(self, name: str, call: Callable[[Deadline], object], timeout_s: float):
        self.name, self._call, self._timeout_s = name, call, timeout_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, thread_name: str) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            thread = self._thread = threading.Thread(target=self._run, daemon=True,
                                                     name=thread_name)
        thread.start()

    def _run(self) -> None:
        try:
            self._call(Deadline(self._timeout_s))
        except RefitError as e:
            log.info("background %s: %s", self.name, e)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a call in flight; True once none runs."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(max(timeout_s, 0.0))
            return not thread.is_alive()
        return True


class HttpEngine(Engine):
    """An engine behind local HTTP admin routes; subclasses supply the routes (the hooks).

    Constructed from its options class: `Engine(url, packing, **fields)` with typed values, or
    `Engine(options=..., packing=...)` (the registry's factory, after `options_cls.parse`)."""

    options_cls: ClassVar[type[HttpEngineOptions]] = HttpEngineOptions
    engine_name: ClassVar[str] = "engine"            # in the client's messages
    admin_routes: ClassVar[str] = "the engine's admin routes"  # in the loopback refusal
    reached: ClassVar[str] = "engine"                 # what the shim reaches on loopback
    teardown_route: ClassVar[str] = "teardown"        # what `_teardown` posts, for messages
    update_route: ClassVar[str] = "update"            # what `_post_update` posts, for messages

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
        self._backend = "gloo"        # the group's
        self._weight_calls = 0        # join/update calls in flight (the engine is inside one)
        self._receiving = False
        self._touched = False         # weights may differ from the last committed version
        self._teardown = _BackgroundCall(self.teardown_route, self._post_teardown,
                                         o.request_timeout_s)
        # Staged epochs: what stage() returned (for flip), the background drop, and the host
        # memory the workers' staged copies hold as they last reported it.
        self._staged: tuple[RefitPlan, str] | None = None
        self._drop = _BackgroundCall(
            "drop_staged", lambda d: self._note_staging(self._post_drop_staged(d)),
            o.request_timeout_s)
        self._staging_bytes = 0
        # Adapter epochs (docs/adapters.md): name -> the version the last flip of each loaded
        # (an engine that lists what it serves adds those it served when this shim started).
        self._adapters: dict[str, int] = {}
        # (version, staged digest) and plan of the workers' committed copy, as the last flip
        # left it. The workers check again: a delta or a serve without one is refused there.
        self._committed: tuple[int, str] | None = None
        self._committed_plan: RefitPlan | None = None
        # The workers' previous copy (a reversible epoch kept it: what a rollback loads); while
        # a reversible stage or a rollback waits for its flip, the committed copy it set aside
        # (given back by a drop), and for a rollback the previous copy it is loading.
        self._previous: tuple[int, str] | None = None
        self._set_aside: tuple[tuple[int, str], RefitPlan] | None = None
        self._restoring: tuple[int, str] | None = None

    @classmethod
    def from_options(cls, options: HttpEngineOptions, packing: Packing) -> HttpEngine:
        return cls(packing=packing, options=options)

    # --- what each engine writes: its routes ----------------------------------------------

    def _error_for(self, reply: Reply, what: str, kind: CallKind) -> RefitError:
        """The typed error for an answer that is not a success (vLLM's rules by default)."""
        return error_for(reply, what, kind)

    @abstractmethod
    def _post_pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool) -> None: ...

    @abstractmethod
    def _post_resume(self, deadline: Deadline) -> None: ...

    @abstractmethod
    def _post_join(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline,
                   timeout_s: float) -> None:
        """Join the workers to the group `spec`, `timeout_s` their own bound; blocks until
        the trainer's rank 0 has joined."""

    @abstractmethod
    def _post_update(self, call: UpdateCall) -> None:
        """The one blocking call of a weight-update session: receive every bucket from the
        group (`call.staged_digest` None), or load the workers' staged copies (a flip). A
        failure names `wire.worker.applied_marker` where the worker knows how much it applied."""

    @abstractmethod
    def _post_finish(self, version: int, deadline: Deadline) -> None: ...

    @abstractmethod
    def _post_teardown(self, deadline: Deadline, *, before_join: bool = False) -> None:
        """Tear the workers' data group down (`teardown_route`); `before_join`: ahead of a new
        join, which may also end a weight-update session left open."""

    def _open_update(self, deadline: Deadline, gen: int, what: str) -> None:
        """Open a weight-update session before its blocking call. By default there is no
        opening route: the weights count as touched from here. An engine with a session
        route (vLLM's /start_weight_update) overrides it, marking `touched` once that route
        may move layers."""
        self._set_touched(True)
        self._check_live(deadline, gen, what)

    def _start_stage(self, plan: RefitPlan, deadline: Deadline, timeout_s: float,
                     delta: bool, keep_previous: bool) -> tuple[list[StageStatus], StagePoll]:
        """Start every worker's staged receive of `plan` (answered at once: the engine keeps
        serving); every worker's status right after, and how to read them again. Only where
        `capabilities.staging`."""
        raise FailedPreconditionError(f"the {self.kind} engine cannot stage an epoch",
                                      reason=Reason.STAGING_UNSUPPORTED)

    def _post_drop_staged(self, deadline: Deadline) -> list[StageStatus] | None:
        """Make every worker forget its staged copy (and end a staged receive in flight); the
        workers' statuses where the route answers them. Nothing to drop by default."""
        return None

    def _start_serve(self, info: ServeInfo, store: Any,
                     deadline: Deadline) -> Callable[[Deadline], StageStatus]:
        """Start the serve of the committed copy on the engine's rank-0 worker (answered at
        once: the engine keeps serving); returns how to read its status (`serve_state` ""
        while not started). Only where `capabilities.serving_copy`."""
        raise FailedPreconditionError(f"the {self.kind} engine cannot serve its committed copy",
                                      reason=Reason.CATCH_UP_UNSUPPORTED)

    def _cancel_serve(self, deadline: Deadline) -> None:
        """End a serve in flight on the engine's rank-0 worker."""

    def _post_restore_previous(self, deadline: Deadline) -> None:
        """Make every worker's previous copy its staged copy (a rollback's first step; answered
        at once). Only where `capabilities.rollback`."""
        raise FailedPreconditionError(f"the {self.kind} engine cannot roll back",
                                      reason=Reason.ROLLBACK_UNSUPPORTED)

    @abstractmethod
    def weight_version(self, deadline: Deadline | None = None) -> Any:
        """The weight version the engine declares (set by `finish`), None if undeclared: for
        trainers, tests and demos."""

    # --- the shared lifecycle --------------------------------------------------------------

    @property
    def partial_on_failure(self) -> bool:
        with self._lock:
            return self._receiving or self._touched

    def pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool = False) -> None:
        self._post_pause(mode, deadline, keep_cache)
        with self._lock:
            self._paused = True

    def resume(self, deadline: Deadline) -> None:
        self._post_resume(deadline)
        with self._lock:
            self._paused = False

    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        self._check_group(spec, plan)
        self._join_teardown(deadline)
        self._post_teardown(deadline, before_join=True)
        timeout_s = worker_timeout(deadline.check("join"))
        with self._weight_call():
            self._post_join(spec, plan, deadline, timeout_s)
        with self._lock:
            self._backend, self._group = spec.backend, spec

    def _check_group(self, spec: GroupSpec, plan: RefitPlan) -> None:
        """Refuse a group the workers cannot join, before any route (by default: the backend,
        `check_backend`)."""
        self.check_backend(spec.backend)

    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        """The blocking update; `on_bucket` runs for every bucket once it succeeded (the
        engines report nothing per bucket: PROGRESS arrives in one burst)."""
        self._forget_committed()  # the workers forget their copies as the receive starts
        self._update(plan, deadline)
        for bucket in plan.buckets:
            on_bucket(bucket)

    def finish(self, version: int, deadline: Deadline) -> str:
        self._post_finish(version, deadline)
        with self._lock:
            self._touched = False  # the new version is whole
        return ""

    def abort_transfer(self) -> None:
        self._http.cancel_pending()
        self._teardown.start(f"{self.kind}-{self.teardown_route}")

    def close(self) -> None:
        self.abort_transfer()
        self._teardown.wait(min(self.request_timeout_s, 5.0))

    def _join_teardown(self, deadline: Deadline) -> None:
        """A teardown posted by an earlier abort must reach the engine before the next init."""
        if not self._teardown.wait(min(deadline.remaining(), self.request_timeout_s)):
            raise EngineUnavailableError(f"the previous {self.teardown_route} is still "
                                         "unanswered")

    # --- one weight-update session: a receive, or a flip's load -----------------------------

    def _update(self, plan: RefitPlan, deadline: Deadline, staged_digest: str | None = None,
                version: int | None = None) -> None:
        """Open the session (`_open_update`), then its one blocking call (`_post_update`),
        watched for aborts. A receive from the group gets an abort key; a flip's load reads
        host memory and needs none. The caller commits (`finish`)."""
        what = self.update_route if staged_digest is None else f"{self.update_route}(staged)"
        gen = self._http.generation
        group = self._group if staged_digest is None else None
        with self._weight_call(receiving=True):
            self._open_update(deadline, gen, what)
            left = deadline.check(what)
            abort_key = self._abort_key(group)
            self._watched_receive(
                lambda on_cancel: self._post_update(UpdateCall(
                    plan, deadline, gen, worker_timeout(left), abort_key, on_cancel,
                    staged_digest, version)),
                what, deadline, gen, group, abort_key)

    @contextlib.contextmanager
    def _weight_call(self, receiving: bool = False) -> Iterator[None]:
        """A join or update call in flight; `receiving`: an update session (touched from
        `_open_update` on)."""
        with self._lock:
            self._weight_calls += 1
            if receiving:
                self._receiving, self._touched = True, False
        try:
            yield
        finally:
            with self._lock:
                self._weight_calls -= 1
                if receiving:
                    self._receiving = False

    def _set_touched(self, touched: bool) -> None:
        with self._lock:
            self._touched = touched

    def _check_live(self, deadline: Deadline, gen: int, what: str) -> None:
        deadline.check(what)
        if gen != self._http.generation:
            raise EpochAbortedError(f"{what}: aborted", reason=Reason.EPOCH_ABORTED)

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
                self._set_touched(False)  # rolled back with nothing loaded: old weights intact
            raise
        if deadline.cancel.is_set() or gen != self._http.generation:
            raise EpochAbortedError(f"{what} finished after an abort; not committing",
                                    reason=Reason.EPOCH_ABORTED)

    def _signal_abort(self, group: GroupSpec, key: str) -> None:
        """Set the receive's abort key in the trainer's TCPStore (the worker polls it): the only
        way to reach a worker blocked inside a receive (engines run worker RPCs one at a time).
        Best effort, bounded."""
        from refit_grpc.dataplane.rendezvous import set_store_key  # torch, only when it is needed

        if set_store_key(group.master_address, group.master_port, key,
                         min(self.abort_grace_s, 2.0)):
            log.info("abort key set for the worker: %s", key)
        else:
            log.info("abort key not set: the worker fails with the trainer")

    # --- staged epochs: stage, flip, drop ---------------------------------------------------

    @property
    def staging_bytes(self) -> int:
        """Host memory the workers' staged copies hold (one copy of the plan per worker), as
        they last reported it; 0 before the first staged epoch."""
        with self._lock:
            return self._staging_bytes

    def stage(self, plan: RefitPlan, deadline: Deadline,
              on_bucket: Callable[[Bucket], None], delta: bool = False,
              keep_previous: bool = False) -> str:
        """Start every worker's staged receive (`_start_stage`), then follow them until every
        bucket landed everywhere. The engine is not paused and its weights are not touched;
        every worker stages the whole plan (each TP rank receives every byte, as in place),
        and their staged digests must agree.

        Returns:
            The staged digest.

        Raises:
            RefitError: a worker's receive failed (its reason where it knew one), the workers
                disagree, or the stage was aborted or ran out of time; nothing is staged then.
        """
        if delta and not self.capabilities.delta:
            raise FailedPreconditionError(f"the {self.kind} engine cannot apply a delta",
                                          reason=Reason.DELTA_UNSUPPORTED)
        self._drop.wait(min(deadline.remaining(), self.request_timeout_s))
        gen = self._http.generation
        self._claim_copy(delta, keep_previous)
        timeout_s = worker_timeout(deadline.check("stage"))
        statuses, poll = self._start_stage(plan, deadline, timeout_s, delta, keep_previous)
        digest = self._await_staged(plan, deadline, on_bucket, gen, statuses, poll)
        with self._lock:
            self._staged = (plan, digest)
        return digest

    def flip(self, version: int, deadline: Deadline) -> str:
        """Load the staged copy into the live weights through the in-place receive's own
        session (`_update` with the staged digest: the workers' loader, so layerwise reload,
        tied heads and MoE experts are as in place), then commit `version`. Called while
        paused. The copy is consumed, or no longer trusted after a failed load.

        An adapter plan's flip (never paused) is `_flip_adapter`: the copy is spent on the
        adapter, so the workers keep no committed copy of the model after it."""
        return self._flip(version, deadline, self._load_staged)

    def flip_in_loop(self, version: int, keep_cache: bool, deadline: Deadline) -> LoopFlipTimes:
        """`flip` in one turn of the engine's loop (`_load_in_loop`), not paused."""
        times: list[LoopFlipTimes] = []

        def load(plan: RefitPlan, digest: str, version: int, deadline: Deadline) -> str:
            times.append(self._load_in_loop(plan, digest, version, keep_cache, deadline))
            return ""

        self._flip(version, deadline, load)
        return times[0]

    def _load_in_loop(self, plan: RefitPlan, digest: str, version: int, keep_cache: bool,
                      deadline: Deadline) -> LoopFlipTimes:
        """`_load_staged` in one turn of the engine's loop, caches and label included: an engine
        with `Capabilities.flip_in_loop` implements it."""
        return Engine.flip_in_loop(self, version, keep_cache, deadline)

    def _flip(self, version: int, deadline: Deadline,
              load: Callable[[RefitPlan, str, int, Deadline], str]) -> str:
        """`flip` with the load and commit of a model's copy given (`_load_staged`, or
        `flip_in_loop`'s): the staged copy taken, then committed once `load` returned."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is not None and staged[0].adapter is not None:
                self._committed = self._committed_plan = None
        if staged is None:
            raise FailedPreconditionError("flip: nothing is staged on this engine",
                                          reason=Reason.NOT_STAGED)
        plan, digest = staged
        if plan.adapter is not None:
            self._flip_adapter(plan, digest, version, deadline)
            with self._lock:
                self._adapters[plan.adapter.name] = version
            return ""
        try:
            result = load(plan, digest, version, deadline)
        except BaseException:
            with self._lock:  # partly loaded: no copy is trusted
                self._previous = self._set_aside = self._restoring = None
            raise
        with self._lock:  # the copy it loaded: from here the committed copy
            self._committed, self._committed_plan = (version, digest), plan
            # A reversible stage's set-aside copy is now the previous one; a rollback keeps
            # none (the version it left is not one to go back to).
            kept = self._set_aside
            self._previous = kept[0] if kept is not None and self._restoring is None else None
            self._set_aside = self._restoring = None
        return result

    def _load_staged(self, plan: RefitPlan, digest: str, version: int,
                     deadline: Deadline) -> str:
        """A flip's load and commit: by default the receive's own session from the staged
        copy (`_update`), then `finish`. An engine whose workers do the session in one call
        overrides it (vLLM's `flip`)."""
        self._update(plan, deadline, staged_digest=digest, version=version)
        return self.finish(version, deadline)

    @property
    def adapters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._adapters)

    @staticmethod
    def _refuse_adapter_problems(answers: Iterable[object]) -> None:
        """Prepare of an adapter plan: the first problem the workers found (`AdapterProblem`
        as they answer it, `{"problem", "reason"}`) is the refusal, ADAPTER_UNSUPPORTED as the
        engine's failed precondition, anything else as an invalid plan."""
        for answer in answers:
            if not isinstance(answer, dict) or not answer.get("problem"):
                continue
            reason = Reason(answer.get("reason") or Reason.INVALID_ADAPTER)
            cls = FailedPreconditionError if reason is Reason.ADAPTER_UNSUPPORTED \
                else InvalidPlanError
            raise cls(str(answer["problem"]), reason=reason)

    def _flip_adapter(self, plan: RefitPlan, digest: str, version: int,
                      deadline: Deadline) -> None:
        """An adapter epoch's flip, while the engine serves: the workers' staged copy becomes
        version `version` of `plan.adapter`, served under its name from here (the engine's
        own routes; an engine with `Capabilities.adapters` implements it)."""
        raise FailedPreconditionError(f"{self.engine_name} serves no adapter epochs",
                                      reason=Reason.ADAPTER_UNSUPPORTED)

    def drop_staged(self) -> None:
        """Forget the staged copy on every worker and end a staged receive in flight (on a
        background thread: never blocks; the next stage waits for it)."""
        with self._lock:
            self._staged = None
            if self._set_aside is not None:  # the workers give their committed copies back
                (self._committed, self._committed_plan), self._set_aside = self._set_aside, None
                self._previous, self._restoring = self._restoring, None
        self._drop.start(f"{self.kind}-drop_staged")

    @property
    def previous_copy(self) -> tuple[int, str] | None:
        with self._lock:
            return self._previous

    def restore_previous(self, deadline: Deadline) -> tuple[int, str]:
        """Every worker makes its previous copy the staged copy (`_post_restore_previous`);
        `flip` then loads it through the workers' loader as any staged copy."""
        with self._lock:
            previous, committed, plan = self._previous, self._committed, self._committed_plan
        if previous is None or committed is None or plan is None:
            raise FailedPreconditionError("no previous copy to roll back to",
                                          reason=Reason.NO_PREVIOUS_COPY)
        self._drop.wait(min(deadline.remaining(), self.request_timeout_s))
        self._post_restore_previous(deadline)
        with self._lock:
            self._staged = (plan, previous[1])
            self._set_aside, self._restoring = (committed, plan), previous
            self._committed = self._committed_plan = self._previous = None
        return previous

    # --- the committed copy: delta epochs and catch-up ------------------------------------

    @property
    def committed_copy(self) -> tuple[int, str] | None:
        with self._lock:
            return self._committed

    def _claim_copy(self, delta: bool, keep_previous: bool = False) -> None:
        """A stage is about to overwrite the workers' copy (a delta: apply onto it, which
        needs a committed copy), or with `keep_previous` to set it aside as the previous copy;
        it is no longer the committed copy from here."""
        with self._lock:
            self._staged = None
            if delta and self._committed is None:
                raise FailedPreconditionError("no committed copy to apply a delta to",
                                              reason=Reason.DELTA_BASE_MISMATCH)
            kept = self._committed
            self._set_aside = (kept, self._committed_plan) \
                if keep_previous and kept is not None and self._committed_plan is not None \
                else None
            self._committed = self._committed_plan = self._previous = self._restoring = None

    def _forget_committed(self) -> None:
        with self._lock:
            self._committed = self._committed_plan = None
            self._previous = self._set_aside = self._restoring = None

    def serve_copy(self, spec: GroupSpec, store: Any, deadline: Deadline,
                   on_bucket: Callable[[Bucket], None] | None = None) -> None:
        """The engine's rank-0 worker joins `spec`'s group as its rank 0 (a client of `store`,
        which this shim hosts) and broadcasts its committed copy while the engine serves;
        followed until sent. On a failure, an abort or the deadline the serve is cancelled
        (its group closes, so the newcomer's receive fails at once)."""
        with self._lock:
            committed, plan = self._committed, self._committed_plan
        if committed is None or plan is None:
            raise FailedPreconditionError("no committed copy to serve",
                                          reason=Reason.PEER_COPY_MISMATCH)
        info = ServeInfo.for_group(spec, worker_timeout(deadline.check("serve_copy")))
        poll = self._start_serve(info, store, deadline)
        reported = 0
        try:
            while True:
                status = poll(deadline)
                if on_bucket is not None:
                    for bucket in plan.buckets[reported:status.served]:
                        on_bucket(bucket)
                reported = max(reported, status.served)
                if status.serve_state == SERVE_DONE:
                    return
                if status.serve_state not in ("", SERVE_RUNNING):
                    raise CollectiveError(f"serve_copy: worker rank {status.rank} failed: "
                                          f"{status.serve_error or status.serve_state}",
                                          reason=Reason.COLLECTIVE_FAILED)
                deadline.cancel.wait(min(STAGE_POLL_S, max(deadline.remaining(), 0.0)))
                if deadline.cancel.is_set():
                    raise EpochAbortedError("serve_copy: aborted", reason=Reason.EPOCH_ABORTED)
                deadline.check("serve_copy")
        except BaseException:
            try:
                self._cancel_serve(Deadline(self.request_timeout_s))
            except RefitError as e:
                log.info("cancel_serve: %s", e)
            raise

    def _note_staging(self, statuses: list[StageStatus] | None) -> list[StageStatus] | None:
        if statuses is not None:
            with self._lock:
                self._staging_bytes = sum(s.staging_bytes for s in statuses)
        return statuses

    def _await_staged(self, plan: RefitPlan, deadline: Deadline,
                      on_bucket: Callable[[Bucket], None], gen: int,
                      statuses: list[StageStatus], poll: StagePoll) -> str:
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
            self._note_staging(statuses)
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


__all__ = ["HttpEngine", "HttpEngineOptions", "StagePoll", "UpdateCall", "stage_error",
           "worker_timeout"]
