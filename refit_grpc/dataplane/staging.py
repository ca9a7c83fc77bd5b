"""What a staged epoch lands in, and the digest both ends compute of what crossed.

A staged epoch (docs/protocol.md, "Staged epochs") receives the new version into a host-side
copy of the weights in plan layout while the engine keeps serving the old one; the engine loads
that copy into its live weights only at the flip. This module is the one definition of

- `StagingCopy`: that copy. Plan layout is the wire's: the plan's tensors back to back in plan
  order, so every bucket lands in place (one slice, no unpack, no second buffer). It is allocated
  once per plan and kept: staging costs one copy of the weights, nothing per epoch. It is marked
  complete (with its staged digest) only once every bucket landed, and live (with a version)
  once a flip loaded it; an epoch that fails or is aborted leaves it invalid, never the live
  weights.
- `StagedDigest`: a per-bucket checksum (`STAGED_CHECKSUM`: XXH3-64, from the xxhash package)
  folded with SHA-256 into one hex digest. The trainer computes it over the bytes it sends,
  every receiver over the bytes it staged; a flip goes ahead only where they are equal. It
  catches transport corruption and a misplaced bucket, not an adversary: `verify_weights`
  (SHA-256 of the weights) is the exact check. Why XXH3 and not zlib's CRC-32 (the checksum
  until 2026-12): both ends checksum every byte of a staged epoch on the cores that also move
  it, and on the 2-core test machine XXH3-64 runs at about 10.5 GiB/s on one core against
  3.6 GiB/s for CRC-32 (both release the GIL; XXH3 on two threads: 19.8 GiB/s); it is 64 bits
  wide. The checksum's name is in the digest's preamble, so digests of two checksums never
  compare equal; Describe says it (`staged_checksum`), and a shim refuses a staged epoch whose
  driver names another (`UpdateWeightsRequest.staged_checksum`; docs/protocol.md, invariant 9).

The reference engine and the vLLM worker extension both use these (the latter in vLLM's worker
processes), so the digest is computed one way everywhere.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import torch
import xxhash

from refit_grpc.plan import Bucket, RefitPlan, TensorSpec, raw_bytes

# The per-bucket checksum of every staged digest this package computes; an engine advertises it
# in Describe (`staged_checksum`). An engine that says nothing predates it and used "crc32".
STAGED_CHECKSUM = "xxh3-64"


def bucket_checksum(buf: torch.Tensor) -> int:
    """XXH3-64 of a bucket's bytes (a contiguous uint8 tensor; copied to host if it is not on
    one). The GIL is released while it runs."""
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return xxhash.xxh3_64_intdigest(raw_bytes(buf.contiguous()))


class StagedDigest:
    """The staged digest of one plan, built bucket by bucket (any order, each once).

    Args:
        plan: the epoch's plan; its digest and bucket count are part of the result.
    """

    def __init__(self, plan: RefitPlan):
        self._plan_digest = plan.digest
        self._checksums: list[int | None] = [None] * len(plan.buckets)

    def add(self, bucket: Bucket, buf: torch.Tensor) -> None:
        """Record bucket `bucket`'s bytes (`buf`, exactly `bucket.nbytes` of them)."""
        self.add_checksum(bucket.index, bucket_checksum(buf))

    def add_checksum(self, index: int, checksum: int) -> None:
        """Record a checksum computed elsewhere (a vLLM worker's, `bucket_checksum`)."""
        self._checksums[index] = checksum

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self._checksums)

    def hexdigest(self) -> str:
        """SHA-256 of the checksum's name, the plan digest and every bucket's checksum, in
        bucket order.

        Raises:
            ValueError: a bucket was never added.
        """
        missing = [i for i, c in enumerate(self._checksums) if c is None]
        if missing:
            raise ValueError(f"staged digest: buckets {missing[:8]} never added")
        h = hashlib.sha256(f"staged:{STAGED_CHECKSUM}:{self._plan_digest}:"
                           f"{len(self._checksums)}\n".encode())
        for checksum in self._checksums:
            h.update(f"{checksum:016x}".encode())
        return h.hexdigest()


def staged_digest(plan: RefitPlan, buckets: Iterator[tuple[Bucket, torch.Tensor]]) -> str:
    """The staged digest of a whole epoch's buckets (tests, and senders that pack elsewhere)."""
    d = StagedDigest(plan)
    for bucket, buf in buckets:
        d.add(bucket, buf)
    return d.hexdigest()


