"""What NVIDIA Dynamo's RL admin routes take and answer, in one place for every caller: the shim's
`dynamo` engine, the worker extension inside Dynamo's vLLM worker, the direct-route baseline of
the measurements and the discovery integration. Pure: no vLLM, no gRPC.

A Dynamo vLLM worker started with `--enable-rl` serves `{system_url}/engine/<route>` (POST or GET,
JSON; an empty body is `{}`). A handler's failure is HTTP 200 with `{"status": "error",
"message": ...}`; an unknown route is 404, a body that is not JSON 400. The weight-transfer routes
forward to vLLM worker methods named by `engine_rpc`, with the rest of the body as keyword
arguments (`update_weights_from_distributed` keeps its reserved keys for itself).
"""

from __future__ import annotations

from typing import Any

from refit_grpc.common import GroupSpec
from refit_grpc.plan import RefitPlan
from refit_grpc.wire.vllm import adapter_path, flip_info_for, init_info_for, update_info_for
from refit_grpc.wire.worker import ServeInfo

# Routes, under {system_url}/engine/.
LIVENESS = "liveness_probe"
PAUSE = "pause_generation"
RESUME = "resume_generation"
FLUSH_CACHE = "flush_cache"
INIT_GROUP = "init_weights_update_group"
UPDATE_DISTRIBUTED = "update_weights_from_distributed"
DESTROY_GROUP = "destroy_weights_update_group"
GET_VERSION = "get_weight_version"
SET_VERSION = "set_weight_version"

# Dynamo's own defaults for `engine_rpc`; the project's worker extension
# (refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension) defines these methods.
INIT_RPC = "init_broadcaster"
UPDATE_RPC = "update_weights_from_path"
DESTROY_RPC = "destroy_broadcaster"
WORKER_EXTENSION = "refit_grpc.vllm_plugin.dynamo_extension.RefitGlooWorkerExtension"

# Staged epochs (docs/dynamo.md, Staged epochs): more methods of the same extension, reached
# through update_weights_from_distributed's `engine_rpc`. Dynamo discards a forwarded call's
# result, so each worker publishes its staged receive's status (`wire.worker.StageStatus`, JSON)
# under `stage_status_key(status_key, rank)` in the trainer's TCPStore, where the shim reads it.
STAGE_RPC = "refit_grpc_stage"
DROP_STAGED_RPC = "refit_grpc_drop_staged"
# Catch-up from this engine: the worker that is the engine's rank 0 broadcasts its committed copy
# to the newcomer's group, publishing the serve's status under `serve_status_key(status_key)` in
# the catch-up's rendezvous store (hosted by the shim, which reads it there).
SERVE_RPC = "refit_grpc_serve"
CANCEL_SERVE_RPC = "refit_grpc_cancel_serve"
# A rollback: every worker makes its previous copy the staged copy (answered at once, raising
# where it keeps none); the flip that follows loads it.
RESTORE_RPC = "refit_grpc_restore_previous"
# What the engine is (`wire.worker.WorkerInfo`: its quantization), asked once by the shim: every
# worker publishes its info under `engine_info_key(key, rank)` in a store the shim hosts.
INFO_RPC = "refit_grpc_engine_info"

# Adapter epochs (docs/adapters.md, Dynamo): at Prepare every worker says whether it can serve
# the adapter (`AdapterProblem`, JSON, published under `engine_info_key(key, rank)` in a store the
# shim hosts, as the engine info is); at the flip every worker makes its staged copy the
# adapter's pending version in memory (answered when done), then Dynamo's LoRA route loads it
# (hot swap for a later version) from `wire.vllm.adapter_path`, a URI of the scheme the
# project's source resolves (`vllm_plugin.dynamo_lora`), so no file is written.
CHECK_ADAPTER_RPC = "refit_grpc_check_adapter"
COMMIT_ADAPTER_RPC = "refit_grpc_commit_adapter"
LOAD_LORA = "load_lora"
# What Dynamo's worker needs for it: URI-based LoRA loading (its LoRA manager), and for a second
# version of an adapter, hot swap (else Dynamo answers "already loaded" and keeps the old one).
LORA_ENABLED_ENV = "DYN_LORA_ENABLED"
LORA_HOTSWAP_ENV = "DYN_LORA_HOTSWAP_ENABLED"

# Dynamo shuts the whole worker down (os._exit) when init_weights_update_group outlives this.
INIT_TIMEOUT_ENV = "DYN_RL_INIT_WEIGHTS_TIMEOUT_S"
INIT_TIMEOUT_DEFAULT_S = 30.0

# Discovery: GET {frontend}:{DYN_RL_PORT, 8001}/v1/rl/workers.
DISCOVERY_PATH = "/v1/rl/workers"
DISCOVERY_PROTOCOL_VERSION = 1


def join_limit_s(dynamo_limit_s: float) -> float:
    """The longest join that ends before Dynamo's limit shuts the worker down: a margin of 10%
    (at least two seconds) for the call's way through Dynamo, the EngineCore and the worker on
    a loaded machine (Dynamo's clock starts before the call reaches the worker)."""
    return max(dynamo_limit_s - max(2.0, 0.1 * dynamo_limit_s), 0.5)


def init_body(spec: GroupSpec, plan: RefitPlan, timeout_s: float) -> dict[str, Any]:
    """The body of `init_weights_update_group`: the gloo backend's init info (the keyword
    arguments of the extension's `init_broadcaster`)."""
    return {**init_info_for(spec, plan, timeout_s), "engine_rpc": INIT_RPC}


