"""What a quantized engine computes, on the trainer's side: a copy of a transformers model whose
layers compute as the engine's quantized kernels do, so that the canary (and the tests) of a
quantized engine have a reference to compare it with.

A quantized engine never holds the trainer's bytes: at every refit it re-derives its quantized
weights and scales from the new weights the trainer sent. An engine that skips or botches that
(a scale left stale, a fused layer scaled from one shard) serves wrong outputs that every digest
agrees with. What sees it is comparing what the engine computes with what it should compute: the
trainer's weights, quantized as the method defines, in the trainer's own forward. That is
`emulate_quantization(model, method)`; `canary_from_model(emulate_quantization(model, method),
...)` is then the canary of a refit into such an engine.

Methods, named as vLLM's online `--quantization` shorthands:

- `int8_per_channel_weight_only` (vLLM 0.32, `layers/quantization/online/int8.py`): the
  mixture-of-experts experts only; vLLM's config for it has no linear entry, so dense layers (and
  a dense model) stay unquantized. Weights: symmetric int8 per output row, in the weights' dtype
  as vLLM computes it (`scale = amax(|row|) / 127`, `q = round(w / scale)` clamped to +-127):
  each row of gate/up over the hidden dimension, each row of down over the intermediate one.
  Despite the name, the CPU kernel vLLM selects for it (`CPUExpertsInt8`, "W8A8 per-channel
  weight / dynamic per-token activation") quantizes the activations too: each token's input to
  an expert, and each token's intermediate after SiLU(gate) * up (rounded to the model's dtype
  first), symmetric int8 per token with `scale = amax(|token|) / 127`. Measured against a real
  int8 vLLM engine on a tiny Qwen2-MoE whose expert rows carry one large weight: the weights
  alone left the reference 0.043 away from the engine in log-probability, with the activations
  0.0096, inside the reference's own bf16 rounding noise (0.024).

Which modules: transformers (5.x) holds a mixture-of-experts layer's experts fused, as one
module with `gate_up_proj` [experts, 2 * intermediate, hidden] and `down_proj` [experts, hidden,
intermediate] (Qwen2-MoE, Qwen3-MoE, Mixtral); those are the ones emulated. A model with none is
refused (ValueError): emulating nothing would make a reference that cannot fail.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

INT8_MOE = "int8_per_channel_weight_only"
METHODS = (INT8_MOE,)

_INT8_MAX = 127


def emulate_quantization(model: Any, method: str) -> Any:
    """A deep copy of `model` (a transformers causal LM) whose quantized layers compute as an
    engine serving it with `method` does; `model` itself is not changed.

    Raises:
        ValueError: an unknown method, or a model with no layer the method quantizes.
    """
    if method not in METHODS:
        raise ValueError(f"no emulation of quantization {method!r}; known: {', '.join(METHODS)}")
    out = copy.deepcopy(model)
    experts = [m for m in out.modules() if _is_fused_experts(m)]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no fused mixture-of-experts layer: "
                         f"{method} quantizes nothing else")
    with torch.no_grad():
        for module in experts:
            _quantize_expert_weights(module)
            module.forward = types.MethodType(_int8_experts_forward, module)
    return out


def _is_fused_experts(module: torch.nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.ndim == 3 and down.ndim == 3 and hasattr(module, "act_fn"))


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-row symmetric int8 of a 2-D weight, in the weight's own dtype as vLLM computes
    it: (the int8 values, the float32 scale of each row)."""
    scales = w.abs().amax(dim=1) / _INT8_MAX
    q = w.div(scales.unsqueeze(1)).round().clamp(-_INT8_MAX, _INT8_MAX)
    return q.to(torch.int8), scales.float()


def _quantize_expert_weights(module: torch.nn.Module) -> None:
    """Each expert's gate/up and down weights replaced by their int8 values times their scales
    (float32: the kernel dequantizes its int32 sums in float32)."""
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name)
        dequantized = torch.empty(weight.shape, dtype=torch.float32)
        for e in range(weight.shape[0]):
            q, scales = int8_rows(weight[e])
            dequantized[e] = q.float() * scales.unsqueeze(1)
        setattr(module, f"{name}_int8_dequantized", dequantized)


def _int8_tokens(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric int8 per token (row), quantized and dequantized, in float32."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / _INT8_MAX
    return (x / scale).round().clamp(-_INT8_MAX, _INT8_MAX) * scale


def _int8_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' fused-experts forward with the int8 kernel's arithmetic: int8 tokens
    times int8 weights, dequantized in float32; the intermediate rounded to the model's dtype
    and quantized per token again before the down projection."""
    dtype = hidden_states.dtype
    out = torch.zeros(hidden_states.shape, dtype=torch.float32)
    gate_up, down = self.gate_up_proj_int8_dequantized, self.down_proj_int8_dequantized
    experts = gate_up.shape[0]
    for e in range(experts):
        token_idx, k_pos = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        x = _int8_tokens(hidden_states[token_idx])
        gate, up = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
        h = (self.act_fn(gate) * up).to(dtype)
        y = torch.nn.functional.linear(_int8_tokens(h), down[e])
        weights = top_k_weights[token_idx, k_pos, None].float()
        out.index_add_(0, token_idx, y * weights)
    return out.to(dtype)
