"""`refit_grpc.integrations.quantization`, the trainer's emulation of a quantized engine: pure
arithmetic, checked here on transformers-shaped modules built in the test (no transformers
needed). Against real vLLM engines: tests/test_vllm_quantized.py (int8 experts) and
tests/test_vllm_quantized_dense.py (fp8 linear layers)."""

from __future__ import annotations

import pytest
import torch

from refit_grpc.integrations.quantization import (
    FP8_DENSE,
    INT8_MOE,
    emulate_quantization,
    fp8_rows,
    fp8_tokens,
    int8_rows,
)


class Experts(torch.nn.Module):
    """transformers 5's fused experts, as Qwen2-MoE holds them (forward in full precision)."""

    def __init__(self, experts: int = 3, hidden: int = 8, inner: int = 4):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inner))
        self.act_fn = torch.nn.SiLU()

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, k = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, -1)
            y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, k, None])
        return out


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.experts = Experts()


def routing(tokens: int = 5, experts: int = 3):
    index = torch.stack([torch.arange(tokens) % experts, (torch.arange(tokens) + 1) % experts], 1)
    return index, torch.full((tokens, 2), 0.5)


def test_int8_rows_is_symmetric_per_row_with_the_row_max_at_127():
    w = torch.randn(6, 10) * torch.arange(1, 7)[:, None]
    q, scales = int8_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (6,)
    assert (q.abs().amax(dim=1) == 127).all()
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all()


def test_the_emulation_is_a_copy_and_changes_only_the_experts():
    torch.manual_seed(0)
    model = Model()
    original = {n: t.clone() for n, t in model.state_dict().items()}
    emulated = emulate_quantization(model, INT8_MOE)
    assert emulated is not model
    for name, t in model.state_dict().items():
        assert torch.equal(t, original[name]), f"{name} changed in the trainer's model"
    assert torch.equal(emulated.norm.weight, model.norm.weight)
    assert "forward" not in vars(model.experts)


def test_weights_on_the_int8_grid_are_kept_exactly_and_tokens_are_quantized():
    """Rows that are int8 values times a scale lose nothing to the weights' quantization; the
    tokens (off their grid) are rounded per token, so the output moves, by a quantization step's
    worth."""
    torch.manual_seed(1)
    model = Model()
    with torch.no_grad():
        for w in (model.experts.gate_up_proj, model.experts.down_proj):
            q = torch.randint(-127, 128, w.shape).float()
            q[..., 0] = 127  # each row's largest: its scale is exactly 0.25
            w.copy_(q * 0.25)
    experts = emulate_quantization(model, INT8_MOE).experts
    assert torch.equal(experts.gate_up_proj_int8_dequantized, model.experts.gate_up_proj)
    assert torch.equal(experts.down_proj_int8_dequantized, model.experts.down_proj)
    index, weights = routing()
    tokens = torch.randn(5, 8)
    with torch.no_grad():
        exact = model.experts(tokens, index, weights)
        got = experts(tokens, index, weights)
    assert not torch.allclose(got, exact), "the tokens were not quantized"
    assert torch.allclose(got, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())


def test_a_model_without_fused_experts_or_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="no fused mixture-of-experts layer"):
        emulate_quantization(torch.nn.Sequential(torch.nn.Linear(4, 4)), INT8_MOE)
    with pytest.raises(ValueError, match="no emulation of quantization 'fp8'"):
        emulate_quantization(Model(), "fp8")


class Dense(torch.nn.Module):
    """A dense block and an output head, as a causal LM holds them."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=True)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.proj(x))


def test_fp8_rows_and_tokens_put_each_rows_max_at_448():
    w = torch.randn(6, 10) * torch.arange(1, 7)[:, None]
    q, scales = fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6,)
    assert (q.float().abs().amax(dim=1) == 448).all()
    x = torch.randn(3, 10)
    qx, sx = fp8_tokens(x)
    assert (qx.float().abs().amax(dim=1) == 448).all() and sx.shape == (3, 1)
    zero, zero_scale = fp8_rows(torch.zeros(2, 4))  # no division by zero: the smallest scale
    assert (zero.float() == 0).all() and (zero_scale > 0).all()


def test_fp8_changes_the_linear_layers_but_not_the_head_nor_the_trainers_model():
    torch.manual_seed(2)
    model = Dense()
    original = {n: t.clone() for n, t in model.state_dict().items()}
    emulated = emulate_quantization(model, FP8_DENSE)
    for name, t in model.state_dict().items():
        assert torch.equal(t, original[name]), f"{name} changed in the trainer's model"
    assert "forward" in vars(emulated.proj) and "forward" not in vars(emulated.lm_head)
    x = torch.randn(4, 8)
    with torch.no_grad():
        exact, got = model(x), emulated(x)
    assert not torch.equal(got, exact), "nothing was quantized"
    assert torch.allclose(got, exact, rtol=0.1, atol=0.1 * exact.abs().max().item())


def test_fp8_refuses_fused_experts_and_a_model_with_only_a_head():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        emulate_quantization(Model(), FP8_DENSE)
    head_only = Dense()
    head_only.proj = torch.nn.Identity()
    with pytest.raises(ValueError, match="no linear layer but its LM head"):
        emulate_quantization(head_only, FP8_DENSE)
