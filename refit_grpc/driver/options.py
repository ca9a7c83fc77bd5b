"""What an epoch is, as one value: `InPlace(flush=...)` or `Staged(min_engines=..., delta=...)`
(`Fleet.refit(epoch=...)`, `Fleet.update_weights(epoch=...)`). An option that does not apply
to a mode cannot be passed to it; what both modes check is `Checks` (`driver.checks`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from refit_grpc.common import EpochMode, PauseMode
from refit_grpc.driver.checks import Checks
from refit_grpc.errors import InvalidArgumentError, RefitDeprecationWarning
from refit_grpc.reasons import Reason


@dataclass(frozen=True, kw_only=True)
class InPlace:
    """An in-place epoch: every engine pauses, receives into its live weights, commits.

    Args:
        flush: the engines serve the new weights once committed (their caches cleared):
            without checks each resumes at its own commit, with no Flush call
            (`resume_on_commit`); with checks all are flushed once the checks passed. False
            leaves every engine paused for `flush_cache()`.
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
            (`refit_grpc.dataplane.delta`).
        reversible: every engine keeps its committed copy as the previous copy beside the
            new one, so the fleet can go back to the version before this epoch: at once when
            the epoch's checks fail after the flip (the error's `rollback` says what was
            done), or later with `Fleet.rollback()`. Costs a second host copy of the weights
            on each engine; an engine whose last epoch was in place has no copy to keep.
        keep_cache: the flip keeps the KV cache of the requests it parks (pause mode KEEP)
            and the prefix cache, so they go on after it without recomputing: the tokens they
            generate after the flip attend to keys and values the previous version computed
            (off-policy for the trainer), and vLLM labels each token with the version that
            sampled it (docs/trainer.md, "Keeping the cache across a flip"). An engine that cannot
            refuses (KEEP_CACHE_UNSUPPORTED, left behind).

    Raises:
        InvalidArgumentError: `min_engines` below 1 (INVALID_MIN_ENGINES).
    """

    mode: ClassVar[EpochMode] = EpochMode.STAGED
    min_engines: int | None = None
    delta: bool = False
    reversible: bool = True
    keep_cache: bool = False

    def __post_init__(self) -> None:
        if self.min_engines is not None and self.min_engines < 1:
            raise InvalidArgumentError(f"min_engines must be >= 1, got {self.min_engines}",
                                       reason=Reason.INVALID_MIN_ENGINES)

    def check_pause_mode(self, pause_mode: PauseMode) -> None:
        """Raises InvalidArgumentError (INVALID_KEEP_CACHE): `keep_cache` with a pause mode
        other than KEEP, which parks no request whose cache there would be to keep."""
        if self.keep_cache and pause_mode is not PauseMode.KEEP:
            raise InvalidArgumentError(f"keep_cache needs pause_mode KEEP, got {pause_mode.value}",
                                       reason=Reason.INVALID_KEEP_CACHE)

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

# The keywords `refit()`, `update_weights()` and `flip()` took before `epoch=` and `checks=`
# (deprecated: they work for one release, with a DeprecationWarning).
LEGACY_KEYWORDS = {"refit": ("flush", "verify_weights", "canary", "mode", "min_engines", "delta"),
                   "update_weights": ("verify_weights", "canary", "mode")}


def options(what: str, epoch: Epoch | None, checks: Checks | None,
            legacy: Mapping[str, Any], adapter: bool = False) -> tuple[Epoch, Checks]:
    """The epoch and checks `refit()` or `update_weights()` was given: `epoch=` and `checks=`,
    or (deprecated) the keywords of `LEGACY_KEYWORDS[what]`, never both. `adapter`: the plan
    is an adapter's, whose epochs are staged (the default `Staged(reversible=False)`: an adapter
    flip keeps no previous copy, docs/adapters.md).

    Raises:
        TypeError: a keyword the call never took.
        InvalidArgumentError: both shapes at once, an `epoch` that is neither `InPlace` nor
            `Staged` (INVALID_EPOCH_MODE), or old keywords of the other mode.
    """
    unknown = sorted(set(legacy) - set(LEGACY_KEYWORDS[what]))
    if unknown:
        raise TypeError(f"{what}() got unexpected keyword arguments {unknown}")
    if legacy:
        if epoch is not None or checks is not None:
            raise InvalidArgumentError(f"{what}(): pass epoch=/checks= or the deprecated "
                                       f"keywords {sorted(legacy)}, not both",
                                       reason=Reason.INVALID_ARGUMENT)
        warnings.warn(f"{what}({', '.join(f'{k}=' for k in sorted(legacy))}) is deprecated: "
                      "pass epoch=InPlace(flush=...) or Staged(min_engines=..., delta=...) and "
                      "checks=Checks(verify=..., canary=...)", RefitDeprecationWarning,
                      stacklevel=3)
        checks = Checks(verify=legacy.get("verify_weights", False), canary=legacy.get("canary"))
        epoch = _from_keywords(legacy)
    if epoch is not None and not isinstance(epoch, InPlace | Staged):
        raise InvalidArgumentError(f"epoch must be InPlace(...) or Staged(...), got {epoch!r}",
                                   reason=Reason.INVALID_EPOCH_MODE)
    if adapter:
        if isinstance(epoch, InPlace):
            raise InvalidArgumentError(
                f"{what}(): an adapter epoch is staged (its flip replaces the adapter without "
                "pausing the engine); pass Staged(...) or no epoch", reason=Reason.ADAPTER_NOT_STAGED)
        return dataclasses.replace(epoch or Staged(), reversible=False), checks or Checks()
    return epoch or InPlace(), checks or Checks()


def _from_keywords(legacy: Mapping[str, Any]) -> Epoch:
    """The epoch the deprecated keywords describe (options of the other mode refused)."""
    try:
        mode = EpochMode(legacy.get("mode", EpochMode.IN_PLACE))
    except ValueError:
        raise InvalidArgumentError(f"mode must be one of {[m.value for m in EpochMode]}, "
                                   f"got {legacy['mode']!r}",
                                   reason=Reason.INVALID_EPOCH_MODE) from None
    if mode is EpochMode.STAGED:
        return Staged(min_engines=legacy.get("min_engines"), delta=legacy.get("delta", False))
    if legacy.get("delta"):
        raise InvalidArgumentError("delta=True is for staged epochs (mode=\"staged\")",
                                   reason=Reason.INVALID_DELTA)
    if legacy.get("min_engines") is not None:
        raise InvalidArgumentError("min_engines is for staged epochs: an in-place epoch "
                                   "cannot leave an engine behind unharmed",
                                   reason=Reason.INVALID_MIN_ENGINES)
    return InPlace(flush=legacy.get("flush", True))


def reopened(handle: Any, legacy: Mapping[str, Any]) -> None:
    """`flip()`'s deprecated keywords (`min_engines`, `pause_mode`, `verify_weights`,
    `canary`) replace what the staged epoch `handle` was opened with, as before the handle
    carried them (then a flip checked only what it was told to)."""
    unknown = sorted(set(legacy) - {"min_engines", "pause_mode", "verify_weights", "canary"})
    if unknown:
        raise TypeError(f"flip() got unexpected keyword arguments {unknown}")
    warnings.warn(f"flip({', '.join(f'{k}=' for k in sorted(legacy))}) is deprecated: the "
                  "epoch carries them (update_weights(epoch=Staged(min_engines=...), "
                  "checks=Checks(...)))", RefitDeprecationWarning, stacklevel=3)
    handle.epoch = Staged(min_engines=legacy.get("min_engines"), delta=handle.epoch.delta,
                          reversible=handle.epoch.reversible)
    handle.pause_mode = legacy.get("pause_mode", PauseMode.KEEP)
    handle.checks = Checks(verify=legacy.get("verify_weights", False),
                           canary=legacy.get("canary"))


__all__ = ["LEGACY_KEYWORDS", "Epoch", "InPlace", "Staged", "options", "reopened"]
