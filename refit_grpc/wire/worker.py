"""What an engine's workers tell the shim, whatever the engine: defined once for both ends.

An HTTP engine's receive runs inside its workers (vLLM's, Dynamo's, next SGLang's), so two
things cross back to the shim through whatever route the engine offers:
- `StageStatus`: one worker's staged receive (docs/protocol.md, Staged epochs), as the shim's
  `HttpEngine` polls it (vLLM: the answers of /collective_rpc; Dynamo: JSON the worker
  publishes in the trainer's TCPStore);
- the applied marker of a failed update (`applied_marker`, read back with `APPLIED_RE`): how
  much of it reached the model; with nothing applied the worker rolled every layer back, so the
  engine still holds the old weights, whole.
Pure: no vLLM, no gRPC, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# A failed update's error starts with this marker: A of B buckets reached the model. With A == 0
# the worker's rollback restored every layer, so the engine still holds the old weights.
APPLIED_RE = re.compile(r"refit_grpc\[applied=(\d+)/(\d+)\]")


def applied_marker(applied: int, total: int) -> str:
    return f"refit_grpc[applied={applied}/{total}]"


# A worker's staged receive, as its status says
STAGE_IDLE, STAGE_RECEIVING, STAGE_STAGED, STAGE_FAILED = "idle", "receiving", "staged", "failed"
STAGE_STATES = (STAGE_IDLE, STAGE_RECEIVING, STAGE_STAGED, STAGE_FAILED)


@dataclasses.dataclass(frozen=True)
class StageStatus:
    """One worker's staged receive.

    Args:
        rank: the worker's rank in the data group.
        state: `STAGE_IDLE`, `STAGE_RECEIVING`, `STAGE_STAGED` or `STAGE_FAILED`.
        landed: buckets landed (and checksummed) in the copy so far, in bucket order.
        total: buckets of the plan.
        digest: the staged digest once `STAGE_STAGED`, else "".
        error: why it failed (`STAGE_FAILED`), else "".
        reason: the failure's `Reason` name where the worker knew it, else "".
        staging_bytes: host memory the worker's copy holds.
    """

    rank: int
    state: str
    landed: int = 0
    total: int = 0
    digest: str = ""
    error: str = ""
    reason: str = ""
    staging_bytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: Any) -> StageStatus:
        """Parse one worker's status (fields it does not know are ignored); raises ValueError
        on anything else."""
        if not isinstance(body, dict):
            raise ValueError(f"a staged-epoch status must be an object, got {body!r:.200}")
        names = {f.name for f in dataclasses.fields(cls)}
        status = cls(**{k: v for k, v in body.items() if k in names})
        if status.state not in STAGE_STATES:
            raise ValueError(f"unknown staged-epoch state {status.state!r}")
        return status


__all__ = ["APPLIED_RE", "STAGE_FAILED", "STAGE_IDLE", "STAGE_RECEIVING", "STAGE_STAGED",
           "STAGE_STATES", "StageStatus", "applied_marker"]
