"""A staged flip that installs linear layers prepared while the engine serves (docs/vllm.md,
What the flip costs).

Why. A flip's stall is mostly vLLM's layerwise reload of the linear layers, and on vLLM CPU most
of that is their processing: `UnquantizedLinearMethod.process_weights_after_loading`
(`dispatch_cpu_unquantized_gemm`) builds a oneDNN handle or a packed copy of the new weight,
captures it in `layer.cpu_linear` and drops the weight. That processing depends only on the
layer's new weights, which the staged copy holds as soon as the stage is complete. So each such
layer is built again beside the live one on the staged receive's thread, while the engine keeps
serving: a *shadow* of the layer (a shallow copy of the module with tensors of its own,
materialized from vLLM's reload metadata, filled by the layer's own weight loaders from the
staged copy, processed by the layer's own quant method). The flip installs every shadow's state
in its live layer (the module's attribute dict: no copy of any weight) and loads only the other
layers through the layerwise reload while the engine is paused: norms, embeddings, tied output
projections, experts, quantized layers, anything not recognised here (or, where those are only
norms and untied embeddings, copies them without a session: `direct.py`).

Which layers are prepared: `LinearBase` modules served by `UnquantizedLinearMethod` with no
children, and an output projection (`ParallelLMHead`, `UnquantizedEmbeddingMethod`) not tied to
the input embedding, of a model in `PREPARED_MODELS` (below) run eagerly, whose checkpoint
tensors are all in the plan under their plain names: the module's own (`<module>.weight`,
`<module>.bias`) or, for a fused module (`qkv_proj`, `gate_up_proj`), its parts from the model's
`packed_modules_mapping` with vLLM's shard ids (q/k/v for `QKVParallelLinear`, 0..n-1 for
`MergedColumnParallelLinear`: the models' `stacked_params_mapping`). A compiled engine may hold
a handle its graph was traced with; a checkpoint that holds the fused tensor itself (phi3), a
model whose names map otherwise, LoRA-wrapped layers and quantized ones are not prepared: they
load at the flip as before, which is always correct.

Cost: one more processed copy of the prepared layers from the end of the stage to the flip (the
live ones are freed when the shadows are installed), and the processing on a second thread
beside the engine's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from refit_grpc.dataplane.packing import as_tensor, unpack
from refit_grpc.dataplane.staging import StagingCopy
from refit_grpc.plan import RefitPlan

log = logging.getLogger("vllm.refit_grpc")

ShardId = str | int | None

# The model classes whose `load_weights` hands a dense linear layer's checkpoint tensors to its
# weight loaders unchanged (by name, or through the packed mapping), each proven by a staged
# flip against transformers in the tests (test_vllm_staged, test_vllm_families, test_vllm_tp,
# the engine contract; Qwen2, tied, q/k/v biases, in bf16: test_vllm_truth). Any other model
# loads every layer at the flip: a model that transforms a weight in its own `load_weights`
# would otherwise be served the untransformed one.
PREPARED_MODELS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                             "MixtralForCausalLM", "Qwen3MoeForCausalLM"})


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor a prepared layer loads, and the shard id its loader takes."""

    name: str        # e.g. "model.layers.0.self_attn.k_proj.weight"
    param: str       # the layer's parameter: "weight" or "bias"
    shard: ShardId   # "k" for a QKVParallelLinear, 1 for a MergedColumnParallelLinear, else None


@dataclass
class _Shadow:
    layer: torch.nn.Module
    state: dict[str, Any]  # the shadow module's attributes, its children excepted


