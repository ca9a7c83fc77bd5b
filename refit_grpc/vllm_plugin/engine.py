"""The `gloo` weight-transfer backend, running inside vLLM's workers (vLLM >= 0.32's native
weight-transfer routes: /init_weight_transfer_engine, /start_weight_update, /update_weights,
/finish_weight_update, /shutdown_weight_transfer_engine).

Everything the worker does is `layerwise.LayerwiseReceiver`'s, which the Dynamo worker extension
(`dynamo_extension.py`) shares: the group (`refit_grpc.dataplane.group.Group.join`), the packed receive
(`refit_grpc.dataplane.transfer.receive`), vLLM's layerwise reload with rollback on failure, the tied
output projection re-processed after a reload, and the abort key in the trainer's TCPStore. This
module maps vLLM's four phases onto it:

    init_transfer_engine(info)  LayerwiseReceiver.join   (rank by vLLM's rule, below)
    start_weight_update()       LayerwiseReceiver.start  (initialize_layerwise_reload)
    update_weights(info)        LayerwiseReceiver.update (receive + load; rollback on failure)
    finish_weight_update()      LayerwiseReceiver.finish (finalize_layerwise_reload)
    shutdown()                  LayerwiseReceiver.close
    __call__(op, payload)       a staged epoch's stage / stage_status / drop_staged, and a
                                catch-up's serve_copy / cancel_serve, through vLLM's POST
                                /collective_rpc (the receive and the serve run on threads of
                                their own, beside the engine loop: `staged.py`); a flip is
                                `flip` (the whole session in one call) or, on a LoRA engine,
                                an update_weights whose update_info says source="staged" (the
                                copy it loads stays as the engine's committed copy)

The error of a failed update starts with `refit_grpc[applied=A/B]`: A buckets of B reached the
model. With A == 0 the rollback restored every layer, so the weights are the old ones; the shim
(`refit_grpc.shim.engines.vllm`) reads the marker from vLLM's HTTP 500 body.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from refit_grpc.dataplane.group import Group
from refit_grpc.plan import Packing
from refit_grpc.vllm_plugin import adapters
from refit_grpc.vllm_plugin.adapters import AdapterProblem
from refit_grpc.vllm_plugin.layerwise import (  # noqa: F401  (TiedRoutes: re-exported)
    LayerwiseReceiver,
    TiedHead,
    TiedRoutes,
    tied_heads,
    worker_rank,
)
from refit_grpc.wire import vllm as wire_vllm
from refit_grpc.wire.vllm import GlooInitInfo, GlooUpdateInfo
from refit_grpc.wire.worker import NO_QUANTIZATION, ServeInfo, StageStatus, WorkerInfo

log = logging.getLogger("vllm.refit_grpc")  # under "vllm" so vLLM's log handlers print it


@dataclass(kw_only=True)
class RefitGlooInitInfo(GlooInitInfo, WeightTransferInitInfo):
    """`init_info` of POST /init_weight_transfer_engine for this backend."""


@dataclass
class RefitGlooUpdateInfo(GlooUpdateInfo, WeightTransferUpdateInfo):
    """`update_info` of POST /update_weights: the plan in vLLM's field names, plus a deadline,
    the plan digest and the abort key (vLLM runs worker RPCs one at a time, so
    /shutdown_weight_transfer_engine cannot reach a worker blocked in this receive)."""


class RefitGlooWeightTransferEngine(
        WeightTransferEngine[RefitGlooInitInfo, RefitGlooUpdateInfo]):
    init_info_cls = RefitGlooInitInfo
    update_info_cls = RefitGlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = LayerwiseReceiver(model, self.model_config)
        if getattr(vllm_config, "lora_config", None) is not None:
            adapters.install_loader()  # adapter epochs: adapters built from memory

    @property
    def group(self) -> Group | None:
        return self.receiver.group

    @property
    def last_stats(self) -> dict[str, Any]:
        return self.receiver.last_stats

    # --- group -----------------------------------------------------------------------------

    def worker_rank(self, rank_offset: int) -> int:
        """vLLM's rule (nccl_common.worker_init_process_group): unique across DP replicas."""
        return worker_rank(self.parallel_config, rank_offset)

    def init_transfer_engine(self, init_info: RefitGlooInitInfo) -> None:
        self.receiver.join(init_info, self.worker_rank(init_info.rank_offset))

    def shutdown(self) -> None:
        self.receiver.close()  # a staged receive on the group fails at once, reports it

    # --- one update ------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        # vLLM may retarget an update (set_weight_update_target); follow it.
        self.receiver.model, self.receiver.model_config = self.model, self.model_config
        self.receiver.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Overrides the base, which ends in torch.accelerator.synchronize(): that raises on a
        # CPU-only host, and every receive here has completed when receive() returns.
        self.receiver.update(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: RefitGlooUpdateInfo) -> None:
        self.receiver.update(update_info)

    def finish_weight_update(self) -> None:
        self.receiver.finish()

    # --- staged epochs: reached through POST /collective_rpc ------------------------------

    def __call__(self, op: str, payload: str = "") -> dict[str, Any]:
        """One staged-epoch operation on this worker (docs/vllm.md, Staged epochs).

        vLLM's dev-mode POST /collective_rpc runs `getattr(worker, method)(**kwargs)` on every
        worker; naming this engine's attribute (`refit_grpc.wire.vllm.STAGE_RPC_METHOD`) calls
        it here, with string arguments only, as that route asks. Every operation but `flip`
        returns at once: the staged receive itself runs on its own thread
        (`staged.StagedReceive`), so the worker's engine loop keeps serving while the bytes
        arrive; `flip` loads the copy, which the paused engine waits for.

        Args:
            op: `stage` (payload: the update_info of the plan), `stage_status`,
                `drop_staged`, `serve_copy` (payload: a `ServeInfo`; the engine's rank-0
                worker serves a catch-up from its committed copy), `cancel_serve`,
                `restore_previous`, `engine_info` (what the worker says of its engine),
                `configure` (payload {"prepare_flip": bool}) or `flip` (payload: the flip's
                update_info; the whole weight-update session, on this call's thread).
            payload: JSON.

        Returns:
            This worker's `refit_grpc.wire.worker.StageStatus`, as a dict (`engine_info`: its
            `WorkerInfo`).
        """
        receiver, staged = self.receiver, self.receiver.staged
        operations: dict[str, Callable[[], StageStatus | WorkerInfo | AdapterProblem]] = {
            wire_vllm.STAGE_OP_START: lambda: receiver.stage(
                self.parse_update_info(json.loads(payload or "{}"))),
            wire_vllm.STAGE_OP_STATUS: staged.status,
            wire_vllm.STAGE_OP_DROP: receiver.drop_staged,
            wire_vllm.STAGE_OP_SERVE: lambda: receiver.serve(
                ServeInfo(**json.loads(payload or "{}")), self.worker_rank(0)),
            wire_vllm.STAGE_OP_CANCEL_SERVE: staged.cancel_serve,
            wire_vllm.STAGE_OP_RESTORE: staged.restore_previous,
            wire_vllm.STAGE_OP_INFO: lambda: WorkerInfo(
                quantization=self.model_config.quantization or NO_QUANTIZATION,
                multimodal=bool(self.model_config.is_multimodal_model),
                flip_in_one_call=not self._serves_lora),
            wire_vllm.STAGE_OP_CHECK_ADAPTER: lambda: self._check_adapter(payload),
            wire_vllm.STAGE_OP_COMMIT_ADAPTER: lambda: self._commit_adapter(payload),
            wire_vllm.STAGE_OP_CONFIGURE: lambda: self._configure(payload),
            wire_vllm.STAGE_OP_FLIP: lambda: self._flip(payload),
        }
        operation = operations.get(op)
        if operation is None:
            raise ValueError(f"refit_grpc gloo: unknown operation {op!r}")
        return operation().to_wire()

    @property
    def _serves_lora(self) -> bool:
        return getattr(self.vllm_config, "lora_config", None) is not None

    def _flip(self, payload: str) -> StageStatus:
        """A staged epoch's flip in one call (`wire.vllm.STAGE_OP_FLIP`), one turn of the engine
        loop: `LayerwiseReceiver.run_update`, the prepared layers installed and the norms and
        embeddings copied straight in where that is all the plan needs (`direct.py`), else the
        session vLLM's worker runs for /start_weight_update, /update_weights (source "staged")
        and /finish_weight_update. Its failure is the session's: rolled back and raised with
        the applied marker; a finalize that fails after every bucket loaded says so.

        Not on a LoRA engine: vLLM's worker removes every adapter after a session of its own
        (`reset_lora_state`), which this engine cannot reach; its shim flips through the
        routes (`WorkerInfo.flip_in_one_call`)."""
        from vllm.config import set_current_vllm_config

        if self._serves_lora:
            raise RuntimeError("refit_grpc gloo: a LoRA engine flips through vLLM's "
                               "weight-update routes, not in one call")
        info = self.parse_update_info(json.loads(payload or "{}"))
        if info.source != wire_vllm.SOURCE_STAGED:
            raise ValueError("refit_grpc gloo: a flip loads the staged copy "
                             f"(source {wire_vllm.SOURCE_STAGED!r}), got source {info.source!r}")
        receiver = self.receiver
        # vLLM may retarget an update (set_weight_update_target); follow it.
        receiver.model, receiver.model_config = self.model, self.model_config
        t0 = time.monotonic()
        with set_current_vllm_config(self.vllm_config):
            receiver.run_update(info)  # rolled back, the applied marker, on failure
        # What the flip's stall holds inside the worker (docs/vllm.md, What the flip costs).
        log.info("refit_grpc gloo: flip of version %s in one call: %.1f ms in the worker",
                 info.version, (time.monotonic() - t0) * 1e3)
        return receiver.staged.status()

    def _configure(self, payload: str) -> StageStatus:
        """Whether later stages prepare their flip's linear layers (`prepared.py`)."""
        args = json.loads(payload or "{}")
        if "prepare_flip" in args:
            self.receiver.prepare_flip = bool(args["prepare_flip"])
        return self.receiver.staged.status()

    def _check_adapter(self, payload: str) -> AdapterProblem:
        """Prepare of an adapter plan: what vLLM would refuse when it builds the adapter
        (`adapters.check`); an empty problem when it can serve it."""
        plan = self.parse_update_info(json.loads(payload or "{}")).plan(Packing())
        return adapters.check_plan(self.vllm_config, self.model, plan)

    def _commit_adapter(self, payload: str) -> StageStatus:
        """An adapter epoch's flip: the staged copy (exactly `staged_digest`) becomes the
        adapter's pending version (`adapters.commit`); the copy is spent, not a committed
        copy of the model."""
        args = json.loads(payload or "{}")
        return adapters.commit_staged(self.receiver.staged, str(args["staged_digest"]),
                                      int(args["version"]))


__all__ = ["RefitGlooInitInfo", "RefitGlooUpdateInfo", "RefitGlooWeightTransferEngine",
           "TiedHead", "TiedRoutes", "tied_heads"]
