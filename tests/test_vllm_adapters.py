"""Adapter epochs into a real vLLM (issue 24; docs/adapters.md).

The engine: vLLM 0.32 CPU serving the tiny Llama with LoRA enabled (`--enable-lora`, rank up to
8) and its runtime adapter route (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). The trainer: the same base
model with a PEFT LoRA adapter (rank 8 on every attention and MLP projection) trained by plain
SGD; each version's adapter tensors (PEFT's names, 128 KiB) are one adapter epoch: staged while
the engine serves, then loaded or replaced in place under the adapter's name, from memory.

(a) Three trained versions: after each, the engine's teacher-forced log-probabilities for
    requests naming the adapter equal PEFT's (base + adapter, transformers), and moved; the base
    model's (requests naming the base model) are exactly what they were. Base-model requests
    stream through every adapter epoch: each one is printed with its longest token gap next to
    the steady gap, and the flip reports no stall. A shim restarted afterwards lists the adapter
    at the version vLLM serves.
(b) Bad adapters are refused at Prepare, typed and named, and nothing changes: a rank over the
    engine's maximum, a module the model cannot adapt, a name that is the base model's or that
    of an adapter the operator loaded from a file, a factor whose shape does not fit its base
    weight; and an engine started without LoRA refuses any adapter (ADAPTER_UNSUPPORTED).
(c) A failed adapter flip: a second adapter, tenant-b, beside tenant-a in the same engine; the
    engine's build of tenant-b's second version fails (a deliberate fault in the server's
    environment, `REFIT_GRPC_TEST_FAIL_ADAPTER_BUILD=tenant-b:2`). The epoch fails typed, naming
    the engine and the build's error, and leaves it behind; the engine still serves tenant-b's
    first version (equal to PEFT's at it), tenant-a and the base model exactly as before,
    Describe lists both at the versions served, nothing is paused. The fleet (its only engine
    left behind) refuses the next epoch (NO_MEMBERS) until `readmit()`; then the third version
    flips.
"""

from __future__ import annotations

import pytest
import torch

from support import describe
from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc import AdapterSpec, FleetError, FleetStateError  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.reasons import Reason  # noqa: E402
from refit_grpc.shim.process import spawn_shim  # noqa: E402
from refit_grpc.testing.vllm import SERVED_MODEL, http_json  # noqa: E402
from refit_grpc.vllm_plugin.faults import FAIL_ADAPTER_BUILD_ENV  # noqa: E402

from vllm_support.streams import base_streams_through  # noqa: E402
from vllm_support.truth import (  # noqa: E402
    FP32_TOL,
    MIN_MOVE,
    engine_logprobs,
    hf_logprobs,
    load_model,
    sgd_step,
)

NAME = "tenant-a"
RANK = 8
MAX_RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ARGS = ("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2")
SECOND = "tenant-b"  # (c): a second adapter beside the first, whose second build fails
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", FAIL_ADAPTER_BUILD_ENV: f"{SECOND}:2"}
LR = 1.0  # measured: moves some log-probability of the adapter by 0.08-0.12 per version
VERSIONS = 3
# The base model's log-probabilities across adapter epochs: the same engine, the same kernels,
# the same weights; measured equal to the last bit.
BASE_TOL = 1e-6


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-adapters-logs") as pool:
        yield pool


@pytest.fixture(scope="module")
def rig(pool):
    return pool.rig("lora-0", tiny_model_dir(), extra_args=LORA_ARGS, env=LORA_ENV).ready()