@dataclass
class PreparedLayers:
    """The shadows built from one staged copy (`digest`) and the plan tensors they took."""

    digest: str
    shadows: list[_Shadow]
    names: frozenset[str]

    def expect_nothing(self) -> None:
        """Inside a flip's layerwise session, before finalize: the prepared layers receive
        nothing through the loader (vLLM would log "Failed to load weights" for each and
        place their old kernel tensors back, which `install` then replaces)."""
        for shadow in self.shadows:
            info = LAYERWISE_INFO.get(shadow.layer)
            if info is not None and info.can_load() and info.load_numel == 0:
                info.load_numel_total = 0

    def install(self) -> int:
        """After the flip's session finished: each live layer takes its shadow's state."""
        for shadow in self.shadows:
            shadow.layer.__dict__.update(shadow.state)
        return len(self.shadows)


def prepare(model: torch.nn.Module, model_config: Any, plan: RefitPlan, copy: StagingCopy,
            digest: str) -> PreparedLayers | None:
    """Build the shadows of every preparable layer from the complete staged `copy` (module
    docstring); None when the engine has none. Touches no live tensor: safe beside the engine
    loop. Raises whatever a loader or the processing raises (the caller then flips through the
    loader alone)."""
    t0 = time.monotonic()
    layers = list(_preparable(model, model_config, {s.name for s in plan.tensors}))
    if not layers:
        return None
    wanted = {source.name for _, sources in layers for source in sources}
    tensors = dict(_tensors(plan, copy, wanted))
    shadows = []
    with torch.no_grad():
        for layer, sources in layers:
            shadows.append(_Shadow(layer, _build(layer, sources, tensors)))
    seconds = time.monotonic() - t0
    log.info("refit_grpc gloo: prepared %d linear layers (%d tensors) for the flip in %.3fs, "
             "beside the engine loop", len(shadows), len(wanted), seconds)
    return PreparedLayers(digest, shadows, frozenset(wanted))


def _preparable(model: torch.nn.Module, model_config: Any, plan_names: set[str]
                ) -> Iterator[tuple[torch.nn.Module, list[_Source]]]:
    if (not getattr(model_config, "enforce_eager", False)
            or type(model).__name__ not in PREPARED_MODELS):
        return
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    embeddings = {id(m._parameters.get("weight")) for m in model.modules()
                  if type(m) is VocabParallelEmbedding}
    for module_name, module in model.named_modules():
        if isinstance(module, ParallelLMHead):
            # An output projection is processed as a linear layer is (its `cpu_linear` for the
            # logits); one tied to the input embedding shares its parameter, which the flip
            # loads once through the loader (layerwise.TiedHead), so only an untied one.
            if (type(getattr(module, "quant_method", None)) is UnquantizedEmbeddingMethod
                    and id(module._parameters.get("weight")) not in embeddings
                    and module in LAYERWISE_INFO):
                sources = _own_sources(module_name, module, None)
                if all(s.name in plan_names for s in sources):
                    yield module, sources
            continue
        if (not isinstance(module, LinearBase) or any(True for _ in module.children())
                or type(getattr(module, "quant_method", None)) is not UnquantizedLinearMethod
                or module not in LAYERWISE_INFO):
            continue
        sources = _sources(module_name, module, packed)
        if sources and all(s.name in plan_names for s in sources):
            yield module, sources


def _sources(module_name: str, module: torch.nn.Module, packed: dict[str, list[str]]
             ) -> list[_Source]:
    prefix, _, leaf = module_name.rpartition(".")
    parts: list[tuple[str, ShardId]]
    if leaf in packed:
        names = list(packed[leaf])
        if leaf in names:
            # The checkpoint itself holds the fused tensor (phi3's qkv_proj, gate_up_proj): its
            # model splits it in load_weights, which only the loader at the flip runs.
            return []
        if isinstance(module, QKVParallelLinear) and len(names) == 3:
            parts = list(zip(names, ("q", "k", "v")))
        elif (isinstance(module, MergedColumnParallelLinear)
              and len(names) == len(getattr(module, "output_sizes", ()))):
            parts = [(name, i) for i, name in enumerate(names)]
        else:
            return []
        parts = [(f"{prefix}.{name}" if prefix else name, shard) for name, shard in parts]
    else:
        parts = [(module_name, None)]
    return [s for base, shard in parts for s in _own_sources(base, module, shard)]


