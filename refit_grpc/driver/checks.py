"""What an epoch checks after its engines commit (in place) or flip (staged), before any of
them serves the new version: every engine's weights digest the same (`verify`), and every
engine's canary log-probabilities close to the trainer's (`canary`). `Checks` is the value an
epoch carries from its opening to its end, so a flip repeats nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from refit_grpc.canary import Canary
from refit_grpc.driver.calls import WorkerLink
from refit_grpc.driver.failures import (
    CanaryMismatchError,
    WeightsMismatchError,
    WorkerFailure,
    odd_digests,
)
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason


@dataclass(frozen=True)
class Checks:
    """What an epoch checks before any engine serves the new version.

    Args:
        verify: every engine computes its weights digest at commit (staged: at the flip);
            engines that disagree raise `WeightsMismatchError` and stay paused.
        canary: every engine computes the canary's teacher-forced log-probabilities after
            the commit (staged: after the flip's load); an engine farther from the trainer's
            than `canary.tolerance` raises `CanaryMismatchError` and all stay paused.
    """

    verify: bool = False
    canary: Canary | None = None

    @property
    def any(self) -> bool:
        """Something is checked (a staged flip then holds the engines paused until it is)."""
        return self.verify or self.canary is not None

    def run(self, version: int, committed: Sequence[pb.UpdateWeightsResponse],
            links: Sequence[WorkerLink]) -> None:
        """Both checks, on one COMMITTED (or flip answer) per link.

        Raises:
            WeightsMismatchError: `verify`, and the engines' digests differ.
            CanaryMismatchError: `canary`, and an engine is out of tolerance.
        """
        if self.verify:
            same_weights(version, committed, links)
        if self.canary is not None:
            canary_close(version, self.canary, committed, links)


def same_weights(version: int, committed: Sequence[pb.UpdateWeightsResponse],
                 links: Sequence[WorkerLink]) -> None:
    """Every engine of the epoch must report the same weights digest. The largest group of
    equal digests is taken as the fleet's; every other engine is named (with two engines that
    disagree, both are).

    Raises:
        WeightsMismatchError: naming the engines whose digest is not the fleet's.
    """
    digests = [m.weights_digest for m in committed]
    majority, odd_indexes = odd_digests(digests)
    if not odd_indexes:
        return
    odd = [WorkerFailure(links[i].endpoint.instance_id, links[i].endpoint.address,
                         grpc.StatusCode.DATA_LOSS, Reason.WEIGHTS_MISMATCH,
                         f"weights digest {digests[i][:16] or '(none)'} at version {version}"
                         + (f", the fleet's is {majority[:16]}" if majority else ""))
           for i in odd_indexes]
    raise WeightsMismatchError(f"epoch {version}: engines hold different weights; held "
                               "paused, not flushed", odd)


def canary_close(version: int, canary: Canary, committed: Sequence[pb.UpdateWeightsResponse],
                 links: Sequence[WorkerLink]) -> None:
    """Compare every engine's canary log-probabilities with the trainer's.

    Raises:
        CanaryMismatchError: naming every engine whose canary log-probabilities are farther
            than `canary.tolerance` from the trainer's (or missing), with every engine's gap.
    """
    gaps = {w.endpoint.instance_id: canary.gap(m.canary) for w, m in zip(links, committed)}
    odd = []
    for w, m in zip(links, committed):
        gap = gaps[w.endpoint.instance_id]
        if gap <= canary.tolerance:
            continue
        why = (f"no canary computed: {m.canary.error}" if m.canary.error
               else f"log-probabilities {gap:.3g} from the trainer's at worst "
                    f"(tolerance {canary.tolerance:g})")
        odd.append(WorkerFailure(w.endpoint.instance_id, w.endpoint.address,
                                 grpc.StatusCode.DATA_LOSS, Reason.CANARY_MISMATCH,
                                 f"version {version}: {why}"))
    if odd:
        raise CanaryMismatchError(
            f"epoch {version}: engines compute other log-probabilities than the trainer's; "
            "held paused, not flushed", odd, gaps=gaps)


__all__ = ["Checks", "canary_close", "same_weights"]
