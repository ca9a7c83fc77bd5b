"""What crosses into a vLLM engine's weight-transfer routes, defined once for both ends.

`/init_weight_transfer_engine {"init_info": ...}` and `/update_weights {"update_info": ...}` carry a
backend-specific dict: the project's `gloo` backend (`GlooInitInfo`, `GlooUpdateInfo`, below; inside
vLLM `refit_grpc.vllm_plugin` parses the same classes) or vLLM's own `nccl` backend
(`NCCLWeightTransfer*Info`, in vLLM's field names). The shim's vLLM and Dynamo adapters, the
trainer's NCCL link and the direct-route baseline of the benchmarks build them here; the worker
parses them with the same dataclasses, so the two sides of the wire cannot drift apart. Pure: no
vLLM, no gRPC.

Also here: vLLM's rule for the ranks an engine's workers take (`worker_rank`). What a worker
reports back whatever the engine (a staged receive's `StageStatus`, a failed update's applied
marker) is `refit_grpc.wire.worker`'s.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from refit_grpc.common import GroupSpec
from refit_grpc.plan import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_NUM_BUFFERS,
    AdapterSpec,
    Packing,
    RefitPlan,
    TensorSpec,
    dtype_from_name,
    dtype_name,
)

# --- staged epochs (docs/vllm.md, Staged epochs) --------------------------------------------------
#
# A staged receive runs on a thread of each vLLM worker beside its engine loop; the shim starts,
# polls and drops it through vLLM's dev-mode POST /collective_rpc, naming the worker attribute
# that holds the project's weight-transfer engine (callable with one operation and a JSON
# payload, both strings as that route asks). The flip is an ordinary /update_weights whose
# update_info says `source: "staged"`.
STAGE_RPC_METHOD = "weight_transfer_engine"
STAGE_OP_START = "stage"            # payload: the update_info of the plan; returns the status
STAGE_OP_STATUS = "stage_status"    # returns the status
STAGE_OP_DROP = "drop_staged"       # forget a pending copy, end a receive in flight; the status
# Catch-up: the worker that is the engine's rank 0 broadcasts its committed copy to a newcomer's
# group (payload: a `ServeInfo`), on a thread of its own; "cancel_serve" ends it. Both return
# the status, whose serve_* fields say how the serve goes.
STAGE_OP_SERVE = "serve_copy"
STAGE_OP_CANCEL_SERVE = "cancel_serve"
# A rollback: the previous copy becomes the staged copy (a flip then loads it); the status.
STAGE_OP_RESTORE = "restore_previous"
# What the worker says of its engine (a `worker.WorkerInfo`, not a status): asked once.
STAGE_OP_INFO = "engine_info"
# Adapter epochs (docs/adapters.md). At Prepare, whether the worker can serve the plan's adapter
# (payload: the plan's update_info; returns {"problem", "reason"}, both "" when it can). At the
# flip, the staged copy becomes the adapter's pending version in the worker's memory (payload:
# {"staged_digest", "version"}; returns the status), which POST /v1/load_lora_adapter then loads
# from `adapter_path(name, version)`.
STAGE_OP_CHECK_ADAPTER = "check_adapter"
STAGE_OP_COMMIT_ADAPTER = "commit_adapter"
# Whether the worker prepares a flip's linear layers beside the engine loop once a stage is
# complete (`vllm_plugin.prepared`; payload {"prepare_flip": bool}; returns the status). Its
# default is the worker's environment (`PREPARE_FLIP_ENV`); a bench compares both flips.
STAGE_OP_CONFIGURE = "configure"
# A staged epoch's flip in one call to the workers (payload: `flip_info_for`'s update_info;
# returns the status): what /start_weight_update, /update_weights with `source: "staged"` and
# /finish_weight_update do, one engine-loop turn instead of three round trips to the paused
# engine (docs/vllm.md, What the flip costs). Only where the workers say `flip_in_one_call`.
STAGE_OP_FLIP = "flip"
STAGE_OPS = (STAGE_OP_START, STAGE_OP_STATUS, STAGE_OP_DROP, STAGE_OP_SERVE,
             STAGE_OP_CANCEL_SERVE, STAGE_OP_RESTORE, STAGE_OP_INFO, STAGE_OP_CHECK_ADAPTER,
             STAGE_OP_COMMIT_ADAPTER, STAGE_OP_CONFIGURE, STAGE_OP_FLIP)
# "0" in a vLLM server's environment: its workers load every layer at the flip (no prepared
# layers: one processed copy of the linear layers less between a stage and its flip).
PREPARE_FLIP_ENV = "REFIT_GRPC_PREPARE_FLIP"
# The `lora_path` of an adapter held in the workers' memory: no file is behind it; the project's
# loader (`vllm_plugin.adapters`) builds the adapter from the held tensors of that version.
ADAPTER_SCHEME = "refit-grpc-adapter"
ADAPTER_PATH_PREFIX = f"{ADAPTER_SCHEME}://"


def adapter_path(name: str, version: int) -> str:
    """The path the API server is given for version `version` of adapter `name`."""
    return f"{ADAPTER_PATH_PREFIX}{version}/{name}"


def parse_adapter_path(path: str) -> tuple[str, int] | None:
    """(name, version) of an `adapter_path`; None for any other path (a real file's). The
    form a `pathlib.Path` makes of it (`refit-grpc-adapter:/3/name`: Dynamo's LoRA manager
    hands vLLM the path its source returns as a Path) is the same path."""
    for prefix in (ADAPTER_PATH_PREFIX, ADAPTER_PATH_PREFIX[:-1]):
        if path.startswith(prefix):
            break
    else:
        return None
    version, sep, name = path[len(prefix):].partition("/")
    if not sep or not name or not version.isdigit():
        return None
    return name, int(version)
SOURCE_STAGED = "staged"


# A flip in one turn of the engine loop (`vllm_plugin.engine_loop`): a `STAGE_OP_FLIP` whose kwargs
# also carry this key (a `LoopFlip`, JSON). vLLM's EngineCore takes it out before the workers
# see the call, and around their flip, in the same turn of its loop, resets the caches and sets
# the weight version: no pause, no resume, one round trip. Only sent to an engine whose workers'
# `WorkerInfo.flip_in_loop` (said by the EngineCore, not the workers) is True.
LOOP_FLIP_KWARG = "loop_flip"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopFlip:
    """What the EngineCore does around a flip in one turn of its loop.

    Args:
        weight_version: the engine's weight version label from this flip on (vLLM's
            `set_weight_version`: the version spans of the outputs change at this turn).
        reset_caches: preempt the running requests (they recompute with the new weights) and
            clear the prefix cache and a KV connector's; False keeps them (off-policy tokens,
            `keep_cache`).
        multimodal: also clear the multimodal and encoder caches (what the old vision tower
            computed).
    """

    weight_version: str
    reset_caches: bool = True
    multimodal: bool = False

    def to_wire(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, text: str) -> LoopFlip:
        """Parse `to_wire`'s JSON; raises ValueError on anything else."""
        body = json.loads(text)
        if not isinstance(body, dict) or not isinstance(body.get("weight_version"), str):
            raise ValueError(f"a loop flip must be an object with a weight_version, got "
                             f"{text!r:.200}")
        return cls(weight_version=body["weight_version"],
                   reset_caches=bool(body.get("reset_caches", True)),
                   multimodal=bool(body.get("multimodal", False)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopFlipDone:
    """The EngineCore's answer to a flip in one turn of its loop (the one result of the
    /collective_rpc call, beside the workers' own answers).

    Args:
        stall_s: the turn: what generation stopped for (caches reset, label set, the
            workers' flip).
        load_s: the workers' flip within it.
    """

    stall_s: float
    load_s: float

    def to_wire(self) -> dict[str, Any]:
        return {"loop_flip": dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, body: Any) -> LoopFlipDone:
        """Parse the route's `results` (a list holding `to_wire`'s object); raises ValueError on
        anything else."""
        done = body[0].get("loop_flip") if isinstance(body, list) and body and \
            isinstance(body[0], dict) else None
        if not isinstance(done, dict) or not all(
                isinstance(done.get(k), int | float) for k in ("stall_s", "load_s")):
            raise ValueError(f"not a loop flip's answer: {body!r:.200}")
        return cls(stall_s=float(done["stall_s"]), load_s=float(done["load_s"]))


def stage_rpc_body(op: str, update_info: dict[str, Any] | None = None,
                   timeout_s: float | None = None,
                   loop_flip: LoopFlip | None = None) -> dict[str, Any]:
    """The body of POST /collective_rpc for one staged-epoch operation on every worker.

    Args:
        op: one of `STAGE_OPS`.
        update_info: `update_info_for(plan, "gloo", ...)` for `STAGE_OP_START`,
            `flip_info_for(...)` for `STAGE_OP_FLIP`, a `ServeInfo.to_wire()` for
            `STAGE_OP_SERVE`, else None.
        timeout_s: how long vLLM waits for the workers' answers.
        loop_flip: with `STAGE_OP_FLIP` only: the flip in one turn of the engine loop.

    Returns:
        The JSON body.
    """
    if op not in STAGE_OPS:
        raise ValueError(f"unknown staged-epoch operation {op!r}")
    if loop_flip is not None and op != STAGE_OP_FLIP:
        raise ValueError(f"a loop flip is a {STAGE_OP_FLIP!r}, not {op!r}")
    body: dict[str, Any] = {"method": STAGE_RPC_METHOD,
                            "kwargs": {"op": op, "payload": json.dumps(update_info or {})}}
    if loop_flip is not None:
        body["kwargs"][LOOP_FLIP_KWARG] = loop_flip.to_wire()
    if timeout_s is not None:
        body["timeout"] = timeout_s
    return body


@dataclasses.dataclass(kw_only=True)
class GlooInitInfo:
    """`init_info` of the gloo backend: what a worker needs to join the group."""

    master_address: str
    master_port: int
    rank_offset: int  # this engine's first rank; a worker's rank is `worker_rank`
    world_size: int
    group_id: str = "refit"  # the PrefixStore is refit_grpc/<group_id>, as in Group.join
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    timeout_s: float = 600.0  # rendezvous, and each update without its own timeout_s

    def __post_init__(self) -> None:
        if not self.packed:
            raise ValueError("the refit_grpc gloo backend speaks vLLM's packed format only "
                             "(packed=true)")
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), "
                             f"got {self.rank_offset}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        self.packing.validate()

    @property
    def packing(self) -> Packing:
        return Packing(int(self.packed_buffer_size_bytes), int(self.packed_num_buffers))

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GlooInitInfo)}