@pytest.fixture(scope="module")
def trainer() -> dict:
    """The trainer's PEFT model: the tiny Llama (float32, as the engine) with a fresh rank-8
    LoRA adapter (B zero: version 0 is the base model)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(load_model(tiny_model_dir()), config)
    return {"model": model, "spec": AdapterSpec.of(NAME, config.to_dict()), "version": 0,
            "gen": torch.Generator().manual_seed(24)}


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """What the trainer sends: the adapter's tensors only, under PEFT's names."""
    from peft import get_peft_model_state_dict

    return {n: t.detach().contiguous().clone()
            for n, t in get_peft_model_state_dict(model).items()}


def base_logprobs(model) -> torch.Tensor:
    with model.disable_adapter():
        return hf_logprobs(model)


def train_versions(trainer: dict, count: int) -> list[tuple[int, dict, torch.Tensor, float]]:
    """`count` more versions: (version, the adapter's tensors, PEFT's log-probabilities, how far
    they moved from the version before)."""
    model, out = trainer["model"], []
    before = hf_logprobs(model)
    for _ in range(count):
        sgd_step(model, LR, trainer["gen"])
        trainer["version"] += 1
        want = hf_logprobs(model)
        out.append((trainer["version"], adapter_tensors(model), want,
                    (want - before).abs().max().item()))
        before = want
    return out


def check_version(rig, version: int, want: torch.Tensor, base: torch.Tensor) -> float:
    """The engine serves `version` of the adapter, equal to PEFT's; the base model is as it was;
    Describe says so, and that the flip paused nothing. Returns the adapter's gap."""
    gap = (engine_logprobs(rig.url, model=NAME) - want).abs().max().item()
    base_moved = (engine_logprobs(rig.url) - base).abs().max().item()
    assert gap <= FP32_TOL, f"v{version}: the adapter is {gap:.2e} from PEFT's"
    assert base_moved <= BASE_TOL, f"v{version}: the base model moved {base_moved:.2e}"
    (d,) = rig.fleet.describe(weights_digest=False)
    assert [(a.name, a.version) for a in d.adapters] == [(NAME, version)], d
    assert (d.state, d.weight_version, d.paused) == (pb.SHIM_STATE_READY, version, False), d
    assert d.last_stall_seconds == 0.0, d  # the flip paused nothing
    return gap


def test_three_adapter_versions_follow_peft_and_the_base_model_never_changes(rig, trainer):
    """(a) Module docstring: three versions checked one by one, then two more while base-model
    requests stream. Teacher-forced log-probabilities are asked only while nothing streams: a
    prompt_logprobs request for an adapter batched with other requests crashes vLLM 0.32 CPU's
    engine (`add_lora_logits`: "einsum(): subscript b has size 3 ... size 25", measured;
    docs/adapters.md). The versions are trained before the streams start: the trainer's
    forwards would take the two cores from vLLM, and the token gaps would measure them."""
    model, spec = trainer["model"], trainer["spec"]
    base = engine_logprobs(rig.url)
    assert (base - base_logprobs(model)).abs().max().item() <= FP32_TOL
    for version, tensors, want, moved in train_versions(trainer, VERSIONS):
        report = rig.refit(tensors, version, adapter=spec)
        gap = check_version(rig, version, want, base)
        print(f"\n{NAME} v{version}: |vLLM - PEFT| {gap:.2e}, moved {moved:.3f}, base model "
              f"unchanged, epoch {report.seconds * 1e3:.0f} ms, {report.bytes} bytes")
        assert moved >= MIN_MOVE, f"v{version}: moved {moved:.4f} only"

    streamed_versions = train_versions(trainer, 2)
    base_streams_through(rig.url, [(v, tensors) for v, tensors, _, _ in streamed_versions],
                         lambda tensors, v: rig.refit(tensors, v, adapter=spec), "vLLM")
    version, _, want, _ = streamed_versions[-1]
    check_version(rig, version, want, base)

    # A shim started afresh against the engine (a restart) lists the adapter at the version
    # vLLM serves, read from vLLM's model list, not from what it committed itself (nothing).
    restarted = spawn_shim("--engine", "vllm", "--engine-url", rig.url,
                           "--instance-id", "lora-restarted")
    try:
        d = describe(restarted.address, timeout_s=30)
        assert [(a.name, a.version) for a in d.adapters] == [(NAME, version)], d
    finally:
        assert restarted.stop() is not None


