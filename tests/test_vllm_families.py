"""The model families people train, refit through a real shim into a real vLLM CPU engine and
checked by teacher-forced log-probabilities against transformers (the trainer's own forward).

test_vllm_truth.py covers untied (Llama), tied (Qwen2) and bfloat16; this module adds:

- `phi3`: fused names in the checkpoint itself (`qkv_proj`, `gate_up_proj`);
- `qwen2_moe`: routed experts 64 wide plus a shared expert; vLLM CPU prepacks its experts;
- `mixtral`: experts 80 wide, which vLLM CPU pads to 96 for its grouped GEMM;
- `qwen3_moe`: experts 64 wide, q/k norms.

The mixture-of-experts models are the proof of `refit_grpc.vllm_plugin.moe`: without it, a refit
left Qwen2-MoE 0.042 away from transformers (even a refit of identical weights) and failed
Mixtral outright with a size mismatch. The trainer is transformers >= 5, which holds experts fused
in memory under names no checkpoint has: it sends `checkpoint_state_dict(model)`, and a plan with
the fused names is refused at Prepare with a reason that names the call.

One server per family, each reused across its versions; the next family's server boots while the
current one is refit, so at most two run at once.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import ServerPool

require_vllm()

pytestmark = pytest.mark.timeout(600)

from refit_grpc import FleetError  # noqa: E402
from refit_grpc.integrations.hf import checkpoint_state_dict  # noqa: E402
from refit_grpc.reasons import Reason  # noqa: E402

from vllm_support.truth import Rig, build_tiny, load_model, refit_versions  # noqa: E402

FAMILIES = ("phi3", "qwen2_moe", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def rigs(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("vllm-families-logs"))
    rigs = {}
    for seed, family in enumerate(FAMILIES):
        model_dir = build_tiny(family, tmp_path_factory.mktemp(family) / family,
                               tiny_model_dir(), seed=seed)
        rigs[family] = Rig(pool, family, model_dir)
    yield rigs
    survivors = [pid for r in rigs.values() for pid in r.close()]
    survivors += pool.stop_all()
    assert not survivors, f"vLLM processes outlived the module: {survivors}"


def _ready(rigs, family: str) -> Rig:
    """This family's rig, ready; the next family's server starts booting meanwhile."""
    i = FAMILIES.index(family)
    rig = rigs[family]
    if rig.server is None:
        rig.start()
    if i + 1 < len(FAMILIES) and rigs[FAMILIES[i + 1]].server is None:
        rigs[FAMILIES[i + 1]].start()
    return rig.ready()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_refits_to_the_trainers_log_probabilities(rigs, family):
    rig = _ready(rigs, family)
    trainer = {"model": load_model(rig.model_dir), "version": 0,
               "gen": torch.Generator().manual_seed(10 + FAMILIES.index(family))}
    if family.endswith("moe") or family == "mixtral":
        # transformers holds the experts fused: the trainer's own names are refused at Prepare,
        # before any group forms, and the refusal says what to send instead.
        fused = trainer["model"].state_dict()
        with pytest.raises(FleetError) as refused:
            rig.fleet.prepare({n: (t.shape, t.dtype) for n, t in fused.items()})
        (failure,) = refused.value.failures
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT, failure
        assert failure.reason == Reason.UNKNOWN_TENSOR, failure
        assert ".experts." in failure.message and "checkpoint_state_dict" in failure.message, \
            failure.message
    gaps = refit_versions(rig, trainer, send=lambda m: {
        n: t.contiguous().clone() for n, t in checkpoint_state_dict(m).items()})
    print(f"{family}: gaps after each version {[f'{g:.1e}' for g in gaps]}")
    assert rigs[family].close() == []
