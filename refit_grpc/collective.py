"""The data plane: one process group per refit session, and bucketed broadcast with deadlines.

The group is a TCPStore at trainer rank 0 plus a backend group (gloo on CPU, NCCL on GPU) built
directly, never through `torch.distributed.init_process_group`: a trainer already has its own
default group, and an engine worker must not get one it does not own.

Every wait here is bounded by a deadline and can be cancelled from another thread. Gloo cannot
abort a pending operation (`ProcessGroupGloo.abort()` is a no-op), but dropping the group closes its
TCP pairs, which fails every pending operation on the peers at once: `Group.close()` is therefore
the abort, on either side.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import functools
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from refit_grpc.common import CANCEL_POLL_S, Deadline, GroupSpec
from refit_grpc.errors import (
    CollectiveError,
    EpochAbortedError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Bucket, RefitPlan, TensorSpec
from refit_grpc.reasons import Reason
from refit_grpc.staging import StagedDigest

log = logging.getLogger(__name__)

T = TypeVar("T")

# A rank's store client's first connect attempt to a master whose listener it just reached;
# each later attempt within the join's deadline gets twice as long (`_connect_store`).
_STORE_CONNECT_S = 3.0
# How often rank 0 looks at the arrivals while it waits for every rank (`_await_arrivals`), and
# how often every other rank looks for rank 0's word (`_arrive_and_await_go`): one store call
# each; at 1,000 ranks about 10k small requests a second to rank 0's store while it forms.
_ARRIVAL_POLL_S = 0.02
_GO_POLL_S = 0.1

class RendezvousTimeoutError(RefitTimeoutError):
    """A rendezvous that did not complete in time (RENDEZVOUS_TIMEOUT). On rank 0,
    `missing_ranks` lists the ranks that never reached its store, so a driver can name the
    workers behind them; empty where this process could not tell."""

    def __init__(self, message: str, *, missing_ranks: Sequence[int] = ()):
        super().__init__(message, reason=Reason.RENDEZVOUS_TIMEOUT)
        self.missing_ranks = tuple(missing_ranks)


class PendingReceive(Protocol):
    def wait(self, deadline: Deadline, what: str) -> None: ...


class ReceivingGroup(Protocol):
    """What an engine's receive uses of its data group: a `collective.Group`, or a
    `shared_rank.SharedRankMember` of a rank shared with other engines of the process."""

    spec: GroupSpec
    device: torch.device

    @property
    def closed(self) -> bool: ...

    def receive_buffers(self, plan: RefitPlan) -> list[torch.Tensor]: ...

    def broadcast_async(self, tensor: torch.Tensor, deadline: Deadline) -> PendingReceive: ...

    def close(self) -> None: ...


class Group:
    """A joined data group. Only rank 0 ever sends."""

    def __init__(self, spec: GroupSpec, store: dist.Store, pg: dist.ProcessGroup):
        self.spec = spec
        self._store: dist.Store | None = store
        self._pg: dist.ProcessGroup | None = pg
        # Held while a collective is enqueued and while close() takes the group away. Gloo's
        # destructor waits for every pending op; without the lock a thread mid-enqueue could end
        # up holding the last reference and block in that destructor until the op times out.
        self._pg_lock = threading.Lock()
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if spec.backend == "nccl" else torch.device("cpu")
        self._receive_buffers: list[torch.Tensor] = []
        self._closed = threading.Event()  # set by close(): pending waits give up

    @classmethod
    def join(cls, spec: GroupSpec, timeout_s: float, *,
             store: dist.TCPStore | None = None,
             cancel: threading.Event | None = None) -> Group:
        """Rendezvous; blocks until every rank has joined or `timeout_s` passes. `cancel` (an
        Abort, a caller gone, a peer's join that failed) ends the wait for the master's
        listener, a store connect and rank 0's wait for the other ranks at once.

        Every rank but 0 connects to rank 0's store (retrying within the deadline: a store
        client's connect can stall for seconds under load, which is no failure while the
        deadline lasts) and then says it arrived. Rank 0 waits for every arrival before it
        builds the backend group, so a rank that never comes is named
        (`RendezvousTimeoutError.missing_ranks`), and a `cancel` ends rank 0's wait within
        `_ARRIVAL_POLL_S` (the backend's own rendezvous cannot be interrupted).

        Rank 0 may pass the master `store` it already listens with (`bind_master_store`, on
        `spec.master_port`): the port is then bound before any peer is told of it."""
        if store is not None and spec.rank != 0:
            raise InvalidArgumentError("only rank 0 hosts the store", reason=Reason.INVALID_RANK)
        spec.validate()
        # Checked here, not in validate(): a shim may pass an nccl spec on to an engine whose
        # workers (elsewhere, with GPUs) do the joining.
        if spec.backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend nccl needs CUDA, which this process lacks",
                                       reason=Reason.BACKEND_UNAVAILABLE)
        end = time.monotonic() + max(timeout_s, 0.001)
        try:
            if spec.rank != 0:
                store = _connect_store(spec, end, timeout_s, cancel)
            elif store is None:
                store = bind_master_store(spec.master_address, spec.master_port,
                                          spec.world_size, timeout_s)
            store.set_timeout(_left(end))
            prefixed = dist.PrefixStore(f"refit_grpc/{spec.group_id}", store)
            if spec.rank != 0:
                _arrive_and_await_go(prefixed, spec, end, timeout_s, cancel)
            else:
                _await_arrivals(prefixed, spec, end, timeout_s, cancel)
            pg = _build_backend(prefixed, spec, _left(end), cancel)
        except RefitError:
            raise  # ours already (a timeout, an abort), with its reason
        except (RuntimeError, dist.DistStoreError) as e:
            text = str(e)
            if "timeout" in text.lower() or "timed out" in text.lower():
                raise RendezvousTimeoutError(f"rendezvous at {spec.master_address}:"
                                             f"{spec.master_port} timed out after "
                                             f"{timeout_s:.1f}s: {text[:300]}") from e
            raise CollectiveError(f"rendezvous at {spec.master_address}:{spec.master_port} "
                                  f"failed: {text[:300]}", reason=Reason.RENDEZVOUS_FAILED) from e
        log.info("joined group %s rank %d/%d (%s)", spec.group_id, spec.rank, spec.world_size,
                 spec.backend)
        # torch's stubs lack the broadcast() the gloo and NCCL backends have at runtime; Group
        # types its backend as a ProcessGroup, whose broadcast() has the same signature.
        return cls(spec, store, pg)  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        return self._pg is None

    def receive_buffers(self, plan: RefitPlan) -> list[torch.Tensor]:
        """`num_buffers` bucket buffers, each as large as the plan's largest bucket (the memory
        bound), allocated once per group and reused by every epoch on it. Every receive writes
        a whole bucket before anything reads it, so no byte of an earlier epoch is ever used."""
        nbytes = max(b.nbytes for b in plan.buckets)
        count = min(plan.packing.num_buffers, len(plan.buckets))
        have = self._receive_buffers
        if len(have) < count or (have and have[0].numel() < nbytes):
            have = self._receive_buffers = _buffers(nbytes, count, self.device)
        return [buf[:nbytes] for buf in have[:count]]

    def broadcast_async(self, tensor: torch.Tensor, deadline: Deadline) -> _PendingOp:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=max(deadline.check("broadcast"), 0.001))
        with self._pg_lock:
            if self._pg is None:
                raise CollectiveError("group is closed", reason=Reason.GROUP_CLOSED)
            # No local name for the group: only the reaper may ever drop its last reference.
            work = self._pg.broadcast([tensor], opts)
        return _PendingOp(work, self._closed)

    def close(self) -> None:
        """Tear the group down; pending operations on every peer fail promptly, and so do this
        process's own waits (GROUP_CLOSED).

        Never blocks: destroying a gloo group joins its worker threads, which wait for any
        pending operation to time out, so the last reference is dropped on a reaper thread.
        """
        self._closed.set()
        with self._pg_lock:
            if self._pg is None:
                return
            # No local may keep a reference: the caller's frame would then run the destructor.
            refs: list[Any] = [self._pg, self._store]
            self._pg = self._store = None
        if self.spec.backend == "nccl":
            try:
                refs[0].abort()
            except RuntimeError as e:  # already aborted or never initialised
                log.debug("nccl abort: %s", e)
        reaper = threading.Thread(target=_reap, args=(refs,), daemon=True,
                                  name=f"reap-{self.spec.group_id}")
        del refs
        with _reapers_lock:
            _reapers.append(reaper)
        reaper.start()


_reapers: list[threading.Thread] = []
_reapers_lock = threading.Lock()


def _reap(refs: list) -> None:
    """Drop the group's last references: that closes the gloo pairs (peers fail at once). A
    full collection only when something else still holds one (a cycle, an exception's
    traceback): it holds the GIL for its whole run, 0.4 s in a vLLM worker's heap, measured,
    and the worker's engine loop (its model steps) waits that long."""
    held = any(_held_elsewhere(r) for r in refs)
    refs.clear()
    if held:
        gc.collect()


