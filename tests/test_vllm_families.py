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

Every version also carries the logprob canary (`Fleet.refit(checks=Checks(canary=...))`),
which must pass; and the canary must catch the MoE bug itself: one more Qwen2-MoE server runs
with the fix turned off (`REFIT_GRPC_MOE_REPROCESS=0`, vLLM's own behaviour), and its refit
raises CanaryMismatchError naming the engine, left paused and not flushed, although every byte
arrived.

One server per family, each reused across its versions; the next server boots while the current
one is refit, so at most two run at once.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import Rig, module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

from refit_grpc import CanaryMismatchError, FleetError, InPlace, Staged  # noqa: E402
from refit_grpc.integrations.hf import canary_from_model, checkpoint_state_dict  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.reasons import Reason  # noqa: E402
from refit_grpc.vllm_plugin.moe import DISABLE_ENV  # noqa: E402

from vllm_support.truth import (  # noqa: E402
    FP32_TOL,
    SEQUENCE,
    build_tiny,
    load_model,
    refit_versions,
    sgd_step,
)

FAMILIES = ("phi3", "qwen2_moe", "mixtral", "qwen3_moe")
UNFIXED = "qwen2_moe-unfixed"  # Qwen2-MoE in an engine without the fix
ORDER = (*FAMILIES, UNFIXED)


@pytest.fixture(scope="module")
def rigs(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-families-logs") as pool:
        rigs = {}
        for seed, family in enumerate(FAMILIES):
            model_dir = build_tiny(family, tmp_path_factory.mktemp(family) / family,
                                   tiny_model_dir(), seed=seed)
            rigs[family] = pool.rig(family, model_dir)
        rigs[UNFIXED] = pool.rig(UNFIXED, rigs["qwen2_moe"].model_dir, env={DISABLE_ENV: "0"})
        yield rigs


def _ready(rigs, name: str) -> Rig:
    """This rig, ready; the next one's server starts booting meanwhile."""
    i = ORDER.index(name)
    rig = rigs[name]
    if rig.server is None:
        rig.start()
    if i + 1 < len(ORDER) and rigs[ORDER[i + 1]].server is None:
        rigs[ORDER[i + 1]].start()
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
    # The first version in place, the others staged: a staged flip installs the dense linear
    # layers prepared while staging (vllm_plugin/prepared.py; phi3's fused checkpoint names
    # are not prepared, they load at the flip) and loads the experts, norms and heads.
    gaps = refit_versions(rig, trainer, send=lambda m: {
        n: t.contiguous().clone() for n, t in checkpoint_state_dict(m).items()},
        epochs=(InPlace(), Staged(), Staged()))
    print(f"{family}: gaps after each version {[f'{g:.1e}' for g in gaps]}")
    assert rigs[family].close() == []


def test_the_canary_catches_the_moe_bug_no_digest_can_see(rigs):
    """The engine without the fix receives every byte and commits; only what it computes is
    wrong (measured 0.02-0.05 before the fix), which the canary sees. Named, left paused."""
    rig = _ready(rigs, UNFIXED)
    model = load_model(rig.model_dir)
    sgd_step(model, 0.5, torch.Generator().manual_seed(20))
    tensors = {n: t.contiguous().clone() for n, t in checkpoint_state_dict(model).items()}
    canary = canary_from_model(model, SEQUENCE, FP32_TOL)
    with pytest.raises(CanaryMismatchError) as caught:
        rig.refit(tensors, 1, canary=canary)
    (failure,) = caught.value.failures
    gap = caught.value.gaps[UNFIXED]
    print(f"{UNFIXED}: canary gap {gap:.3f} (tolerance {FP32_TOL})")
    assert failure.instance_id == UNFIXED and failure.reason == Reason.CANARY_MISMATCH, failure
    assert gap > 10 * FP32_TOL, gap
    (d,) = rig.fleet.describe(weights_digest=False)
    assert (d.state, d.weight_version) == (pb.SHIM_STATE_READY, 1), d  # every byte arrived
    assert d.paused and d.last_canary_gap > 10 * FP32_TOL, d  # not flushed: serves nothing
    assert rigs[UNFIXED].close() == []
