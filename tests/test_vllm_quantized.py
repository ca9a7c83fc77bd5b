"""A bf16 trainer refits a quantized vLLM engine (issue 24; docs/vllm.md, Quantized engines).

The engine: vLLM 0.32 CPU serving the tiny Qwen2-MoE in bfloat16 with online int8
(`--quantization int8_per_channel_weight_only`: the experts' weights int8 per row, and, in the CPU
kernel, the activations int8 per token). It is the quantized path vLLM CPU serves for experts:
fp8's mixture-of-experts half refuses the CPU backends, and int8 online quantizes the experts
only, so dense models are tests/test_vllm_quantized_dense.py's (fp8 per channel; docs/vllm.md).
Every refit sends the trainer's bf16 weights; the engine must derive new int8 weights and new
scales from them.

The model's experts carry one large weight per row, which sets that row's int8 scale and grows
with every version (`plant_outliers`). int8 then computes something far from bf16 (so a reference
that did not quantize fails), and each version needs new scales (so an engine that kept the old
ones fails).

(a) Three trained versions, in place, staged, staged: after each, the engine's teacher-forced
    log-probabilities equal transformers' with the method emulated from its definition
    (`refit_grpc.integrations.quantization.emulate_quantization`) within QUANT_TOL, and are far
    from the unquantized model's; each refit carries the canary computed from the emulation,
    and it passes (`vllm_support.quantized.refit_versions`, which says why two sequences).
(b) A second engine started fresh from the trainer's last version (its checkpoint), with the same
    quantization, computes what the refit engine computes.
(c) That second engine runs with a deliberate fault: each refit leaves its old int8 scales
    (`REFIT_GRPC_TEST_STALE_SCALES=1`, the int8 weights are new). Every byte arrives, and the next
    version fails the canary: CanaryMismatchError naming that engine, left paused and not
    flushed. The first engine takes the same version and passes.
"""

from __future__ import annotations

import pytest
import torch

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

# vLLM CPU's only int8 MoE kernel (CPUExpertsInt8) needs AMX tiles: on a CPU without them the
# engine does not start ("No Int8 MoE backend supports the deployment configuration").
_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
pytestmark = [pytest.mark.timeout(900), pytest.mark.engine,
              pytest.mark.skipif(not _AMX, reason="needs a CPU with AMX tiles: vLLM CPU's int8 "
                                 "MoE kernel (CPUExpertsInt8) runs only there")]

from refit_grpc import FleetError  # noqa: E402
from refit_grpc.integrations.quantization import INT8_MOE  # noqa: E402
from refit_grpc.reasons import Reason  # noqa: E402
from refit_grpc.vllm_plugin.faults import STALE_SCALES_ENV  # noqa: E402

from vllm_support.quantized import (  # noqa: E402
    EPOCHS,
    HELD_OUT,
    QuantizedTrainer,
    canary_fails_stale_scales,
    fresh_engine_agrees,
    refit_versions,
    to_send,
)
from vllm_support.truth import build_tiny, engine_logprobs, load_model  # noqa: E402

QUANT_ARGS = ("--quantization", INT8_MOE)
EXPERTS_GAIN = 8.0
INT8, STALE = "int8-0", "int8-stale-scales"


