"""One vLLM worker's end of a refit over gloo, shared by both ways the project runs inside vLLM:
the `gloo` weight-transfer backend (`engine.py`, vLLM >= 0.32's native weight-transfer routes) and
the Dynamo worker extension (`dynamo_extension.py`, vLLM 0.31 inside NVIDIA Dynamo, reached
through `collective_rpc`). Neither imports the other; both hold a `LayerwiseReceiver`.

The wire is the project's own, by construction rather than by a second implementation: the group is
`refit_grpc.dataplane.group.Group.join` (TCPStore client at the trainer's rank 0, PrefixStore
`refit_grpc/<group_id>`, ProcessGroupGloo on the interface that routes to the master), the buckets
are `refit_grpc.plan.RefitPlan.buckets` (vLLM's packing rule) and the receive loop is
`refit_grpc.dataplane.transfer.receive` (num_buffers receives posted ahead, every wait bounded by a
deadline). The sender is therefore exactly `Fleet.refit`'s.

Loading is vLLM's layerwise reload, as its own NCCL backend does: `initialize_layerwise_reload`
at `start`, `model.load_weights` per bucket, `finalize_layerwise_reload` at `finish`. Plain
`load_weights` fails on CPU (oneDNN repacks linear weights and leaves `layer.weight` empty).
Consequences handled here:

- layerwise reload keeps references to the loaded tensors until a layer is complete, and the
  receive reuses its bucket buffers, so every tensor is copied out of the buffer before loading;
- a failed receive leaves some layers on the meta device and vLLM drops the session, so the next
  forward would kill the EngineCore: the session is rolled back (partially loaded layers get their
  old kernel tensors back; completed layers keep the new weights) before the error propagates;
- a tied output projection (`tie_word_embeddings`: `lm_head` shares `embed_tokens`' parameter)
  is re-processed from the embedding once the session ends (`TiedHead`): on CPU vLLM computes
  logits from a repacked copy of the weight, which the layerwise reload does not rebuild for a
  layer that received nothing, so the engine kept serving the old output projection.

The error of a failed update starts with `refit_grpc[applied=A/B]`: A buckets of B reached the
model. With A == 0 the rollback restored every layer, so the weights are the old ones; the shim
reads the marker from the engine's error (vLLM's HTTP 500 body, Dynamo's `{"status": "error"}`).

A staged epoch (docs/vllm.md, Staged epochs) receives into the worker's staged copy on a thread
beside the engine loop (`stage`, `staged.StagedReceive`); its flip is an update whose
`source="staged"` feeds the same loader (`_loader`) from that copy instead of the group, inside
the same session, rollback and tied-head and experts handling as a receive.

An update can be aborted from outside the worker: the shim sets the update's `abort_key` in the
trainer's TCPStore, which the receive polls (vLLM runs worker RPCs one at a time, so no other
call can reach a worker blocked inside a receive).

Imports only the project's pure layers (common, plan, dataplane, wire) and vLLM's model
classes, which vLLM 0.31 and 0.32 share; vLLM's loader modules are imported where used.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.packing import unpack
from refit_grpc.dataplane.transfer import receive
from refit_grpc.plan import Bucket, RefitPlan, TensorSpec
from refit_grpc.vllm_plugin.direct import copy_direct, direct_targets
from refit_grpc.vllm_plugin.faults import StaleScales
from refit_grpc.vllm_plugin.moe import ExpertsReprocessing
from refit_grpc.vllm_plugin.prepared import PreparedLayers, prepare
from refit_grpc.vllm_plugin.staged import StagedReceive
from refit_grpc.wire.vllm import PREPARE_FLIP_ENV, SOURCE_STAGED, GlooInitInfo, GlooUpdateInfo
from refit_grpc.wire.vllm import worker_rank as wire_worker_rank
from refit_grpc.wire.worker import ServeInfo, StageStatus, applied_marker

log = logging.getLogger("vllm.refit_grpc")


def worker_rank(parallel_config: Any, rank_offset: int) -> int:
    """This worker's rank in the group: `refit_grpc.wire.vllm.worker_rank` of vLLM's parallel
    config (its rank within the engine, tensor x pipeline size, data-parallel index)."""
    pc = parallel_config
    return wire_worker_rank(rank_offset, pc.rank, pc.world_size, pc.data_parallel_index)


class LayerwiseReceiver:
    """One worker's group and its layerwise loads: `join`, then per update `start`, `update`
    (which rolls back and raises with the applied marker on failure), `finish`; `close` drops
    the group. Not thread-safe: vLLM runs a worker's RPCs one at a time."""

    def __init__(self, model: torch.nn.Module, model_config: Any):
        self.model = model
        self.model_config = model_config
        self.group: Group | None = None
        self.info: GlooInitInfo | None = None
        self.rank: int | None = None
        self.last_stats: dict[str, Any] = {}
        self.applied = 0  # buckets handed to load_weights in the current update
        self.total = 0
        self._abort_store: dist.Store | None = None
        self._tied: list[TiedHead] = []
        self._experts: ExpertsReprocessing | None = None
        self._faults: StaleScales | None = None
        self.staged = StagedReceive()  # a staged epoch's copy and its background receive
        # A flip's version once its load succeeded: the copy becomes the committed copy when
        # the session finishes (`finish`), not before (a failed finalize leaves none).
        self._flipped: int | None = None
        # Linear layers built from the complete staged copy beside the engine loop
        # (`prepared.py`); the flip in progress installs them when its session finishes.
        self._prepared: PreparedLayers | None = None
        self._installing: PreparedLayers | None = None
        self.prepare_flip = os.environ.get(PREPARE_FLIP_ENV, "1") != "0"

    @property
    def joined(self) -> bool:
        return self.group is not None and not self.group.closed

    # --- group -----------------------------------------------------------------------------

    def join(self, info: GlooInitInfo, rank: int) -> None:
        if self.joined:
            raise RuntimeError("refit_grpc gloo weight transfer is already initialised; "
                               "shut it down first")
        spec = GroupSpec(info.master_address, info.master_port, info.world_size, rank, "gloo",
                         info.group_id)
        t0 = time.monotonic()
        self.group = Group.join(spec, info.timeout_s)
        self.info, self.rank = info, rank
        log.info("refit_grpc gloo: rank %d/%d joined group %s at %s:%d in %.3fs", rank,
                 info.world_size, info.group_id, info.master_address, info.master_port,
                 time.monotonic() - t0)

    def close(self) -> None:
        # A staged receive on this group fails at once (GROUP_CLOSED) and reports it.
        group, self.group, self.info = self.group, None, None
        self._abort_store = None
        if group is not None:
            group.close()  # never blocks; peers' pending operations fail at once

    # --- one update ------------------------------------------------------------------------

    def start(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # Found now: inside the session every layer holds its own meta tensor, the tie is gone.
        self._tied = tied_heads(self.model)
        self._experts = ExpertsReprocessing(self.model)
        self._faults = StaleScales(self.model)  # nothing unless a test's environment asks
        initialize_layerwise_reload(self.model)

    def update(self, update_info: GlooUpdateInfo) -> None:
        """Load every bucket of one update: received from the group, or, for a staged epoch's
        flip (`source="staged"`), read from the staged copy. On failure: roll the session back,
        drop the group after a failed receive (unusable: a peer left, or a receive is still
        posted) and raise a RuntimeError whose message starts with the applied marker."""
        self.applied, self.total = 0, 0
        self._flipped = None
        self._installing = None
        staged = update_info.source == SOURCE_STAGED
        if not staged:
            # The live weights are about to change without the copy.
            self.staged.forget_committed()
            self._prepared = None
        try:
            if staged:
                self._load_staged(update_info)
            else:
                self._receive(update_info)
        except Exception as e:
            restored = self.rollback()
            if not staged:
                self.close()
            raise RuntimeError(
                f"{applied_marker(self.applied, self.total)} "
                f"{'load of the staged copy' if staged else 'receive'} failed "
                f"({type(e).__name__}: {e}); rolled back ({restored} partly loaded layers "
                f"restored{'' if self.applied else ', weights unchanged'})") from e
        except BaseException:
            self.rollback()
            raise

    def _loader(self, plan: RefitPlan
                ) -> Callable[[Bucket, Iterator[tuple[TensorSpec, torch.Tensor]]], None]:
        """The one way a bucket's tensors reach the model, whichever way its bytes came: an
        owned copy of each (layerwise reload keeps them until their layer completes), the tied
        routes, `model.load_weights`. Counts `applied`."""
        routes = TiedRoutes(self._tied, {s.name for s in plan.tensors})

        def apply(bucket: Bucket, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
            # Counted before loading: a bucket that fails halfway may have completed layers.
            self.applied += 1
            loads = []
            for spec, raw in tensors:
                tensor = _owned(spec, raw)
                name = routes.load_as(spec.name, tensor)
                if name is not None:
                    loads.append((name, tensor))
            if loads:
                with torch.no_grad():
                    # A vLLM model's own method; nn.Module's __getattr__ types it Tensor | Module.
                    self.model.load_weights(loads)  # type: ignore[operator]

        return apply

    def _receive(self, update_info: GlooUpdateInfo) -> None:
        group, info = self.group, self.info
        if group is None or group.closed or info is None:
            raise RuntimeError("refit_grpc gloo weight transfer is not initialised; "
                               "join the group first")
        if self.staged.running:
            raise RuntimeError("refit_grpc gloo: a staged receive is running on this group; "
                               "drop it first")
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        plan = update_info.plan(info.packing)
        self.total = len(plan.buckets)
        self.last_stats = {"buckets": len(plan.buckets), "bytes": plan.total_bytes}
        deadline = Deadline(update_info.timeout_s or info.timeout_s)
        apply = self._loader(plan)
        watcher = (_AbortWatcher(self._store(info), update_info.abort_key, deadline.cancel)
                   if update_info.abort_key else None)
        # An operator reading the engine's log sees each rank enter the receive (and the
        # TP-worker fault test waits for this line before it kills a rank mid-receive).
        log.info("refit_grpc gloo: rank %d receiving %d buckets, %d bytes", self.rank,
                 len(plan.buckets), plan.total_bytes)
        try:
            with disable_mtp_completeness_check():
                stats = receive(group, plan, deadline, apply)
        finally:
            if watcher is not None:
                watcher.stop()
        self.last_stats.update(seconds=stats.seconds, rank=self.rank)
        log.info("refit_grpc gloo: received %d buckets, %d bytes in %.3fs", stats.buckets,
                 stats.bytes, stats.seconds)

    def _load_staged(self, update_info: GlooUpdateInfo) -> None:
        """A staged epoch's flip: every bucket of the staged copy through `_loader`, exactly as
        a receive would hand it over. The group is not needed (the trainer may have left)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        assert update_info.staged_digest  # GlooUpdateInfo refuses a staged load without one
        staged_plan = self.staged.take(update_info.staged_digest)
        plan = update_info.plan(staged_plan.packing)  # its plan_digest: the staged plan's
        if plan.digest != staged_plan.digest:
            raise RuntimeError(f"refit_grpc gloo: the flip's plan {plan.digest[:12]} is not "
                               f"the staged one {staged_plan.digest[:12]}")
        self.total = len(plan.buckets)
        deadline = Deadline(update_info.timeout_s or 600.0)
        apply = self._loader(plan)
        # The layers prepared from this very copy are installed at `finish`; the loader takes
        # every other tensor.
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.digest != update_info.staged_digest:
            prepared = None
        skip = prepared.names if prepared is not None else frozenset()
        self._installing = prepared  # a failed load's rollback tells vLLM not to expect them
        t0 = time.monotonic()
        with disable_mtp_completeness_check():
            for bucket in plan.buckets:
                deadline.check(f"load of staged bucket {bucket.index}")
                apply(bucket, ((spec, raw) for spec, raw in unpack(
                    self.staged.copy.bucket_view(bucket), plan.tensors[bucket.start:bucket.stop])
                    if spec.name not in skip))
        self._flipped = update_info.version or 0
        seconds = time.monotonic() - t0
        self.last_stats = {"buckets": len(plan.buckets), "bytes": plan.total_bytes,
                           "seconds": seconds, "rank": self.rank, "source": SOURCE_STAGED,
                           "prepared_layers": len(prepared.shadows) if prepared else 0}
        log.info("refit_grpc gloo: loaded the staged copy, %d buckets, %d bytes in %.3fs "
                 "(%d tensors of %d prepared layers taken from the preparation)",
                 len(plan.buckets), plan.total_bytes, seconds, len(skip),
                 len(prepared.shadows) if prepared else 0)

    def run_update(self, update_info: GlooUpdateInfo) -> None:
        """One whole update in one call (vLLM's `flip` operation, Dynamo's update route): the
        session (`start`, `update`, `finish`), except for a staged epoch's flip whose plan the
        prepared layers and direct copies cover (`direct.py`), which needs none. Fails as
        `update` does: rolled back, the applied marker; a finalize that fails after every
        bucket loaded says so."""
        if self._flip_directly(update_info):
            return
        self.start()
        self.update(update_info)  # rolls back and raises with the applied marker on failure
        try:
            self.finish()
        except Exception as e:
            raise RuntimeError(f"{applied_marker(self.total, self.total)} the reload failed "
                               f"to finalize ({type(e).__name__}: {e})") from e

    def _flip_directly(self, update_info: GlooUpdateInfo) -> bool:
        """The flip without a session (`direct.py`); False, having changed nothing, where the
        plan needs one."""
        prepared = self._prepared
        if (update_info.source != SOURCE_STAGED or prepared is None
                or prepared.digest != update_info.staged_digest):
            return False
        try:
            staged_plan = self.staged.take(update_info.staged_digest)
            plan = update_info.plan(staged_plan.packing)
        except (RuntimeError, ValueError):
            # Nothing (or another copy) is staged: the session's load refuses it, with its
            # message and the marker that nothing was applied.
            return False
        if plan.digest != staged_plan.digest:
            return False  # refused there as well
        targets = direct_targets(self.model, self.model_config, plan, prepared)
        if targets is None:
            return False
        self._prepared = None
        self.applied, self.total = 0, len(plan.buckets)
        t0 = time.monotonic()
        try:
            copied = copy_direct(targets, plan, self.staged.copy)
        except Exception as e:
            # A loader refused a tensor its checks let through: the parameters before it hold
            # the new values, the prepared layers were not installed.
            self.staged.committed(None)
            raise RuntimeError(f"{applied_marker(self.total, self.total)} the direct copy of "
                               f"the staged copy failed ({type(e).__name__}: {e})") from e
        installed = prepared.install()
        self.applied = self.total
        self.staged.committed(update_info.version or 0)
        seconds = time.monotonic() - t0
        self.last_stats = {"buckets": len(plan.buckets), "bytes": plan.total_bytes,
                           "seconds": seconds, "rank": self.rank, "source": SOURCE_STAGED,
                           "prepared_layers": installed, "direct": copied}
        log.info("refit_grpc gloo: the flip installed %d prepared layers and copied %d tensors "
                 "straight in, without a session, in %.3fs", installed, copied, seconds)
        return True

    # --- staged epochs: the receive beside the engine loop (staged.py) ---------------------

    def stage(self, update_info: GlooUpdateInfo) -> StageStatus:
        """Start a staged receive of `update_info`'s plan on a thread of its own; returns at
        once (the worker's main thread goes back to serving). A failed staged receive closes
        the group, as a failed receive does."""
        group, info = self.group, self.info
        if group is None or group.closed or info is None or self.rank is None:
            raise RuntimeError("refit_grpc gloo weight transfer is not initialised; "
                               "join the group first")
        plan = update_info.plan(info.packing)
        deadline = Deadline(update_info.timeout_s or info.timeout_s)
        self._prepared = None
        prepare_flip = self.prepare_flip and plan.adapter is None
        return self.staged.start(group, plan, deadline, self.rank, on_failure=group.close,
                                 delta=bool(update_info.delta),
                                 keep_previous=bool(update_info.reversible),
                                 on_complete=self._prepare_flip if prepare_flip else None)

    def _prepare_flip(self, plan: RefitPlan, digest: str) -> None:
        """On the staged receive's thread, the copy complete: build the linear layers the flip
        will install (`prepared.prepare`)."""
        self._prepared = prepare(self.model, self.model_config, plan, self.staged.copy, digest)

    def drop_staged(self) -> StageStatus:
        """Forget the staged copy (`StagedReceive.drop`) and the layers prepared from it (after
        the drop as well: a preparation the drop waited for may have just stored them)."""
        self._prepared = None
        status = self.staged.drop()
        self._prepared = None
        return status

    def serve(self, info: ServeInfo, engine_rank: int) -> StageStatus:
        """A catch-up from this engine: its rank-0 worker broadcasts its committed copy to the
        newcomer's group (`staged.StagedReceive.serve`); every worker holds the whole copy
        (each TP rank received every byte), so one sends. The other workers only answer."""
        if engine_rank == 0:
            return self.staged.serve(info)
        return self.staged.status()

    def _store(self, info: GlooInitInfo) -> dist.Store | None:
        """A client of the trainer's TCPStore, for abort keys (the group's own stays private)."""
        if self._abort_store is None:
            try:
                self._abort_store = dist.TCPStore(
                    info.master_address, info.master_port, is_master=False,
                    wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
            except (RuntimeError, dist.DistError) as e:
                log.warning("refit_grpc gloo: no abort channel (%s); an abort then waits for "
                            "the trainer to leave or for the update's timeout", e)
        return self._abort_store

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for tie in self._tied:
            tie.expect_nothing_of_its_own()
        flipped, self._flipped = self._flipped, None
        installing, self._installing = self._installing, None
        if installing is not None:
            installing.expect_nothing()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            if flipped is not None:
                self.staged.committed(None)  # the live weights are not the copy's
            raise
        finally:
            self._end_experts_reprocessing()
        if installing is not None:
            installed = installing.install()
            log.info("refit_grpc gloo: the flip installed %d prepared layers", installed)
        self._refresh_tied_heads()
        if flipped is not None:
            self.staged.committed(flipped)

    def _refresh_tied_heads(self) -> None:
        for tie in self._tied:
            tie.refresh()

    def _end_experts_reprocessing(self) -> None:
        experts, self._experts = self._experts, None
        if experts is not None:
            experts.restore()
        faults, self._faults = self._faults, None
        if faults is not None:
            faults.restore()

    def rollback(self) -> int:
        """End the layerwise session after a failure; returns how many partly loaded layers got
        their old kernel tensors back. vLLM's worker drops the session on any update error, so
        without this the layers still on the meta device would kill the next forward."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        partial = 0
        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and info.load_numel > 0:
                # Some but not all of this layer's tensors arrived: drop them, so finalize puts
                # the old kernel tensors back instead of processing a half-filled layer.
                info.loaded_weights = []
                info.load_numel = 0
                partial += 1
        installing, self._installing = self._installing, None
        try:
            for tie in self._tied:
                tie.expect_nothing_of_its_own()
            if installing is not None:  # never installed: those layers keep their weights
                installing.expect_nothing()
            finalize_layerwise_reload(self.model, self.model_config)
            # A completed embedding keeps its new values: its tied head must follow it.
            self._refresh_tied_heads()
        except Exception:  # noqa: BLE001  (the original error is what the caller must see)
            log.exception("refit_grpc gloo: rollback of the layerwise reload failed")
        finally:
            self._end_experts_reprocessing()
        log.warning("refit_grpc gloo: update failed after %d buckets; layerwise reload rolled "
                    "back (%d partly loaded layers restored)", self.applied, partial)
        return partial


@dataclass
class TiedHead:
    """An output projection tied to an input embedding: one parameter, two layers.

    After a layerwise reload vLLM hands both layers that parameter back with the new values, but
    only a layer that received weights is re-processed. On CPU, processing an embedding-shaped
    layer (`UnquantizedEmbeddingMethod.process_weights_after_loading`) builds `cpu_linear` from a
    repacked copy of the weight, and logits come from that copy: without `refresh` the head kept
    the copy made from the previous embedding.
    """

    head_name: str         # parameter names as the model loads them, e.g. "lm_head.weight" ...
    embedding_name: str    # ... and "model.embed_tokens.weight"
    head: ParallelLMHead
    embedding: VocabParallelEmbedding

    def expect_nothing_of_its_own(self) -> None:
        """Before finalize: a head that received nothing is not a failed load (vLLM would log
        "Failed to load weights" at every refit), its tensor is the embedding's."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        info = LAYERWISE_INFO.get(self.head)
        if info is not None and info.can_load() and info.load_numel == 0:
            info.load_numel_total = 0

    def refresh(self) -> None:
        """After finalize: the head holds exactly the embedding's parameter, processed anew."""
        weight = self.embedding._parameters.get("weight")
        if weight is None or weight.is_meta:
            return  # the embedding itself was not restored; nothing sound to tie to
        if self.head._parameters.get("weight") is not weight:
            # vLLM gives both layers the same kernel tensor back today; should a later version
            # not, the head would serve a tensor no load ever reaches.
            self.head.weight = weight
        method = getattr(self.head, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(self.head)
        else:
            log.warning("refit_grpc gloo: %s is tied to %s but quantized (%s): not re-processed "
                        "after a refit", self.head_name, self.embedding_name,
                        type(method).__name__)


def tied_heads(model: torch.nn.Module) -> list[TiedHead]:
    """Every `ParallelLMHead` whose weight is an input embedding's weight (the same Parameter,
    as `tie_weights` makes it), with both parameter names."""
    embeddings: dict[int, tuple[str, VocabParallelEmbedding]] = {}
    heads: list[tuple[str, ParallelLMHead]] = []
    for name, module in model.named_modules():
        if isinstance(module, ParallelLMHead):
            heads.append((name, module))
        elif isinstance(module, VocabParallelEmbedding):
            weight = module._parameters.get("weight")
            if weight is not None:
                embeddings[id(weight)] = (name, module)
    found = []
    for name, head in heads:
        weight = head._parameters.get("weight")
        match = embeddings.get(id(weight)) if weight is not None else None
        if match is not None:
            found.append(TiedHead(_param_name(name), _param_name(match[0]), head, match[1]))
    return found


def _param_name(module_name: str) -> str:
    return f"{module_name}.weight" if module_name else "weight"


class TiedRoutes:
    """Which name each received tensor is loaded under, for a model with tied heads.

    The tie means one tensor, so one of the two names is loaded. When a plan names both, the
    embedding wins and the head's copy is only checked against it (a mismatch fails the update:
    the engine cannot serve two different matrices through one parameter); vLLM's own
    checkpoint loader does the same (`AutoWeightsLoader` skips the second name of a tied
    parameter). A plan with the head's name alone is loaded as the embedding.
    """

    def __init__(self, tied: list[TiedHead], plan_names: set[str]):
        self._skip: dict[str, str] = {}      # head name -> embedding name, both in the plan
        self._rename: dict[str, str] = {}    # head name -> embedding name, head alone
        for tie in tied:
            if tie.head_name not in plan_names:
                continue
            if tie.embedding_name in plan_names:
                self._skip[tie.head_name] = tie.embedding_name
            else:
                self._rename[tie.head_name] = tie.embedding_name
        self._pairs = {n: k for k, n in self._skip.items()} | {k: k for k in self._skip}
        self._first: dict[str, tuple[str, torch.Tensor]] = {}  # pair key -> first arrival

    def load_as(self, name: str, tensor: torch.Tensor) -> str | None:
        """The name to load `tensor` under, or None to not load it."""
        if name in self._rename:
            return self._rename[name]
        key = self._pairs.get(name)
        if key is not None:
            first = self._first.pop(key, None)
            if first is None:
                self._first[key] = (name, tensor)  # a reference: the owned copy, no new one
            else:
                _check_same(first, (name, tensor))
        return None if name in self._skip else name


def _check_same(a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor]) -> None:
    (na, ta), (nb, tb) = a, b
    if ta.shape != tb.shape or not torch.equal(ta, tb.to(ta.dtype)):
        raise ValueError(f"{na} and {nb} are one tied parameter in this engine's model, but "
                         "the trainer sent two different tensors; send the same tensor, or "
                         "one of the two names")


def _owned(spec: TensorSpec, raw: torch.Tensor) -> torch.Tensor:
    """A typed copy of one tensor's packed bytes: layerwise reload keeps what it is given until
    the layer completes, and the bucket buffer is reused for a later bucket."""
    return raw.clone().view(spec.dtype).view(spec.shape)


class _AbortWatcher:
    """Polls the trainer's TCPStore for an abort key and sets the receive's cancel flag; the
    receive's waits notice it within 50 ms (`common.CANCEL_POLL_S`)."""

    POLL_S = 0.1

    def __init__(self, store: dist.Store | None, key: str, cancel: threading.Event):
        self._stop = threading.Event()
        self._thread = None
        if store is not None:
            self._thread = threading.Thread(target=self._run, args=(store, key, cancel),
                                            daemon=True, name="refit-abort-watch")
            self._thread.start()

    def _run(self, store: dist.Store, key: str, cancel: threading.Event) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                if store.check([key]):
                    log.warning("refit_grpc gloo: abort requested (%s)", key)
                    cancel.set()
                    return
            except (RuntimeError, dist.DistError):
                return  # the trainer's store is gone: so is the sender, the receive fails anyway

    def stop(self) -> None:
        self._stop.set()
