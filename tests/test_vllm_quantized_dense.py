"""A bf16 trainer refits a dense vLLM engine that quantizes its linear layers to fp8 (issue 24;
docs/vllm.md, Quantized engines).

The engine: vLLM 0.32 CPU serving the tiny Llama in bfloat16 with `--quantization
fp8_per_channel`: every linear layer (q/k/v fused, o, gate/up fused, down) holds float8_e4m3fn
weights with one scale per output row, and quantizes each token's input to fp8 at run time; the
LM head and the embeddings stay bf16. Every refit sends the trainer's bf16 weights; the engine
must derive new fp8 weights and new scales from them. (fp8_per_block serves too; fp8_per_tensor,
mxfp8 and mxfp4 do not start on vLLM CPU: docs/vllm.md.)

fp8 is a floating-point format, so a large row scale costs the rest of the row precision only
once its weights fall into fp8's subnormal range; on the tiny Llama as built fp8 moves a
log-probability by 0.025-0.045 only (measured). The model is planted so that it matters
(`vllm_support.quantized.plant_fp8`): in each row one weight 200,000 or 300,000 times the
row's RMS (alternating, so every scale moves at every version), on an input channel that is
always zero, and one huge
activation channel (gain 100,000) that sets every token's scale and that no output reads. fp8
then moves log-probabilities by 0.27-0.42 (measured offline), the emulation follows the engine
within 0.001-0.019.

(a) Three trained versions, in place, staged, staged, against the emulation
    (`vllm_support.quantized.refit_versions`), Describe saying fp8_per_channel.
(b) An engine started fresh from the trainer's last version (its checkpoint), with the same
    quantization, computes what the refit engine computes.
(c) That second engine runs with a deliberate fault: each refit leaves its old fp8 scales
    (`REFIT_GRPC_TEST_STALE_SCALES=1`, the fp8 weights are new). Every byte arrives, and the
    next version fails the canary: CanaryMismatchError naming that engine, left paused and not
    flushed. The first engine takes the same version and passes.
"""

from __future__ import annotations

import pytest

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc.integrations.quantization import FP8_DENSE  # noqa: E402
from refit_grpc.vllm_plugin.faults import STALE_SCALES_ENV  # noqa: E402

from vllm_support.quantized import (  # noqa: E402
    EPOCHS,
    QuantizedTrainer,
    canary_fails_stale_scales,
    fresh_engine_agrees,
    plant_fp8,
    refit_versions,
)
from vllm_support.truth import load_model  # noqa: E402

QUANT_ARGS = ("--quantization", FP8_DENSE)
FP8, STALE = "fp8-0", "fp8-stale-scales"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-quantized-dense-logs") as pool:
        yield pool


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> QuantizedTrainer:
    """The trainer's tiny Llama (float32 master weights, sent as bf16) at version 0, planted,
    and its checkpoint."""
    return QuantizedTrainer(load_model(tiny_model_dir()), FP8_DENSE, plant_fp8,
                            tmp_path_factory.mktemp("quantized-dense"))


@pytest.fixture(scope="module")
def rig(pool, trainer):
    return pool.rig(FP8, trainer.checkpoint, dtype="bfloat16", extra_args=QUANT_ARGS,
                    epoch_timeout_s=120).ready()


def test_refits_of_a_bf16_trainer_follow_the_fp8_reference_in_place_and_staged(rig, trainer):
    """(a) Module docstring."""
    refit_versions(rig, trainer, FP8)


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
