"""A transformers trainer's tensors under the names an engine loads.

Engines load checkpoint names: vLLM's `load_weights` takes what `save_pretrained` writes, and the
shim checks a plan against the engine's checkpoint (Prepare refuses a name it cannot load with
UNKNOWN_TENSOR). transformers >= 5 holds some weights in memory in another shape than it saves
them: a mixture-of-experts layer keeps its experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) and writes one tensor per expert and projection
(`mlp.experts.0.gate_proj.weight`, ...; Mixtral's `block_sparse_moe.experts.0.w1.weight`). So
`model.state_dict()` of such a model names tensors no checkpoint has.

`checkpoint_state_dict(model)` is the one call a trainer makes instead: transformers' own
reverse of its load-time conversion (`revert_weight_conversion`, what `save_pretrained` uses), so
the names and shapes are exactly the checkpoint's, for every family transformers converts. The
per-expert tensors are views into the fused parameters where the conversion allows (no copy);
the sender packs them like any tensor.

    from refit_grpc.integrations.hf import checkpoint_state_dict

    tensors = checkpoint_state_dict(model)
    fleet.prepare({n: (t.shape, t.dtype) for n, t in tensors.items()})
    ...
    fleet.refit(link, checkpoint_state_dict(model))   # every step: same names, same order
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from refit_grpc.canary import Canary, default_tolerance, teacher_forced_logprobs


def checkpoint_state_dict(model: Any, state_dict: Mapping[str, torch.Tensor] | None = None
                          ) -> dict[str, torch.Tensor]:
    """`model`'s tensors (or `state_dict`'s, a state dict of `model`) under the names and
    shapes `model.save_pretrained` writes.

    Args:
        model: a transformers `PreTrainedModel`.
        state_dict: the tensors to rename; `model.state_dict()` when None.

    Returns:
        A new dict, name -> tensor, in a deterministic order (the same every call for the same
        model), detached. Models transformers does not convert come back unchanged.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers.core_model_loading import revert_weight_conversion

    tensors = dict(model.state_dict() if state_dict is None else state_dict)
    reverted = revert_weight_conversion(model, tensors)
    return {name: t.detach() for name, t in reverted.items()}


def canary_from_model(model: Any, token_ids: Sequence[int],
                      tolerance: float | None = None) -> Canary:
    """A logprob canary (`Fleet.refit(..., canary=)`) from the trainer's own forward.

    Args:
        model: a transformers causal LM holding the weights about to be sent.
        token_ids: the sequence (2 to 4096 ids of the model's vocabulary).
        tolerance: the largest |engine - trainer| allowed; default by the model's dtype
            (`refit_grpc.canary.default_tolerance`: 2e-3 float32, 2e-2 bfloat16/float16).

    Returns:
        The Canary, with the model's log-probabilities of `token_ids`.
    """
    ids = torch.tensor([list(token_ids)])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(ids).logits[0]
    finally:
        model.train(was_training)
    dtype = next(model.parameters()).dtype
    return Canary(tuple(token_ids), tuple(teacher_forced_logprobs(logits, token_ids)),
                  default_tolerance(dtype) if tolerance is None else tolerance)

