"""NeMo RL's `DynamoRefitChannel`, on a refit_grpc `Fleet`, with Ray `ObjectRef`s where NeMo
RL's channel returns them.

    # was: from nemo_rl.models.generation.dynamo.refit import DynamoRefitChannel
    from refit_grpc.integrations.ray import DynamoRefitChannel

The surface is NeMo RL's channel's: the constructor `(workers, *, engine_world_size, control_timeout_s,
validate_workers=None)` (plus optional refit_grpc settings), the `workers`, `engine_world_size`,
`control_timeout_s` and `validate_workers` attributes, `client_copy()`, `inference_world_size`,
`sender_spec`, `prepare()`, `init_collective() -> list[ObjectRef]`,
`update_weights() -> list[ObjectRef]` and `flush_cache() -> bool`. Worker metadata must name
each engine's shim (`address`, the gRPC target); NeMo RL's `system_url` is not used.

The data group's name is derived, not minted: `group_name(ip, port, world_size,
train_world_size=..., plan_digest=...)`, from what the trainer ranks and the channel both hold
before either joins. So the trainer ranks may join before `init_collective()` (NeMo RL's order:
the policy workers' `init_collective` first, then the generation side's, then one `ray.get` over
both), at the same time, or after it. The name is unique per formation because the port is:
the trainer's store holds `ip:port` while its group forms, a trainer takes a fresh port for each
formation (NeMo RL does), and the channel refuses to form a group under a name while a join of
an earlier formation under it is still running (docs/ray.md, "The group's name").

How the refs are made (docs/ray.md): the Fleet runs in the caller's process, where the trainer
broadcasts. Each ref is the pending result of `wait(key)` on a small async actor (`_Outcomes`,
no CPU, one per channel, created on first use); the caller's process settles the key when the
worker's step is really done: JOINED for `init_collective`, COMMITTED for `update_weights`, or
the typed refit_grpc error (`EpochFailedError`, `FleetError`, ...) naming the failed worker,
which `ray.get` raises as a `RayTaskError` whose `cause` is that error. Nothing blocks to make a
ref; each wait has a deadline (the driver's own, plus a margin), and the actor shares the
caller's fate, so a dead trainer fails the refs (`RayActorError`) instead of hanging them.

Where the trainer's broadcast fits: `update_weights()` opens the driver's two-phase epoch and
returns once every worker said ACCEPTED (validated and paused, about to receive), raising
`EpochRefusedError` right there, before any byte moves, if one refused. So the order that keeps
refit_grpc's guarantee is: `refs = channel.update_weights()`, then broadcast, then
`ray.get(refs)`. A broadcast already started (NeMo RL starts its trainer ranks' broadcast first)
does not deadlock it, since ACCEPTED does not depend on the sender; see docs/ray.md for what a
refusal then costs.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import pickle
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import ray

from refit_grpc.common import Deadline, EpochMode, PauseMode
from refit_grpc.driver import ChannelSecurity, EpochFailedError, EpochHandle, Fleet, WorkerEndpoint
from refit_grpc.driver.epoch import StreamPhase
from refit_grpc.driver.options import InPlace, Staged
from refit_grpc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    RefitDeprecationWarning,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

__all__ = ["DynamoRefitChannel", "RefitChannel", "WorkerEndpoint", "group_name"]

log = logging.getLogger(__name__)

# How long a ref waits past the driver's own deadline for its outcome: the driver's epoch ends
# at its deadline, then aborts the fleet and lets the streams settle (a few seconds).
_OUTCOME_MARGIN_S = 30.0
# How often an epoch's watcher looks for workers that committed.
_WATCH_POLL_S = 0.01


# Ray's typed overloads of remote() know task options only, not an actor's max_concurrency.
@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4096)  # type: ignore[call-overload]
class _Outcomes:
    """One pending outcome per key. `wait(key)` is the task behind one ObjectRef: it returns the
    value, or raises the error, that the channel's process `settle`s under the key; the two may
    come in either order. All methods run on the actor's one event loop (no locks)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._outcomes: dict[str, tuple[bool, Any]] = {}
        self._expired: set[str] = set()

    def _event(self, key: str) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    async def wait(self, key: str, what: str, timeout_s: float) -> Any:
        try:
            await asyncio.wait_for(self._event(key).wait(), timeout_s)
        except TimeoutError:
            self._events.pop(key, None)
            self._expired.add(key)
            raise RefitTimeoutError(f"{what}: no outcome within {timeout_s:.0f}s (the channel's "
                                    "process stopped reporting)") from None
        self._events.pop(key, None)
        ok, value = self._outcomes.pop(key)
        if not ok:
            raise value
        return value

    async def settle(self, key: str, ok: bool, value: Any) -> None:
        if key in self._expired:
            self._expired.discard(key)
            return
        self._outcomes[key] = (ok, value)
        self._event(key).set()