def _held_elsewhere(obj: object) -> bool:
    # Inside the caller's loop `obj` is referenced by the list, the loop variable, this
    # parameter and getrefcount's own argument.
    return sys.getrefcount(obj) > 4


@atexit.register
def join_reapers(timeout_s: float = 30.0) -> None:
    """Let torn-down groups finish destroying themselves: a process that exits while a gloo
    group is half destroyed dies in std::terminate (SIGABRT) instead of exiting cleanly."""
    end = time.monotonic() + timeout_s
    with _reapers_lock:
        reapers = list(_reapers)
    for r in reapers:
        r.join(max(end - time.monotonic(), 0))


def bind_master_store(address: str, port: int, world_size: int,
                      timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening before any peer is told where: with `port` 0 the
    kernel picks a free port as the store binds it (`store.port` says which), so no port is
    picked, found free, and taken by another process before the store binds it (EADDRINUSE).
    Pass it to `Group.join(spec, timeout_s, store=store)` with `spec.master_port = store.port`.

    The store listens on `address` only (the one address its peers are told), on a socket of
    that address's own family, handed to torch. torch's own listener is a dual-stack IPv6
    socket on every interface: it sees an IPv4 peer as a v4-mapped IPv6 address, and formats
    each accepted peer with a reverse lookup (getnameinfo) in its one accept loop. No hosts
    file names v4-mapped addresses, so each connection asks DNS; a resolver that drops one
    query in ~25 (measured here) stalls every rank still connecting by 5 s, the resolver's
    timeout: 64 ranks connecting at once took 5-10 s, and a fleet of 40 shims never formed.
    On a socket of the address's family, loopback and hosts-file peers resolve locally."""
    if not 0 <= port < 65536:
        raise InvalidArgumentError(f"master_port {port} out of range",
                                   reason=Reason.INVALID_MASTER_PORT)
    try:
        listener = _listen(address, port, world_size)
    except OSError as e:
        raise CollectiveError(f"rendezvous store at {address}:{port} could not listen: {e}",
                              reason=Reason.RENDEZVOUS_FAILED) from e
    fd = listener.detach()  # torch owns (and closes) it from here
    try:
        return dist.TCPStore(address, port, world_size, is_master=True,
                             timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)),
                             wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, dist.DistStoreError) as e:
        os.close(fd)
        raise CollectiveError(f"rendezvous store at {address}:{port} could not listen: "
                              f"{str(e)[:300]}", reason=Reason.RENDEZVOUS_FAILED) from e


