"""Moving a plan's buckets over a joined group: the trainer's send and an engine's receive.

`Sender` (trainer rank 0) packs each bucket and broadcasts it, packing bucket i+1 while bucket i
is on the wire, or broadcasts it straight from the trainer's memory when its bytes already lie
back to back there; `broadcast_buckets` broadcasts buckets that already lie in plan layout (a
peer's committed copy, serving a catch-up); `receive` (an engine rank) posts `num_buffers`
receives ahead and hands each bucket to the engine, or lands it in the engine's own storage.
Every wait is bounded by the epoch's deadline and ends when the group is closed.

Its own module because it is the part of the data plane that runs once per epoch: a group
(`group`) is formed once and carries many epochs; the bytes' layout is `packing`'s.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from refit_grpc.common import Deadline
from refit_grpc.dataplane.group import Group, PendingOp, PendingReceive, ReceivingGroup
from refit_grpc.dataplane.packing import bucket_buffers, pack_into, unpack
from refit_grpc.dataplane.staging import StagedDigest
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.plan import Bucket, RefitPlan, TensorSpec
from refit_grpc.reasons import Reason


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
        in_flight: list[PendingOp | None] = [None] * slots
        in_place: list[PendingOp] = []
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
                    self._slots = bucket_buffers(max((b.nbytes for b in packed), default=1), slots,
                                           device)
                k = bucket.index % len(self._slots)
                if self._slots[k].numel() < bucket.nbytes:
                    # A lone tensor that cannot go in place (non-contiguous, another device):
                    # every slot grows to it, once every broadcast from the old ones is done.
                    for op in in_flight:
                        if op is not None:
                            op.wait(deadline, f"broadcast before bucket {bucket.index}")
                    in_flight = [None] * len(self._slots)
                    self._slots = bucket_buffers(bucket.nbytes, len(self._slots), device)
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
    in_flight: collections.deque[PendingOp] = collections.deque()
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