@dataclasses.dataclass
class GlooUpdateInfo:
    """`update_info` of one update: the plan in vLLM's field names (all vLLM's nccl backend
    takes), plus, for the gloo backend, a deadline, the digest both sides must agree on and the
    key that aborts it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    timeout_s: float | None = None  # this update's deadline (the shim passes its epoch's)
    plan_digest: str | None = None  # if set, the plan rebuilt here must have exactly this digest
    # A key in the trainer's TCPStore: once someone sets it, this receive gives up at once.
    abort_key: str | None = None
    # Where the bytes come from: None, the group (an in-place receive); "staged", the worker's
    # staged copy (a staged epoch's flip), which must hold exactly `staged_digest`.
    source: str | None = None
    staged_digest: str | None = None
    # A staged receive (`STAGE_OP_START`) whose buckets come as deltas against the worker's
    # committed copy (`refit_grpc.dataplane.delta`).
    delta: bool | None = None
    # A flip: the version it commits; the copy it loaded stays as the committed copy.
    version: int | None = None
    # A staged receive of a reversible epoch: the committed copy is kept as the previous copy
    # (a rollback's) and the receive lands beside it.
    reversible: bool | None = None
    # An adapter epoch's plan: the adapter it carries (`AdapterSpec` as {"name", "peft_config"}),
    # part of the plan digest; the worker builds the adapter from the staged copy at the commit.
    adapter: dict[str, str] | None = None

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"names/dtype_names/shapes lengths differ: {n}/"
                             f"{len(self.dtype_names)}/{len(self.shapes)}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.source not in (None, SOURCE_STAGED):
            raise ValueError(f"source must be unset or {SOURCE_STAGED!r}, got {self.source!r}")
        if self.source == SOURCE_STAGED and not self.staged_digest:
            raise ValueError("a load from the staged copy needs the staged_digest it must hold")
        if self.delta and self.source == SOURCE_STAGED:
            raise ValueError("a delta is received, not loaded from the staged copy")
        if self.reversible and self.source == SOURCE_STAGED:
            raise ValueError("reversible is a staged receive's, not a flip's")
        if self.version is not None and (self.source != SOURCE_STAGED or self.version < 1):
            raise ValueError(f"version {self.version} is a staged flip's, >= 1")

    def plan(self, packing: Packing) -> RefitPlan:
        specs = tuple(TensorSpec(name, tuple(int(d) for d in shape), dtype_from_name(dt))
                      for name, dt, shape in zip(self.names, self.dtype_names, self.shapes))
        adapter = AdapterSpec(**self.adapter) if self.adapter else None
        plan = RefitPlan(specs, packing, adapter)
        plan.validate()
        if self.plan_digest and plan.digest != self.plan_digest:
            raise ValueError(f"plan digest {plan.digest[:16]} != the sender's "
                             f"{self.plan_digest[:16]}: the two sides would cut buckets "
                             "differently")
        return plan

    def to_wire(self) -> dict[str, Any]:
        """The fields that are set (an unset one is absent: vLLM's nccl backend takes only the
        first three)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GlooUpdateInfo)
                if getattr(self, f.name) not in (None, "")}