def _own_sources(base: str, module: torch.nn.Module, shard: ShardId) -> list[_Source]:
    """The checkpoint tensors `<base>.weight` (and `<base>.bias`) of `module`'s parameters."""
    params = ["weight"] + (["bias"] if getattr(module, "bias", None) is not None else [])
    return [_Source(f"{base}.{param}", param, shard) for param in params]


def _tensors(plan: RefitPlan, copy: StagingCopy, wanted: set[str]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The staged copy's tensors that `wanted` names, typed views of the copy (the loaders copy
    out of them at once)."""
    for bucket in plan.buckets:
        for spec, raw in unpack(copy.bucket_view(bucket), plan.tensors[bucket.start:bucket.stop]):
            if spec.name in wanted:
                yield spec.name, as_tensor(spec, raw)


def _build(layer: torch.nn.Module, sources: list[_Source], tensors: dict[str, torch.Tensor]
           ) -> dict[str, Any]:
    """A shadow of `layer` loaded from `tensors` and processed; returns its state."""
    info = LAYERWISE_INFO[layer]
    shadow = object.__new__(type(layer))
    shadow.__dict__ = dict(layer.__dict__)
    # Names registered as None (a layer without bias) stay so: the forward reads them.
    shadow._parameters = {k: None for k, v in layer._parameters.items() if v is None}
    shadow._buffers = {k: None for k, v in layer._buffers.items() if v is None}
    shadow._modules = {}
    shadow._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    params, buffers = info.restore_metadata
    with info.restore_device:
        for name, meta in params.items():
            shadow.register_parameter(  # a Parameter: materialize keeps the meta's class
                name, _rebound(materialize_meta_tensor(meta), layer, shadow))  # type: ignore[arg-type]
        for name, meta in buffers.items():
            shadow.register_buffer(name, _rebound(materialize_meta_tensor(meta), layer, shadow),
                                   persistent=name not in shadow._non_persistent_buffers_set)
    # The bias is never put on meta by vLLM's reload (it is loaded into the live tensor): the
    # shadow gets a tensor of its own, or the load below would write the served bias.
    bias = layer._parameters.get("bias")
    if bias is not None and "bias" not in params:
        shadow.register_parameter("bias", _rebound(_clone(bias), layer, shadow))  # type: ignore[arg-type]
    for source in sources:
        param = shadow._parameters[source.param]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if source.shard is None:
            loader(param, tensors[source.name])
        else:
            loader(param, tensors[source.name], source.shard)
    # UnquantizedLinearMethod, or an untied head's UnquantizedEmbeddingMethod: `_preparable`
    method: Any = shadow.quant_method
    method.process_weights_after_loading(shadow)
    update_tp: Any = getattr(shadow, "update_param_tp_status", None)
    if update_tp is not None:
        update_tp()
    return {k: v for k, v in shadow.__dict__.items() if k != "_modules"}


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.data.clone()
    out.__class__ = tensor.__class__
    out.__dict__ = tensor.__dict__.copy()
    return out


def _rebound(tensor: torch.Tensor, layer: torch.nn.Module, shadow: torch.nn.Module
             ) -> torch.Tensor:
    """The tensor's own weight loaders, unwrapped and bound to the shadow. vLLM's metadata
    keeps the loader a reload wrapped (`online_process_loader`, which loads nothing outside a
    reload session: the shadow would keep uninitialised memory), and bound to nothing or, once
    a reload restored it, to the live layer."""
    loader = getattr(tensor, "weight_loader", None)  # vLLM's own parameters: a property
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    if loader is not None:
        tensor.weight_loader = loader  # type: ignore[attr-defined]
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and (value.__self__ is layer_ref_sentinel
                                              or value.__self__ is layer):
            tensor.__dict__[key] = value.__func__.__get__(shadow)
    return tensor


__all__ = ["PREPARED_MODELS", "PreparedLayers", "prepare"]
