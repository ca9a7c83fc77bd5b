"""The trainer's view of the fleet: one stub per shim, deadlines, retries, epochs.

Its surface mirrors NeMo RL's `DynamoRefitChannel` so trainer code written for it can switch:
`client_copy()`, `inference_world_size`, `sender_spec`, `prepare()`, `init_collective()` and
`update_weights()` returning handles, `flush_cache()`. On top: `connect()` (group + trainer join),
`refit()` (one whole epoch), `describe()`, `abort()`.

Retry policy: idempotent unary calls (Describe, Prepare, Flush, Abort) retry on UNAVAILABLE with
exponential backoff and jitter. InitCollective and UpdateWeights are never retried alone: a failed
epoch is aborted fleet-wide and must be re-run as a whole (connect, then refit).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import tenacity
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from refit_grpc.collective import Deadline, Group, GroupSpec, Sender
from refit_grpc.driver.endpoint import ChannelSecurity, WorkerEndpoint
from refit_grpc.errors import (
    EpochFailedError,
    EpochRefusedError,
    FleetError,
    FleetTimeoutError,
    InvalidArgumentError,
    MembershipChangedError,
    RefitError,
    WorkerFailure,
)
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import BACKEND_FROM_NAME, DTYPE_TO_PROTO, PAUSE_MODE_TO_PROTO, pb, pb_grpc
from refit_grpc.shim.engines.base import PauseMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerReport:
    instance_id: str
    seconds: float
    bytes: int
    weights_digest: str


@dataclass(frozen=True)
class EpochReport:
    version: int
    bytes: int
    seconds: float           # from UpdateWeights sent to every COMMITTED
    broadcast_seconds: float  # the sender's part
    workers: tuple[WorkerReport, ...]

    @property
    def gbps(self) -> float:
        """Effective GB/s: plan bytes over the whole epoch."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def failure_from_rpc(worker: WorkerEndpoint, err: grpc.RpcError) -> WorkerFailure:
    """A WorkerFailure with the ErrorInfo reason the shim attached (or the status code's name)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    reason = code.name
    message = err.details() if hasattr(err, "details") else str(err)
    try:
        status = rpc_status.from_call(err)
    except (ValueError, AttributeError):
        status = None
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    return WorkerFailure(worker.instance_id, worker.address, code, reason, message or "")


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class _Worker:
    def __init__(self, endpoint: WorkerEndpoint, security: ChannelSecurity):
        self.endpoint = endpoint
        self.channel = security.open(endpoint.address)
        self.stub = pb_grpc.RefitServiceStub(self.channel)
        self.metadata = security.metadata()


# (instance_id, bucket_index, bucket_count), called on the stream's thread after each bucket.
ProgressCallback = Callable[[str, int, int], None]


class EpochHandle:
    """One UpdateWeights stream per worker, consumed on background threads."""

    def __init__(self, fleet: Fleet, version: int, request: pb.UpdateWeightsRequest,
                 timeout_s: float, on_progress: ProgressCallback | None = None):
        self.version = version
        self._fleet = fleet
        self._t0 = time.monotonic()
        self._deadline_at = self._t0 + timeout_s
        n = len(fleet._workers)
        self._accepted = [False] * n
        self._committed: list[pb.UpdateWeightsResponse | None] = [None] * n
        self._failures: list[WorkerFailure | None] = [None] * n
        self._accepted_before_failure: list[bool] = [False] * n
        self._done = [threading.Event() for _ in range(n)]
        self._changed = threading.Condition()
        self._calls = [None] * n
        self._aborted = False
        self._unresponsive: set[int] = set()
        self._on_progress = on_progress
        # Buckets each worker reported applied (PROGRESS) so far in this epoch.
        self.buckets_applied = [0] * n
        # Set by the first worker failure: the sender watches it, so a lost peer stops the
        # broadcast in seconds rather than at the epoch deadline.
        self.failed = threading.Event()
        for i, w in enumerate(fleet._workers):
            call = w.stub.UpdateWeights(request, timeout=timeout_s, metadata=w.metadata)
            self._calls[i] = call
            threading.Thread(target=self._consume, args=(i, w, call), daemon=True,
                             name=f"epoch-v{version}-{i}").start()

    def _consume(self, i: int, w: _Worker, call) -> None:
        try:
            for msg in call:
                with self._changed:
                    if msg.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED:
                        self._accepted[i] = True
                    elif msg.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS:
                        self.buckets_applied[i] = msg.bucket_index + 1
                    elif msg.phase == pb.UPDATE_WEIGHTS_PHASE_COMMITTED:
                        self._committed[i] = msg
                    self._changed.notify_all()
                if self._on_progress and msg.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS:
                    self._on_progress(w.endpoint.instance_id, msg.bucket_index, msg.bucket_count)
            if self._committed[i] is None:
                raise RuntimeError("stream ended without COMMITTED")
        except grpc.RpcError as e:
            with self._changed:
                self._failures[i] = failure_from_rpc(w.endpoint, e)
                self._accepted_before_failure[i] = self._accepted[i]
        except Exception as e:  # noqa: BLE001  (reported as a failure of this worker)
            with self._changed:
                self._failures[i] = WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                                  grpc.StatusCode.UNKNOWN, "DRIVER_ERROR", str(e))
        finally:
            with self._changed:
                if self._failures[i] is not None:
                    self.failed.set()
                self._done[i].set()
                self._changed.notify_all()

    def wait_accepted(self, timeout_s: float | None = None) -> None:
        """Block until every worker said ACCEPTED. Raises EpochRefusedError (after aborting the
        fleet) if any refused, FleetTimeoutError if any stays silent past the timeout."""
        end = min(self._deadline_at, time.monotonic() + (timeout_s or float("inf")))
        with self._changed:
            while True:
                refused = [f for f in self._failures if f is not None]
                if refused:
                    break
                if all(self._accepted):
                    return
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
        refused = [f for f in self._failures if f is not None]
        silent = [self._fleet._workers[i].endpoint for i, a in enumerate(self._accepted)
                  if not a and self._failures[i] is None]
        self.abort(f"epoch {self.version} refused")
        self._settle(2.0)
        refused = [f for f in self._failures_so_far()
                   if f.instance_id in {r.instance_id for r in refused}]
        if refused:
            raise EpochRefusedError(f"epoch {self.version} refused before any byte moved",
                                    refused, reason=refused[0].reason)
        raise FleetTimeoutError(
            f"epoch {self.version}: no ACCEPTED within the deadline",
            [WorkerFailure(e.instance_id, e.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                           "ACCEPT_TIMEOUT", "no ACCEPTED") for e in silent])

    def result(self, timeout_s: float | None = None) -> list[pb.UpdateWeightsResponse]:
        """Block until every worker COMMITTED; raise EpochFailedError naming each failure.

        The first failure aborts the fleet at once: survivors blocked in a collective with a dead
        peer would otherwise wait out their whole deadline.
        """
        end = min(self._deadline_at + 2.0, time.monotonic() + (timeout_s or float("inf")))
        with self._changed:
            while not all(ev.is_set() for ev in self._done):
                if any(f is not None for f in self._failures):
                    break
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
        if all(ev.is_set() for ev in self._done) and not any(self._failures):
            return list(self._committed)  # type: ignore[arg-type]
        self.abort(f"epoch {self.version} failed")
        self._settle(5.0)
        self.cancel()
        failures = self._failures_so_far()
        failed_ids = {f.instance_id for f in failures}
        unfinished = [self._fleet._workers[i].endpoint for i, ev in enumerate(self._done)
                      if not ev.is_set() and self._fleet._workers[i].endpoint.instance_id
                      not in failed_ids]
        failures += [WorkerFailure(e.instance_id, e.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "COMMIT_TIMEOUT", "no COMMITTED within the deadline")
                     for e in unfinished]
        cls = FleetTimeoutError if unfinished and len(failures) == len(unfinished) \
            else EpochFailedError
        raise cls(f"epoch {self.version} failed", _root_causes_first(failures))

    def abort(self, reason: str) -> None:
        """Abort the fleet once for this epoch (every later call is a no-op)."""
        if not self._aborted:
            self._aborted = True
            answers = self._fleet.abort(reason)
            # A shim that cannot even answer Abort (frozen, partitioned, dead) is the likeliest
            # cause when every stream merely timed out: it is named first.
            self._unresponsive = {i for i, a in enumerate(answers) if a is None}

    def _failures_so_far(self) -> list[WorkerFailure]:
        out = []
        for i, f in enumerate(self._failures):
            if f is None:
                continue
            if i in self._unresponsive:
                f = WorkerFailure(f.instance_id, f.address, grpc.StatusCode.UNAVAILABLE,
                                  "UNRESPONSIVE", f"did not answer Abort; stream: {f.reason}: "
                                  f"{f.message}")
            out.append(f)
        return out

    def cancel(self) -> None:
        for call in self._calls:
            if call is not None:
                call.cancel()

    def _settle(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        for ev in self._done:
            ev.wait(max(end - time.monotonic(), 0))


def _root_causes_first(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """Order failures so the cause leads: a worker that vanished or failed on its own, then
    workers whose collective broke because a peer went away, then those our Abort cancelled."""

    def rank(f: WorkerFailure) -> int:
        if f.code == grpc.StatusCode.UNAVAILABLE:
            return 0
        if f.code != grpc.StatusCode.ABORTED:
            return 1 if f.reason != "COMMIT_TIMEOUT" else 4
        return 2 if f.reason == "COLLECTIVE_FAILED" else 3

    return sorted(failures, key=rank)


@dataclass
class TrainerLink:
    """The trainer rank 0 side of a joined group: what `refit()` broadcasts through."""

    group: Group
    plan: RefitPlan
    sender: Sender = field(init=False)

    def __post_init__(self) -> None:
        self.sender = Sender(self.group, self.plan)

    def close(self) -> None:
        self.group.close()


class Fleet:
    def __init__(self, workers: Sequence[WorkerEndpoint | Mapping[str, Any]], *,
                 engine_world_size: int = 1,
                 control_timeout_s: float = 30.0,
                 join_timeout_s: float = 120.0,
                 epoch_timeout_s: float = 600.0,
                 validate_workers: Callable[[list[dict]], list[dict]] | None = None,
                 packing: Packing | None = None,
                 backend: str = "gloo",
                 retry_attempts: int = 8,
                 abort_timeout_s: float = 1.0,
                 security: ChannelSecurity | None = None):
        if not workers:
            raise ValueError("a fleet needs at least one worker")
        self.endpoints = tuple(w if isinstance(w, WorkerEndpoint)
                               else WorkerEndpoint.from_metadata(w) for w in workers)
        if len({e.instance_id for e in self.endpoints}) != len(self.endpoints):
            raise ValueError("worker instance ids must be unique")
        if engine_world_size < 1:
            raise ValueError("engine_world_size must be >= 1")
        self.engine_world_size = engine_world_size
        self.control_timeout_s = control_timeout_s
        self.join_timeout_s = join_timeout_s
        self.epoch_timeout_s = epoch_timeout_s
        self.validate_workers = validate_workers
        self.backend = backend
        self.retry_attempts = retry_attempts
        self.abort_timeout_s = abort_timeout_s
        self.security = security or ChannelSecurity()
        self._packing = packing
        self._workers = [_Worker(e, self.security) for e in self.endpoints]
        self._pool = ThreadPoolExecutor(max_workers=min(64, 2 * len(self._workers) + 4),
                                        thread_name_prefix="fleet")
        self._plan: RefitPlan | None = None
        self._group_id: str | None = None
        self._joined_instances: tuple[str, ...] | None = None
        self._version = 0

    # --- the seed's surface ----------------------------------------------------------------

    def client_copy(self) -> Fleet:
        """Endpoints and timeouts only (no validator, no state): safe to ship to rollout actors."""
        return Fleet(self.endpoints, engine_world_size=self.engine_world_size,
                     control_timeout_s=self.control_timeout_s, join_timeout_s=self.join_timeout_s,
                     epoch_timeout_s=self.epoch_timeout_s, packing=self._packing,
                     backend=self.backend, retry_attempts=self.retry_attempts,
                     abort_timeout_s=self.abort_timeout_s, security=self.security)

    def __getstate__(self) -> dict:
        return {"endpoints": self.endpoints, "engine_world_size": self.engine_world_size,
                "control_timeout_s": self.control_timeout_s, "join_timeout_s": self.join_timeout_s,
                "epoch_timeout_s": self.epoch_timeout_s, "packing": self._packing,
                "backend": self.backend, "retry_attempts": self.retry_attempts,
                "abort_timeout_s": self.abort_timeout_s, "security": self.security}

    def __setstate__(self, state: dict) -> None:
        endpoints = state.pop("endpoints")
        packing = state.pop("packing")
        self.__init__(endpoints, packing=packing, **state)

    @property
    def inference_world_size(self) -> int:
        return len(self.endpoints) * self.engine_world_size

    @property
    def sender_spec(self) -> Packing:
        """The packing contract, negotiated: the configured one, or what every shim offers (they
        must agree; a silent mismatch would make receivers mis-split bytes)."""
        if self._packing is None:
            offers = {(d.packing.buffer_size_bytes, d.packing.num_buffers)
                      for d in self.describe(weights_digest=False)}
            if len(offers) != 1:
                raise FleetError(f"shims offer different packings {sorted(offers)}; "
                                 "pass packing= to Fleet", [])
            size, n = offers.pop()
            self._packing = Packing(size, n)
        return self._packing

    @property
    def plan(self) -> RefitPlan | None:
        return self._plan

    def prepare(self, state_dict_info: Mapping[str, tuple[Sequence[int], Any]]) -> RefitPlan:
        """Store the plan on every shim; `{name: (shape, dtype)}` in packing order."""
        if state_dict_info is None:
            raise ValueError("state_dict_info is None")
        plan = RefitPlan.from_state_dict_info(state_dict_info, self.sender_spec)
        request = pb.PrepareRequest(
            tensors=[pb.TensorSpec(name=s.name, shape=s.shape, dtype=DTYPE_TO_PROTO[s.dtype])
                     for s in plan.tensors],
            packing=pb.Packing(buffer_size_bytes=plan.packing.buffer_size_bytes,
                               num_buffers=plan.packing.num_buffers))
        answers = self._unary_all("Prepare", lambda w: request, "prepare failed")
        bad = [WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                             grpc.StatusCode.FAILED_PRECONDITION, "PLAN_DIGEST_MISMATCH",
                             f"shim computed {a.plan_digest[:16]}, driver {plan.digest[:16]}")
               for w, a in zip(self._workers, answers) if a.plan_digest != plan.digest]
        if bad:
            raise FleetError("shims disagree on the plan digest", bad, reason="PLAN_DIGEST_MISMATCH")
        self._plan = plan
        return plan

    def init_collective(self, ip: str, port: int, world_size: int, *,
                        train_world_size: int) -> list[Future]:
        """Ask every shim to join the group; returns one future per worker (JOINED), without
        waiting: the rendezvous completes only once the trainer ranks join too."""
        if self._plan is None:
            raise RuntimeError("prepare() must be called before init_collective()")
        if world_size != train_world_size + self.inference_world_size:
            raise ValueError(f"world_size {world_size} != train_world_size {train_world_size} + "
                             f"inference_world_size {self.inference_world_size}")
        self._check_membership(describe=False)
        self._joined_instances = tuple(
            d.instance_id for d in self.describe(weights_digest=False))
        group_id = f"refit-{uuid.uuid4().hex[:12]}"
        futures = []
        for i, w in enumerate(self._workers):
            request = pb.InitCollectiveRequest(
                master_address=ip, master_port=port, world_size=world_size,
                rank_offset=train_world_size + i * self.engine_world_size,
                backend=BACKEND_FROM_NAME[self.backend], group_id=group_id,
                plan_digest=self._plan.digest)
            futures.append(self._pool.submit(self._join_one, w, request))
        self._group_id = group_id
        return futures

    def _join_one(self, w: _Worker, request) -> pb.InitCollectiveResponse:
        last = None
        try:
            for msg in w.stub.InitCollective(request, timeout=self.join_timeout_s,
                                             metadata=w.metadata):
                last = msg
        except grpc.RpcError as e:
            f = failure_from_rpc(w.endpoint, e)
            raise FleetError("InitCollective failed", [f], reason=f.reason) from None
        if last is None or last.phase != pb.INIT_COLLECTIVE_PHASE_JOINED:
            raise FleetError("InitCollective ended without JOINED", [])
        return last

    def connect(self, ip: str, port: int, *, train_world_size: int = 1) -> TrainerLink:
        """Form the group: every shim joins and this process joins as trainer rank 0."""
        if train_world_size != 1:
            raise InvalidArgumentError("connect() joins as the only trainer rank; with several "
                                       "trainer ranks call init_collective() and join each rank")
        world = train_world_size + self.inference_world_size
        futures = self.init_collective(ip, port, world, train_world_size=train_world_size)
        try:
            group = Group.join(GroupSpec(ip, port, world, 0, self.backend, self._group_id),
                               self.join_timeout_s)
        except RefitError as e:
            self.abort("trainer failed to join")
            failures = self._collect(futures, 5.0)
            raise FleetError(f"trainer rank 0 could not join: {e}", failures,
                             reason=e.reason) from e
        failures = self._collect(futures, self.join_timeout_s)
        if failures:
            group.close()
            self.abort("join failed")
            raise FleetError("InitCollective failed", failures, reason=failures[0].reason)
        return TrainerLink(group, self._plan)

    def update_weights(self, version: int | None = None,
                       pause_mode: PauseMode = PauseMode.KEEP,
                       on_progress: ProgressCallback | None = None) -> EpochHandle:
        """Open an epoch on every shim; returns the handle the trainer waits on while it
        broadcasts. Version defaults to the last one + 1."""
        if self._plan is None:
            raise RuntimeError("prepare() must be called before update_weights()")
        if self._group_id is None:
            raise RuntimeError("init_collective() must be called before update_weights()")
        self._check_membership(describe=True)
        version = self._version + 1 if version is None else version
        request = pb.UpdateWeightsRequest(version=version, plan_digest=self._plan.digest,
                                          group_id=self._group_id,
                                          pause_mode=PAUSE_MODE_TO_PROTO[pause_mode])
        return EpochHandle(self, version, request, self.epoch_timeout_s, on_progress)

    def refit(self, link: TrainerLink, tensors: Mapping[str, torch.Tensor],
              version: int | None = None, *, flush: bool = True,
              pause_mode: PauseMode = PauseMode.KEEP,
              on_progress: ProgressCallback | None = None) -> EpochReport:
        """One whole epoch: UpdateWeights everywhere, wait for every ACCEPTED, broadcast, wait for
        every COMMITTED, then (by default) flush so engines serve the new weights."""
        link.sender.check_tensors(tensors)  # refuse bad input before any shim pauses
        t0 = time.monotonic()
        handle = self.update_weights(version, pause_mode, on_progress)
        try:
            handle.wait_accepted()
        except FleetError:
            link.close()  # the shims tore their ends down; this group is finished
            self._group_id = None
            raise
        deadline = Deadline(max(handle._deadline_at - time.monotonic(), 0.001),
                            cancel=handle.failed)
        try:
            stats = link.sender.send(tensors, deadline)
        except RefitError as e:
            link.close()
            self._group_id = None
            handle.abort(f"epoch {handle.version}: broadcast failed")
            try:
                handle.result(timeout_s=5.0)
            except FleetError as fe:
                raise EpochFailedError(f"broadcast failed ({e})", fe.failures,
                                       reason=e.reason) from e
            raise EpochFailedError(f"broadcast failed ({e})", [], reason=e.reason) from e
        try:
            committed = handle.result()
        except FleetError:
            link.close()
            self._group_id = None
            raise
        seconds = time.monotonic() - t0
        self._version = handle.version
        if flush:
            self.flush_cache()
        return EpochReport(
            version=handle.version, bytes=self._plan.total_bytes, seconds=seconds,
            broadcast_seconds=stats.seconds,
            workers=tuple(WorkerReport(w.endpoint.instance_id, m.seconds, m.bytes_received,
                                       m.weights_digest)
                          for w, m in zip(self._workers, committed)))

    def flush_cache(self, mode: PauseMode = PauseMode.WAIT) -> bool:
        """Drain, clear the KV/prefix cache and resume, on every shim in parallel. A shim that is
        BROKEN refuses to resume; every failure is raised together."""
        request = pb.FlushRequest(mode=PAUSE_MODE_TO_PROTO[mode])
        self._unary_all("Flush", lambda w: request, "flush failed")
        return True

    def describe(self, weights_digest: bool = True) -> list[pb.DescribeResponse]:
        request = pb.DescribeRequest(skip_weights_digest=not weights_digest)
        return self._unary_all("Describe", lambda w: request, "describe failed")

    def abort(self, reason: str = "aborted by driver") -> list[pb.AbortResponse | None]:
        """Abort on every shim in parallel; best effort, never raises, never retries, and bounded
        by `abort_timeout_s`: a dead or frozen shim must not hold up the others' abort."""
        request = pb.AbortRequest(reason=reason)
        futures = [self._pool.submit(w.stub.Abort, request, timeout=self.abort_timeout_s,
                                     metadata=w.metadata) for w in self._workers]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except grpc.RpcError:
                out.append(None)
        return out

    def close(self) -> None:
        for w in self._workers:
            w.channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------------

    def _call(self, w: _Worker, method: str, request):
        """One unary call with a deadline, retried on UNAVAILABLE (exponential backoff, jitter)."""
        retry = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_unavailable),
            # Long enough to outlast the channel's reconnect backoff (max 1 s): a shim that just
            # restarted must be reached, not declared gone after a burst of instant failures.
            wait=tenacity.wait_random_exponential(multiplier=0.1, max=2.0),
            stop=(tenacity.stop_after_attempt(self.retry_attempts)
                  | tenacity.stop_after_delay(self.control_timeout_s)),
            reraise=True)
        return retry(lambda: getattr(w.stub, method)(request, timeout=self.control_timeout_s,
                                                     metadata=w.metadata))

    def _unary_all(self, method: str, make_request, message: str) -> list:
        futures = [self._pool.submit(self._call, w, method, make_request(w))
                   for w in self._workers]
        results, failures = [], []
        for w, f in zip(self._workers, futures):
            try:
                results.append(f.result())
            except grpc.RpcError as e:
                failures.append(failure_from_rpc(w.endpoint, e))
        if failures:
            cls = FleetTimeoutError if all(
                f.code == grpc.StatusCode.DEADLINE_EXCEEDED for f in failures) else FleetError
            raise cls(f"{method}: {message}", failures, reason=failures[0].reason)
        return results

    def _collect(self, futures: list[Future], timeout_s: float) -> list[WorkerFailure]:
        failures = []
        end = time.monotonic() + timeout_s
        for w, f in zip(self._workers, futures):
            try:
                f.result(timeout=max(end - time.monotonic(), 0.001))
            except FleetError as e:
                failures += e.failures or [WorkerFailure(
                    w.endpoint.instance_id, w.endpoint.address, grpc.StatusCode.UNKNOWN,
                    e.reason, e.message)]
            except TimeoutError:
                failures.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                              grpc.StatusCode.DEADLINE_EXCEEDED, "JOIN_TIMEOUT",
                                              "no JOINED in time"))
        return failures

    def _check_membership(self, describe: bool) -> None:
        """Invariant 5: refuse a fleet whose membership changed since InitCollective."""
        if self.validate_workers is not None:
            original = [{"instance_id": e.instance_id, "address": e.address}
                        for e in self.endpoints]
            current = self.validate_workers([dict(m) for m in original])
            changed = [WorkerFailure(str(c.get("instance_id")), str(c.get("address")),
                                     grpc.StatusCode.FAILED_PRECONDITION, "MEMBERSHIP_CHANGED",
                                     "validate_workers reported a change")
                       for o, c in zip(original, current) if dict(o) != dict(c)]
            if len(current) != len(original) or changed:
                raise MembershipChangedError(
                    "membership changed after collective setup: "
                    + "; ".join(str(f) for f in changed or [current]))
        if describe and self._joined_instances is not None:
            now = tuple(d.instance_id for d in self.describe(weights_digest=False))
            moved = [f"{e.instance_id}@{e.address} (was shim {a}, now {b})"
                     for e, a, b in zip(self.endpoints, self._joined_instances, now) if a != b]
            if moved:
                raise MembershipChangedError(
                    "membership changed after collective setup (restarted since "
                    f"InitCollective): {'; '.join(moved)}")