def nccl_init_info(master_address: str, master_port: int, world_size: int, rank_offset: int,
                   packing: Packing) -> dict[str, Any]:
    """`init_info` for vLLM's `nccl` backend (`NCCLWeightTransferInitInfo`), TCP rendezvous mode,
    carrying the plan's packing so the worker cuts the same buckets."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "packed": True,
        "packed_buffer_size_bytes": int(packing.buffer_size_bytes),
        "packed_num_buffers": int(packing.num_buffers),
    }


def init_info_for(spec: GroupSpec, plan: RefitPlan, timeout_s: float) -> dict[str, Any]:
    """`init_info` of /init_weight_transfer_engine: the project's gloo backend
    (`GlooInitInfo`) or vLLM's nccl backend, for the engine whose first rank is `spec.rank`."""
    if spec.backend == "nccl":
        return nccl_init_info(spec.master_address, spec.master_port, spec.world_size, spec.rank,
                              plan.packing)
    return GlooInitInfo(master_address=spec.master_address, master_port=spec.master_port,
                        rank_offset=spec.rank, world_size=spec.world_size,
                        group_id=spec.group_id,  # PrefixStore refit_grpc/<group_id>, as Group.join
                        packed=True,
                        packed_buffer_size_bytes=plan.packing.buffer_size_bytes,
                        packed_num_buffers=plan.packing.num_buffers,
                        timeout_s=timeout_s).to_wire()