class StagingCopy:
    """One host copy of the weights in plan layout (module docstring), and where an epoch is
    reversible, the copy of the version before it.

    The previous copy (`previous`): a staged epoch that is to be reversible (`allocate(...,
    keep_previous=True)`) keeps the committed copy as it was and lands in a second buffer (a
    delta: onto a copy of the committed one). Once that epoch's flip loaded it, the kept copy
    is the previous version's, which `restore_previous` makes the copy a flip loads again: a
    rollback is a flip of the previous copy. A staged epoch that fails or is dropped before
    its flip gives the committed copy back (it still equals the live weights). Memory: a
    second copy of the plan while one is kept (`nbytes` counts both); a staged epoch that is
    not reversible frees it.

    An engine that holds its live weights in plan layout may serve from the copy itself (the
    reference engine in store mode): its flip makes its weights views of `flat_bytes()` instead
    of copying them, and it names that buffer in every `allocate(..., serving=...)`, so no epoch
    lands in the weights being served. The epoch then lands in the second buffer (the one that
    was live before, or a new one), and the flip is a swap: no copy of the weights, and a
    reversible epoch costs no memory beyond that second buffer (`held_bytes`).

    Thread safety: one epoch writes it at a time (the shim serializes epochs); `valid_for`,
    `invalidate` and `commit` may be called from any thread.

    Args:
        pin_memory: allocate page-locked memory (the NCCL path: the device-to-host copies of a
            receive and the host-to-device copies of a flip run at full PCIe speed); only where
            CUDA is available.
    """

    def __init__(self, pin_memory: bool = False):
        self._pin = pin_memory
        self._lock = threading.Lock()
        self._flat: torch.Tensor | None = None
        self._plan: RefitPlan | None = None
        self._offsets: list[int] = []  # tensor index -> byte offset
        self._digest: str | None = None  # staged digest, once every bucket landed
        self._live_version = 0  # the version a flip loaded from it (it equals the live weights)
        # The previous copy: same plan, its buffer, (version, staged digest) while it holds one.
        self._spare: torch.Tensor | None = None
        self._previous: tuple[int, str] | None = None
        # Whether `_previous` is the previous version a rollback may load (a reversible epoch), or
        # only the committed copy set aside while the epoch lands beside the weights being served
        # (given back if the epoch fails, never rolled back to).
        self._reversible = False
        # While a rollback's flip is pending: the previous copy it restores (given back as
        # previous if the flip never comes; once loaded, none is kept before it).
        self._restoring: tuple[int, str] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held (the extra memory staging costs: the copy, and a previous copy's buffer
        while one is kept), 0 before the first epoch."""
        return self.held_bytes()

    def held_bytes(self, besides: torch.Tensor | None = None) -> int:
        """Bytes held, not counting `besides` (an engine serving from one of the buffers counts
        only what staging adds to its weights)."""
        return sum(b.numel() for b in (self._flat, self._spare)
                   if b is not None and b is not besides)

    def allocate(self, plan: RefitPlan, keep_previous: bool = False,
                 delta: bool = False, serving: torch.Tensor | None = None) -> None:
        """Make room for `plan` (kept when the plan is the same) and mark the copy invalid: an
        epoch is about to overwrite it.

        Args:
            plan: the epoch's plan.
            keep_previous: keep the committed copy, if this plan's, as the previous version
                (the epoch is reversible); the epoch lands in the second buffer.
            delta: the epoch applies onto the committed copy: in the second buffer (with
                `keep_previous`, or where the committed copy is being served), which starts as
                a copy of it.
            serving: the buffer the engine's live weights are views of, where the engine serves
                from this copy (class docstring); the epoch never lands in it.
        """
        with self._lock:
            same_plan = self._plan is not None and self._plan.digest == plan.digest
            committed = (self._live_version, self._digest) \
                if same_plan and self._live_version and self._digest else None
            self._digest, self._live_version, self._restoring = None, 0, None
            self._previous, self._reversible = None, False
            served = same_plan and serving is not None and self._flat is serving
            if (keep_previous and committed is not None) or served:
                assert self._flat is not None
                kept = self._flat
                if self._spare is None:
                    self._spare = torch.empty_like(kept, pin_memory=self._pin)
                self._flat, self._spare = self._spare, kept
                self._previous, self._reversible = committed, keep_previous
                if delta:
                    self._flat.copy_(kept)
                return
            if not keep_previous or not same_plan:
                self._spare = None  # its memory goes back
            if same_plan:
                return
            self._flat = None  # the old copy's memory goes before the new one is taken
            offsets, offset = [], 0
            for spec in plan.tensors:
                offsets.append(offset)
                offset += spec.nbytes
            self._flat = torch.empty(plan.total_bytes, dtype=torch.uint8,
                                     pin_memory=self._pin)
            self._plan, self._offsets = plan, offsets

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        """Where bucket `bucket` lands: its bytes' slice of the copy."""
        assert self._flat is not None, "allocate() first"
        start = self._offsets[bucket.start]
        return self._flat[start:start + bucket.nbytes]

    @property
    def plan(self) -> RefitPlan | None:
        """The plan the copy is laid out for; None before `allocate`."""
        return self._plan

    def flat_bytes(self) -> torch.Tensor:
        """The whole copy, every bucket back to back (the plan's bytes in wire order)."""
        assert self._flat is not None, "allocate() first"
        return self._flat

    def tensors(self) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        """(spec, its bytes as a uint8 slice of the copy), in plan order."""
        assert self._flat is not None and self._plan is not None, "allocate() first"
        for spec, start in zip(self._plan.tensors, self._offsets):
            yield spec, self._flat[start:start + spec.nbytes]

    def complete(self, digest: str) -> None:
        """Every bucket landed; `digest` is their staged digest."""
        with self._lock:
            self._digest = digest

    @property
    def digest(self) -> str | None:
        """The staged digest of a complete copy; None while none is."""
        with self._lock:
            return self._digest

    def mark_live(self, version: int) -> None:
        """A flip loaded the copy: it now equals the live weights, at `version`."""
        with self._lock:
            self._live_version = version
            if self._restoring is not None:  # a rollback: the version left is not kept
                self._previous, self._restoring = None, None

    @property
    def live_version(self) -> int:
        """The version the copy equals the live weights at; 0 when it does not."""
        with self._lock:
            return self._live_version

    @property
    def previous(self) -> tuple[int, str] | None:
        """(version, staged digest) of the previous copy: the committed copy before the last
        reversible epoch's flip, what a rollback loads; None when none is kept."""
        with self._lock:
            return self._previous if self._live_version and self._reversible else None

    def restore_previous(self) -> tuple[int, str]:
        """Make the previous copy the one a flip loads (a rollback); the committed copy it
        replaces is kept aside until that flip is done, and given back if it never comes
        (`drop_pending`).

        Returns:
            (version, staged digest) of the copy to flip to.

        Raises:
            ValueError: no previous copy is kept.
        """
        with self._lock:
            previous = self._previous if self._live_version and self._reversible else None
            if previous is None or self._spare is None or self._digest is None:
                raise ValueError("no previous copy to roll back to")
            assert self._flat is not None
            self._flat, self._spare = self._spare, self._flat
            self._previous = (self._live_version, self._digest)
            self._digest, self._live_version, self._restoring = previous[1], 0, previous
            return previous

    def invalidate(self) -> None:
        """Forget what the copy holds, and a previous copy (the live weights changed without
        them: an in-place receive). The memory is kept for the next epoch."""
        with self._lock:
            self._digest, self._live_version = None, 0
            self._previous, self._restoring = None, None

    def drop_pending(self) -> None:
        """Forget a copy that is not (yet) the live weights: a staged epoch failed or dropped
        before its flip. A committed copy (`live_version`) is kept: it is still what the engine
        serves, a delta's base and what a catch-up is served from; where the epoch had set it
        aside as the previous copy, it is given back."""
        with self._lock:
            if self._live_version:
                return
            if self._previous is not None and self._spare is not None:
                self._flat, self._spare = self._spare, self._flat
                self._live_version, self._digest = self._previous
                # A rollback that never flipped: the copy it would have loaded is the previous
                # one again.
                self._previous, self._restoring = self._restoring, None
                return
            self._digest = None

    def release(self) -> None:
        """Give the memory back (the engine closes)."""
        with self._lock:
            self._flat, self._plan, self._offsets = None, None, []
            self._digest, self._live_version = None, 0
            self._spare, self._previous, self._restoring = None, None, None


__all__ = ["STAGED_CHECKSUM", "StagedDigest", "StagingCopy", "bucket_checksum", "staged_digest"]
