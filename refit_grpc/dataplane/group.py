"""A joined data group: its backend (gloo on CPU, NCCL on GPU), its broadcasts in flight, and its
teardown.

The group is a TCPStore at trainer rank 0 plus a backend group built directly, never through
`torch.distributed.init_process_group`: a trainer already has its own default group, and an
engine worker must not get one it does not own. `Group.join` forms it (`rendezvous`); only rank
0 ever sends.

Every wait on a group is bounded by a deadline and ends when the group is closed from another
thread (`PendingOp`). Gloo cannot abort a pending operation (`ProcessGroupGloo.abort()` is a
no-op), but dropping the group closes its TCP pairs, which fails every pending operation on the
peers at once: `Group.close()` is therefore the abort, on either side. It never blocks: the last
references go on a reaper thread (`reapers`).

`ReceivingGroup` is what a receive uses of a group, so an engine sharing its process's rank
(`shared_rank.SharedRankMember`) receives through the same code.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any, Protocol

import torch
import torch.distributed as dist

from refit_grpc.common import CANCEL_POLL_S, Deadline, GroupSpec
from refit_grpc.dataplane.packing import bucket_buffers
from refit_grpc.dataplane.reapers import reap, wait_at_exit
from refit_grpc.dataplane.rendezvous import rendezvous
from refit_grpc.errors import CollectiveError, InvalidArgumentError, RefitTimeoutError
from refit_grpc.plan import RefitPlan
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)


class PendingReceive(Protocol):
    def wait(self, deadline: Deadline, what: str) -> None: ...


class ReceivingGroup(Protocol):
    """What an engine's receive uses of its data group: a `Group`, or a
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
        store, pg = rendezvous(spec, timeout_s, store=store, cancel=cancel)
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
            have = self._receive_buffers = bucket_buffers(nbytes, count, self.device)
        return [buf[:nbytes] for buf in have[:count]]

    def broadcast_async(self, tensor: torch.Tensor, deadline: Deadline) -> PendingOp:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=max(deadline.check("broadcast"), 0.001))
        with self._pg_lock:
            if self._pg is None:
                raise CollectiveError("group is closed", reason=Reason.GROUP_CLOSED)
            # No local name for the group: only the reaper may ever drop its last reference.
            work = self._pg.broadcast([tensor], opts)
        return PendingOp(work, self._closed)

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
        reaper = threading.Thread(target=reap, args=(refs,), daemon=True,
                                  name=f"reap-{self.spec.group_id}")
        del refs
        wait_at_exit(reaper)
        reaper.start()


class PendingOp:
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
