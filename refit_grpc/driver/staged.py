"""Staged epochs across the fleet (docs/protocol.md, "Staged epochs", "Delta epochs"): stage on
every member, re-form the group without the engines that failed until enough staged, decide the
quorum, flip each engine once, run the epoch's checks and resume the engines together.
`Fleet.refit(epoch=Staged(...))` runs a whole one (`StagedRound.run`); `Fleet.flip()` ends one
a trainer broadcast itself (`StagedRound.flip`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import grpc
import torch

from refit_grpc.common import EpochMode, PauseMode
from refit_grpc.dataplane.delta import flat_copy, send_delta
from refit_grpc.dataplane.packing import pack_into
from refit_grpc.dataplane.staging import StagedDigest
from refit_grpc.driver.checks import Checks
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.epochs import DeltaBase, RoundParts
from refit_grpc.driver.failures import (
    CanaryMismatchError,
    FleetError,
    QuorumError,
    WeightsMismatchError,
    WorkerFailure,
    explained_by_abort,
    odd_digests,
)
from refit_grpc.driver.links import GlooLink, TrainerLink
from refit_grpc.driver.membership import Member, links, rank_bundles
from refit_grpc.driver.options import Staged
from refit_grpc.driver.reports import EpochReport, RollbackReport, WorkerReport
from refit_grpc.driver.rollback import Rollbacks, no_previous_copy
from refit_grpc.errors import InvalidArgumentError, RefitError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)

# A staged epoch forms its group again without the engines that failed at most this often:
# each round loses at least one engine, and a fault that follows every round is not one engine's.
_MAX_REFORMS = 3
# How long the engines of a failed staging round get to show they are alive before they are left
# behind (`StagedRound._worth_another_round`).
_LIVENESS_PROBE_S = 5.0


def _staged_digest_of(plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> str:
    """The trainer's staged digest, packed apart from any send (a round whose send failed before
    every bucket went out still needs it to judge what the engines that did finish staged)."""
    digest = StagedDigest(plan)
    buf = torch.empty(max(b.nbytes for b in plan.buckets), dtype=torch.uint8)
    for b in plan.buckets:
        digest.add(b, pack_into(buf, [tensors[s.name].detach().cpu()
                                      for s in plan.tensors[b.start:b.stop]]))
    return digest.hexdigest()


def _other_bytes(member: Member, got: str, expected: str, whose: str) -> WorkerFailure:
    """An engine staged other bytes than `expected` (STAGED_DIGEST_MISMATCH)."""
    return WorkerFailure(member.instance_id, member.endpoint.address, grpc.StatusCode.DATA_LOSS,
                         Reason.STAGED_DIGEST_MISMATCH,
                         f"staged {got[:16]}, {whose} {expected[:16]}")


@dataclass
class _Staging:
    """One staged epoch's books, over its rounds."""

    version: int
    started: float
    pending: list[Member]  # who the current round stages on
    behind: dict[Member, WorkerFailure]  # left behind, and why
    staged: dict[Member, pb.UpdateWeightsResponse] = field(default_factory=dict)
    staged_as: dict[Member, str] = field(default_factory=dict)  # the instance each staged as
    digest: str | None = None  # the trainer's staged digest
    broadcast_s: float = 0.0
    wire_bytes: int = 0
    reforms: int = 0


