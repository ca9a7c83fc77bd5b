"""What an epoch is, as one value: `InPlace(flush=...)` or `Staged(min_engines=..., delta=...)`
(`Fleet.refit(epoch=...)`, `Fleet.update_weights(epoch=...)`). An option that does not apply
to a mode cannot be passed to it; what both modes check is `Checks` (`driver.checks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from refit_grpc.common import EpochMode
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.reasons import Reason


@dataclass(frozen=True, kw_only=True)
class InPlace:
    """An in-place epoch: every engine pauses, receives into its live weights, commits.

    Args:
        flush: after every engine committed, flush them all (drain, clear the caches,
            resume) so they serve the new weights; False leaves that to `flush_cache()`.
    """

    mode: ClassVar[EpochMode] = EpochMode.IN_PLACE
    flush: bool = True


@dataclass(frozen=True, kw_only=True)
class Staged:
    """A staged epoch: the engines keep serving while the bytes land in their staging copies,
    and flip (pause, load, resume) once enough staged the trainer's digest.

    Args:
        min_engines: how many engines must stage the new version for the fleet to flip; by
            default every member (checked against the members when the epoch runs).
        delta: send each bucket as what changed since the last staged epoch when every
            member's committed copy is that epoch's; otherwise a full epoch
            (`refit_grpc.delta`).

    Raises:
        InvalidArgumentError: `min_engines` below 1 (INVALID_MIN_ENGINES).
    """

    mode: ClassVar[EpochMode] = EpochMode.STAGED
    min_engines: int | None = None
    delta: bool = False

    def __post_init__(self) -> None:
        if self.min_engines is not None and self.min_engines < 1:
            raise InvalidArgumentError(f"min_engines must be >= 1, got {self.min_engines}",
                                       reason=Reason.INVALID_MIN_ENGINES)

    def required(self, members: int) -> int:
        """How many of `members` engines must stage (and flip).

        Raises:
            InvalidArgumentError: `min_engines` above `members` (INVALID_MIN_ENGINES).
        """
        required = members if self.min_engines is None else self.min_engines
        if not 1 <= required <= members:
            raise InvalidArgumentError(f"min_engines must be in [1, {members}] (the fleet's "
                                       f"members), got {self.min_engines}",
                                       reason=Reason.INVALID_MIN_ENGINES)
        return required


# What an epoch is: one of the two.
Epoch = InPlace | Staged

__all__ = ["Epoch", "InPlace", "Staged"]
