"""`refit_grpc.integrations.quantization`, the trainer's emulation of a quantized engine: pure
arithmetic, checked here on transformers-shaped fused experts built in the test (no transformers
needed). Checked against a real int8 vLLM engine by hand so far (docs/vllm.md, Quantized
engines); the engine test is the next step of issue 24."""

from __future__ import annotations

import pytest
import torch

from refit_grpc.integrations.quantization import INT8_MOE, emulate_quantization, int8_rows


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