def _listen(address: str, port: int, world_size: int) -> socket.socket:
    """A listening TCP socket on address:port, of the address's family (the first one it
    resolves to), with a backlog for every rank connecting at once."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(max(world_size, 128))  # the kernel caps it at somaxconn
    except OSError:
        sock.close()
        raise
    return sock


def _left(end: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(end - time.monotonic(), 0.001))


def _connect_store(spec: GroupSpec, end: float, timeout_s: float,
                   cancel: threading.Event | None) -> dist.TCPStore:
    """A store client connected to rank 0's store, or RENDEZVOUS_TIMEOUT at `end`, or
    EPOCH_ABORTED once `cancel` is set.

    Each attempt first waits for the master's listener, then gives the client a bounded
    connect: torch's client retries a timed-out connect once more after a random delay, so its
    own timeout stretches to about twice the one given (measured: 16.9 s for 9 s, 7.3 s for
    3 s), and a client left to retry for the whole deadline would be waiting for a master that
    died meanwhile. A connect that stalls (the client's own reverse lookup, a master busy
    accepting hundreds of ranks) is tried again, each attempt twice as long, until the
    deadline: a slow join is no failure while the deadline lasts."""
    host, port = spec.master_address, spec.master_port
    attempt_s = _STORE_CONNECT_S
    attempts = 0
    while True:
        _wait_for_listener(host, port, end, timeout_s, cancel)
        attempts += 1
        connect = min(attempt_s, max(end - time.monotonic(), 0.001))
        try:
            return _unless_cancelled(
                functools.partial(dist.TCPStore, host, port, spec.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=connect),
                                  wait_for_workers=False),
                cancel, f"rank {spec.rank}", f"while its store connected to {host}:{port}")
        except (RuntimeError, dist.DistError) as e:
            if cancel is not None and cancel.is_set():
                raise EpochAbortedError(f"rendezvous at {host}:{port}: aborted",
                                        reason=Reason.EPOCH_ABORTED) from e
            if time.monotonic() >= end:
                raise RendezvousTimeoutError(
                    f"rendezvous at {host}:{port} timed out after {timeout_s:.1f}s: the "
                    f"store's listener answered but {attempts} connect(s) did not complete: "
                    f"{str(e)[:200]}") from e
            log.info("rank %d: store connect to %s:%d attempt %d failed (%s); retrying",
                     spec.rank, host, port, attempts, str(e)[:120])
            attempt_s *= 2


# The rendezvous barrier's keys, under the group's prefix: each rank but 0 sets
# `arrived/<rank>` and adds 1 to `arrivals` once connected to the store; rank 0 then sets `go`
# to "1" (build the backend group) or to why it gave up. Only then does any rank enter the
# backend's rendezvous, which nothing can interrupt: a rank that fails or never comes ends
# everyone's wait at once, instead of each rank waiting out its deadline inside gloo.
_GO = "go"
_GO_PROCEED = "1"


def _arrive_and_await_go(store: dist.Store, spec: GroupSpec, end: float, timeout_s: float,
                         cancel: threading.Event | None) -> None:
    """A rank but 0: say it arrived, then wait for rank 0's word: proceed, or give up
    (RENDEZVOUS_FAILED naming why), or RENDEZVOUS_TIMEOUT at `end`, or EPOCH_ABORTED once
    `cancel` is set."""
    store.set(f"arrived/{spec.rank}", "1")
    store.add("arrivals", 1)
    where = f"{spec.master_address}:{spec.master_port}"
    while not store.check([_GO]):
        if cancel is not None and cancel.is_set():
            raise EpochAbortedError(f"rendezvous at {where}: aborted",
                                    reason=Reason.EPOCH_ABORTED)
        if time.monotonic() >= end:
            raise RendezvousTimeoutError(f"rendezvous at {where} timed out after "
                                         f"{timeout_s:.1f}s: rank 0 never said every rank "
                                         "had arrived")
        time.sleep(_GO_POLL_S)
    word = store.get(_GO).decode(errors="replace")
    if word != _GO_PROCEED:
        raise CollectiveError(f"rendezvous at {where}: rank 0 gave it up: {word}",
                              reason=Reason.RENDEZVOUS_FAILED)


def _await_arrivals(store: dist.Store, spec: GroupSpec, end: float, timeout_s: float,
                    cancel: threading.Event | None) -> None:
    """Rank 0: until every other rank has arrived (connected to the store), then tell them to
    proceed; or tell them why not and raise: RENDEZVOUS_TIMEOUT at `end` naming the ranks that
    never came, EPOCH_ABORTED once `cancel` is set (a driver that saw a peer's join fail sets
    it)."""
    others = spec.world_size - 1
    where = f"{spec.master_address}:{spec.master_port}"
    try:
        while True:
            arrived = store.add("arrivals", 0)
            if arrived >= others:
                break
            if cancel is not None and cancel.is_set():
                raise EpochAbortedError(f"rendezvous at {where}: aborted with {arrived} of "
                                        f"{others} ranks arrived", reason=Reason.EPOCH_ABORTED)
            if time.monotonic() >= end:
                missing = [r for r in range(1, spec.world_size)
                           if not store.check([f"arrived/{r}"])]
                raise RendezvousTimeoutError(
                    f"rendezvous at {where} timed out after {timeout_s:.1f}s: {len(missing)} "
                    f"of {others} ranks never reached the store (ranks {_ranges(missing)})",
                    missing_ranks=missing)
            time.sleep(_ARRIVAL_POLL_S)
    except RefitError as e:
        try:
            store.set(_GO, e.message[:1000])
        except (RuntimeError, dist.DistError) as gone:  # our own store: should not happen
            log.warning("could not tell the ranks the rendezvous was given up: %s", gone)
        raise
    store.set(_GO, _GO_PROCEED)


def _backend_group(store: dist.Store, spec: GroupSpec, timeout: datetime.timedelta
                   ) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    if spec.backend == "gloo":
        # torch's stubs lack _Options (the constructor takes one at runtime).
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [_gloo_device(spec.master_address)]
        return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, opts)
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, nccl_opts)


def _build_backend(store: dist.Store, spec: GroupSpec, timeout: datetime.timedelta,
                   cancel: threading.Event | None
                   ) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    """The backend group, built after the barrier. Its constructor's own rendezvous cannot be
    interrupted, and a rank that dies after arriving leaves the others in it until `timeout`:
    with a `cancel`, it is abandoned once `cancel` is set (`_unless_cancelled`)."""
    return _unless_cancelled(lambda: _backend_group(store, spec, timeout), cancel,
                             f"group {spec.group_id} rank {spec.rank}", "while the backend formed")


def _unless_cancelled(make: Callable[[], T], cancel: threading.Event | None, who: str,
                      when: str) -> T:
    """`make()`, a call into torch that nothing can interrupt (a store's connect, a backend's
    rendezvous). With a `cancel`, it runs on a thread of its own and is abandoned
    (EPOCH_ABORTED, within CANCEL_POLL_S) once `cancel` is set: an Abort ends the caller's wait
    at once, not when torch's own timeout runs out (a store connect with torch's retry: about
    twice its timeout). The thread drops whatever it makes once abandoned, and exiting waits
    for it as for any reaper (`join_reapers`)."""
    if cancel is None:
        return make()
    box: dict[str, Any] = {}
    lock = threading.Lock()
    done = threading.Event()

    def run() -> None:
        try:
            made = make()
        except BaseException as e:  # handed to the waiter, or dropped once abandoned
            with lock:
                box["error"] = e
        else:
            with lock:
                if box.get("abandoned"):
                    log.info("%s: made after it was abandoned; dropped", who)
                else:
                    box["made"] = made
            del made  # an abandoned object's last reference: destroyed here, on this thread
        done.set()

    worker = threading.Thread(target=run, daemon=True, name=f"unless-cancelled-{who}")
    worker.start()
    while not done.wait(CANCEL_POLL_S):
        if cancel.is_set():
            with lock:
                if "made" not in box and "error" not in box:
                    box["abandoned"] = True
                    with _reapers_lock:
                        _reapers.append(worker)
                    raise EpochAbortedError(f"{who}: aborted {when}",
                                            reason=Reason.EPOCH_ABORTED)
    if "error" in box:
        raise box["error"]
    return box["made"]


def _ranges(ranks: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7': a message stays short at any width."""
    out: list[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def set_store_key(host: str, port: int, key: str, timeout_s: float) -> bool:
    """Set `key` in the TCPStore at host:port (a trainer's rendezvous store), within about
    `timeout_s`; False, without raising, when the store is gone or does not answer. Engines poll
    such a key to give up a receive that nothing else can reach.

    The listener is probed first: torch's TCPStore client retries a failed connect after a
    random delay of seconds, which would hold an abort up exactly when the trainer is gone."""
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 1.0)):
            pass
    except OSError as e:
        log.info("store key %s not set: nothing listens at %s:%d (%s)", key, host, port, e)
        return False
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
        store.set(key, "1")
    except (RuntimeError, dist.DistError) as e:
        log.info("store key %s not set: %s", key, e)
        return False
    return True