def test_a_failed_adapter_flip_leaves_what_was_served_and_the_next_version_flips(rig, trainer):
    """(c) Module docstring. Three versions of tenant-b; the engine's build of the second fails
    (the worker raises in the build, every byte having arrived and the copy committed to the
    workers' store)."""
    assert trainer["version"] >= VERSIONS + 2, "runs after (a)"
    model, spec = trainer["model"], AdapterSpec.of(SECOND, trainer["spec"].config)
    base, first = engine_logprobs(rig.url), engine_logprobs(rig.url, model=NAME)
    (d,) = rig.fleet.describe(weights_digest=False)
    first_version = dict((a.name, a.version) for a in d.adapters)[NAME]
    served: tuple[int, torch.Tensor] | None = None
    for build in (1, 2, 3):
        sgd_step(model, LR, trainer["gen"])
        trainer["version"] += 1
        version, tensors, want = trainer["version"], adapter_tensors(model), hf_logprobs(model)
        if build == 2:
            with pytest.raises(FleetError) as failed:
                rig.refit(tensors, version, adapter=spec)
            (failure,) = failed.value.failures
            print(f"\n{SECOND} v{version}, its build failing: {type(failed.value).__name__}: "
                  f"{failure.reason}: {failure.message}")
            assert failure.instance_id == rig.name, failure
            assert "deliberate fault" in failure.message, failure
            # A staged epoch's failed flip leaves the engine behind: the fleet's only one, so
            # the next epoch has nobody to form a group with until it is readmitted.
            assert rig.name in rig.fleet.left_behind
            with pytest.raises(FleetStateError) as alone:
                rig.refit(tensors, version, adapter=spec)
            assert alone.value.reason == Reason.NO_MEMBERS, alone.value
            rig.fleet.readmit(rig.name)
        else:
            rig.refit(tensors, version, adapter=spec)
            served = (version, want)
        assert served is not None
        gap = (engine_logprobs(rig.url, model=SECOND) - served[1]).abs().max().item()
        assert gap <= FP32_TOL, f"after v{version}: {SECOND} is {gap:.2e} from v{served[0]}"
        assert torch.equal(engine_logprobs(rig.url, model=NAME), first), f"{NAME} moved"
        assert (engine_logprobs(rig.url) - base).abs().max().item() <= BASE_TOL
        (d,) = rig.fleet.describe(weights_digest=False)
        assert sorted((a.name, a.version) for a in d.adapters) == \
            [(NAME, first_version), (SECOND, served[0])], d
        assert not d.paused, d
        print(f"after {SECOND} v{version}: serves v{served[0]} (gap to PEFT {gap:.1e}); "
              f"{NAME} and the base model unchanged; state {pb.ShimState.Name(d.state)}")


def test_bad_adapters_are_refused_at_prepare_and_change_nothing(pool, rig, trainer, tmp_path,
                                                                vllm_servers):
    """(b) Module docstring. An adapter the operator loaded from a file keeps its name: an
    adapter epoch under that name is refused, as it would replace it."""
    assert trainer["version"] >= VERSIONS + 2, "runs after (a)"
    model = trainer["model"]
    model.save_pretrained(tmp_path / "from-disk")
    status, body = http_json("POST", rig.url, "/v1/load_lora_adapter", {
        "lora_name": "from-disk", "lora_path": str(tmp_path / "from-disk")})
    assert status == 200, body
    (before,) = rig.fleet.describe(weights_digest=False)
    adapter_before = engine_logprobs(rig.url, model=NAME)
    tensors = adapter_tensors(model)
    info = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    config = trainer["spec"].config
    too_wide = AdapterSpec.of(NAME, {**config, "r": 2 * MAX_RANK})
    norm = {"base_model.model.model.norm.lora_A.weight": ((RANK, 128), torch.float32),
            "base_model.model.model.norm.lora_B.weight": ((128, RANK), torch.float32)}
    base_name = AdapterSpec.of(SERVED_MODEL, config)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # [r, hidden 128]
    cases = [(info, too_wide, "max_lora_rank"),
             ({**info, **norm}, trainer["spec"], "do not have"),
             (info, base_name, "the name vLLM serves the base model under"),
             (info, AdapterSpec.of("from-disk", config), "is taken"),
             ({**info, q_a: ((RANK, 64), torch.float32)}, trainer["spec"], "has shape [8, 64]")]
    for plan_info, spec, needle in cases:
        with pytest.raises(FleetError) as caught:
            rig.fleet.prepare(plan_info, adapter=spec)
        (failure,) = caught.value.failures
        print(f"\nrefused: {failure.reason}: {failure.message}")
        assert failure.reason == Reason.INVALID_ADAPTER and needle in failure.message, failure
    (after,) = rig.fleet.describe(weights_digest=False)
    assert (after.plan_digest, after.weight_version, list(after.adapters)) == \
        (before.plan_digest, before.weight_version, list(before.adapters))
    assert torch.equal(engine_logprobs(rig.url, model=NAME), adapter_before)

    # An engine without --enable-lora: the session's plain tiny Llama (nothing here changes it).
    plain = pool.rig("no-lora", tiny_model_dir(),
                     server=vllm_servers.server(tiny_model_dir())).ready()
    with pytest.raises(FleetError) as caught:
        plain.fleet.prepare(info, adapter=trainer["spec"])
    (failure,) = caught.value.failures
    assert failure.reason == Reason.ADAPTER_UNSUPPORTED and "--enable-lora" in failure.message
    assert plain.fleet.describe(weights_digest=False)[0].state == pb.SHIM_STATE_EMPTY