def update_body(plan: RefitPlan, timeout_s: float, abort_key: str | None) -> dict[str, Any]:
    """The body of `update_weights_from_distributed`: the plan, this update's deadline, the plan
    digest and the abort key (the extension's `update_weights_from_path` keyword arguments), plus
    Dynamo's reserved keys: the worker must be paused, and Dynamo resets the prefix cache after
    the update (the old weights computed it)."""
    return {**update_info_for(plan, "gloo", timeout_s, abort_key), "engine_rpc": UPDATE_RPC,
            "allow_unpaused": False, "reset_prefix_cache": True}


def destroy_body() -> dict[str, Any]:
    return {"engine_rpc": DESTROY_RPC}


def stage_body(plan: RefitPlan, timeout_s: float, status_key: str,
               delta: bool = False, reversible: bool = False) -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that starts every worker's staged
    receive (the extension's `refit_grpc_stage`, which returns at once): the plan as for an
    update, the key prefix its status goes to, and Dynamo's reserved keys for a call on an
    engine that keeps serving (`allow_unpaused`; then Dynamo requires the prefix cache kept,
    which the old weights still serve from)."""
    body = {**update_info_for(plan, "gloo", timeout_s), "status_key": status_key,
            "engine_rpc": STAGE_RPC, "allow_unpaused": True, "reset_prefix_cache": False}
    if delta:
        body["delta"] = True  # the buckets come as deltas against the committed copy
    if reversible:
        body["reversible"] = True  # the committed copy is kept as the previous copy
    return body


def drop_staged_body() -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that drops every worker's staged copy
    and ends a staged receive in flight; the engine keeps serving."""
    return {"engine_rpc": DROP_STAGED_RPC, "allow_unpaused": True, "reset_prefix_cache": False}


def flip_body(plan: RefitPlan, timeout_s: float, staged_digest: str,
              version: int | None = None) -> dict[str, Any]:
    """The body of a staged epoch's flip: an ordinary paused update (`update_weights_from_path`)
    whose update_info says `source: "staged"`, so the workers load their copies through the
    in-place receive's own loader (with `version`, the copy stays as the committed copy of
    that version); Dynamo resets the prefix cache after it."""
    return {**flip_info_for(plan, timeout_s, staged_digest, version), "engine_rpc": UPDATE_RPC,
            "allow_unpaused": False, "reset_prefix_cache": True}


def serve_body(info: ServeInfo, status_key: str) -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that starts the serve of a catch-up
    (the extension's `refit_grpc_serve`, which returns at once); the engine keeps serving."""
    return {**info.to_wire(), "status_key": status_key, "engine_rpc": SERVE_RPC,
            "allow_unpaused": True, "reset_prefix_cache": False}


def restore_body() -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that starts a rollback on every
    worker (the previous copy becomes the staged one); the engine keeps serving."""
    return {"engine_rpc": RESTORE_RPC, "allow_unpaused": True, "reset_prefix_cache": False}


def cancel_serve_body() -> dict[str, Any]:
    return {"engine_rpc": CANCEL_SERVE_RPC, "allow_unpaused": True, "reset_prefix_cache": False}


def engine_info_body(master_address: str, master_port: int, key: str) -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that has every worker publish what it
    says of its engine (the extension's `refit_grpc_engine_info`, answered at once) in the
    store at `master_address:master_port`; the engine keeps serving."""
    return {"master_address": master_address, "master_port": master_port, "info_key": key,
            "engine_rpc": INFO_RPC, "allow_unpaused": True, "reset_prefix_cache": False}


def check_adapter_body(plan: RefitPlan, master_address: str, master_port: int,
                       key: str) -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that has every worker check an adapter
    plan (the extension's `refit_grpc_check_adapter`, answered at once) and publish what it
    found in the store at `master_address:master_port`; the engine keeps serving."""
    return {**update_info_for(plan, "gloo"), "master_address": master_address,
            "master_port": master_port, "info_key": key, "engine_rpc": CHECK_ADAPTER_RPC,
            "allow_unpaused": True, "reset_prefix_cache": False}


def commit_adapter_body(staged_digest: str, version: int) -> dict[str, Any]:
    """The body of the `update_weights_from_distributed` that makes every worker's staged copy
    (exactly `staged_digest`) version `version` of the plan's adapter, in memory; the engine
    keeps serving."""
    return {"staged_digest": staged_digest, "version": version,
            "engine_rpc": COMMIT_ADAPTER_RPC, "allow_unpaused": True,
            "reset_prefix_cache": False}


def load_lora_body(name: str, version: int) -> dict[str, Any]:
    """The body of `load_lora`: the adapter's name and the URI of the version the workers
    hold."""
    return {"lora_name": name, "source": {"uri": adapter_path(name, version)}}


def engine_info_key(key: str, rank: int) -> str:
    """Where worker `rank` publishes its `WorkerInfo`."""
    return f"{key}/info/{rank}"


def serve_status_key(status_key: str) -> str:
    """Where the engine's rank-0 worker publishes its serve's status."""
    return f"{status_key}/serve"


def stage_status_key(status_key: str, rank: int) -> str:
    """Where the worker of data-group rank `rank` publishes its staged receive's status."""
    return f"{status_key}/{rank}"