def _wait_for_listener(host: str, port: int, end: float, timeout_s: float,
                       cancel: threading.Event | None = None) -> None:
    """Until something accepts TCP connections at host:port (the trainer's TCPStore), or raise
    RENDEZVOUS_TIMEOUT at `end` (time.monotonic()), or EPOCH_ABORTED once `cancel` is set."""
    while True:
        if cancel is not None and cancel.is_set():
            raise EpochAbortedError(f"rendezvous at {host}:{port}: aborted",
                                    reason=Reason.EPOCH_ABORTED)
        left = end - time.monotonic()
        if left <= 0:
            raise RendezvousTimeoutError(f"rendezvous at {host}:{port} timed out after "
                                         f"{timeout_s:.1f}s: no master listening there")
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return
        except OSError:
            time.sleep(min(0.05, max(end - time.monotonic(), 0)))


def _gloo_device(master_address: str) -> dist.ProcessGroupGloo.Device:
    """The interface gloo advertises to its peers: GLOO_SOCKET_IFNAME when set, else the local
    address this host routes to the master from. Gloo's own default resolves the hostname, which
    on multi-homed hosts and in network namespaces often names an address peers cannot reach."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))  # UDP connect sends nothing; it only picks a route
        local = s.getsockname()[0]
    return dist.ProcessGroupGloo.create_device(hostname=local)


class _PendingOp:
    """A collective in flight, waited on with a deadline, a cancel flag, and its group's close:
    closing a gloo group fails the peers' pending operations, not this process's own, so the
    wait itself must notice that its group is gone."""

    def __init__(self, work: dist.Work, group_closed: threading.Event):
        self._work = work
        self._group_closed = group_closed
        self._done = threading.Event()
        work.get_future().add_done_callback(lambda _f: self._done.set())

    def wait(self, deadline: Deadline, what: str) -> None:
        while not self._done.wait(min(CANCEL_POLL_S, max(deadline.check(what), 0.0))):
            if self._group_closed.is_set():
                raise CollectiveError(f"{what}: the group was torn down",
                                      reason=Reason.GROUP_CLOSED)
        try:
            self._work.wait()
        except RuntimeError as e:
            text = str(e)
            # gloo reports its op timeout as "Timed out waiting ..." on the op that hit it and
            # as "Application timeout caused pair closure" on the others sharing the pair.
            if "timed out" in text.lower() or "timeout" in text.lower() \
                    or deadline.remaining() <= 0:
                raise RefitTimeoutError(f"{what}: {text[:300]}") from e
            raise CollectiveError(f"{what}: peer failed: {text[:300]}") from e


# --- packing: vLLM's packed format, byte for byte ----------------------------------------------


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim included)."""
    return t.reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst` (a contiguous uint8 tensor) <- the bytes of the contiguous tensor `src`.

    Between CPU tensors this is one `memmove` on the calling thread, with the GIL released.
    torch's `copy_` would split a large copy over its intra-op threads, and on a host whose
    cores are busy pushing the same bytes through the network stack those threads spin-wait
    between copies and take the cores the broadcast needs: measured on 2 cores, 1 GiB to one
    receiver, the sender's CPU time 0.67 s -> 0.33 s and the raw data path 1.60x -> 1.28x the
    floor (docs/bench.md)."""
    n = src.nbytes
    if dst.numel() != n:
        raise ValueError(f"copy_bytes: {dst.numel()} bytes of room for {n}")
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(_byte_view(src.detach()))


def pack_into(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy tensors back to back into the uint8 buffer `out`; returns the used prefix."""
    offset = 0
    for t in tensors:
        n = t.nbytes
        dst = out[offset:offset + n]
        if t.is_contiguous():
            copy_bytes(dst, t)
        else:
            # Copy through a typed view of the destination when aligned: no temporary copy.
            if offset % t.element_size() == 0 and n:
                dst.view(t.dtype).view(t.shape).copy_(t.detach())
            else:
                dst.copy_(_byte_view(t.detach().contiguous()))
        offset += n
    return out[:offset]


def unpack(buf: torch.Tensor, specs: Sequence[TensorSpec]) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Yield (spec, uint8 slice) for each tensor of one bucket."""
    offset = 0
    for s in specs:
        yield s, buf[offset:offset + s.nbytes]
        offset += s.nbytes


def as_tensor(spec: TensorSpec, raw: torch.Tensor) -> torch.Tensor:
    """A typed tensor from its packed bytes (copies only when the offset is unaligned)."""
    if raw.storage_offset() % spec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(spec.dtype).view(spec.shape)


@dataclass(frozen=True)
class TransferStats:
    buckets: int
    bytes: int
    seconds: float


class Sender:
    """Trainer rank 0: packs the plan's buckets and broadcasts them.

    Packing bucket i+1 overlaps the broadcast of bucket i (gloo and NCCL run the broadcast on their
    own threads/streams); at most `num_buffers` packed buckets are alive at once. The bucket
    buffers are allocated once per Sender (one group) and reused by every epoch: fresh buffers
    would cost a page fault per 4 KiB on every refit. A bucket whose bytes already lie back to
    back in the trainer's memory (one contiguous tensor, or views into one flat buffer in plan
    order) is broadcast from there, without a pack copy, and needs no buffer.
    """

    def __init__(self, group: Group, plan: RefitPlan):
        if group.spec.rank != 0:
            raise InvalidArgumentError("only rank 0 sends", reason=Reason.INVALID_RANK)
        self.group = group
        self.plan = plan
        self._slots: list[torch.Tensor] | None = None

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse, before any byte moves, tensors that do not match the plan."""
        self.plan.check_tensors(tensors)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the bucket buffers this sender holds (0 before its first send)."""
        return sum(b.numel() for b in self._slots or ())

    def send(self, tensors: Mapping[str, torch.Tensor], deadline: Deadline,
             on_bucket: Callable[[Bucket], None] | None = None, *,
             checksums: StagedDigest | None = None) -> TransferStats:
        """Pack and broadcast every bucket of the plan; bounded by `deadline`.

        Args:
            tensors: the weights, as the plan names them.
            deadline: when every broadcast must be done.
            on_bucket: runs after each bucket's broadcast was posted.
            checksums: a staged epoch's digest, given each bucket's bytes as they go out (its
                checksum runs while gloo sends them: both only read the buffer).

        Returns:
            Buckets, bytes and seconds.
        """
        self.check_tensors(tensors)
        plan, device = self.plan, self.group.device
        slots = min(plan.packing.num_buffers, len(plan.buckets))
        # Per slot: the broadcast that last used it. In-place sends are tracked apart: their
        # source is the trainer's memory, which must not change until they complete.
        in_flight: list[_PendingOp | None] = [None] * slots
        in_place: list[_PendingOp] = []
        t0 = time.monotonic()
        for bucket in plan.buckets:
            specs = plan.tensors[bucket.start:bucket.stop]
            span = _span([tensors[s.name] for s in specs], bucket.nbytes, device)
            if span is not None:
                in_place.append(self.group.broadcast_async(span, deadline))
                if checksums is not None:
                    checksums.add(bucket, span)
            else:
                if self._slots is None:
                    # Allocated at the first bucket that needs packing (a trainer whose weights
                    # all go in place never has any), sized for the buckets that can need it.
                    packed = [b for b in plan.buckets if b.stop - b.start > 1]
                    self._slots = _buffers(max((b.nbytes for b in packed), default=1), slots,
                                           device)
                k = bucket.index % len(self._slots)
                if self._slots[k].numel() < bucket.nbytes:
                    # A lone tensor that cannot go in place (non-contiguous, another device):
                    # every slot grows to it, once every broadcast from the old ones is done.
                    for op in in_flight:
                        if op is not None:
                            op.wait(deadline, f"broadcast before bucket {bucket.index}")
                    in_flight = [None] * len(self._slots)
                    self._slots = _buffers(bucket.nbytes, len(self._slots), device)
                pending = in_flight[k]
                if pending is not None:
                    pending.wait(deadline, f"broadcast before bucket {bucket.index}")
                buf = pack_into(self._slots[k], [tensors[s.name].to(device) for s in specs])
                in_flight[k] = self.group.broadcast_async(buf, deadline)
                if checksums is not None:
                    checksums.add(bucket, buf)
            if on_bucket:
                on_bucket(bucket)
        for op in [*in_flight, *in_place]:
            if op is not None:
                op.wait(deadline, "final broadcast")
        return TransferStats(len(plan.buckets), plan.total_bytes, time.monotonic() - t0)


def broadcast_buckets(group: Group, plan: RefitPlan, bucket_bytes: Callable[[Bucket], torch.Tensor],
                      deadline: Deadline,
                      on_bucket: Callable[[Bucket], None] | None = None) -> TransferStats:
    """Rank 0: broadcast every bucket of the plan from where its bytes already lie, back to back
    in plan layout (a peer's committed copy, serving a catch-up): no packing, no buffer; up to
    `num_buffers` broadcasts in flight, as many as the receivers post ahead.

    Args:
        group: a group this process is rank 0 of.
        plan: the plan the bytes are laid out by.
        bucket_bytes: bucket -> its bytes (a uint8 tensor of exactly `bucket.nbytes`); they must
            not change until the call returns.
        deadline: when every broadcast must be done.
        on_bucket: runs after each bucket's broadcast was posted.
    """
    if group.spec.rank != 0:
        raise InvalidArgumentError("only rank 0 sends", reason=Reason.INVALID_RANK)
    window = max(1, min(plan.packing.num_buffers, len(plan.buckets)))
    in_flight: collections.deque[_PendingOp] = collections.deque()
    t0 = time.monotonic()
    for bucket in plan.buckets:
        if len(in_flight) >= window:
            in_flight.popleft().wait(deadline, f"broadcast before bucket {bucket.index}")
        in_flight.append(group.broadcast_async(bucket_bytes(bucket), deadline))
        if on_bucket:
            on_bucket(bucket)
    while in_flight:
        in_flight.popleft().wait(deadline, "final broadcast")
    return TransferStats(len(plan.buckets), plan.total_bytes, time.monotonic() - t0)


def _span(tensors: Sequence[torch.Tensor], nbytes: int, device: torch.device) -> torch.Tensor | None:
    """The bucket's bytes as one uint8 view of the trainer's own memory, when its tensors are
    contiguous, on the group's device and back to back in one storage, in plan order: a lone
    contiguous tensor always; a run of views into one flat buffer (Megatron-style contiguous
    parameter buffers) too. Such a bucket is broadcast without a pack copy."""
    first = tensors[0]
    if first.device != device:
        return None
    storage = first.untyped_storage()
    base, end = storage.data_ptr(), first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end or not t.is_contiguous() or t.device != device \
                or t.untyped_storage().data_ptr() != base:
            return None
        end += t.nbytes
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, first.data_ptr() - base, (nbytes,), (1,))


def receive(group: ReceivingGroup, plan: RefitPlan, deadline: Deadline,
            apply: Callable[[Bucket, Iterator[tuple[TensorSpec, torch.Tensor]]], None],
            on_bucket: Callable[[Bucket], None] | None = None,
            land: Callable[[Bucket], torch.Tensor | None] | None = None, *,
            land_from_first: bool = False) -> TransferStats:
    """Engine rank: receive every bucket of the plan and hand each to `apply`.

    The receives of the first `num_buffers` buckets are posted up front and the next one as soon
    as a buffer is free, so applying bucket i overlaps the transfer of the following ones. The
    sender need not wait for these posts: a broadcast completes only once every rank has joined
    it, so a sender that starts first simply waits (bounded by its own deadline).

    `land`, when given, may return the engine's own storage for a bucket (its tensors' bytes, in
    plan order, contiguous): the bucket is then received there, with no buffer and no `apply`.
    It is asked only once the first bucket has been applied and reported (`on_bucket`), so bytes
    can reach the weights directly only when the caller already counts the weights as changed: a
    failure before that point still leaves the old weights provably intact. With
    `land_from_first` (a staging copy, which nothing serves from) it is asked for every bucket.
    """
    buckets = plan.buckets
    window = min(plan.packing.num_buffers, len(buckets))  # receives posted ahead
    # A staging copy takes every bucket in place: no bucket buffers are needed at all.
    slots = [] if land is not None and land_from_first else group.receive_buffers(plan)
    # bucket index -> (the pending receive, where it lands, whether that is the engine's storage)
    pending: dict[int, tuple[PendingReceive, torch.Tensor, bool]] = {}
    reported = False

    def post(i: int) -> None:
        b = buckets[i]
        nonlocal slots
        direct = land(b) if land is not None and (reported or land_from_first) else None
        if direct is None and not slots:
            slots = group.receive_buffers(plan)
        buf = direct if direct is not None else slots[i % window][:b.nbytes]
        pending[i] = (group.broadcast_async(buf, deadline), buf, direct is not None)

    t0 = time.monotonic()
    for i in range(window):
        post(i)
    for b in buckets:
        op, buf, landed = pending.pop(b.index)
        op.wait(deadline, f"receive of bucket {b.index}/{len(buckets)}")
        deadline.check(f"apply of bucket {b.index}")
        later = b.index + window
        if landed and later < len(buckets):
            # This bucket holds no slot (its bytes are where they belong): the receive that
            # takes its place in the window goes out before its checksum, not after.
            post(later)
        if not landed:
            apply(b, unpack(buf, plan.tensors[b.start:b.stop]))
        if on_bucket:
            on_bucket(b)
        reported = True
        if not landed and later < len(buckets):
            post(later)
    return TransferStats(len(buckets), plan.total_bytes, time.monotonic() - t0)


def _buffers(nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
