"""A bf16 trainer refits a tensor-parallel vLLM engine that quantizes its linear layers to fp8
(issue 24; docs/vllm.md, Quantized engines).

The engine: vLLM 0.32 CPU, `--tensor-parallel-size 2 --quantization fp8_per_channel`, serving
the planted tiny Llama of tests/test_vllm_quantized_dense.py in bfloat16. Each TP worker holds
its shard of every linear layer: column-parallel layers (qkv, gate_up) split the output rows,
row-parallel ones (o, down) split each row's inputs. A per-row fp8 scale is the row's absmax
over its inputs, so on a row-parallel shard it would see only half of them; vLLM reduces the
amax over the TP group in `process_weights_after_loading` (`amax_for_tp_weight_quant`), so each
worker derives the scale the whole row has. A refit re-runs that reduction inside the layerwise
reload, on both workers, in the order the bytes arrive (the same on both: each receives every
byte of the broadcast). The planted outlier sits on one input channel of each row, so a worker
whose scale saw only its half would quantize the other half of every row-parallel row far more
finely than the whole row is quantized: its outputs would move toward bf16's (the quantization
moves them by 0.12-0.63 here), away from the reference below, the unsharded emulation.

Three trained versions, in place, staged, staged (`vllm_support.quantized.refit_versions`):
after each, the engine's teacher-forced log-probabilities equal the fp8 emulation's within
QUANT_TOL on the shared sequence and held out, the quantization matters (MIN_EFFECT from bf16),
the canary computed from the emulation passes, and Describe says fp8_per_channel.
"""

from __future__ import annotations

import pytest

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc.integrations.quantization import FP8_DENSE  # noqa: E402

from vllm_support.quantized import QuantizedTrainer, plant_fp8, refit_versions  # noqa: E402
from vllm_support.truth import load_model  # noqa: E402


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> QuantizedTrainer:
    return QuantizedTrainer(load_model(tiny_model_dir()), FP8_DENSE, plant_fp8,
                            tmp_path_factory.mktemp("quantized-tp"))


@pytest.fixture(scope="module")
def rig(tmp_path_factory, trainer):
    with module_pool(tmp_path_factory, "vllm-quantized-tp-logs") as pool:
        yield pool.rig("fp8-tp2", trainer.checkpoint, dtype="bfloat16",
                       extra_args=("--quantization", FP8_DENSE), tensor_parallel=2,
                       buffer_size_bytes=128 * 1024, epoch_timeout_s=120).ready(400)


def test_two_tp_ranks_of_an_fp8_engine_follow_the_unsharded_reference(rig, trainer):
    """Module docstring."""
    refit_versions(rig, trainer, "fp8 TP=2")