def _epoch_of(epoch: InPlace | Staged | None, mode: EpochMode | str | None,
              min_engines: int | None) -> InPlace | Staged:
    """The channel's epoch: `epoch`, or (deprecated) what `mode` and `min_engines` say."""
    if mode is None and min_engines is None:
        return epoch if epoch is not None else InPlace()
    if epoch is not None:
        raise InvalidArgumentError("pass epoch= or the deprecated mode=/min_engines=, not both",
                                   reason=Reason.INVALID_ARGUMENT)
    warnings.warn("RefitChannel(mode=..., min_engines=...) is deprecated: pass "
                  "epoch=InPlace() or epoch=Staged(min_engines=...)", RefitDeprecationWarning,
                  stacklevel=3)
    try:
        staged = EpochMode(mode or EpochMode.IN_PLACE) is EpochMode.STAGED
    except ValueError:
        raise InvalidArgumentError(f"mode must be one of {[m.value for m in EpochMode]}, got "
                                   f"{mode!r}", reason=Reason.INVALID_EPOCH_MODE) from None
    if staged:
        return Staged(min_engines=min_engines)
    if min_engines is not None:
        raise InvalidArgumentError("min_engines is for staged epochs",
                                   reason=Reason.INVALID_MIN_ENGINES)
    return InPlace()


def group_name(ip: str, port: int, world_size: int, *, train_world_size: int,
               plan_digest: str) -> str:
    """The name of the data group formed at `ip:port` (the prefix every rank's rendezvous keys
    live under in the trainer's store): a pure function of what a trainer rank and the channel
    both hold before either joins. A trainer rank joins with it
    (`dataplane.group.Group.join(GroupSpec(ip, port, world_size, rank, "gloo", name), timeout)`)
    before, during or after `RefitChannel.init_collective(ip, port, world_size, ...)`, which
    sends the shims the same name.

    `plan_digest` is the plan's (`RefitPlan.from_state_dict_info(info, packing).digest`, or
    `channel.plan.digest`): a trainer rank holding another plan lands under another name and
    never meets the shims, so no byte is ever split by the wrong plan. Unique per formation as
    long as the port is (docs/ray.md, "The group's name").

    Args:
        ip: the trainer's rank 0 address.
        port: its store's port.
        world_size: every rank of the group, trainer and engines.
        train_world_size: the trainer's ranks.
        plan_digest: the plan's digest.

    Returns:
        The group's name, "refit-" and 24 hex digits.

    Raises:
        ValueError: no ip or no plan digest.
    """
    if not ip or not plan_digest:
        raise ValueError("group_name needs the master's ip and the plan digest")
    fields = ("refit_grpc/group/v1", ip, str(int(port)), str(int(world_size)),
              str(int(train_world_size)), plan_digest)
    return "refit-" + hashlib.sha256("\0".join(fields).encode()).hexdigest()[:24]