def plant_outliers(model, version: int) -> None:
    """Make int8 matter, and its scales move at every version.

    Each expert row's first weight is set to +-k times the rest of the row's RMS (k 150 at even
    versions, 190 at odd ones): the row's largest by far, so it alone sets the row's int8 scale,
    the other weights round to a few levels, and every scale moves by a fifth or more between
    two versions. The outliers see only zeros, so they set scales without deciding outputs
    (measured: an outlier that does decide its row's output hides the quantization, and int8's
    effect wandered between 0.01 and 0.7 from version to version): the experts' input channel 0
    is zero (the post-attention norm's weight 0 there), and so is the experts' intermediate
    channel 0 (its gate and up rows zero but for the outlier), which down_proj's outliers see."""
    k = 150.0 if version % 2 == 0 else 190.0
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[0] = 0.0
        for module in model.modules():
            gate_up = getattr(module, "gate_up_proj", None)
            if isinstance(gate_up, torch.Tensor) and gate_up.ndim == 3:
                gate_up[:, 0, :] = 0.0  # [experts, 2 * intermediate, hidden]: gate row 0
                gate_up[:, gate_up.shape[1] // 2, :] = 0.0  # and up row 0
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(module, name, None)
                if isinstance(w, torch.Tensor) and w.ndim == 3:
                    rms = w[..., 1:].pow(2).mean(dim=-1).sqrt()
                    w[..., 0] = k * rms * torch.sign(w[..., 0] + 1e-9)


def amplify_experts(model, factor: float = EXPERTS_GAIN) -> None:
    """The routed experts' output multiplied by `factor` (down_proj), once, at version 0: in the
    tiny model as built they add little to the residual, so even a wrong expert moved a
    log-probability by 0.01-0.04 only (measured); amplified 8 times, int8's rounding moves
    some position by 0.15-0.27 at every version (measured offline, 5 versions)."""
    with torch.no_grad():
        for module in model.modules():
            down = getattr(module, "down_proj", None)
            if isinstance(down, torch.Tensor) and down.ndim == 3:
                down.mul_(factor)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-quantized-logs") as pool:
        yield pool


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> QuantizedTrainer:
    """The trainer's Qwen2-MoE (float32 master weights, sent as bf16) at version 0, its experts
    amplified, and its checkpoint."""
    root = tmp_path_factory.mktemp("quantized")
    model = load_model(build_tiny("qwen2_moe", root / "base", tiny_model_dir(), seed=7))
    amplify_experts(model)
    return QuantizedTrainer(model, INT8_MOE, plant_outliers, root)


@pytest.fixture(scope="module")
def rig(pool, trainer):
    return pool.rig(INT8, trainer.checkpoint, dtype="bfloat16", extra_args=QUANT_ARGS,
                    epoch_timeout_s=120).ready()


def test_refits_of_a_bf16_trainer_follow_the_int8_reference_in_place_and_staged(rig, trainer):
    """(a) Module docstring."""
    refit_versions(rig, trainer, INT8)


def test_an_engine_started_from_the_checkpoint_computes_what_the_refit_engine_computes(
        pool, rig, trainer):
    """(b) Module docstring. The second engine is the stale-scale one of (c): its fault acts on
    refits only, its first load quantizes as any engine's."""
    assert trainer.version == len(EPOCHS), "runs after (a)"
    stale = pool.rig(STALE, trainer.checkpoint, dtype="bfloat16", extra_args=QUANT_ARGS,
                     env={STALE_SCALES_ENV: "1"}, epoch_timeout_s=120).ready()
    fresh_engine_agrees(stale, rig, trainer)


def test_the_canary_fails_an_engine_that_kept_its_old_scales_and_passes_the_good_one(
        pool, rig, trainer):
    """(c) Module docstring."""
    (stale,) = [r for r in pool.rigs if r.name == STALE]
    assert stale.fleet is not None, "runs after (b)"
    canary_fails_stale_scales(stale, rig, trainer)


def test_describe_says_int8_and_prepare_refuses_a_dtype_the_engine_cannot_quantize(rig, trainer):
    """Describe names the engine's quantization (asked of its workers); a plan sending the
    experts as int8 (values -128..127 the loader would cast to bf16, not a quantized weight) is
    refused at Prepare, TENSOR_MISMATCH naming the tensor and the method, and nothing changes:
    the plan, the version and what the engine computes."""
    (d,) = rig.fleet.describe(weights_digest=False)
    assert d.quantization == INT8_MOE, d.quantization
    before = engine_logprobs(rig.url, HELD_OUT)
    tensors = to_send(trainer.model)
    experts = next(n for n in tensors if n.endswith("mlp.experts.0.down_proj.weight"))
    info = {n: (tuple(t.shape), torch.int8 if n == experts else t.dtype)
            for n, t in tensors.items()}
    with pytest.raises(FleetError) as caught:
        rig.fleet.prepare(info)
    (failure,) = caught.value.failures
    print(f"\nrefused: {failure.reason}: {failure.message}")
    assert failure.instance_id == INT8 and failure.reason == Reason.TENSOR_MISMATCH, failure
    assert repr(experts) in failure.message and f"online ({INT8_MOE})" in failure.message, failure
    (after,) = rig.fleet.describe(weights_digest=False)
    assert (after.plan_digest, after.weight_version, after.state) == \
        (d.plan_digest, d.weight_version, d.state), after
    assert torch.equal(engine_logprobs(rig.url, HELD_OUT), before)
