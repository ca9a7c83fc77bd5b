"""A staged flip without vLLM's layerwise session where none is needed (docs/vllm.md, What the
flip costs).

Why. Once the dense linear layers and an untied output projection are prepared beside the engine
loop (`prepared.py`), what a flip still loads through vLLM's layerwise reload is the norms and the
input embedding: tensors served exactly as the checkpoint holds them (each rank's shard of a
vocab-parallel embedding), whose post-load step builds nothing they are served from. The session
is then most of the flip's load: `initialize_layerwise_reload` puts every layer of the model on
the meta device and `finalize_layerwise_reload` puts each one back, for a few small tensors. So
when every tensor of the plan is in a prepared layer or is such a *direct* tensor, the flip copies
the direct ones straight into their live parameters, each through its own weight loader (which
takes the rank's shard and pads as at load time), and installs the prepared layers: no session.

Which tensors are direct: the parameters of a norm layer (a class of vLLM's `layernorm` module,
no quant method) and the weight of a `VocabParallelEmbedding` that is not an output projection
and not tied to one, served by `UnquantizedEmbeddingMethod` (the lookup reads the weight itself),
of a model whose layers `prepared.py` prepares (`PREPARED_MODELS`, run eagerly). Anything else in
the plan (experts, a tied head, a quantized layer, a name the model maps otherwise) keeps the
session, and the flip is exactly as before. Every target is found and checked before the first
byte moves, so a flip that cannot go direct changes nothing and takes the session instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from refit_grpc.dataplane.packing import as_tensor, unpack
from refit_grpc.dataplane.staging import StagingCopy
from refit_grpc.plan import RefitPlan, TensorSpec
from refit_grpc.vllm_plugin.prepared import PREPARED_MODELS, PreparedLayers

_NORM_MODULE = "vllm.model_executor.layers.layernorm"


def direct_targets(model: torch.nn.Module, model_config: Any, plan: RefitPlan,
                   prepared: PreparedLayers | None) -> dict[str, torch.nn.Parameter] | None:
    """The live parameter of every plan tensor the prepared layers do not hold, or None when
    some tensor needs the layerwise session (module docstring). Touches nothing."""
    if (prepared is None or not getattr(model_config, "enforce_eager", False)
            or type(model).__name__ not in PREPARED_MODELS):
        return None
    modules = dict(model.named_modules())
    head_weights = {id(m._parameters.get("weight")) for m in modules.values()
                    if isinstance(m, ParallelLMHead)}
    targets: dict[str, torch.nn.Parameter] = {}
    for spec in plan.tensors:
        if spec.name in prepared.names:
            continue
        path, _, leaf = spec.name.rpartition(".")
        module = modules.get(path)
        param = module._parameters.get(leaf) if module is not None else None
        if module is None or param is None or not _direct(module, param, spec, head_weights):
            return None
        targets[spec.name] = param
    return targets


def _direct(module: torch.nn.Module, param: torch.nn.Parameter, spec: TensorSpec,
            head_weights: set[int]) -> bool:
    if type(module).__module__ == _NORM_MODULE:
        return (getattr(module, "quant_method", None) is None
                and tuple(param.shape) == spec.shape)
    return (type(module) is VocabParallelEmbedding
            and type(getattr(module, "quant_method", None)) is UnquantizedEmbeddingMethod
            and id(param) not in head_weights
            and param is module._parameters.get("weight")
            and len(spec.shape) == 2 and param.dim() == 2
            and spec.shape[0] == getattr(module, "org_vocab_size", -1)
            and spec.shape[1] == param.shape[1])


def copy_direct(targets: dict[str, torch.nn.Parameter], plan: RefitPlan,
                copy: StagingCopy) -> int:
    """Copy each target's tensor from the staged copy into its live parameter; returns how
    many were copied."""
    copied = 0
    with torch.no_grad():
        for bucket in plan.buckets:
            for spec, raw in unpack(copy.bucket_view(bucket),
                                    plan.tensors[bucket.start:bucket.stop]):
                param = targets.get(spec.name)
                if param is not None:
                    _loader(param)(param, as_tensor(spec, raw))
                    copied += 1
    return copied


def _loader(param: torch.nn.Parameter) -> Callable[..., None]:
    """The parameter's own weight loader, unwrapped of the layerwise reload's wrapper (which
    loads nothing outside a session)."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


__all__ = ["copy_direct", "direct_targets"]