def _portable(exc: BaseException) -> BaseException:
    """The error itself when it survives pickling (every refit_grpc error does), else a RefitError
    that carries its text: a ref must fail with something the reader can unpickle."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001  (anything unpicklable is replaced)
        return RefitError(f"{type(exc).__name__}: {exc}")


def _rebuild(cls: type[RefitChannel], workers: tuple[WorkerEndpoint, ...],
             options: dict[str, Any]) -> RefitChannel:
    return cls(workers, **options)


class RefitChannel:
    """NeMo RL's `DynamoRefitChannel` surface on a refit_grpc `Fleet` (module docstring).

    Args:
        workers: the shims, as worker metadata (`instance_id`, `address`) or `WorkerEndpoint`s.
        engine_world_size: TP x PP ranks of one engine.
        control_timeout_s: the deadline of every unary call, and of the wait for ACCEPTED.
        validate_workers: NeMo RL's membership hook (`Fleet`'s).
        join_timeout_s: the deadline of a group formation.
        epoch_timeout_s: the deadline of one UpdateWeights epoch, broadcast included.
        packing: the packing; by default the one the shims offer.
        backend: "gloo" or "nccl".
        pause_mode: how engines pause their requests during an epoch (staged: the flip).
        security: TLS and token (`ChannelSecurity`); plaintext by default.
        epoch: `InPlace()` (NeMo RL's; its `flush` is `flush_cache()`'s) or
            `Staged(min_engines=...)`: the engines serve on while the bytes land;
            `update_weights()`'s refs resolve at STAGED and `flush_cache()` flips them once
            `min_engines` (by default every one) staged (docs/ray.md).
        mode, min_engines: deprecated (a DeprecationWarning): `epoch=Staged(min_engines=...)`.

    Raises:
        InvalidArgumentError: no worker, duplicate instance ids, or a bad setting.
    """

    def __init__(self, workers: Sequence[Mapping[str, Any] | WorkerEndpoint], *,
                 engine_world_size: int,
                 control_timeout_s: float,
                 validate_workers: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
                 | None = None,
                 join_timeout_s: float = 120.0,
                 epoch_timeout_s: float = 600.0,
                 packing: Packing | None = None,
                 backend: str = "gloo",
                 pause_mode: PauseMode = PauseMode.KEEP,
                 security: ChannelSecurity | None = None,
                 epoch: InPlace | Staged | None = None,
                 mode: EpochMode | str | None = None,
                 min_engines: int | None = None):
        self._fleet = Fleet(workers, engine_world_size=engine_world_size,
                            control_timeout_s=control_timeout_s, join_timeout_s=join_timeout_s,
                            epoch_timeout_s=epoch_timeout_s, validate_workers=validate_workers,
                            packing=packing, backend=backend, security=security)
        self.workers: tuple[WorkerEndpoint, ...] = self._fleet.endpoints
        self.engine_world_size = engine_world_size
        self.control_timeout_s = control_timeout_s
        self.validate_workers = validate_workers
        self.pause_mode = pause_mode
        self.epoch = _epoch_of(epoch, mode, min_engines)
        self._options: dict[str, Any] = {
            "engine_world_size": engine_world_size, "control_timeout_s": control_timeout_s,
            "join_timeout_s": join_timeout_s, "epoch_timeout_s": epoch_timeout_s,
            "packing": packing, "backend": backend, "pause_mode": pause_mode,
            "security": security, "epoch": self.epoch}
        self._session = uuid.uuid4().hex[:12]
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._outcomes: Any = None  # the _Outcomes actor, created on first use
        self._watchers: list[threading.Thread] = []
        self._epoch: EpochHandle | None = None
        self._flipped = False  # the open staged epoch's flip ran (flush_cache)
        self._version: int | None = None  # the last version an epoch was opened with
        # The shims' joins of each group name formed, kept while any of them runs: a name is
        # not formed again before its last formation's joins have all ended.
        self._formations: dict[str, list[Future]] = {}
        self._formations_lock = threading.Lock()

    # --- NeMo RL's channel's surface ------------------------------------------------------

    def client_copy(self) -> RefitChannel:
        """What rollout actors get: endpoints and settings only (no validator, no plan, no group).

        Returns:
            A picklable channel whose own Fleet opens channels to the same shims.
        """
        options = dict(self._options, packing=self._known_packing())
        return type(self)(self.workers, validate_workers=None, **options)

    def __reduce__(self):
        options = dict(self._options, packing=self._known_packing(),
                       validate_workers=self.validate_workers)
        return _rebuild, (type(self), self.workers, options)

    @property
    def inference_world_size(self) -> int:
        """The engines' ranks in the group: workers x `engine_world_size`."""
        return self._fleet.inference_world_size

    @property
    def sender_spec(self) -> Packing:
        """The packing every receiver splits buckets by. NeMo RL's channel returns fixed constants
        here; refit_grpc agrees on them with the shims instead.

        Returns:
            The configured packing, or the one every shim offers (one Describe round, bounded by
            `control_timeout_s`, then remembered).

        Raises:
            FleetError: the shims offer different packings, or a Describe failed.
        """
        return self._fleet.negotiate_packing()

    def prepare(self, state_dict_info: Mapping[str, tuple[Sequence[int], Any]] | None) -> None:
        """Store the plan on every shim.

        Args:
            state_dict_info: `{name: (shape, dtype)}` in packing order.

        Raises:
            ValueError: no plan (None) or a malformed one.
            FleetError: a shim refused or failed, or computed another plan digest.
        """
        if state_dict_info is None:
            raise ValueError("state_dict_info is None")
        self._fleet.prepare(state_dict_info)
        self._actor()  # started now, so its start-up is not on the first refs' path

    def init_collective(self, ip: str, port: int, world_size: int, *,
                        train_world_size: int,
                        group_id: str | None = None) -> list[ray.ObjectRef]:
        """Ask every shim to join the data group. Not waited on: the rendezvous completes only
        when the trainer ranks join too (gloo: `dataplane.group.Group.join` under
        `group_name(ip, port, world_size, train_world_size=..., plan_digest=...)`, before,
        during or after this call).

        Args:
            ip: the trainer's rank 0 address.
            port: where its store listens, or will.
            world_size: `train_world_size + inference_world_size`.
            train_world_size: the trainer's ranks.
            group_id: overrides the derived name (the trainer then hands the same one to its
                ranks and keeps it unique per formation).

        Returns:
            One ref per worker, resolving to True once the worker JOINED (raising the typed
            error otherwise).

        Raises:
            RuntimeError: `prepare()` was not called.
            FailedPreconditionError: reason BUSY, before any call to a shim, while a join of an
                earlier formation under the same name still runs (one of its members could
                otherwise join this one): wait for that formation's refs, or form at another
                port.
            InvalidArgumentError: a port out of range or a world size that does not add up.
        """
        if self._fleet.plan is None:
            raise RuntimeError("prepare() must be called before init_collective()")
        name = group_id if group_id is not None else group_name(
            ip, port, world_size, train_world_size=train_world_size,
            plan_digest=self._fleet.plan.digest)
        with self._formations_lock:
            running = sum(not f.done() for f in self._formations.get(name, ()))
            if running:
                raise FailedPreconditionError(
                    f"group {name} at {ip}:{port}: {running} join(s) of its previous formation "
                    "still running, and a member of that formation could join this one; wait "
                    "for its refs, or form at another port", reason=Reason.BUSY)
            futures = self._fleet.init_collective(ip, port, world_size,
                                                  train_world_size=train_world_size,
                                                  group_id=name)
            self._formations = {n: fs for n, fs in self._formations.items()
                                if not all(f.done() for f in fs)}
            self._formations[name] = futures
        timeout_s = self._fleet.config.join_timeout_s + _OUTCOME_MARGIN_S
        actor = self._actor()
        refs = []
        for worker, future in zip(self.workers, futures):
            key = self._key()
            refs.append(actor.wait.remote(key, f"init_collective on {worker.instance_id}",
                                          timeout_s))
            future.add_done_callback(functools.partial(_settle_future, actor, key))
        return refs

    def update_weights(self, version: int | None = None) -> list[ray.ObjectRef]:
        """Open the driver's two-phase epoch and return once every worker said ACCEPTED.

        Broadcast after this returns, then `ray.get` the refs. After any failed epoch, form the
        group again (`init_collective`).

        Args:
            version: the epoch's version; by default one past the last epoch's (the first
                time: past the newest version any shim holds).

        Returns:
            One ref per worker, resolving to True when that worker COMMITTED, or raising the
            epoch's typed error (`EpochFailedError`, `FleetTimeoutError`) naming the failed
            workers.

        Raises:
            EpochRefusedError: a worker refused, after the fleet was aborted and before any
                byte moved.
            FleetTimeoutError: a worker said nothing within `control_timeout_s`.
            FleetStateError: no group formed.
        """
        if version is None:
            version = self._next_version()
        handle = self._fleet.update_weights(version, self.pause_mode, epoch=self.epoch)
        self._version = max(self._version or 0, version)
        self._epoch, self._flipped = handle, False
        handle.wait_accepted(self.control_timeout_s)
        timeout_s = max(handle.remaining(), 0.0) + _OUTCOME_MARGIN_S
        actor = self._actor()
        keys = [self._key() for _ in self.workers]
        refs = [actor.wait.remote(key, f"update_weights v{version} on {w.instance_id}",
                                  timeout_s)
                for key, w in zip(keys, self.workers)]
        watcher = threading.Thread(target=_watch_epoch, args=(actor, handle, keys), daemon=True,
                                   name=f"ray-refit-v{version}")
        with self._lock:
            self._watchers = [t for t in self._watchers if t.is_alive()] + [watcher]
        watcher.start()
        return refs

    def flush_cache(self, staged_digest: str | None = None) -> bool:
        """Drain, clear caches and resume every worker, in parallel (mode WAIT).

        Staged (`epoch=Staged(...)`): flips the open staged epoch instead, every engine that staged
        (the digest most staged) when at least `min_engines` did (`Fleet.flip`); the engines
        that did not are left behind (`fleet.left_behind`).

        Args:
            staged_digest: the trainer's staged digest of what it sent
                (`Sender.send(checksums=...)`),
                which the engines' must equal; None: the digest most engines staged.

        Returns:
            True, once every worker resumed.

        Raises:
            FleetError: naming every worker that failed (a BROKEN one refuses to resume);
                staged: `QuorumError` when too few staged (nothing flipped).
        """
        if self._epoch is not None and self._epoch.staged and not self._flipped:
            self._flipped = True
            self._fleet.flip(self._epoch, staged_digest)
            return True
        return self._fleet.flush_cache()

    # --- refit_grpc's additions --------------------------------------------------------------

    @property
    def mode(self) -> EpochMode:
        """The epochs' mode (`epoch.mode`)."""
        return self.epoch.mode

    @property
    def min_engines(self) -> int | None:
        """Staged: how many engines must stage for `flush_cache()` to flip (None: every one)."""
        return self.epoch.min_engines if isinstance(self.epoch, Staged) else None

    @property
    def fleet(self) -> Fleet:
        """The Fleet underneath: `describe()`, `abort()`, `connect()`, `refit()`."""
        return self._fleet

    @property
    def plan(self) -> RefitPlan | None:
        """The plan of the last `prepare()`, or None before it."""
        return self._fleet.plan

    @property
    def group_id(self) -> str | None:
        """The data group of the last `init_collective` (None before it, or after a failed
        epoch): the name trainer ranks join under, the same as `group_name()` gave them."""
        return self._fleet.group_id

    def group_name(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> str:
        """The name `init_collective(ip, port, world_size, ...)` will form the group under, known
        before it is called.

        Args:
            ip: the trainer's rank 0 address.
            port: its store's port.
            world_size: every rank of the group.
            train_world_size: the trainer's ranks.

        Returns:
            The module function `group_name` with this channel's plan digest.

        Raises:
            RuntimeError: `prepare()` was not called.
        """
        if self._fleet.plan is None:
            raise RuntimeError("prepare() must be called before group_name()")
        return group_name(ip, port, world_size, train_world_size=train_world_size,
                          plan_digest=self._fleet.plan.digest)

    def send_deadline(self) -> Deadline:
        """The open epoch's deadline for the trainer's sender.

        Returns:
            The deadline, cancelled by the epoch's first worker failure (so a
            `dataplane.transfer.Sender` stops in seconds when a worker dies).

        Raises:
            RuntimeError: `update_weights()` has not been called.
        """
        if self._epoch is None:
            raise RuntimeError("update_weights() has not been called")
        return self._epoch.send_deadline()

    def describe(self, weights_digest: bool = True) -> list[pb.DescribeResponse]:
        """`Fleet.describe()`: one answer per worker, in order; raises FleetError."""
        return self._fleet.describe(weights_digest)

    def close(self) -> None:
        """Close the Fleet (open epochs end, their refs fail), then let the actor go."""
        self._fleet.close()
        with self._lock:
            watchers, self._watchers = self._watchers, []
        for t in watchers:
            t.join(10.0)
        self._outcomes = None  # Ray ends an actor once no handle to it is left

    def __enter__(self) -> RefitChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ----------------------------------------------------------------------------

    def _actor(self):
        with self._lock:
            if self._outcomes is None:
                # An ActorClass at runtime; mypy keeps a decorated class's own type.
                self._outcomes = _Outcomes.remote()  # type: ignore[attr-defined]
            return self._outcomes

    def _key(self) -> str:
        return f"{self._session}:{next(self._seq)}"

    def _known_packing(self) -> Packing | None:
        try:
            return self._fleet.sender_spec
        except RuntimeError:  # not negotiated yet: the copy negotiates its own
            return None

    def _next_version(self) -> int:
        if self._version is None:
            self._version = max(d.weight_version
                                for d in self._fleet.describe(weights_digest=False))
        return self._version + 1


def _settle(actor, key: str, ok: bool, value: Any) -> None:
    """Fire and forget: the ref's `wait` task is what anyone reads."""
    try:
        actor.settle.remote(key, ok, value if ok else _portable(value))
    except Exception:  # Ray already shut down: nobody is left to read the ref
        log.exception("could not settle %s", key)


def _settle_future(actor, key: str, future: Future) -> None:
    if future.cancelled():
        _settle(actor, key, False, RefitError("init_collective: cancelled (channel closed)"))
        return
    error = future.exception()
    _settle(actor, key, error is None, True if error is None else error)


def _watch_epoch(actor, handle: EpochHandle, keys: list[str]) -> None:
    """Settle each worker's ref as it COMMITS (staged: STAGES); when the epoch ends (every one
    done, or the first failure, which `result()` turns into a fleet abort and a typed error, and
    `settle()` into the failed workers' errors), settle the rest with that error."""
    outcome: dict[str, BaseException] = {}
    done = StreamPhase.STAGED if handle.staged else StreamPhase.COMMITTED

    def finish() -> None:
        try:
            if handle.staged:
                _, failures = handle.settle()
                if failures:
                    raise EpochFailedError(f"epoch {handle.version} failed to stage", failures)
            else:
                handle.result()
        except BaseException as e:  # noqa: BLE001  (every unsettled worker's ref carries it)
            outcome["error"] = e

    driver = threading.Thread(target=finish, daemon=True, name=f"epoch-v{handle.version}-result")
    driver.start()
    settled = [False] * len(keys)
    while True:
        running = driver.is_alive()  # read first: one more pass after it ends
        for i, phase in enumerate(handle.phases()):
            if phase is done and not settled[i]:
                _settle(actor, keys[i], True, True)
                settled[i] = True
        if not running:
            break
        driver.join(_WATCH_POLL_S)
    error = outcome.get("error") or RefitError(f"epoch {handle.version} ended without COMMITTED")
    for i, key in enumerate(keys):
        if not settled[i]:
            _settle(actor, key, False, error)


# NeMo RL's class name, so that switching NeMo RL to refit_grpc is one import.
DynamoRefitChannel = RefitChannel
