"""The rendezvous of a data group: the TCPStore at trainer rank 0, the arrival barrier every rank
passes before the backend group forms, and the store's other use, a key an engine polls.

Every rank but 0 connects to rank 0's store (`_connect_store`: the listener first, then a
bounded connect, retried within the deadline) and says it arrived; rank 0 (`bind_master_store`:
listening before any peer is told where) waits for every arrival and then tells them all to
build the backend group (`_await_arrivals`, `_arrive_and_await_go`), so a rank that never comes
is named and no rank waits out its deadline inside gloo. The backend's own rendezvous cannot be
interrupted; with a `cancel` it runs on a thread of its own and is abandoned once the cancel is
set (`_unless_cancelled`; the thread is left to `reapers`). `set_store_key` sets a key in a
trainer's store from outside the group (an abort an engine's receive polls for).

Its own module because it is the part of the data plane that talks to the network before any
group exists: `group.Group.join` calls `rendezvous` and owns what it returns.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from refit_grpc.common import CANCEL_POLL_S, GroupSpec
from refit_grpc.dataplane.reapers import wait_at_exit
from refit_grpc.errors import (
    CollectiveError,
    EpochAbortedError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.reasons import Reason

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


def rendezvous(spec: GroupSpec, timeout_s: float, *, store: dist.TCPStore | None = None,
               cancel: threading.Event | None = None
               ) -> tuple[dist.TCPStore, dist.ProcessGroupGloo | dist.ProcessGroupNCCL]:
    """`Group.join`'s rendezvous, for a checked `spec` (its docstring says how): the store
    (rank 0's own, or a client connected to it), the arrival barrier, then the backend group;
    RENDEZVOUS_TIMEOUT / RENDEZVOUS_FAILED, or EPOCH_ABORTED once `cancel` is set."""
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
    return store, pg


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
                    wait_at_exit(worker)
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
