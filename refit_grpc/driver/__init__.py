"""The trainer side: endpoints, the Fleet of stubs, its epochs, and the links the sender broadcasts
through. Imports nothing from the shim: the two meet only on the wire (the proto).

Who owns what (`fleet.Fleet` is a facade over these; each owns its state, and no module touches
another class's private names):
- `membership.Membership`: one record per shim (endpoint, link, removed, left behind, the
  instance it joined the data group as); `validate_workers`.
- `calls.ShimCalls`: every call to a shim (channels, pools, deadlines, retries, fan-outs; the
  one place a call's failure becomes a `WorkerFailure`).
- `groups.GroupFormation`: forms, re-forms and drops the data group for a member list.
- `epochs.Epochs`: opens epochs (`epoch.EpochHandle`, one per epoch: its streams and waits),
  the versions (latest opened, committed copy), the delta base.
- `in_place.InPlaceRound`, `staged.StagedRound`: one epoch of each mode, with its checks
  (`checks.Checks`: verify, canary).
- `rollback.Rollbacks`: rollbacks to the previous copy (after a failed check, `Fleet.rollback()`).
- `catch_up.CatchUps`: catch-ups from a peer; `plans`: Prepare; `reports`: what an epoch
  reports; `failures`: what went wrong; `links` / `nccl`: the trainer's end of the group;
  `status`: the operator's view of a fleet (`refit-grpc fleet status`), over `failures`.
- `options`: what an epoch is (`InPlace`, `Staged`); `config`: `FleetConfig` and the derived
  `FleetState`; `endpoint`: `WorkerEndpoint`, `ChannelSecurity`.

Imports go one way: `fleet` -> the rounds (`in_place`, `staged`) -> `rollback` -> `epochs` -> `groups`,
`catch_up` -> `membership`, `plans`, `checks` -> `calls` -> `failures`, `config`, `endpoint`.
"""

from refit_grpc.driver.catch_up import CatchUpError, CatchUpReport
from refit_grpc.driver.checks import Checks
from refit_grpc.driver.endpoint import ChannelSecurity, WorkerEndpoint
from refit_grpc.driver.epoch import EpochHandle, ProgressCallback
from refit_grpc.driver.failures import (
    EpochFailedError,
    EpochRefusedError,
    FleetError,
    FleetTimeoutError,
    MembershipRefusedError,
    QuorumError,
    WeightsMismatchError,
    WorkerFailure,
)
from refit_grpc.driver.fleet import EpochReport, Fleet, WorkerReport
from refit_grpc.driver.links import GlooLink, TrainerLink
from refit_grpc.driver.options import InPlace, Staged
from refit_grpc.driver.reports import RollbackReport
from refit_grpc.driver.rollback import RollbackError

__all__ = ["CatchUpError", "CatchUpReport", "ChannelSecurity", "Checks", "EpochFailedError",
           "EpochHandle", "EpochRefusedError", "EpochReport", "Fleet", "FleetError",
           "FleetTimeoutError", "GlooLink", "InPlace", "MembershipRefusedError",
           "ProgressCallback", "QuorumError", "RollbackError", "RollbackReport", "Staged",
           "TrainerLink", "WeightsMismatchError",
           "WorkerEndpoint", "WorkerFailure", "WorkerReport"]
