"""Catch-up from a peer, the rendezvous at both ends (docs/protocol.md, "Catch-up from a peer").

The peer (ServeCatchUp) hosts a two-rank rendezvous and broadcasts its committed copy; the
newcomer (CatchUp) announces itself there, joins, stages the copy and confirms receipt. Two keys
in the peer's store order it:
- `newcomer_key`: the newcomer is about to join. The peer forms the group only then: gloo's own
  wait for the other ranks cannot be cancelled, and a newcomer that refused or died must not hold
  the peer busy until its deadline.
- `received_key`: every byte landed. The peer keeps its rendezvous open until then, so the
  newcomer's `PeerWatch` reads it closing as the peer's death, not its end.
The servicer owns the state (admission, BUSY, the load as a Flip); this module only moves bytes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.dataplane.rendezvous import bind_master_store, set_store_key
from refit_grpc.errors import CollectiveError, RefitError
from refit_grpc.plan import Bucket, RefitPlan
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine

log = logging.getLogger(__name__)


@dataclass
class CatchUp:
    """A catch-up this shim takes part in: its deadline (Abort cancels it) and the other end."""

    deadline: Deadline
    serving: bool  # True on the peer (ServeCatchUp), False on the engine catching up
    other: str     # the other engine's instance id
    bytes_received: int = 0  # the engine catching up: what landed so far


class CopyServer:
    """The peer's end: a rendezvous listening at `address` (its port chosen by the system),
    open as long as this object lives."""

    def __init__(self, engine: Engine, address: str, world_size: int, group_id: str,
                 deadline: Deadline):
        self._engine = engine
        self._group_id = group_id
        self._deadline = deadline
        self._store = bind_master_store(address, 0, world_size,
                                        deadline.check("catch-up rendezvous"))
        self.port: int = self._store.port
        self._spec = GroupSpec(address, self.port, world_size, 0, "gloo", group_id)

    def serve(self) -> None:
        """Wait for the newcomer, broadcast the committed copy, wait for its receipt."""
        self._wait_for(newcomer_key(self._group_id), "waiting for the newcomer")
        self._engine.serve_copy(self._spec, self._store, self._deadline)
        self._wait_for(received_key(self._group_id), "waiting for the newcomer's receipt")

    def _wait_for(self, key: str, what: str) -> None:
        while not _store_has(self._store, key):
            time.sleep(min(0.02, self._deadline.check(what)))


def fetch_copy(engine: Engine, spec: GroupSpec, plan: RefitPlan, record: CatchUp,
               peer: str) -> str:
    """The newcomer's end: announce itself in the peer's rendezvous, join the two-rank group,
    stage the peer's copy, confirm receipt. Returns the staged digest; the group is closed
    either way, and a failure names the peer and how far it got."""
    deadline = record.deadline

    def landed(bucket: Bucket) -> None:
        record.bytes_received += bucket.nbytes

    watch = PeerWatch(spec.master_address, spec.master_port, deadline, engine.abort_transfer)
    try:
        if not set_store_key(spec.master_address, spec.master_port, newcomer_key(spec.group_id),
                             min(deadline.check("catch-up rendezvous"), 10.0)):
            raise CollectiveError(
                f"the peer's rendezvous at {spec.master_address}:{spec.master_port} does not "
                "answer", reason=Reason.RENDEZVOUS_FAILED)
        watch.start()
        engine.init_transfer(spec, plan, deadline)
        digest = engine.stage(plan, deadline, landed)
        watch.stop()
        # The peer holds its rendezvous open until this word: until then, its going away means
        # it died (`PeerWatch`), not that it finished.
        set_store_key(spec.master_address, spec.master_port, received_key(spec.group_id), 5.0)
        return digest
    except RefitError as e:
        err: RefitError = CollectiveError(
            "the peer went away (its rendezvous closed) mid-transfer",
            reason=Reason.COLLECTIVE_FAILED) if watch.peer_lost else e
        cause = "aborted" if deadline.cancel.is_set() and deadline.remaining() > 0 \
            and not watch.peer_lost else err.message
        raise type(err)(f"catch-up from peer {peer} failed after {record.bytes_received} of "
                        f"{plan.total_bytes} bytes: {cause}", reason=err.reason) from e
    finally:
        watch.stop()
        engine.abort_transfer()  # the two-rank group is done either way


def newcomer_key(group_id: str) -> str:
    """Set by the engine catching up once it is about to join: the peer forms the group only
    then."""
    return f"refit_grpc/catch-up/{group_id}/newcomer"


def received_key(group_id: str) -> str:
    """Set by the engine catching up once every byte landed: the peer closes its rendezvous
    (and ends ServeCatchUp with SENT) only then."""
    return f"refit_grpc/catch-up/{group_id}/received"


def _store_has(store, key: str) -> bool:
    """Whether the rendezvous store holds `key`; a store that fails (its server dropped the
    connection) is a failed rendezvous, not an unknown error."""
    try:
        return bool(store.check([key]))
    except Exception as e:  # noqa: BLE001  (torch raises DistNetworkError, RuntimeError, ...)
        raise CollectiveError(f"the catch-up rendezvous store failed: {type(e).__name__}: "
                              f"{str(e)[:200]}", reason=Reason.RENDEZVOUS_FAILED) from e


class PeerWatch:
    """Watches a catch-up's peer while its bytes come: gloo does not fail a pending receive
    when the sending process dies (measured: the receive waits out its deadline), but the
    peer's rendezvous listener, which it keeps open until the newcomer confirms receipt, is
    gone at once. A refused connection there cancels the catch-up and closes its group."""

    def __init__(self, host: str, port: int, deadline: Deadline,
                 close_group: Callable[[], None]) -> None:
        self._address = (host, port)
        self._deadline = deadline
        self._close_group = close_group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="catch-up-watch")
        self.peer_lost = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                socket.create_connection(self._address, timeout=1.0).close()
            except OSError:
                if self._stop.is_set():
                    return
                log.warning("catch-up: the peer's rendezvous at %s:%d is gone", *self._address)
                self.peer_lost = True
                self._deadline.cancel.set()
                self._close_group()
                return


__all__ = ["CatchUp", "CopyServer", "PeerWatch", "fetch_copy", "newcomer_key", "received_key"]
