"""What an engine's workers tell the shim, whatever the engine: defined once for both ends.

An HTTP engine's receive runs inside its workers (vLLM's, Dynamo's, next SGLang's), so two
things cross back to the shim through whatever route the engine offers:
- `StageStatus`: one worker's staged receive (docs/protocol.md, Staged epochs), its committed
  copy and a catch-up's serve from it, as the shim's
  `HttpEngine` polls it (vLLM: the answers of /collective_rpc; Dynamo: JSON the worker
  publishes in the trainer's TCPStore);
- the applied marker of a failed update (`applied_marker`, read back with `APPLIED_RE`): how
  much of it reached the model; with nothing applied the worker rolled every layer back, so the
  engine still holds the old weights, whole.
- `ServeInfo`: the catch-up group an engine's rank-0 worker serves its committed copy to.
Pure: no vLLM, no gRPC, no torch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from refit_grpc.common import GroupSpec

# A failed update's error starts with this marker: A of B buckets reached the model. With A == 0
# the worker's rollback restored every layer, so the engine still holds the old weights.
APPLIED_RE = re.compile(r"refit_grpc\[applied=(\d+)/(\d+)\]")


def applied_marker(applied: int, total: int) -> str:
    return f"refit_grpc[applied={applied}/{total}]"


# A worker's staged receive, as its status says
STAGE_IDLE, STAGE_RECEIVING, STAGE_STAGED, STAGE_FAILED = "idle", "receiving", "staged", "failed"
STAGE_STATES = (STAGE_IDLE, STAGE_RECEIVING, STAGE_STAGED, STAGE_FAILED)
# A worker's serve of its committed copy (catch-up), as its status says ("" before any)
SERVE_RUNNING, SERVE_DONE, SERVE_FAILED = "serving", "served", "failed"
SERVE_STATES = ("", SERVE_RUNNING, SERVE_DONE, SERVE_FAILED)


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
        committed_version: the version whose flip loaded the copy, while the copy still equals
            the live weights (the engine's committed copy: a delta's base, what a catch-up is
            served from); 0 when there is none.
        committed_digest: that copy's staged digest, else "".
        serve_state: "" (never served), `SERVE_RUNNING`, `SERVE_DONE` or `SERVE_FAILED`.
        served: buckets of the committed copy broadcast so far by the serve.
        serve_error: why the serve failed, else "".
        previous_version: the version of the previous copy (the committed copy before the
            last reversible epoch's flip, what a rollback loads); 0 when none is kept.
        previous_digest: that copy's staged digest, else "".
    """

    rank: int
    state: str
    landed: int = 0
    total: int = 0
    digest: str = ""
    error: str = ""
    reason: str = ""
    staging_bytes: int = 0
    committed_version: int = 0
    committed_digest: str = ""
    serve_state: str = ""
    served: int = 0
    serve_error: str = ""
    previous_version: int = 0
    previous_digest: str = ""

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
        if status.serve_state not in SERVE_STATES:
            raise ValueError(f"unknown serve state {status.serve_state!r}")
        return status


# What a worker reports for an engine that serves the weights as they are sent.
NO_QUANTIZATION = "none"


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """What a worker says of the engine it serves, fixed for the engine's life (vLLM:
    `wire.vllm.STAGE_OP_INFO`).

    Args:
        quantization: the engine's quantization method as vLLM names it (its `--quantization`,
            or the checkpoint's own method), `NO_QUANTIZATION` when it has none.
        multimodal: whether the model takes images (vLLM's `is_multimodal_model`): its
            multimodal and encoder caches hold what the old weights computed, cleared at a
            flip with the prefix cache. Absent in an older worker's answer: False.
        adapters: the adapters this worker built from adapter epochs, name -> version
            (`vllm_plugin.adapters.AdapterStore.versions`); unlike the rest it changes, and a
            shim reads it once, when it starts (a Dynamo shim restarted beside a worker that
            serves adapters). Absent in an older worker's answer: none.
        flip_in_one_call: whether the worker does a staged flip's whole weight-update session
            in one call (vLLM: `wire.vllm.STAGE_OP_FLIP`); False where it cannot (a LoRA
            engine, whose worker must reset its adapters after the session) and in an older
            worker's answer: the shim then flips through the three session routes.
        flip_in_loop: whether the engine's loop (vLLM's EngineCore, which every worker's answer
            passes through: `vllm_plugin.engine_loop`) does a flip in one turn with the cache
            reset and the version label around it (`wire.vllm.LoopFlip`): no pause, one round
            trip. Not the worker's to say; False in an answer that did not pass such a loop.
    """

    quantization: str = NO_QUANTIZATION
    multimodal: bool = False
    adapters: dict[str, int] = dataclasses.field(default_factory=dict)
    flip_in_one_call: bool = False
    flip_in_loop: bool = False

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: Any) -> WorkerInfo:
        """Parse one worker's info (fields it does not know are ignored); raises ValueError on
        anything else."""
        if not isinstance(body, dict) or not isinstance(body.get("quantization"), str):
            raise ValueError(f"a worker's info must be an object with a quantization, got "
                             f"{body!r:.200}")
        adapters = body.get("adapters", {})
        if not isinstance(adapters, dict) or not all(
                isinstance(k, str) and isinstance(v, int) for k, v in adapters.items()):
            raise ValueError(f"a worker's adapters must map names to versions, got "
                             f"{adapters!r:.200}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in names})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeInfo:
    """The payload of a serve request (vLLM: `wire.vllm.STAGE_OP_SERVE`; Dynamo:
    `wire.dynamo.SERVE_RPC`): the catch-up group the engine's rank-0 worker joins as its rank
    0. The shim hosts the group's rendezvous store (it listens before the newcomer is told
    where); the worker connects to it as a client."""

    master_address: str
    master_port: int
    world_size: int
    group_id: str
    timeout_s: float

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} out of range")
        if self.world_size < 2:
            raise ValueError(f"a catch-up group has >= 2 ranks, got {self.world_size}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def for_group(cls, spec: GroupSpec, timeout_s: float) -> ServeInfo:
        return cls(master_address=spec.master_address, master_port=spec.master_port,
                   world_size=spec.world_size, group_id=spec.group_id, timeout_s=timeout_s)

    def spec(self) -> GroupSpec:
        return GroupSpec(self.master_address, self.master_port, self.world_size, 0, "gloo",
                         self.group_id)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["APPLIED_RE", "SERVE_DONE", "SERVE_FAILED", "SERVE_RUNNING", "SERVE_STATES",
           "STAGE_FAILED", "STAGE_IDLE", "STAGE_RECEIVING", "STAGE_STAGED", "STAGE_STATES",
           "NO_QUANTIZATION", "ServeInfo", "StageStatus", "WorkerInfo", "applied_marker"]