def update_info_for(plan: RefitPlan, backend: str, timeout_s: float | None = None,
                    abort_key: str | None = None) -> dict[str, Any]:
    """`update_info` of /update_weights: the plan in vLLM's field names (all vLLM's nccl backend
    takes); the gloo backend also takes this epoch's deadline (else its init timeout applies),
    the plan digest (it refuses a plan that would cut buckets differently from the sender's) and
    the key that aborts it.

    Every plan tensor is named, `lm_head.weight` of a tied model included: the receiver cuts
    the broadcast bytes by these names and shapes (vLLM's nccl consumer as well), so a dropped
    name would shift every tensor after it. Which of a tied parameter's two names is loaded is
    the worker's decision (docs/vllm.md, Tied embeddings)."""
    info = GlooUpdateInfo(names=[s.name for s in plan.tensors],
                          dtype_names=[dtype_name(s.dtype) for s in plan.tensors],
                          shapes=[list(s.shape) for s in plan.tensors])
    if backend == "gloo":
        info = dataclasses.replace(info, timeout_s=timeout_s, plan_digest=plan.digest,
                                   abort_key=abort_key or None,
                                   adapter=dataclasses.asdict(plan.adapter)
                                   if plan.adapter is not None else None)
    return info.to_wire()


def flip_info_for(plan: RefitPlan, timeout_s: float, staged_digest: str,
                  version: int | None = None) -> dict[str, Any]:
    """`update_info` of the /update_weights that loads a worker's staged copy (a staged epoch's
    flip, gloo backend only): the plan as for a receive, the bytes from the copy, which must
    hold exactly `staged_digest`; with `version`, the copy stays as the committed copy of that
    version."""
    info = update_info_for(plan, "gloo", timeout_s)
    info.update(source=SOURCE_STAGED, staged_digest=staged_digest, version=version)
    return GlooUpdateInfo(**info).to_wire()


def nccl_misalignment(plan: RefitPlan) -> str | None:
    """The first tensor vLLM's NCCL consumer could not unpack, or None. Its `unpack_tensor`
    views each tensor in place in the bucket, which needs every tensor to start at a multiple of
    its element size (an odd-sized int8 tensor before a float32 one breaks that); the project's
    own receiver copies such tensors instead, so only this backend needs the check."""
    for bucket in plan.buckets:
        offset = 0
        for spec in plan.tensors[bucket.start:bucket.stop]:
            if offset % spec.dtype.itemsize:
                return (f"tensor {spec.name!r} ({dtype_name(spec.dtype)}) would start at byte "
                        f"{offset} of bucket {bucket.index}, not a multiple of "
                        f"{spec.dtype.itemsize}")
            offset += spec.nbytes
    return None


def worker_rank(rank_offset: int, rank: int, tp_pp_size: int, dp_index: int = 0) -> int:
    """A vLLM worker's rank in the group, by vLLM's rule (`nccl_common.worker_init_process_group`):
    unique across data-parallel replicas, `dp_index * (tp * pp) + rank + rank_offset`."""
    return dp_index * tp_pp_size + rank + rank_offset


def worker_ranks(rank_offset: int, tp_pp_size: int, dp_size: int = 1) -> list[int]:
    """The ranks one vLLM engine's workers take (`worker_rank` of each)."""
    return [worker_rank(rank_offset, r, tp_pp_size, dp)
            for dp in range(dp_size) for r in range(tp_pp_size)]
