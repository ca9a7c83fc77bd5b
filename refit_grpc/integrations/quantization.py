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
  module with `gate_up_proj` [experts, 2 * intermediate, hidden] and `down_proj` [experts,
  hidden, intermediate] (Qwen2-MoE, Qwen3-MoE, Mixtral); those are the ones emulated. A model
  with none is refused (ValueError): emulating nothing would make a reference that cannot fail.

- `fp8_per_channel` (vLLM 0.32, `Fp8PtpcOnlineLinearMethod` in `layers/quantization/online/
  fp8.py`): every linear layer of a dense model, float8_e4m3fn weights with one scale per output
  row and activations quantized to float8_e4m3fn per token at run time. Weights, in the weights'
  dtype as vLLM loads them (`process_weights_after_loading`): `amax = max |row|` (exact in any
  dtype), `scale = float32(amax) / 448` clamped below at `1 / (448 * 512)` (`_fp8_channel_scale`),
  `q = fp8(clamp(w / scale, -448, 448))`, a true division in float32 and round-to-nearest-even
  into e4m3 (`_fp8_quant_per_channel`). The kernel vLLM selects on a CPU without AMX-FP8 (its log:
  "Selected ChannelWiseTorchFP8ScaledMMLinearKernel", `kernels/linear/scaled_mm/pytorch.py`) runs
  `QuantFP8.forward_native` (`layers/quantization/input_quant_fp8.py`) on each token's input:
  `scale = float32(max |token|) / 448` clamped below at `1 / (448 * 512)`, `q = fp8(clamp(
  float32(x) * (1 / scale), -448, 448))` (a multiplication by the reciprocal, not a division);
  then `torch._scaled_mm(q_x, q_w)` with unit scales into float32 (exact products, float32 sums),
  times the token's scale times the row's scale, plus the bias, rounded to the model's dtype.
  vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; scales per output row and per
  input token do not see the fusion, so transformers' separate projections compute the same.
  The LM head (a `ParallelLMHead`, not a linear layer in vLLM) and the embeddings stay
  unquantized; so do attention, norms and activations. vLLM's CPU build refuses the method's
  mixture-of-experts half (`Fp8PtpcOnlineMoEMethod` rejects the CPU backends), so a model with
  fused experts is refused here too (ValueError), as is one with no linear layer.
  Measured: each emulated layer equals vLLM's kernel bit for bit on the same input; against a
  real fp8_per_channel engine on the tiny Llama whose rows carry one large weight (on an input
  channel that is always zero) and whose linear inputs carry one huge channel that no output
  reads, the reference is 0.001 away in log-probability, the unquantized model 0.38-0.42,
  and the same reference with its activations left unquantized 0.06.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

INT8_MOE = "int8_per_channel_weight_only"
FP8_DENSE = "fp8_per_channel"
METHODS = (INT8_MOE, FP8_DENSE)

_INT8_MAX = 127
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448
# vLLM's smallest fp8 scale, for weights and tokens alike: an all-zero row or token gets this
# scale, not 0, so nothing divides by zero.
_FP8_MIN_SCALE = 1.0 / (_FP8_MAX * 512.0)


def emulate_quantization(model: Any, method: str) -> Any:
    """A deep copy of `model` (a transformers causal LM) whose quantized layers compute as an
    engine serving it with `method` does; `model` itself is not changed.

    Raises:
        ValueError: an unknown method, a model with no layer the method quantizes, or (for
            FP8_DENSE) one with mixture-of-experts layers.
    """
    if method not in METHODS:
        raise ValueError(f"no emulation of quantization {method!r}; known: {', '.join(METHODS)}")
    if method == FP8_DENSE:
        return _emulate_fp8_dense(model)
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


def _emulate_fp8_dense(model: Any) -> Any:
    """`emulate_quantization(model, FP8_DENSE)`: a deep copy whose linear layers, all but the LM
    head, compute as vLLM's fp8 per-channel kernel does."""
    if any(_is_fused_experts(m) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has mixture-of-experts layers: vLLM's CPU build "
                         f"refuses {FP8_DENSE} for them, so there is no engine to emulate")
    out = copy.deepcopy(model)
    # vLLM's LM head is an embedding-like ParallelLMHead, which the online config never quantizes.
    get_head = getattr(out, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linears = [m for m in out.modules()
               if isinstance(m, torch.nn.Linear) and m is not head]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no linear layer but its LM head: "
                         f"{FP8_DENSE} quantizes nothing else")
    with torch.no_grad():
        for module in linears:
            q, scales = fp8_rows(module.weight)
            # The fp8 values as float32 (exact) and the row scales apart, as the kernel keeps them:
            # it sums fp8 products before it scales.
            module.fp8_weight = q.float()
            module.fp8_weight_scale = scales
            # This module only, on the copy: nn.Linear's class keeps its forward.
            module.forward = types.MethodType(  # type: ignore[method-assign]
                _fp8_linear_forward, module)
    return out


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-row float8_e4m3fn of a 2-D weight, from the weight in its own dtype (the
    engine's, bf16 for a bf16 engine): (the fp8 values, the float32 scale of each row)."""
    amax = w.abs().amax(dim=1, keepdim=True).float()
    # A 0-d tensor divisor, as vLLM's: a true division, not a multiplication by 1/448.
    scales = (amax / torch.tensor(_FP8_MAX, dtype=torch.float32)).clamp_min(_FP8_MIN_SCALE)
    q = (w / scales).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return q, scales[:, 0]


def fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic float8_e4m3fn per token (row) of a 2-D activation, as its CPU path computes
    it (`QuantFP8.forward_native`): (the fp8 values, the float32 scale of each token)."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / _FP8_MAX).clamp(min=_FP8_MIN_SCALE)
    # Multiplied by the reciprocal, as forward_native does (its CUDA kernel divides): the two
    # can round a value on a midpoint differently.
    q = (x.float() * scales.reciprocal()).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8)
    return q, scales


def _fp8_linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward with the fp8 kernel's arithmetic: fp8 tokens times fp8 weights,
    summed in float32, times the token's and the row's scales, plus the bias, in the input's
    dtype."""
    rows = x.reshape(-1, x.shape[-1])
    q, scales = fp8_tokens(rows)
    y = q.float() @ self.fp8_weight.t()
    y = y * scales * self.fp8_weight_scale
    if self.bias is not None:
        y = y + self.bias
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])
