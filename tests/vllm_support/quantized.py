"""A bf16 trainer and a vLLM engine that quantizes online: what the quantized-engine tests share
(tests/test_vllm_quantized.py for int8 MoE experts, tests/test_vllm_quantized_dense.py for fp8
linear layers; docs/vllm.md, Quantized engines).

The trainer keeps float32 master weights and sends them as bf16 under the checkpoint's names; a
`plant(model, version)` of the test's makes the quantization matter and moves its scales at
every version. The reference is the bf16 model with the method emulated from its definition
(`refit_grpc.integrations.quantization.emulate_quantization`), on two sequences: the shared one
(its first 20 tokens follow the pattern the trainer learns, so it shows training) and HELD_OUT,
random tokens the trainer never sees. As training sharpens the tiny model the shared sequence's
positions become near-certain and a quantization stops showing there (int8: its effect fell to
0.02-0.06 by v2, measured); on HELD_OUT the predictions stay spread, so the effect stays, and
the canary is computed there.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from refit_grpc import InPlace, Staged
from refit_grpc.integrations.hf import canary_from_model, checkpoint_state_dict
from refit_grpc.integrations.quantization import emulate_quantization
from refit_grpc.proto import pb
from refit_grpc.testing.vllm import http_json

from vllm_support import tiny_model_dir
from vllm_support.truth import (
    MIN_MOVE,
    SEQUENCE,
    TOKENIZER_FILES,
    engine_logprobs,
    hf_logprobs,
    sgd_step,
)

# The engine against the emulation. Measured: at most 0.016 (int8) and 0.019 (fp8), while the
# emulation's own bf16 rounding (the same emulation computed in float32 instead) moves it by up to
# 0.024 (int8) and 0.026 (fp8): what is left is rounding in a different order, not arithmetic.
QUANT_TOL = 2.5e-2
# The quantized engine against the unquantized bf16 model, at least: the quantization must
# matter, or a reference that ignored it would pass.
MIN_EFFECT = 3 * QUANT_TOL
LR = 0.1  # gentle: at 0.5 the toy pattern is learned by v2 and every position is near-certain
EPOCHS = (("in place", InPlace()), ("staged", Staged()), ("staged", Staged()))
# 26 random tokens the trainer's pattern does not predict (seeded: the same every run).
HELD_OUT = torch.randint(0, 512, (26,), generator=torch.Generator().manual_seed(24)).tolist()


@dataclass
class QuantizedTrainer:
    """The trainer's model at `version`, the method its engine quantizes with, and how the test
    plants what makes the quantization matter (`plant(model, version)`, after every step)."""

    model: torch.nn.Module
    method: str
    plant: Callable[[torch.nn.Module, int], None]
    root: Path
    checkpoint: Path = field(init=False)
    version: int = 0
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(11))

    def __post_init__(self) -> None:
        self.plant(self.model, 0)
        self.checkpoint = self.save_checkpoint()

    def reference(self) -> torch.nn.Module:
        """What the engine must compute: the bf16 weights, quantized as the method defines."""
        return emulate_quantization(bf16(self.model), self.method)

    def canary(self):
        """The canary a trainer of a quantized engine sends: the emulation's numbers."""
        return canary_from_model(self.reference(), HELD_OUT, QUANT_TOL)

    def next_version(self) -> tuple[int, dict[str, torch.Tensor]]:
        sgd_step(self.model, LR, self.gen)
        self.version += 1
        self.plant(self.model, self.version)
        return self.version, to_send(self.model)

    def gaps(self, engine: str | Callable[[Sequence[int]], torch.Tensor],
             sequence: Sequence[int] = HELD_OUT) -> tuple[torch.Tensor, float, float]:
        """The engine's log-probabilities on `sequence`, its gap to the reference and to plain
        bf16 there. `engine`: a vLLM server's URL, or what reads an engine's teacher-forced
        log-probabilities (a Dynamo worker's, through its frontend)."""
        got = engine_logprobs(engine, sequence) if isinstance(engine, str) else engine(sequence)
        return (got, (got - hf_logprobs(self.reference(), sequence)).abs().max().item(),
                (got - hf_logprobs(bf16(self.model), sequence)).abs().max().item())

    def save_checkpoint(self) -> Path:
        out = self.root / f"v{self.version}"
        self.model.save_pretrained(out, safe_serialization=True)
        for name in TOKENIZER_FILES:
            src = tiny_model_dir() / name
            if src.is_file():
                shutil.copy(src, out / name)
        return out


def bf16(model):
    return copy.deepcopy(model).to(torch.bfloat16)


def to_send(model) -> dict[str, torch.Tensor]:
    """The bf16 trainer's tensors, under the checkpoint's names."""
    return {n: t.to(torch.bfloat16).contiguous().clone()
            for n, t in checkpoint_state_dict(model).items()}


