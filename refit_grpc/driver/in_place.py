"""One in-place epoch across the fleet (`Fleet.refit(epoch=InPlace())`): open it on the data
group, wait for every ACCEPTED, broadcast, wait for every COMMITTED, run the epoch's checks,
then (by default) flush so the engines serve the new weights. Any failure drops the group.

Without checks nothing is compared before the engines serve, so the flush is not a call: each
shim clears its engine's caches and resumes it right after its own commit (`resume_on_commit`),
before its COMMITTED. No engine waits for the slowest one and one more round trip, and the
trainer spends no call per engine on it; an engine whose resume failed (COMMITTED `resumed`
false) is flushed as before."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from refit_grpc.common import PauseMode
from refit_grpc.driver.checks import Checks
from refit_grpc.driver.epoch import ProgressCallback
from refit_grpc.driver.epochs import RoundParts
from refit_grpc.driver.failures import EpochFailedError, FleetError
from refit_grpc.driver.links import TrainerLink
from refit_grpc.driver.membership import links
from refit_grpc.driver.options import InPlace
from refit_grpc.driver.reports import EpochReport, WorkerReport
from refit_grpc.errors import RefitError
from refit_grpc.plan import RefitPlan


class InPlaceRound(RoundParts):
    """Runs in-place epochs (module docstring), from `RoundParts`."""

    def run(self, link: TrainerLink, tensors: Mapping[str, torch.Tensor], plan: RefitPlan,
            version: int | None, *, epoch: InPlace, checks: Checks, pause_mode: PauseMode,
            on_progress: ProgressCallback | None) -> EpochReport:
        """One in-place epoch (`Fleet.refit()` documents it)."""
        t0 = time.monotonic()
        resume_on_commit = epoch.flush and not checks.any
        handle = self.epochs.open(plan, version, epoch=epoch, checks=checks,
                                  pause_mode=pause_mode, on_progress=on_progress,
                                  resume_on_commit=resume_on_commit)
        shims = links(self.membership.group)
        try:
            handle.wait_accepted()
        except FleetError:
            self._group_finished(link)
            raise
        try:
            stats = link.sender.send(tensors, handle.send_deadline())
        except RefitError as e:
            self._group_finished(link)
            handle.abort(f"epoch {handle.version}: broadcast failed")
            try:
                handle.result(timeout_s=5.0)
            except FleetError as fe:
                raise EpochFailedError(f"broadcast failed ({e})", fe.failures,
                                       reason=e.reason) from e
            raise EpochFailedError(f"broadcast failed ({e})", [], reason=e.reason) from e
        try:
            committed = handle.result()
        except FleetError:
            self._group_finished(link)
            raise
        seconds = time.monotonic() - t0
        checks.run(handle.version, committed, shims)
        if epoch.flush:
            paused = ([w for w, m in zip(shims, committed) if not m.resumed]
                      if resume_on_commit else links(self.membership.members))
            if paused:
                self.calls.flush(paused)
        canary = checks.canary
        return EpochReport(
            version=handle.version, bytes=stats.bytes, seconds=seconds,
            broadcast_seconds=stats.seconds,
            workers=tuple(WorkerReport(w.endpoint.instance_id, m.seconds, m.bytes_received,
                                       m.weights_digest,
                                       canary.gap(m.canary) if canary else None,
                                       m.canary.seconds if canary else None)
                          for w, m in zip(shims, committed)))

    def _group_finished(self, link: TrainerLink) -> None:
        """The shims tore their ends down: this group is finished."""
        link.close()
        self.formation.drop()


__all__ = ["InPlaceRound"]
