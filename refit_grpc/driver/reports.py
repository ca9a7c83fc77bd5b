"""What an epoch reports: `EpochReport` (what `Fleet.refit()` returns) and its `WorkerReport`s;
what a rollback reports: `RollbackReport` (`Fleet.rollback()`, and a failed check's
`error.rollback`)."""

from __future__ import annotations

from dataclasses import dataclass

from refit_grpc.common import EpochMode
from refit_grpc.driver.failures import WorkerFailure


@dataclass(frozen=True)
class WorkerReport:
    """One engine's part of an epoch (`EpochReport.workers`).

    Args:
        instance_id: the engine's shim.
        seconds: from the engine's ACCEPTED to its COMMITTED.
        bytes: the bytes it applied.
        weights_digest: its weights digest at commit ("" unless it knows it or was asked).
        canary_gap: max |engine - trainer| of the epoch's canary, if any.
        canary_seconds: how long the engine took to compute the canary, if any.
        stall_seconds: staged: how long the engine stopped generating (its flip, pause to
            resume); in place it stops for the whole epoch (`seconds` and the flush).
        load_seconds: staged: the load of the staged copy, within the stall.
    """

    instance_id: str
    seconds: float
    bytes: int
    weights_digest: str
    canary_gap: float | None = None  # max |engine - trainer| of the epoch's canary, if any
    canary_seconds: float | None = None
    stall_seconds: float | None = None
    load_seconds: float | None = None


@dataclass(frozen=True)
class EpochReport:
    """What `Fleet.refit()` returns.

    Args:
        version: the epoch's version.
        bytes: the plan's bytes, sent once to every engine.
        seconds: from UpdateWeights sent to every COMMITTED.
        broadcast_seconds: the sender's part (staged: of every round).
        workers: one report per engine that committed, in fleet order.
        mode: the epoch's mode.
        left_behind: staged: the engines it went on without, and why (`Fleet.left_behind`).
        reforms: staged: how many times the group was formed again without failed engines.
        delta: staged: whether the buckets went as deltas.
        wire_bytes: staged: the bytes that crossed, every round.
        rollback: staged, reversible: the engines that failed the checks while a quorum
            passed them, rolled back to the previous version (they are also `left_behind`).
    """

    version: int
    bytes: int
    seconds: float           # from UpdateWeights sent to every COMMITTED
    broadcast_seconds: float  # the sender's part
    workers: tuple[WorkerReport, ...]
    mode: EpochMode = EpochMode.IN_PLACE
    left_behind: tuple[WorkerFailure, ...] = ()
    reforms: int = 0
    delta: bool = False   # sent as deltas (refit(delta=True) against a matching base)
    wire_bytes: int = 0   # staged: bytes on the wire over every round (headers included)
    rollback: RollbackReport | None = None

    @property
    def stall_seconds(self) -> float | None:
        """Staged: the longest flip (pause to resume) of any engine; None in place."""
        stalls = [w.stall_seconds for w in self.workers if w.stall_seconds is not None]
        return max(stalls) if stalls else None

    @property
    def gbps(self) -> float:
        """Effective GB/s: plan bytes over the whole epoch."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RollbackReport:
    """What a rollback did (`Fleet.rollback()`; `error.rollback` of a staged epoch whose checks
    failed after its flip).

    Args:
        version: the version the rolled-back engines serve now.
        rolled_back_from: the version they left.
        workers: the engines rolled back (resumed together), by instance id.
        stall_seconds: the longest pause of any of them (pause to the end of its load).
        failed: the engines that were not rolled back, and why (no previous copy kept, or the
            call failed): they are where they were.
    """

    version: int
    rolled_back_from: int
    workers: tuple[str, ...]
    stall_seconds: float
    failed: tuple[WorkerFailure, ...] = ()

    @property
    def complete(self) -> bool:
        """Every engine asked was rolled back."""
        return not self.failed


__all__ = ["EpochReport", "RollbackReport", "WorkerReport"]