def refit_versions(rig, trainer: QuantizedTrainer, label: str) -> None:
    """The engine started from version 0, then one version per `EPOCHS` (in place, staged,
    staged): after each, its teacher-forced log-probabilities equal the reference's within
    QUANT_TOL on both sequences and are at least MIN_EFFECT from plain bf16 on HELD_OUT; they
    moved; the canary computed from the reference passed; Describe and vLLM's declared version
    say the version. Saves the last version's checkpoint."""
    before, gap, unquantized = trainer.gaps(rig.url, SEQUENCE)
    _, held_gap, held_unquantized = trainer.gaps(rig.url)
    print(f"\n{label} v0 (started from it): |vLLM - reference| {gap:.2e} (held out "
          f"{held_gap:.2e}), |vLLM - bf16| {unquantized:.3f} (held out {held_unquantized:.3f})")
    assert max(gap, held_gap) <= QUANT_TOL, (gap, held_gap)
    assert held_unquantized >= MIN_EFFECT, held_unquantized
    for kind, epoch in EPOCHS:
        version, tensors = trainer.next_version()
        report = rig.refit(tensors, version, canary=trainer.canary(), epoch=epoch)
        (worker,) = report.workers
        got, gap, unquantized = trainer.gaps(rig.url, SEQUENCE)
        _, held_gap, held_unquantized = trainer.gaps(rig.url)
        moved = (got - before).abs().max().item()
        before = got
        print(f"{label} v{version} {kind}: |vLLM - reference| {gap:.2e} (held out "
              f"{held_gap:.2e}, canary gap {worker.canary_gap:.2e}), |vLLM - bf16| "
              f"{unquantized:.3f} (held out {held_unquantized:.3f}), moved {moved:.3f}, "
              f"epoch {report.seconds * 1e3:.0f} ms")
        assert worker.canary_gap is not None and worker.canary_gap <= QUANT_TOL, worker
        assert max(gap, held_gap) <= QUANT_TOL, \
            f"v{version} {kind}: {gap:.4f} / {held_gap:.4f} from the reference"
        assert held_unquantized >= MIN_EFFECT, \
            f"v{version}: the quantization changed little ({held_unquantized})"
        assert moved >= MIN_MOVE, f"v{version}: moved {moved:.4f} only"
        (d,) = rig.fleet.describe(weights_digest=False)
        assert (d.state, d.weight_version, d.paused) == (pb.SHIM_STATE_READY, version, False), d
        assert d.quantization == trainer.method, d.quantization
        assert http_json("GET", rig.url, "/weight_info")[1] == {"weight_version": str(version)}
    trainer.checkpoint = trainer.save_checkpoint()


def fresh_engine_agrees(fresh, rig, trainer: QuantizedTrainer) -> None:
    """An engine started from the trainer's last checkpoint, with the same quantization,
    computes what the engine refit to that version computes."""
    got, gap, _ = trainer.gaps(fresh.url)
    between = (got - engine_logprobs(rig.url, HELD_OUT)).abs().max().item()
    print(f"\nv{trainer.version}: |fresh engine - refit engine| {between:.2e}, "
          f"|fresh engine - reference| {gap:.2e}")
    assert between <= QUANT_TOL, between
    assert gap <= QUANT_TOL, gap


def canary_fails_stale_scales(stale, rig, trainer: QuantizedTrainer) -> None:
    """The next version into an engine whose refits keep their old scales
    (`refit_grpc.vllm_plugin.faults.STALE_SCALES_ENV`): every byte arrives, the canary fails,
    `CanaryMismatchError` names it, and it is left paused, not flushed; the good engine takes
    the same version and passes."""
    import pytest

    from refit_grpc import CanaryMismatchError
    from refit_grpc.reasons import Reason

    version, tensors = trainer.next_version()
    with pytest.raises(CanaryMismatchError) as caught:
        stale.refit(tensors, version, canary=trainer.canary())
    (failure,) = caught.value.failures
    gap = caught.value.gaps[stale.name]
    assert failure.instance_id == stale.name and failure.reason == Reason.CANARY_MISMATCH, \
        failure
    (d,) = stale.fleet.describe(weights_digest=False)
    assert (d.state, d.weight_version) == (pb.SHIM_STATE_READY, version), d  # every byte arrived
    assert d.paused and d.last_canary_gap > QUANT_TOL, d  # not flushed: serves nothing
    report = rig.refit(tensors, version, canary=trainer.canary())
    (worker,) = report.workers
    print(f"\nv{version}: canary gap {gap:.3f} on the engine that kept its old scales, "
          f"{worker.canary_gap:.2e} on the good one (tolerance {QUANT_TOL})")
    assert gap > 3 * QUANT_TOL, gap
    assert worker.canary_gap is not None and worker.canary_gap <= QUANT_TOL, worker


# The gain of the activation channel `plant_fp8` makes huge (it sets every token's fp8 scale).
ACTIVATION_GAIN = 1e5


def plant_fp8(model, version: int) -> None:
    """Make fp8 matter, and its scales move at every version (tests/test_vllm_quantized_dense.py's
    docstring says why it must be planted).

    Weights: channel 0 of both norms' outputs is zero, so q/k/v and gate/up see zeros there; so
    do o_proj (v's row 0 is zero but for its outlier, so attention's output channel 0 is zero)
    and down_proj (gate's row 0 is zero: silu(0) * up = 0). Column 0 of every row of the seven
    projections then holds +-k times the rest of the row's RMS: it alone sets the row's scale.

    Activations: channel 1 of both norms' outputs is multiplied by ACTIVATION_GAIN. q/k/v and
    gate/up read it only through v's row 1 and gate's and up's row 1, which carry it on (into
    attention's output channel 1 and the intermediate channel 1, both huge), and o_proj's and
    down_proj's column 1 are zero: it sets every token's fp8 scale at every linear input and
    decides no output."""
    k = 2e5 if version % 2 == 0 else 3e5
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[0], norm.weight[1] = 0.0, ACTIVATION_GAIN
            attn.v_proj.weight[0, :] = 0.0
            mlp.gate_proj.weight[0, :] = 0.0
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                lin.weight[:, 1] = 0.0
            attn.v_proj.weight[1, :] = 0.0
            attn.v_proj.weight[1, 1] = 1.0
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight[1, :] = 0.0
                lin.weight[1, 1] = 1e-3
            attn.o_proj.weight[:, 1] = 0.0
            mlp.down_proj.weight[:, 1] = 0.0
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                        mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                w = lin.weight
                rms = w[:, 2:].pow(2).mean(dim=-1).sqrt()
                w[:, 0] = k * rms * torch.where(w[:, 0] >= 0, 1.0, -1.0)
