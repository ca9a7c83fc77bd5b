"""One receiving rank of a data group shared by several engines of one process: a host's relay.

A shim process that serves several engines (`refit-grpc shim --engines K`: a host with 8
engines, or the servicers of the simulated 1,000-engine fleet) joins each data group once, as one
rank, whatever the number of its engines in it. The trainer's broadcast then reaches the process
once, and every engine of the process takes its bytes from that one receive:

- the first engine of the process to join a group (by its `group_id` and rank) joins it for
  real; the others attach to the same rank and wait for that join (`SharedRank.join`);
- each engine receives through its own `SharedRankMember`, which offers what the receive paths
  use of a `group.Group` (`broadcast_async`, `receive_buffers`, `closed`, `close`, `spec`,
  `device`). Every engine posts the same collectives in the same order (the same plan, the same
  epoch), so the n-th collective of one engine is the n-th of every other: the first engine to
  post it posts the real one, into a buffer of the rank's own; each engine's wait waits for it
  and copies the bytes where it asked for them. The buffer goes when every engine took it.
- a member's `close()` closes the real group, as an engine's abort of its own rank would: the
  trainer's broadcast fails and so does every other member's receive. A failure therefore still
  ends the epoch for everyone at once, and the driver names the engine whose stream reported it.

The driver learns which engines share a rank from Describe (`DescribeResponse.shared_rank`, the
same non-empty key for the engines of one rank) and gives them one rank offset; the world counts
each shared rank once. Only engines of one rank each (`world_size` 1) share.

What it costs: one copy of each bucket per engine from the rank's buffer (the engines of a host
cannot all own the bytes the collective wrote), and the rank's buffer for the buckets in flight.
"""

from __future__ import annotations

import copy
import logging
import threading
import uuid
from dataclasses import dataclass, field

import torch

from refit_grpc.common import CANCEL_POLL_S, Deadline, GroupSpec
from refit_grpc.dataplane.group import Group, PendingReceive
from refit_grpc.errors import (
    CollectiveError,
    EpochAbortedError,
    InvalidArgumentError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import RefitPlan
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)


@dataclass
class _SharedOp:
    """The n-th collective of the shared rank: posted once, into `buffer`, taken by every
    member (`left` counts those that have not taken it yet)."""

    pending: PendingReceive
    buffer: torch.Tensor
    left: int


@dataclass
class _SharedGroup:
    """One data group as the process's rank in it: the real group once joined, the members."""

    spec: GroupSpec
    joined: threading.Event = field(default_factory=threading.Event)
    group: Group | None = None
    error: RefitError | None = None   # the real join's failure, for the members that waited
    members: int = 0
    receiving: bool = False           # a collective was posted: no member may attach any more
    ops: dict[int, _SharedOp] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def closed(self) -> bool:
        return self.error is not None or (self.group is not None and self.group.closed)


class SharedRank:
    """The rank this process holds in each data group its engines join (module docstring).

    Args:
        key: the rank's name in Describe, the same for every engine of the process; unique
            across processes (a random one by default).
    """

    def __init__(self, key: str | None = None):
        self.key = key or f"rank-{uuid.uuid4().hex[:16]}"
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, int], _SharedGroup] = {}

    def join(self, spec: GroupSpec, timeout_s: float, *,
             cancel: threading.Event | None = None) -> SharedRankMember:
        """Join `spec`'s group as one of the engines of this process's rank: the first engine
        joins it for real (`Group.join`), the others wait for that join, each within its own
        `timeout_s` and `cancel`. Raises what the real join raised, on every member."""
        name = (spec.group_id, spec.rank)
        with self._lock:
            for k in [k for k, g in self._groups.items() if g.closed]:
                del self._groups[k]
            shared = self._groups.get(name)
            leader = shared is None
            if shared is None:
                shared = self._groups[name] = _SharedGroup(spec)
            elif (shared.spec.master_address, shared.spec.master_port, shared.spec.world_size,
                  shared.spec.backend) != (spec.master_address, spec.master_port,
                                           spec.world_size, spec.backend):
                raise InvalidArgumentError(
                    f"group {spec.group_id!r} rank {spec.rank} is already joined by this "
                    f"process's engines at another rendezvous or world size",
                    reason=Reason.INVALID_RANK)
            with shared.lock:
                if shared.receiving:
                    raise CollectiveError(
                        f"group {spec.group_id!r}: this process's rank is already receiving; "
                        "an engine cannot join it mid-epoch", reason=Reason.WRONG_STATE)
                shared.members += 1
        if leader:
            try:
                shared.group = Group.join(spec, timeout_s, cancel=cancel)
            except RefitError as e:
                shared.error = e
                raise
            except BaseException as e:
                shared.error = CollectiveError(f"rendezvous failed: {e}",
                                               reason=Reason.RENDEZVOUS_FAILED)
                raise
            finally:
                shared.joined.set()
        else:
            deadline = Deadline(timeout_s, cancel=cancel)
            while not shared.joined.wait(min(CANCEL_POLL_S, max(deadline.remaining(), 0.0))):
                if deadline.cancel.is_set():
                    self._leave(shared)
                    raise EpochAbortedError("join cancelled while another engine of this "
                                            "process joined the group", reason=Reason.EPOCH_ABORTED)
                if deadline.remaining() <= 0:
                    self._leave(shared)
                    raise RefitTimeoutError(f"join of group {spec.group_id!r} timed out after "
                                            f"{timeout_s:.1f}s (another engine of this "
                                            "process was joining it)",
                                            reason=Reason.RENDEZVOUS_TIMEOUT)
            if shared.error is not None:
                raise copy.copy(shared.error)  # each member its own exception object
        log.debug("engine attached to group %s rank %d (%d engines)", spec.group_id, spec.rank,
                  shared.members)
        return SharedRankMember(shared)

    @staticmethod
    def _leave(shared: _SharedGroup) -> None:
        with shared.lock:
            shared.members -= 1

    def groups(self) -> int:
        """How many groups this rank is in (open ones), for tests and metrics."""
        with self._lock:
            return sum(1 for g in self._groups.values() if not g.closed)


