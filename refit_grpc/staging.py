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
- `StagedDigest`: per-bucket CRC-32 (zlib, about 1.8 GiB/s on one core of the 2-core test
  machine, the GIL released) folded with SHA-256 into one hex digest. The trainer computes it
  over the bytes it sends, every receiver over the bytes it staged; a flip goes ahead only where
  they are equal. CRC-32 catches transport corruption and a misplaced bucket, not an adversary:
  `verify_weights` (SHA-256 of the weights) is the exact check.

The reference engine and the vLLM worker extension both use these (the latter in vLLM's worker
processes), so the digest is computed one way everywhere.
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections.abc import Iterator

import torch

from refit_grpc.plan import Bucket, RefitPlan, TensorSpec, raw_bytes


def bucket_checksum(buf: torch.Tensor) -> int:
    """CRC-32 of a bucket's bytes (a contiguous uint8 tensor; copied to host if it is not on
    one)."""
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return zlib.crc32(raw_bytes(buf.contiguous()))


class StagedDigest:
    """The staged digest of one plan, built bucket by bucket (any order, each once).

    Args:
        plan: the epoch's plan; its digest and bucket count are part of the result.
    """

    def __init__(self, plan: RefitPlan):
        self._plan_digest = plan.digest
        self._crcs: list[int | None] = [None] * len(plan.buckets)

    def add(self, bucket: Bucket, buf: torch.Tensor) -> None:
        """Record bucket `bucket`'s bytes (`buf`, exactly `bucket.nbytes` of them)."""
        self.add_checksum(bucket.index, bucket_checksum(buf))

    def add_checksum(self, index: int, crc: int) -> None:
        """Record a checksum computed elsewhere (a vLLM worker's, `bucket_checksum`)."""
        self._crcs[index] = crc

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self._crcs)

    def hexdigest(self) -> str:
        """SHA-256 of the plan digest and every bucket's CRC-32, in bucket order.

        Raises:
            ValueError: a bucket was never added.
        """
        missing = [i for i, c in enumerate(self._crcs) if c is None]
        if missing:
            raise ValueError(f"staged digest: buckets {missing[:8]} never added")
        h = hashlib.sha256(f"staged:{self._plan_digest}:{len(self._crcs)}\n".encode())
        for crc in self._crcs:
            h.update(f"{crc:08x}".encode())
        return h.hexdigest()


def staged_digest(plan: RefitPlan, buckets: Iterator[tuple[Bucket, torch.Tensor]]) -> str:
    """The staged digest of a whole epoch's buckets (tests, and senders that pack elsewhere)."""
    d = StagedDigest(plan)
    for bucket, buf in buckets:
        d.add(bucket, buf)
    return d.hexdigest()


class StagingCopy:
    """One host copy of the weights in plan layout (module docstring).

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

    @property
    def nbytes(self) -> int:
        """Bytes held (the extra memory staging costs), 0 before the first epoch."""
        return 0 if self._flat is None else self._flat.numel()

    def allocate(self, plan: RefitPlan) -> None:
        """Make room for `plan` (kept when the plan is the same) and mark the copy invalid: an
        epoch is about to overwrite it."""
        with self._lock:
            self._digest, self._live_version = None, 0
            if self._plan is not None and self._plan.digest == plan.digest:
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

    @property
    def live_version(self) -> int:
        """The version the copy equals the live weights at; 0 when it does not."""
        with self._lock:
            return self._live_version

    def invalidate(self) -> None:
        """Forget what the copy holds (the memory is kept for the next epoch)."""
        with self._lock:
            self._digest, self._live_version = None, 0

    def drop_pending(self) -> None:
        """Forget a copy that is not (yet) the live weights: a staged epoch dropped before its
        flip. A committed copy (`live_version`) is kept: it is still what the engine serves,
        a delta's base and what a catch-up is served from."""
        with self._lock:
            if not self._live_version:
                self._digest = None

    def release(self) -> None:
        """Give the memory back (the engine closes)."""
        with self._lock:
            self._flat, self._plan, self._offsets = None, None, []
            self._digest, self._live_version = None, 0


__all__ = ["StagedDigest", "StagingCopy", "bucket_checksum", "staged_digest"]
