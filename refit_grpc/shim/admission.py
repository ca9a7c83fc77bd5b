"""Which RPC the shim admits in which state: one table, one refusal rule.

Every handler asks `refusal()` (through `RefitServicer._admit_locked`, under the servicer's lock)
before it changes anything; none writes its own state, busy, draining or instance check.
docs/protocol.md's state table is checked against `ADMISSIONS` by tests/test_state_machine.py.

A refusal names the first of these that holds, in this order:
1. the request names another instance (`checks_instance`): MEMBERSHIP_CHANGED. First, because a
   restarted shim is in another state too, and "wrong state" would hide the cause;
   then its version is not newer than every version this shim applied or rolled back from
   (`checks_version`): STALE_VERSION. Before the state too: such a request is refused whatever
   the state, and a state an Abort left (the driver aborts a refused epoch at its first refusal,
   which may overtake the others' requests) would read as the abort's doing, naming no one;
2. a state with a reason of its own (`own_reasons`: Flush in BROKEN is refused BROKEN);
3. the shim is draining (`refused_draining`): UNAVAILABLE, SHUTTING_DOWN;
4. the state is not one it is admitted in (`states`): WRONG_STATE;
5. a long operation runs that it may not overlap (`busy_refused`): BUSY.
An RPC that `holds` a long operation marks the shim busy with it until its handler ends.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from refit_grpc.errors import EngineUnavailableError, FailedPreconditionError, RefitError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason


class Busy(enum.Enum):
    """The long operation running outside the servicer's lock, if any (its RPC's name)."""

    JOIN = "InitCollective"
    EPOCH = "UpdateWeights"
    FLIP = "Flip"
    SERVE = "ServeCatchUp"
    CATCH_UP = "CatchUp"
    ROLLBACK = "Rollback"


ANY_STATE: frozenset[int] = frozenset(pb.ShimState.values()) - {pb.SHIM_STATE_UNSPECIFIED}
ANY_BUSY: frozenset[Busy] = frozenset(Busy)


@dataclass(frozen=True)
class Admission:
    """When one RPC is admitted (the module's docstring gives the order of the checks)."""

    states: frozenset[int]                 # the derived states it is admitted in
    busy_refused: frozenset[Busy]          # the long operations it may not overlap (BUSY)
    holds: Busy | None = None              # the long operation it runs itself
    checks_instance: bool = False          # its request's instance_id, when set, must be ours
    checks_version: bool = False           # its request's version must be newer (invariant 4)
    refused_draining: bool = True          # refused once the shim drains (SIGTERM)
    # States refused with a reason and message of their own, named before draining.
    own_reasons: Mapping[int, tuple[Reason, str]] = field(default_factory=dict)


_LIVE = frozenset({pb.SHIM_STATE_PREPARED, pb.SHIM_STATE_READY})

ADMISSIONS: Mapping[str, Admission] = {
    # Never refused: operators and the driver watch every state, the drain included.
    "Describe": Admission(ANY_STATE, frozenset(), refused_draining=False),
    # Not in STAGED: another plan would orphan the staged version's layout.
    "Prepare": Admission(_LIVE | {pb.SHIM_STATE_EMPTY, pb.SHIM_STATE_BROKEN}, ANY_BUSY),
    # Not in STAGED: joining drops the group a staged version came through, and a trainer that
    # re-forms a group leaves its STAGED engines out of it.
    "InitCollective": Admission(_LIVE | {pb.SHIM_STATE_BROKEN}, ANY_BUSY, holds=Busy.JOIN),
    "UpdateWeights": Admission(frozenset({pb.SHIM_STATE_READY, pb.SHIM_STATE_BROKEN}), ANY_BUSY,
                               holds=Busy.EPOCH, checks_instance=True, checks_version=True),
    # Carriers: the engine serving the call admits it in any state, beside anything; each
    # engine it names is admitted as that engine's own UpdateWeights (Flip). Refused while
    # draining.
    "UpdateEngines": Admission(ANY_STATE, frozenset()),
    "FlipEngines": Admission(ANY_STATE, frozenset()),
    # Any state: what it needs is a staged version (the handler's NOT_STAGED), which STAGED has
    # and so has a BROKEN engine whose staged epoch (opened while BROKEN) committed.
    "Flip": Admission(ANY_STATE, ANY_BUSY, holds=Busy.FLIP, checks_instance=True),
    # Never resumes partial weights (invariant 1); runs beside a join, a flip or a serve.
    "Flush": Admission(
        _LIVE | {pb.SHIM_STATE_EMPTY, pb.SHIM_STATE_STAGED}, frozenset({Busy.EPOCH}),
        own_reasons={pb.SHIM_STATE_BROKEN: (
            Reason.BROKEN, "engine is BROKEN (a failed epoch left partial weights); refusing "
                           "to resume until a full update commits")}),
    "ServeCatchUp": Admission(_LIVE, ANY_BUSY, holds=Busy.SERVE, checks_instance=True),
    "CatchUp": Admission(_LIVE | {pb.SHIM_STATE_BROKEN}, ANY_BUSY, holds=Busy.CATCH_UP,
                         checks_instance=True, checks_version=True),
    # Not in STAGED (a staged version waits for its Flip; Abort drops it) nor BROKEN (the
    # previous copy is older than the last good version).
    "Rollback": Admission(_LIVE, ANY_BUSY, holds=Busy.ROLLBACK, checks_instance=True),
    # Never refused: it is how anything running is stopped, the drain's included.
    "Abort": Admission(ANY_STATE, frozenset(), refused_draining=False),
}


def stale_version(version: int, applied: int, highest: int) -> RefitError | None:
    """Why `version` may not be applied by a shim that applied `applied` and rolled back from
    up to `highest` (invariant 4: versions only move forward, past a rollback's too: a version
    rolled back from is never reused for other weights), or None when it may."""
    if version > max(applied, highest):
        return None
    rolled = f", {highest} before a rollback" if highest > applied else ""
    return FailedPreconditionError(f"version {version} is not newer than applied {applied}"
                                   f"{rolled}", reason=Reason.STALE_VERSION)


def refusal(rpc: str, *, state: int, busy: Busy | None, draining: bool, instance_id: str,
            own_instance_id: str, version: int | None = None, applied: int = 0,
            highest: int = 0) -> RefitError | None:
    """Why `rpc` is refused now, or None when it is admitted (`version`: the request's, checked
    for an RPC that `checks_version` when given; `applied`, `highest`: the shim's, as
    `stale_version` takes them)."""
    admission = ADMISSIONS[rpc]
    if admission.checks_instance and instance_id and instance_id != own_instance_id:
        return FailedPreconditionError(
            f"this shim is {own_instance_id!r}, the {rpc} was sent to {instance_id!r} "
            "(restarted since the caller saw it)", reason=Reason.MEMBERSHIP_CHANGED)
    if admission.checks_version and version is not None \
            and (stale := stale_version(version, applied, highest)):
        return stale
    if state in admission.own_reasons:
        reason, message = admission.own_reasons[state]
        return FailedPreconditionError(message, reason=reason)
    if draining and admission.refused_draining:
        return EngineUnavailableError(f"{rpc} refused: the shim is shutting down",
                                      reason=Reason.SHUTTING_DOWN)
    if state not in admission.states:
        names = ", ".join(pb.ShimState.Name(s) for s in sorted(admission.states))
        return FailedPreconditionError(
            f"{rpc} refused in state {pb.ShimState.Name(state)} (allowed: {names})",
            reason=Reason.WRONG_STATE)
    if busy in admission.busy_refused:
        return FailedPreconditionError(f"{rpc} refused while {busy.value} runs",
                                       reason=Reason.BUSY)
    return None


def state_names(states: frozenset[int]) -> list[str]:
    """The states' short names (READY, not SHIM_STATE_READY), in the proto's order."""
    return [pb.ShimState.Name(s).removeprefix("SHIM_STATE_") for s in sorted(states)]


def markdown_table() -> str:
    """`ADMISSIONS` as docs/protocol.md shows it (`python -m refit_grpc.shim.admission` prints
    it; tests/test_state_machine.py fails when the page shows anything else)."""

    def states(admission: Admission) -> str:
        text = "any" if admission.states == ANY_STATE else ", ".join(state_names(admission.states))
        for state, (reason, _) in sorted(admission.own_reasons.items()):
            text += f"; in {state_names(frozenset({state}))[0]} `{reason}`"
        return text

    def busy(admission: Admission) -> str:
        if admission.busy_refused == ANY_BUSY:
            return "any"
        return ", ".join(b.value for b in Busy if b in admission.busy_refused) or "never"

    rows = ["| call | admitted in | BUSY while | holds BUSY | checks instance_id "
            "| while draining |", "|---|---|---|---|---|---|"]
    for rpc, admission in ADMISSIONS.items():
        rows.append(f"| {rpc} | {states(admission)} | {busy(admission)} "
                    f"| {'yes' if admission.holds else '-'} "
                    f"| {'yes' if admission.checks_instance else '-'} "
                    f"| {'`SHUTTING_DOWN`' if admission.refused_draining else 'admitted'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")


__all__ = ["ADMISSIONS", "ANY_BUSY", "ANY_STATE", "Admission", "Busy", "markdown_table",
           "refusal", "state_names"]
