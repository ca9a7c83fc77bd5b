"""What vLLM's weight-transfer routes take, built in one place for every caller.

`/init_weight_transfer_engine {"init_info": ...}` and `/update_weights {"update_info": ...}` carry a
backend-specific dict: the project's `gloo` backend (`refit_grpc.vllm_plugin.engine`, the
`RefitGloo*Info` dataclasses) or vLLM's own `nccl` backend (`NCCLWeightTransfer*Info`). The shim's
vLLM adapter, the trainer's NCCL link and the direct-route baseline of the benchmarks all build
them here, so the two sides of the wire cannot drift apart. Pure: no vLLM, no gRPC.

Also here: the marker by which the gloo backend inside vLLM tells the shim how much of a failed
update reached the model (`refit_grpc[applied=A/B]` in vLLM's HTTP 500 body).
"""

from __future__ import annotations

import re
from typing import Any

from refit_grpc.common import GroupSpec
from refit_grpc.plan import Packing, RefitPlan, dtype_name

# A failed update's error starts with this marker: A of B buckets reached the model. With A == 0
# the backend's rollback restored every layer, so the engine still holds the old weights.
APPLIED_RE = re.compile(r"refit_grpc\[applied=(\d+)/(\d+)\]")


def applied_marker(applied: int, total: int) -> str:
    return f"refit_grpc[applied={applied}/{total}]"


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
    (`RefitGlooInitInfo`) or vLLM's nccl backend, for the engine whose first rank is `spec.rank`."""
    if spec.backend == "nccl":
        return nccl_init_info(spec.master_address, spec.master_port, spec.world_size, spec.rank,
                              plan.packing)
    return {"master_address": spec.master_address, "master_port": spec.master_port,
            "rank_offset": spec.rank, "world_size": spec.world_size,
            "group_id": spec.group_id,  # PrefixStore refit_grpc/<group_id>, as Group.join
            "packed": True,
            "packed_buffer_size_bytes": plan.packing.buffer_size_bytes,
            "packed_num_buffers": plan.packing.num_buffers,
            "timeout_s": timeout_s}


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
    info: dict[str, Any] = {"names": [s.name for s in plan.tensors],
                            "dtype_names": [dtype_name(s.dtype) for s in plan.tensors],
                            "shapes": [list(s.shape) for s in plan.tensors]}
    if backend == "gloo":
        if timeout_s is not None:
            info["timeout_s"] = timeout_s
        info["plan_digest"] = plan.digest
        if abort_key:
            info["abort_key"] = abort_key
    return info


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


def worker_ranks(rank_offset: int, tp_pp_size: int, dp_size: int = 1) -> list[int]:
    """The ranks one vLLM engine's workers take: `dp_index * (tp * pp) + rank + rank_offset`
    (vLLM's `worker_init_process_group`)."""
    return [dp * tp_pp_size + r + rank_offset for dp in range(dp_size) for r in range(tp_pp_size)]
