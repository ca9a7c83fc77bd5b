"""Rolling the fleet back to the version before its last flip (docs/protocol.md, "Rollback").

A reversible staged epoch (`Staged(reversible=True)`, the default) leaves each engine holding
its previous copy: the committed copy as it was before the flip. A rollback has every engine
load it (the shim's Rollback: a flip of that copy), held paused until all did, then resumes them
together, so the fleet serves the old version everywhere at once. Two callers:

- `StagedRound`: a staged epoch whose checks (canary, verify) failed after the flip puts every
  flipped engine back, then raises the check's error with the rollback's report attached
  (`error.rollback`): no engine is left paused or on the rejected version where it held a
  previous copy.
- `Fleet.rollback()`: an operator (or the trainer) takes the fleet back one version.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence

import grpc

from refit_grpc.common import PauseMode
from refit_grpc.driver.calls import ShimCalls
from refit_grpc.driver.epochs import Epochs
from refit_grpc.driver.failures import FleetError, WorkerFailure, odd_digests
from refit_grpc.driver.membership import Member, links
from refit_grpc.driver.reports import RollbackReport
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb
from refit_grpc.reasons import Reason

log = logging.getLogger(__name__)


class RollbackError(FleetError):
    """A rollback was refused before any engine moved (the members do not serve one version
    with one previous copy: `failures` names those that differ), or some engines failed to
    roll back (`failures`; the others were rolled back and resumed, `report`)."""

    default_reason = Reason.ROLLBACK_FAILED

    def __init__(self, message: str, failures: list[WorkerFailure], *,
                 report: RollbackReport | None = None, reason: str | None = None):
        super().__init__(message, failures, reason=reason)
        self.report = report


def no_previous_copy(member: Member, version: int) -> WorkerFailure:
    """Why `member`, which flipped to `version`, cannot be rolled back."""
    return WorkerFailure(member.instance_id, member.endpoint.address,
                         grpc.StatusCode.FAILED_PRECONDITION, Reason.NO_PREVIOUS_COPY,
                         f"kept no previous copy at version {version} (its last epoch before "
                         "was not staged, or it cannot roll back): left paused at it")


class Rollbacks:
    """Runs rollbacks on given members (module docstring).

    Args:
        calls: the calls to the shims.
        epochs: the fleet's versions (the committed copy's, the delta base), set back.
    """

    def __init__(self, calls: ShimCalls, epochs: Epochs):
        self.calls = calls
        self.epochs = epochs

    def fleet(self, members: Sequence[Member], pause_mode: PauseMode) -> RollbackReport:
        """Take every one of `members` back one version (`Fleet.rollback()`): they must all
        serve one version and hold a previous copy of one version (one Describe round),
        else nothing moves.

        Raises:
            RollbackError: refused (nothing moved), naming the members that do not answer or
                differ; or some failed to roll back (`report`: the others did).
        """
        answers = self.calls.each("Describe", links(members),
                                  lambda w: pb.DescribeRequest(skip_weights_digest=True))
        silent = [a for a in answers if isinstance(a, WorkerFailure)]
        if silent:
            raise RollbackError("rollback refused, nothing rolled back: not every member "
                                "answered", silent, reason=silent[0].reason)
        described = [(m, a) for m, a in zip(members, answers)
                     if isinstance(a, pb.DescribeResponse)]
        pairs = Counter((a.weight_version, a.previous_copy_version) for _, a in described)
        (serving, previous), _ = pairs.most_common(1)[0]
        odd = [_differs(m, a, serving, previous) for m, a in described
               if (a.weight_version, a.previous_copy_version) != (serving, previous)
               or not a.previous_copy_version]
        if odd:
            raise RollbackError(f"rollback refused, nothing rolled back: the fleet serves "
                                f"version {serving} with a previous copy of version "
                                f"{previous or '(none)'}, these do not", odd,
                                reason=odd[0].reason)
        report = self.run(members, serving, previous, pause_mode,
                          {m: a.instance_id for m, a in described})
        if report.failed:
            raise RollbackError(f"rollback from version {serving} to {previous}: "
                                f"{len(report.workers)} of {len(members)} engines rolled back",
                                list(report.failed), report=report,
                                reason=report.failed[0].reason)
        return report

    def run(self, members: Sequence[Member], from_version: int, to_version: int,
            pause_mode: PauseMode, instance_of: Mapping[Member, str]) -> RollbackReport:
        """Roll `members` back from `from_version` to `to_version` (each holds that previous
        copy), each once and held paused, then resume those that did together.

        Args:
            members: the engines to roll back.
            from_version: the version they serve (a shim serving another refuses).
            to_version: their previous copies' version.
            pause_mode: for each engine's pause.
            instance_of: the shim instance each is known as (a restarted one refuses).

        Returns:
            What was done: `failed` names the engines that did not roll back and why (they
            are where they were; the others serve `to_version`).
        """
        requests = {m.instance_id: pb.RollbackRequest(
            version=from_version, to_version=to_version, instance_id=instance_of.get(m, ""),
            pause_mode=PAUSE_MODE_TO_PROTO[pause_mode], stay_paused=True) for m in members}
        answers = self.calls.once("Rollback", links(members),
                                  lambda w: requests[w.endpoint.instance_id],
                                  self.epochs.config.epoch_timeout_s)
        rolled: dict[Member, pb.RollbackResponse] = {}
        failed: list[WorkerFailure] = []
        for m, answer in zip(members, answers):
            if isinstance(answer, WorkerFailure):
                failed.append(answer)
            else:
                rolled[m] = answer
        if rolled:
            # Held paused until every engine had loaded: now all serve the old version at once.
            try:
                self.calls.flush(links(list(rolled)), pause_mode, "resume after the rollback")
            except FleetError as e:
                failed.extend(e.failures)
        digest, odd = odd_digests([a.staged_digest for a in rolled.values()])
        # The fleet's committed copy is the old one again where every engine agrees on it; the
        # delta base (the rejected version's bytes) is spent either way.
        self.epochs.committed = (to_version, digest) if digest and not odd and not failed \
            else None
        self.epochs.delta_base = None
        log.warning("rolled back from version %d to %d on %d engines%s", from_version,
                    to_version, len(rolled),
                    f"; not on {', '.join(f.instance_id for f in failed)}" if failed else "")
        return RollbackReport(
            version=to_version, rolled_back_from=from_version,
            workers=tuple(m.instance_id for m in rolled),
            stall_seconds=max((a.stall_seconds for a in rolled.values()), default=0.0),
            failed=tuple(failed))


def _differs(member: Member, answer: pb.DescribeResponse, serving: int,
             previous: int) -> WorkerFailure:
    """Why `member` (as described) cannot be rolled back with the fleet."""
    if not answer.previous_copy_version:
        why, reason = "keeps no previous copy", Reason.NO_PREVIOUS_COPY
    else:
        why, reason = (f"serves version {answer.weight_version} with a previous copy of "
                       f"{answer.previous_copy_version}"), Reason.ROLLBACK_VERSION_MISMATCH
    if answer.weight_version == serving and not answer.previous_copy_version and previous:
        why += f" (the fleet's: {previous})"
    return WorkerFailure(member.instance_id, member.endpoint.address,
                         grpc.StatusCode.FAILED_PRECONDITION, reason, why)


__all__ = ["RollbackError", "Rollbacks", "no_previous_copy"]
