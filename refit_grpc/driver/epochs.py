"""The fleet's epochs: opening one on the data group's members (an `EpochHandle` each), the
fleet's versions (the highest opened, the one its members' committed copies hold), the delta
base, and the epochs still open (closed with the fleet)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from refit_grpc.common import PauseMode
from refit_grpc.dataplane.staging import STAGED_CHECKSUM
from refit_grpc.driver.calls import ShimCalls
from refit_grpc.driver.catch_up import CatchUps
from refit_grpc.driver.checks import Checks
from refit_grpc.driver.config import FleetConfig
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.groups import GroupFormation
from refit_grpc.driver.membership import Membership, links, rank_bundles
from refit_grpc.driver.options import Epoch, Staged
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import EPOCH_MODE_TO_PROTO, PAUSE_MODE_TO_PROTO, pb


@dataclass(frozen=True)
class DeltaBase:
    """What a delta epoch is computed against: the last staged epoch that flipped with
    `delta=True`, as every engine that flipped holds it (the trainer's one extra copy)."""

    version: int
    staged_digest: str
    flat: torch.Tensor  # the plan's bytes, in plan layout

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


class Epochs:
    """Opens the fleet's epochs and keeps their books (module docstring).

    Args:
        config: the fleet's configuration (epoch and flip deadlines).
        calls: the calls to the shims (the epoch's streams run on its I/O loop).
        membership: the shims; an epoch runs on the data group's.
        formation: the data group (its name; an epoch that gives up drops it).
        catch_ups: settled before each epoch opens.
    """

    def __init__(self, config: FleetConfig, calls: ShimCalls, membership: Membership,
                 formation: GroupFormation, catch_ups: CatchUps):
        self.config = config
        self.calls = calls
        self.membership = membership
        self.formation = formation
        self.catch_ups = catch_ups
        # The highest version opened (not committed): the next epoch's default moves on either
        # way, since a shim refuses a repeated version only once it has committed it.
        self.latest = 0
        # (version, staged digest) of the last staged epoch that flipped, as the members'
        # committed copies hold it; None after an in-place one (which ends the copies) and
        # while an epoch runs. What a catch-up serves.
        self.committed: tuple[int, str] | None = None
        # The last staged epoch that flipped with delta=True (`refit_grpc.dataplane.delta`).
        self.delta_base: DeltaBase | None = None
        self._open: list[EpochHandle] = []
        self._lock = threading.Lock()

    def next_version(self, version: int | None) -> int:
        """`version`, or by default the latest opened + 1."""
        return self.latest + 1 if version is None else version

    def open(self, plan: RefitPlan, version: int | None, *, epoch: Epoch, checks: Checks,
             pause_mode: PauseMode = PauseMode.KEEP,
             on_progress: ProgressCallback | None = None,
             delta_base: DeltaBase | None = None,
             resume_on_commit: bool = False) -> EpochHandle:
        """Open an epoch on the data group's members (`Fleet.update_weights()` documents it):
        catch-ups settled first, the membership checked, each shim told the instance it
        joined as (a shim restarted since refuses: no Describe round trip first).
        `resume_on_commit` (in place): each engine serves again at its own commit, its COMMITTED
        saying whether it did (`resumed`), instead of waiting for a Flush."""
        self.catch_ups.settle()
        self.membership.check_unchanged()
        self.committed = None  # the epoch overwrites (staged) or ends (in place) the copies
        version = self.next_version(version)
        self.latest = max(self.latest, version)
        group = self.membership.group
        staged = isinstance(epoch, Staged)
        requests = [pb.UpdateWeightsRequest(
            version=version, plan_digest=plan.digest, group_id=self.formation.group_id,
            pause_mode=PAUSE_MODE_TO_PROTO[pause_mode], instance_id=m.joined_as or "",
            verify_weights=checks.verify,
            canary=checks.canary.to_proto() if checks.canary else None,
            mode=EPOCH_MODE_TO_PROTO[epoch.mode],
            flip_timeout_s=self.config.flip_timeout_s if staged else 0.0,
            delta_base_version=delta_base.version if delta_base else 0,
            delta_base_digest=delta_base.staged_digest if delta_base else "",
            reversible=isinstance(epoch, Staged) and epoch.reversible,
            staged_checksum=STAGED_CHECKSUM if staged else "",
            resume_on_commit=resume_on_commit)
            for m in group]
        handle = EpochHandle(links(group), version, requests, self.config.epoch_timeout_s,
                             self.formation.abort_epoch, on_progress, io=self.calls.io,
                             epoch=epoch, checks=checks, pause_mode=pause_mode,
                             bundles=rank_bundles(group) if self.config.stream_per_process
                             else [])
        with self._lock:
            # Finished epochs are dropped here, so a long run keeps only the open ones.
            self._open = [e for e in self._open if not e.closed] + [handle]
        return handle

    def close(self) -> list[EpochHandle]:
        """End every open epoch (streams cancelled, consumers joined, bounded).

        Returns:
            The epochs that were open.
        """
        with self._lock:
            epochs, self._open = self._open, []
        for epoch in epochs:
            epoch.close()
        return epochs


@dataclass(frozen=True)
class RoundParts:
    """What an epoch of either mode (`InPlaceRound`, `StagedRound`) is run with.

    Args:
        calls: the calls to the shims.
        membership: the shims.
        formation: the data group (dropped when an epoch fails, re-formed by a staged one).
        epochs: opens each epoch (and its `config`).
    """

    calls: ShimCalls
    membership: Membership
    formation: GroupFormation
    epochs: Epochs


__all__ = ["DeltaBase", "Epochs", "RoundParts"]