class SharedRankMember:
    """One engine's view of its process's rank in a group (module docstring): the `Group`
    calls its receive makes."""

    def __init__(self, shared: _SharedGroup):
        assert shared.group is not None
        self._shared = shared
        self._group = shared.group
        self.spec = shared.spec
        self.device = shared.group.device
        self._next = 0  # the index of this member's next collective
        self._receive_buffers: list[torch.Tensor] = []

    @property
    def closed(self) -> bool:
        return self._group.closed

    def receive_buffers(self, plan: RefitPlan) -> list[torch.Tensor]:
        """This engine's own bucket buffers (the rank's hold only what is in flight)."""
        nbytes = max(b.nbytes for b in plan.buckets)
        count = min(plan.packing.num_buffers, len(plan.buckets))
        have = self._receive_buffers
        if len(have) < count or (have and have[0].numel() < nbytes):
            have = self._receive_buffers = [torch.empty(nbytes, dtype=torch.uint8,
                                                        device=self.device)
                                            for _ in range(count)]
        return [buf[:nbytes] for buf in have[:count]]

    def broadcast_async(self, tensor: torch.Tensor, deadline: Deadline) -> _MemberReceive:
        """The next collective, into `tensor`: posted for real by the first member to reach
        it, taken from the rank's buffer by the others."""
        index, self._next = self._next, self._next + 1
        nbytes = tensor.numel() * tensor.element_size()
        shared = self._shared
        with shared.lock:
            shared.receiving = True
            op = shared.ops.get(index)
            if op is None:
                # Under the lock: the real collectives are posted in index order, which is the
                # order the sender broadcasts in.
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                op = shared.ops[index] = _SharedOp(self._group.broadcast_async(buffer, deadline),
                                                   buffer, shared.members)
            elif op.buffer.numel() != nbytes:
                raise CollectiveError(
                    f"collective {index}: this engine receives {nbytes} bytes where another "
                    f"engine of the rank received {op.buffer.numel()} (different plans on one "
                    "rank)", reason=Reason.RECEIVE_FAILED)
        return _MemberReceive(self, index, op, tensor)

    def took(self, index: int, op: _SharedOp) -> None:
        """This member is done with collective `index` (took its bytes, or gave up): the
        rank's buffer goes once every member is."""
        with self._shared.lock:
            op.left -= 1
            if op.left <= 0:
                self._shared.ops.pop(index, None)

    def close(self) -> None:
        """Close the rank's group (every member's, as an engine's abort of its own rank would
        end the broadcast for every rank)."""
        self._group.close()
        with self._shared.lock:
            self._shared.ops.clear()


class _MemberReceive:
    def __init__(self, member: SharedRankMember, index: int, op: _SharedOp, into: torch.Tensor):
        self._member = member
        self._index = index
        self._op = op
        self._into = into

    def wait(self, deadline: Deadline, what: str) -> None:
        try:
            self._op.pending.wait(deadline, what)
            self._into.reshape(-1).view(torch.uint8).copy_(self._op.buffer)
        finally:
            self._member.took(self._index, self._op)


__all__ = ["SharedRank", "SharedRankMember"]