class StagedRound(RoundParts):
    """Runs staged epochs and flips them (module docstring), from `RoundParts`: the shims
    left behind are recorded in the membership, the group re-formed without them, the
    committed version and the delta base kept by the epochs."""

    # --- a whole staged epoch -------------------------------------------------------------

    def run(self, link: TrainerLink, tensors: Mapping[str, torch.Tensor], plan: RefitPlan,
            version: int | None, *, epoch: Staged, checks: Checks, pause_mode: PauseMode,
            on_progress: ProgressCallback | None,
            gone: Mapping[Member, WorkerFailure]) -> EpochReport:
        """Stage on every member, re-forming the group without the engines that failed until
        enough staged, then flip them (`Fleet.refit()` documents it). `gone`: members the
        re-forming before the epoch left behind."""
        required = epoch.required(len(self.membership.members))
        run = _Staging(self.epochs.next_version(version), time.monotonic(),
                       list(self.membership.members), dict(gone))
        spent = self.epochs.delta_base
        base = self._delta_base(link) if epoch.delta else None
        self.epochs.delta_base = None  # whatever happens below, the old base is spent
        sent_delta = base is not None
        while True:
            failures = self._stage_round(run, link, tensors, plan, base, epoch, checks,
                                         pause_mode, on_progress)
            retry = self._worth_another_round(run.pending, failures, run.behind)
            if not failures or not retry or len(run.staged) + len(retry) < required:
                break  # staged, or too few left to matter (they are not to blame: not behind)
            if run.reforms >= _MAX_REFORMS:
                for m in retry:  # failed round after round: no more rounds for them
                    run.behind.setdefault(m, next(f for f in failures
                                                  if f.instance_id == m.instance_id))
                break
            # Re-form the group among the engines that still need the bytes; those STAGED
            # keep their copies and wait for the flip.
            run.reforms += 1
            log.warning("epoch %d: %d staged, %d left behind (%s); re-forming the group for "
                        "%d", run.version, len(run.staged), len(run.behind),
                        ", ".join(m.instance_id for m in run.behind), len(retry))
            lost = self.formation.reform(link, retry, plan, leave_behind=True)
            run.behind.update(lost)
            run.pending = [m for m in retry if m not in lost]
            base = None  # a failed round spent the base (engines' and the trainer's): full
        assert run.digest is not None
        report = self._finish(run, plan, required, pause_mode, checks, epoch)
        if self.formation.group_id is None:
            # The last round aborted after every engine left in it had staged (none to
            # re-form it for): the fleet goes on, and the next refit() forms the group again
            # of the members, as after any membership change. (Measured in CI at 160 engines:
            # a whole process SIGKILLed as its bytes landed.)
            self.formation.reform_owed = True
        if epoch.delta:
            # The next delta's base: what every engine that flipped now holds.
            flat = base.flat if base is not None else \
                flat_copy(plan, tensors, out=spent.flat if spent is not None else None)
            self.epochs.delta_base = DeltaBase(run.version, run.digest, flat)
        return replace(report, delta=sent_delta, wire_bytes=run.wire_bytes)

    def _stage_round(self, run: _Staging, link: TrainerLink,
                     tensors: Mapping[str, torch.Tensor], plan: RefitPlan,
                     base: DeltaBase | None, epoch: Staged, checks: Checks,
                     pause_mode: PauseMode, on_progress: ProgressCallback | None
                     ) -> list[WorkerFailure]:
        """One round: open the epoch on the group, send (full or delta), settle; the engines
        that staged the trainer's digest join `run.staged`, those that staged other bytes
        `run.behind`. Returns the round's failures."""
        handle = self.epochs.open(plan, run.version, epoch=epoch, checks=checks,
                                  pause_mode=pause_mode, on_progress=on_progress,
                                  delta_base=base)
        joined = {m: m.joined_as or "" for m in self.membership.group}
        checksums = StagedDigest(plan)
        try:
            handle.wait_accepted()
            if base is not None:
                assert isinstance(link, GlooLink)  # _delta_base checked it
                sent = send_delta(link.group, plan, tensors, base.flat, handle.send_deadline(),
                                  checksums.add)
                run.broadcast_s += sent.seconds
                run.wire_bytes += sent.wire_bytes
            else:
                stats = link.sender.send(tensors, handle.send_deadline(), checksums=checksums)
                run.broadcast_s += stats.seconds
                run.wire_bytes += stats.bytes
        except FleetError:
            pass  # wait_accepted aborted the epoch; settle() names who refused
        except RefitError as e:
            handle.abort(f"epoch {run.version}: broadcast failed ({e})")
        finals, failures = handle.settle()
        if run.digest is None:
            run.digest = checksums.hexdigest() if checksums.complete else \
                _staged_digest_of(plan, tensors)
        for m, msg in zip(run.pending, finals):
            if msg is None:
                continue
            if msg.staged_digest == run.digest:
                run.staged[m], run.staged_as[m] = msg, joined.get(m, "")
            else:
                run.behind[m] = _other_bytes(m, msg.staged_digest, run.digest,
                                             "the trainer sent")
        return failures

    def _delta_base(self, link: TrainerLink) -> DeltaBase | None:
        """The last staged epoch's base when a delta against it can go: the gloo link, and
        every member's committed copy is that version with that digest (one Describe round);
        None: a full epoch."""
        base = self.epochs.delta_base
        if base is None or not isinstance(link, GlooLink):
            return None
        shims = links(self.membership.members)
        answers = self.calls.each("Describe", shims,
                                  lambda w: pb.DescribeRequest(skip_weights_digest=True))
        odd = [w.endpoint.instance_id for w, a in zip(shims, answers)
               if not isinstance(a, pb.DescribeResponse)
               or (a.committed_copy_version, a.committed_copy_digest)
               != (base.version, base.staged_digest)]
        if odd:
            log.info("delta epoch after version %d: full instead, %s hold another copy",
                     base.version, ", ".join(odd))
            return None
        return base

    def _worth_another_round(self, pending: Sequence[Member],
                             failures: Sequence[WorkerFailure],
                             behind: dict[Member, WorkerFailure]) -> list[Member]:
        """Sort the engines of a staging round that did not stage: left behind (`behind`), or
        worth another round (returned). Another round is for an engine that is alive, the same
        instance, not BROKEN, and whose failure the round's abort or a dead peer explains; the
        rest caused the failure or refused on their own."""
        by_id = {f.instance_id: f for f in failures}
        failed = [m for m in pending if m.instance_id in by_id and m not in behind]
        if not failed:
            return []
        # One try each: a dead shim refuses at once, a frozen one is as good as dead for this
        # epoch. Bounded by _LIVENESS_PROBE_S, not Abort's second: at width a shim process
        # busy tearing down the receives of its engines answers late, not never (measured: a
        # 1 s bound judged about 480 of 1,000 simulated engines dead, and the quorum failed).
        request = pb.DescribeRequest(skip_weights_digest=True)
        config = self.epochs.config
        answers = self.calls.once("Describe", links(failed), lambda w: request,
                                  max(config.abort_timeout_s,
                                      min(config.control_timeout_s, _LIVENESS_PROBE_S)))
        retry = []
        for m, answer in zip(failed, answers):
            f = by_id[m.instance_id]
            # (The round's abort dropped the group, so `joined_as` is None here unless the
            # round ended without one: the instance is then compared with the one it joined.)
            alive = isinstance(answer, pb.DescribeResponse) \
                and answer.instance_id == (m.joined_as or answer.instance_id) \
                and answer.state != pb.SHIM_STATE_BROKEN
            # UNRESPONSIVE (no answer to Abort in time, its stream then cancelled by the
            # driver) that answers this probe was slow, not frozen: at 1,000 simulated engines
            # whole shim processes tearing down 50 receives each missed Abort's second.
            if alive and (explained_by_abort(f) or f.reason == Reason.UNRESPONSIVE):
                retry.append(m)
            else:
                behind[m] = f if alive or not isinstance(answer, WorkerFailure) else answer
        return retry

    # --- the flip -------------------------------------------------------------------------

    def flip(self, handle: EpochHandle, plan: RefitPlan, staged_digest: str | None
             ) -> EpochReport:
        """End a staged epoch a trainer broadcast itself, as it was opened (its `epoch`,
        `checks`, `pause_mode`): `Fleet.flip()` documents it."""
        if not isinstance(handle.epoch, Staged):
            raise InvalidArgumentError("flip() ends a staged epoch; this one is in place",
                                       reason=Reason.INVALID_EPOCH_MODE)
        group = self.membership.group
        required = handle.epoch.required(len(group))
        joined = {m: m.joined_as or "" for m in group}
        finals, failures = handle.settle()
        if staged_digest is None:
            staged_digest, _ = odd_digests([m.staged_digest if m else "" for m in finals])
            staged_digest = staged_digest or ""
        by_id = {f.instance_id: f for f in failures}
        run = _Staging(handle.version, handle.started_at, group, {}, digest=staged_digest)
        for m, msg in zip(group, finals):
            if msg is not None and msg.staged_digest == staged_digest:
                run.staged[m], run.staged_as[m] = msg, joined[m]
            elif msg is not None:
                run.behind[m] = _other_bytes(m, msg.staged_digest, staged_digest, "expected")
            elif m.instance_id in by_id:
                run.behind[m] = by_id[m.instance_id]
        return self._finish(run, plan, required, handle.pause_mode, handle.checks,
                            handle.epoch)

    def _finish(self, run: _Staging, plan: RefitPlan, required: int, pause_mode: PauseMode,
                checks: Checks, epoch: Staged) -> EpochReport:
        """The decision and the flip of a staged epoch: quorum or nothing, each engine flipped
        once, checked, and (when held paused for the checks) resumed together; a reversible
        epoch whose checks failed is rolled back (`_roll_back_after`)."""
        assert run.digest is not None
        version, behind = run.version, run.behind
        mismatched = [m for m, f in behind.items() if f.reason == Reason.STAGED_DIGEST_MISMATCH]
        if mismatched:  # their copies are not what was sent: dropped now, not at the timeout
            self.calls.abort(f"epoch {version}: staged other bytes than the trainer sent",
                             links(mismatched))
        if len(run.staged) < required:
            self._drop_staged(version, run.staged)
            self.membership.leave_behind(behind)
            raise QuorumError(f"epoch {version}: {len(run.staged)} of "
                              f"{len(self.membership.members)} engines staged it, {required} "
                              "required; nothing flipped, every engine serves the previous "
                              "version", list(behind.values()),
                              staged=[m.instance_id for m in run.staged])
        flipped, flip_failures = self._flip_each(version, run.digest, run.staged_as,
                                                 pause_mode, stay_paused=checks.any,
                                                 keep_cache=epoch.keep_cache)
        behind.update(flip_failures)
        self.membership.leave_behind(behind)
        if len(flipped) < required:
            raise QuorumError(f"epoch {version}: {len(flipped)} engines flipped to it, "
                              f"{required} required", list(behind.values()),
                              staged=[m.instance_id for m in flipped])
        self.epochs.committed = (version, run.digest)
        shims = links(list(flipped))
        as_committed = [pb.UpdateWeightsResponse(weights_digest=a.weights_digest,
                                                 canary=a.canary) for a in flipped.values()]
        rollback = None
        try:
            checks.run(version, as_committed, shims)
        except (CanaryMismatchError, WeightsMismatchError) as e:
            failed_checks = {f.instance_id: f for f in e.failures}
            rejected = {m: failed_checks[m.instance_id] for m in flipped
                        if m.instance_id in failed_checks}
            if not rejected or len(flipped) - len(rejected) < required:
                # The version itself is suspect (or too few engines are right): all go back.
                if epoch.reversible:
                    self._roll_back_after(e, version, flipped, run.staged_as, pause_mode)
                raise
            # A quorum passed the checks: the version is right and the engines that failed
            # them are at fault. They go back to the previous version (or, without a copy to go
            # back to, stay held paused) and are left behind; the others serve the version.
            if epoch.reversible:
                rollback = self._roll_back_minority(version, run.digest, rejected, flipped,
                                                    run.staged_as, pause_mode)
            log.warning("epoch %d: %d engines failed the checks and are left behind (%s); %d "
                        "serve it", version, len(rejected), e, len(flipped) - len(rejected))
            behind.update(rejected)
            self.membership.leave_behind(rejected)
            flipped = {m: a for m, a in flipped.items() if m not in rejected}
            shims = links(list(flipped))
        if checks.any:
            # Held paused by the flip until every engine was checked: now all serve at once.
            self.calls.flush(shims, pause_mode, "resume after the flip failed")
        canary = checks.canary
        return EpochReport(
            version=version, bytes=plan.total_bytes, seconds=time.monotonic() - run.started,
            broadcast_seconds=run.broadcast_s,
            workers=tuple(WorkerReport(
                m.instance_id, run.staged[m].seconds, run.staged[m].bytes_received,
                a.weights_digest, canary.gap(a.canary) if canary else None,
                a.canary.seconds if canary else None, stall_seconds=a.stall_seconds,
                load_seconds=a.load_seconds) for m, a in flipped.items()),
            mode=EpochMode.STAGED, left_behind=tuple(behind.values()), reforms=run.reforms,
            rollback=rollback)

    def _roll_back_after(self, error: FleetError, version: int,
                         flipped: Mapping[Member, pb.FlipResponse],
                         staged_as: Mapping[Member, str], pause_mode: PauseMode) -> None:
        """The checks rejected `version` after the flip, the engines held paused: put every
        one back (`_roll_back`). The report goes on `error` (`error.rollback`), which the
        caller raises."""
        report = self._roll_back(version, flipped, staged_as, pause_mode)
        error.rollback = report
        error.add_note(f"rolled back to version {report.version} on {len(report.workers)} of "
                       f"{len(flipped)} engines" + (
                           "" if report.complete else "; not: " + "; ".join(
                               str(f) for f in report.failed)))

    def _roll_back_minority(self, version: int, digest: str,
                            rejected: Mapping[Member, WorkerFailure],
                            flipped: Mapping[Member, pb.FlipResponse],
                            staged_as: Mapping[Member, str],
                            pause_mode: PauseMode) -> RollbackReport:
        """Only `rejected` go back; the fleet stays at `version`: its committed copy and delta
        base are the version's still (a rollback of the whole fleet would forget them)."""
        committed, base = self.epochs.committed, self.epochs.delta_base
        report = self._roll_back(version, {m: flipped[m] for m in rejected}, staged_as,
                                 pause_mode)
        self.epochs.committed, self.epochs.delta_base = (version, digest), base
        assert committed == (version, digest), (committed, version, digest)
        return report

    def _roll_back(self, version: int, flipped: Mapping[Member, pb.FlipResponse],
                   staged_as: Mapping[Member, str], pause_mode: PauseMode) -> RollbackReport:
        """Put every engine of `flipped` that kept a previous copy back on it and resume them
        (`Rollbacks`); those that kept none stay paused at `version`. An engine that could not
        be rolled back (no copy, or gone: killed after its flip) is left behind: the next
        epoch forms the group without it, a catch-up or `readmit()` brings it back."""
        previous = {m: a.previous_copy_version for m, a in flipped.items()}
        able = [m for m, v in previous.items() if v]
        to_versions = {previous[m] for m in able}
        cannot = tuple(no_previous_copy(m, version) for m in flipped if not previous[m])
        if len(to_versions) == 1:
            (to_version,) = to_versions
            report = Rollbacks(self.calls, self.epochs).run(able, version, to_version,
                                                            pause_mode, staged_as)
            report = replace(report, failed=report.failed + cannot)
        else:  # none kept one, or they kept different versions: nothing to agree on
            report = RollbackReport(version=version, rolled_back_from=version, workers=(),
                                    stall_seconds=0.0, failed=cannot + tuple(
                                        no_previous_copy(m, version) for m in able))
        by_id = {m.instance_id: m for m in flipped}
        self.membership.leave_behind({by_id[f.instance_id]: f for f in report.failed
                                      if f.instance_id in by_id})
        return report

    def _flip_each(self, version: int, digest: str, staged_as: Mapping[Member, str],
                   pause_mode: PauseMode, stay_paused: bool, keep_cache: bool = False
                   ) -> tuple[dict[Member, pb.FlipResponse], dict[Member, WorkerFailure]]:
        """Flip every engine that staged, in parallel, each once (a Flip that reached its
        shim is not repeated): each answer, or why it did not flip. Each Flip names the
        instance that staged, so a shim restarted since cannot flip what it lost."""
        members = list(staged_as)
        requests = [pb.FlipRequest(
            version=version, staged_digest=digest, pause_mode=PAUSE_MODE_TO_PROTO[pause_mode],
            stay_paused=stay_paused, instance_id=staged_as[m], keep_cache=keep_cache)
            for m in members]
        # Engines of one shim process sharing a rank flip in one FlipEngines call.
        bundles = rank_bundles(members) if self.epochs.config.stream_per_process else []
        answers = self.calls.flips(links(members), requests, bundles,
                                   self.epochs.config.epoch_timeout_s)
        flipped: dict[Member, pb.FlipResponse] = {}
        failed: dict[Member, WorkerFailure] = {}
        for m, answer in zip(members, answers):
            if isinstance(answer, WorkerFailure):
                failed[m] = answer
            else:
                flipped[m] = answer
        return flipped, failed

    def _drop_staged(self, version: int, staged: Mapping[Member, object]) -> None:
        """Nothing flips: the engines that staged drop their copies now (rather than at their
        flip timeout). Abort does it; it also drops their group, which this epoch already
        ended for the others."""
        if staged:
            self.calls.abort(f"epoch {version}: quorum not met", links(list(staged)))
        self.formation.drop()


__all__ = ["StagedRound"]
