"""Staged epochs across the fleet (docs/protocol.md, "Staged epochs", "Delta epochs"): stage on
every member, re-form the group without the engines that failed until enough staged, decide the
quorum, flip each engine once, check them and resume them together. Functions of a `Fleet`,
which opens the epochs (`_open_epoch`) and owns the group; `Fleet.refit(mode="staged")` and
`Fleet.flip()` come here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import torch

from refit_grpc.canary import Canary
from refit_grpc.collective import pack_into
from refit_grpc.common import EpochMode, PauseMode
from refit_grpc.delta import flat_copy, send_delta
from refit_grpc.driver import membership
from refit_grpc.driver.config import FleetState, FleetStateError, refuse_unless
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.failures import (
    FleetError,
    QuorumError,
    WorkerFailure,
    explained_by_abort,
    odd_digests,
)
from refit_grpc.driver.links import GlooLink, TrainerLink
from refit_grpc.driver.reports import EpochReport, WorkerReport
from refit_grpc.errors import InvalidArgumentError, RefitError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import PAUSE_MODE_TO_PROTO, pb
from refit_grpc.reasons import Reason
from refit_grpc.staging import StagedDigest

if TYPE_CHECKING:
    from refit_grpc.driver.fleet import Fleet

log = logging.getLogger(__name__)

# What a member that is gone answers (dead, or too frozen to answer in time): a staged epoch's
# re-forming goes on without it.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

# A staged epoch forms its group again without the engines that failed at most this often:
# each round loses at least one engine, and a fault that follows every round is not one engine's.
_MAX_REFORMS = 3


def _staged_digest_of(plan: RefitPlan, tensors: Mapping[str, torch.Tensor]) -> str:
    """The trainer's staged digest, packed apart from any send (a round whose send failed before
    every bucket went out still needs it to judge what the engines that did finish staged)."""
    digest = StagedDigest(plan)
    buf = torch.empty(max(b.nbytes for b in plan.buckets), dtype=torch.uint8)
    for b in plan.buckets:
        digest.add(b, pack_into(buf, [tensors[s.name].detach().cpu()
                                      for s in plan.tensors[b.start:b.stop]]))
    return digest.hexdigest()


def delta_base_bytes(fleet: Fleet) -> int:
    """`Fleet.delta_base_bytes`, which documents it."""
    return 0 if fleet._delta_base is None else fleet._delta_base[2].numel()


def flip_epoch(fleet: Fleet, handle: EpochHandle, staged_digest: str | None = None, *,
         min_engines: int | None = None, pause_mode: PauseMode = PauseMode.KEEP,
         verify_weights: bool = False, canary: Canary | None = None) -> EpochReport:
    """`Fleet.flip()`, which documents it."""
    if not handle.staged:
        raise InvalidArgumentError("flip() ends a staged epoch; this one is in place",
                                   reason=Reason.INVALID_EPOCH_MODE)
    indexes = list(fleet._group_members or ())
    required = len(indexes) if min_engines is None else min_engines
    if not 1 <= required <= len(indexes):
        raise InvalidArgumentError(f"min_engines must be in [1, {len(indexes)}], got "
                                   f"{min_engines}", reason=Reason.INVALID_MIN_ENGINES)
    plan = fleet._plan_for("flip()", (FleetState.CONNECTED, FleetState.PREPARED))
    joined = dict(zip(indexes, fleet._joined_instances or ()))
    finals, failures = handle.settle()
    if staged_digest is None:
        staged_digest, _ = odd_digests([m.staged_digest if m else "" for m in finals])
        staged_digest = staged_digest or ""
    by_id = {f.instance_id: f for f in failures}
    staged: dict[int, pb.UpdateWeightsResponse] = {}
    behind: dict[int, WorkerFailure] = {}
    for i, msg in zip(indexes, finals):
        ep = fleet._endpoints[i]
        if msg is not None and msg.staged_digest == staged_digest:
            staged[i] = msg
        elif msg is not None:
            behind[i] = WorkerFailure(ep.instance_id, ep.address, grpc.StatusCode.DATA_LOSS,
                                      Reason.STAGED_DIGEST_MISMATCH,
                                      f"staged {msg.staged_digest[:16]}, expected "
                                      f"{staged_digest[:16]}")
        elif ep.instance_id in by_id:
            behind[i] = by_id[ep.instance_id]
    return finish_staged(fleet, handle.version, plan, staged,
                         {i: joined.get(i, "") for i in staged}, behind, staged_digest,
                         required, pause_mode, verify_weights, canary,
                         started=handle.started_at, broadcast_s=0.0, reforms=0)


def refit_staged(fleet: Fleet, link: TrainerLink, tensors: Mapping[str, torch.Tensor],
                 version: int | None, pause_mode: PauseMode,
                 on_progress: ProgressCallback | None, verify_weights: bool,
                 canary: Canary | None, min_engines: int | None,
                 delta: bool = False,
                 gone: Mapping[int, WorkerFailure] | None = None) -> EpochReport:
    """`refit(mode=STAGED)`: stage on every member, re-forming the group without the
    engines that failed until enough staged, then flip them (docs/protocol.md, "Staged
    epochs")."""
    refuse_unless(fleet.state, (FleetState.CONNECTED,), "refit()")
    required = len(fleet._members) if min_engines is None else min_engines
    if not 1 <= required <= len(fleet._members):
        raise InvalidArgumentError(f"min_engines must be in [1, {len(fleet._members)}] (the "
                                   f"fleet's members), got {min_engines}",
                                   reason=Reason.INVALID_MIN_ENGINES)
    plan = fleet._plan_for("refit()", (FleetState.CONNECTED,))
    version = fleet._version + 1 if version is None else version
    t0 = time.monotonic()
    staged: dict[int, pb.UpdateWeightsResponse] = {}  # worker index -> its STAGED
    staged_as: dict[int, str] = {}  # worker index -> the instance id it staged as
    behind: dict[int, WorkerFailure] = dict(gone or {})  # left behind at the re-forming
    trainer_digest: str | None = None
    broadcast_s, reforms = 0.0, 0
    pending = list(fleet._members)
    base = delta_base_for(fleet, link, plan) if delta else None
    fleet._delta_base = None  # whatever happens below, the old base is spent
    wire_bytes, sent_delta = 0, base is not None
    while True:
        joined = dict(zip(fleet._group_members or (), fleet._joined_instances or ()))
        handle = fleet._open_epoch(version, pause_mode, on_progress, verify_weights, canary,
                                   EpochMode.STAGED, base[:2] if base else None)
        checksums = StagedDigest(plan)
        try:
            handle.wait_accepted()
            if base is not None:
                assert isinstance(link, GlooLink)  # _delta_base_for checked it
                sent = send_delta(link.group, plan, tensors, base[2], handle.send_deadline(),
                                  checksums.add)
                broadcast_s += sent.seconds
                wire_bytes += sent.wire_bytes
            else:
                stats = link.sender.send(tensors, handle.send_deadline(),
                                         checksums=checksums)
                broadcast_s += stats.seconds
                wire_bytes += stats.bytes
        except FleetError:
            pass  # wait_accepted aborted the epoch; settle() names who refused
        except RefitError as e:
            handle.abort(f"epoch {version}: broadcast failed ({e})")
        finals, failures = handle.settle()
        if trainer_digest is None:
            trainer_digest = checksums.hexdigest() if checksums.complete else \
                _staged_digest_of(plan, tensors)
        for i, msg in zip(pending, finals):
            if msg is None:
                continue
            if msg.staged_digest == trainer_digest:
                staged[i], staged_as[i] = msg, joined.get(i, "")
            else:
                ep = fleet._endpoints[i]
                behind[i] = WorkerFailure(
                    ep.instance_id, ep.address, grpc.StatusCode.DATA_LOSS,
                    Reason.STAGED_DIGEST_MISMATCH, f"staged {msg.staged_digest[:16]}, the "
                    f"trainer sent {trainer_digest[:16]}")
        retry = after_staging_failures(fleet, pending, failures, behind)
        if not failures or not retry or len(staged) + len(retry) < required:
            break  # staged, or too few left to matter (they are not to blame: not behind)
        if reforms >= _MAX_REFORMS:
            for i in retry:  # failed round after round: no more rounds for them
                behind.setdefault(i, next(f for f in failures
                                          if f.instance_id == fleet._endpoints[i].instance_id))
            break
        # Re-form the group among the engines that still need the bytes; those STAGED keep
        # their copies and wait for the flip.
        reforms += 1
        log.warning("epoch %d: %d staged, %d left behind (%s); re-forming the group for %d",
                    version, len(staged), len(behind),
                    ", ".join(fleet._endpoints[i].instance_id for i in behind), len(retry))
        lost = reform(fleet, link, retry, leave_behind=True)
        behind.update(lost)
        retry = [i for i in retry if i not in lost]
        pending = retry
        base = None  # a failed round spent the base (engines' and the trainer's): full
    report = finish_staged(fleet, version, plan, staged, staged_as, behind, trainer_digest,
                           required, pause_mode, verify_weights, canary,
                           started=t0, broadcast_s=broadcast_s, reforms=reforms)
    if delta:
        # The next delta's base: what every engine that flipped now holds.
        flat = base[2] if base is not None else flat_copy(plan, tensors)
        fleet._delta_base = (version, trainer_digest, flat)
    return replace(report, delta=sent_delta, wire_bytes=wire_bytes)


def delta_base_for(fleet: Fleet, link: TrainerLink, plan: RefitPlan
                   ) -> tuple[int, str, torch.Tensor] | None:
    """The last staged epoch's (version, staged digest, bytes) when a delta against it can
    go: the gloo link, and every member's committed copy is that version with that digest
    (one Describe round); None: a full epoch."""
    if fleet._delta_base is None or not isinstance(link, GlooLink):
        return None
    version, digest, _ = fleet._delta_base
    answers = fleet.calls.each("Describe", fleet._member_links(),
                               lambda w: pb.DescribeRequest(skip_weights_digest=True))
    odd = [w.endpoint.instance_id for w, a in zip(fleet._member_links(), answers)
           if not isinstance(a, pb.DescribeResponse)
           or (a.committed_copy_version, a.committed_copy_digest) != (version, digest)]
    if odd:
        log.info("delta epoch after version %d: full instead, %s hold another copy",
                 version, ", ".join(odd))
        return None
    return fleet._delta_base


def finish_staged(fleet: Fleet, version: int, plan: RefitPlan,
                  staged: Mapping[int, pb.UpdateWeightsResponse],
                  staged_as: Mapping[int, str], behind: dict[int, WorkerFailure],
                  digest: str, required: int, pause_mode: PauseMode,
                  verify_weights: bool, canary: Canary | None, *, started: float,
                  broadcast_s: float, reforms: int) -> EpochReport:
    """The decision and the flip of a staged epoch: quorum or nothing, each engine flipped
    once, checked, and (when held paused for the checks) resumed together."""
    fleet._version = max(fleet._version, version)
    mismatched = [i for i, f in behind.items() if f.reason == Reason.STAGED_DIGEST_MISMATCH]
    if mismatched:  # their copies are not what was sent: dropped now, not at the timeout
        fleet.calls.abort(f"epoch {version}: staged other bytes than the trainer sent",
                          fleet._member_links(mismatched))
    if len(staged) < required:
        drop_staged(fleet, version, staged)
        membership.leave_behind(fleet, behind)
        raise QuorumError(f"epoch {version}: {len(staged)} of {len(fleet._members)} engines "
                          f"staged it, {required} required; nothing flipped, every engine "
                          "serves the previous version",
                          list(behind.values()), staged=[fleet._endpoints[i].instance_id
                                                         for i in staged])
    flipped, flip_failures = flip_each(fleet, version, digest, staged_as, pause_mode,
                                       stay_paused=verify_weights or canary is not None)
    for i, f in flip_failures.items():
        behind[i] = f
    membership.leave_behind(fleet, behind)
    if len(flipped) < required:
        raise QuorumError(f"epoch {version}: {len(flipped)} engines flipped to it, "
                          f"{required} required", list(behind.values()),
                          staged=[fleet._endpoints[i].instance_id for i in flipped])
    fleet._committed = (version, digest)
    links = fleet._member_links(list(flipped))
    answers = list(flipped.values())
    as_committed = [pb.UpdateWeightsResponse(weights_digest=a.weights_digest,
                                             canary=a.canary) for a in answers]
    if verify_weights:
        fleet._check_same_weights(version, as_committed, links)
    if canary is not None:
        fleet.check_canary(version, canary, as_committed, links)
    if verify_weights or canary is not None:
        # Held paused by the flip until every engine was checked: now all serve at once.
        fleet.calls.all("Flush", links, lambda w: pb.FlushRequest(
            mode=PAUSE_MODE_TO_PROTO[pause_mode]), "resume after the flip failed")
    return EpochReport(
        version=version, bytes=plan.total_bytes, seconds=time.monotonic() - started,
        broadcast_seconds=broadcast_s,
        workers=tuple(WorkerReport(
            fleet._endpoints[i].instance_id, staged[i].seconds, staged[i].bytes_received,
            a.weights_digest, canary.gap(a.canary) if canary else None,
            a.canary.seconds if canary else None, stall_seconds=a.stall_seconds,
            load_seconds=a.load_seconds) for i, a in flipped.items()),
        mode=EpochMode.STAGED, left_behind=tuple(behind.values()), reforms=reforms)


def after_staging_failures(fleet: Fleet, pending: Sequence[int], failures: Sequence[WorkerFailure],
                           behind: dict[int, WorkerFailure]) -> list[int]:
    """Sort the engines of a staging round that did not stage: left behind (`behind`), or
    worth another round (returned). Another round is for an engine that is alive, the same
    instance, not BROKEN, and whose failure the round's abort or a dead peer explains; the
    rest caused the failure or refused on their own."""
    by_id = {f.instance_id: f for f in failures}
    failed = [i for i in pending if fleet._endpoints[i].instance_id in by_id
              and i not in behind]
    if not failed:
        return []
    # One try each, as bounded as Abort: a dead shim refuses at once, a frozen one is as
    # good as dead for this epoch.
    request = pb.DescribeRequest(skip_weights_digest=True)
    links = fleet._member_links(failed)
    answers = fleet.calls.once("Describe", links, lambda w: request,
                               fleet.config.abort_timeout_s)
    retry = []
    joined = dict(zip(fleet._group_members or (), fleet._joined_instances or ()))
    for i, answer in zip(failed, answers):
        f = by_id[fleet._endpoints[i].instance_id]
        alive = isinstance(answer, pb.DescribeResponse) \
            and answer.instance_id == joined.get(i, answer.instance_id) \
            and answer.state != pb.SHIM_STATE_BROKEN
        if alive and explained_by_abort(f):
            retry.append(i)
        else:
            behind[i] = f if alive or not isinstance(answer, WorkerFailure) else answer
    return retry


def reform(fleet: Fleet, link: TrainerLink, members: Sequence[int], *,
           leave_behind: bool = False) -> dict[int, WorkerFailure]:
    """Form a new group of `members` only, the trainer's end replacing `link`'s (gloo).
    With `leave_behind`, members that do not answer Prepare (dead, frozen) are left behind
    instead of failing it all (returned, by worker index); a refusal still raises."""
    if not isinstance(link, GlooLink):
        raise FleetStateError("a staged epoch re-forms its group without the engines that "
                              "failed, which only the gloo link can do; connect() again",
                              reason=Reason.FLEET_NOT_CONNECTED)
    ip = link.group.spec.master_address
    link.close()
    fleet._drop_group()
    # A worker added (or restarted and readmitted) since has no plan; for the others
    # Prepare of the plan they hold is a no-op.
    assert fleet._plan is not None  # a fleet with a group has a plan
    failed: dict[int, WorkerFailure] = {}
    if leave_behind:
        # A staged epoch goes on without the members that cannot even take the plan (dead
        # since the last epoch): they are left behind, named in its report.
        request = fleet._prepare_request()
        answers = dict(zip(members, fleet.calls.each(
            "Prepare", fleet._member_links(members), lambda w: request)))
        failed = {i: a for i, a in answers.items() if isinstance(a, WorkerFailure)}
        refusals = [f for f in failed.values() if f.code not in _GONE]
        if refusals:  # alive and saying no (BUSY, ...): the trainer's to decide, not ours
            raise FleetError("Prepare: prepare failed", refusals, reason=refusals[0].reason)
        if failed:
            log.warning("re-forming without %s: %s", ", ".join(
                f.instance_id for f in failed.values()), "; ".join(map(str, failed.values())))
            membership.leave_behind(fleet, failed)
            members = [i for i in members if i not in failed]
            if not members:
                raise FleetError("no member can take the plan", list(failed.values()))
        fleet._check_prepared(fleet._member_links(members), [answers[i] for i in members])
    else:
        fleet._prepare_on(fleet._plan, fleet._member_links(members))
    everyone = fleet._members
    fleet._members = list(members)
    try:
        fresh = fleet.connect(ip)
    finally:
        fleet._members = everyone
    assert isinstance(fresh, GlooLink)
    link.adopt(fresh)
    return failed


def flip_each(fleet: Fleet, version: int, digest: str, staged_as: Mapping[int, str],
          pause_mode: PauseMode, stay_paused: bool
          ) -> tuple[dict[int, pb.FlipResponse], dict[int, WorkerFailure]]:
    """Flip every engine that staged, in parallel, each once (a Flip that reached its
    shim is not repeated): each answer, or why it did not flip. Each Flip names the
    instance that staged, so a shim restarted since cannot flip what it lost."""
    indexes = list(staged_as)
    links = fleet._member_links(indexes)
    instance_of = {w.endpoint.instance_id: staged_as[i] for i, w in zip(indexes, links)}
    answers = fleet.calls.once("Flip", links, lambda w: pb.FlipRequest(
        version=version, staged_digest=digest, pause_mode=PAUSE_MODE_TO_PROTO[pause_mode],
        stay_paused=stay_paused, instance_id=instance_of[w.endpoint.instance_id]),
        fleet.config.epoch_timeout_s)
    flipped: dict[int, pb.FlipResponse] = {}
    failed: dict[int, WorkerFailure] = {}
    for i, answer in zip(indexes, answers):
        if isinstance(answer, WorkerFailure):
            failed[i] = answer
        else:
            flipped[i] = answer
    return flipped, failed


def drop_staged(fleet: Fleet, version: int, staged: Mapping[int, object]) -> None:
    """Nothing flips: the engines that staged drop their copies now (rather than at their
    flip timeout). Abort does it; it also drops their group, which this epoch already
    ended for the others."""
    if staged:
        fleet.calls.abort(f"epoch {version}: quorum not met",
                          fleet._member_links(list(staged)))
    fleet._drop_group()
