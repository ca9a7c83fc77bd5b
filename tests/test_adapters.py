"""Adapter plans without an engine that serves adapters (docs/adapters.md): the plan and its
digest, the refusals of engines that serve none, and the driver's rules for adapter epochs. The
epochs themselves, into a real vLLM and a real Dynamo worker, are tests/test_vllm_adapters.py
and tests/test_dynamo_adapters.py."""

from __future__ import annotations

import grpc
import pytest
import torch

from refit_grpc import AdapterSpec, Fleet, InPlace, Staged
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.driver.options import options
from refit_grpc.driver.plans import prepare_request
from refit_grpc.errors import InvalidArgumentError, InvalidPlanError
from refit_grpc.plan import RefitPlan
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.reference import ReferenceEngine

CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
FACTORS = {f"base_model.model.model.layers.0.self_attn.{m}_proj.lora_{ab}.weight":
           ((4, 16) if ab == "A" else (16, 4), "float32") for m in "qv" for ab in "AB"}


def test_an_adapter_plan_has_its_own_digest_and_a_model_plan_keeps_its_own():
    spec = AdapterSpec.of("tenant-a", CONFIG)
    plain = RefitPlan.from_state_dict_info(FACTORS)
    with_adapter = RefitPlan.from_state_dict_info(FACTORS, adapter=spec)
    other_name = RefitPlan.from_state_dict_info(FACTORS, adapter=AdapterSpec.of("b", CONFIG))
    other_rank = RefitPlan.from_state_dict_info(
        FACTORS, adapter=AdapterSpec.of("tenant-a", {**CONFIG, "r": 8}))
    digests = {p.digest for p in (plain, with_adapter, other_name, other_rank)}
    assert len(digests) == 4
    # The config is written canonically: the same config, keys in another order and
    # target_modules as a set (PEFT's own type), is the same plan.
    same = AdapterSpec.of("tenant-a", dict(reversed(list(
        {**CONFIG, "target_modules": {"v_proj", "q_proj"}}.items()))))
    assert RefitPlan.from_state_dict_info(FACTORS, adapter=same).digest == with_adapter.digest


@pytest.mark.parametrize(("name", "config", "tensors", "needle"), [
    ("", CONFIG, FACTORS, "adapter name"),
    (" padded", CONFIG, FACTORS, "adapter name"),
    ("x" * 257, CONFIG, FACTORS, "adapter name"),
    ("a", {**CONFIG, "r": 0}, FACTORS, "rank"),
    ("a", {**CONFIG, "r": "4"}, FACTORS, "rank"),
    ("a", {k: v for k, v in CONFIG.items() if k != "target_modules"}, FACTORS, "target_modules"),
    ("a", CONFIG, {**FACTORS, "model.layers.0.self_attn.q_proj.weight": ((16, 16), "float32")},
     "not a LoRA factor"),
])
def test_a_malformed_adapter_plan_is_refused_naming_what(name, config, tensors, needle):
    with pytest.raises(InvalidPlanError) as e:
        RefitPlan.from_state_dict_info(tensors, adapter=AdapterSpec(name, _json(config)))
    assert e.value.reason == Reason.INVALID_ADAPTER and needle in e.value.message, e.value


def test_a_shim_refuses_an_adapter_plan_it_cannot_serve_and_keeps_its_plan(shim):
    """The reference engine serves no adapters: ADAPTER_UNSUPPORTED at Prepare, its plan and
    state unchanged; a malformed adapter is INVALID_ADAPTER, from the shim as from the driver."""
    sh = shim(ReferenceEngine(model=None))
    plan = RefitPlan.from_state_dict_info({"w": ((4,), "float32")})
    sh.stub.Prepare(prepare_request(plan), timeout=5)
    before = sh.describe()
    adapter_plan = RefitPlan.from_state_dict_info(FACTORS, adapter=AdapterSpec.of("t", CONFIG))
    bad = RefitPlan(adapter_plan.tensors, adapter_plan.packing, AdapterSpec("t", '{"r": 0}'))
    for p, code, reason in ((adapter_plan, grpc.StatusCode.FAILED_PRECONDITION,
                             Reason.ADAPTER_UNSUPPORTED),
                            (bad, grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_ADAPTER)):
        with pytest.raises(grpc.RpcError) as e:
            sh.stub.Prepare(prepare_request(p), timeout=5)
        failure = failure_from_rpc(WorkerEndpoint("ref", sh.address), e.value)
        assert (e.value.code(), failure.reason) == (code, reason), failure
    after = sh.describe()
    assert (after.plan_digest, after.state) == (before.plan_digest, before.state)
    assert list(after.adapters) == [] and after.quantization == "none"


def test_the_driver_stages_adapter_epochs_and_refuses_an_in_place_one():
    """An adapter plan's epoch is `Staged(reversible=False)` by default; an explicit `InPlace`
    is refused before any call (ADAPTER_NOT_STAGED)."""
    epoch, _ = options("refit", None, None, {}, adapter=True)
    assert isinstance(epoch, Staged) and not epoch.reversible
    epoch, _ = options("refit", Staged(min_engines=1), None, {}, adapter=True)
    assert isinstance(epoch, Staged) and epoch.min_engines == 1 and not epoch.reversible
    with pytest.raises(InvalidArgumentError) as e:
        options("refit", InPlace(), None, {}, adapter=True)
    assert e.value.reason == Reason.ADAPTER_NOT_STAGED
    assert isinstance(options("refit", None, None, {})[0], InPlace)  # a model's plan


def test_fleet_prepare_of_an_adapter_reaches_the_shim_and_is_refused_there(shim):
    sh = shim(ReferenceEngine(model=None))
    with Fleet([WorkerEndpoint("ref-0", sh.address)]) as fleet:
        with pytest.raises(Exception) as e:
            fleet.prepare({n: (s, torch.float32) for n, (s, _) in FACTORS.items()},
                          adapter=AdapterSpec.of("t", CONFIG))
        (failure,) = e.value.failures
        assert failure.instance_id == "ref-0" and failure.reason == Reason.ADAPTER_UNSUPPORTED
        assert "serves no LoRA adapters" in failure.message
        assert sh.describe().state == pb.SHIM_STATE_EMPTY


def _json(config: dict) -> str:
    import json

    return json.dumps(config, sort_keys=True)


@pytest.mark.parametrize("environ, needle", [
    ({}, "DYN_LORA_ENABLED=true"),
    ({"DYN_LORA_ENABLED": "true"}, "DYN_LORA_HOTSWAP_ENABLED=true"),
    ({"DYN_LORA_ENABLED": "1", "DYN_LORA_HOTSWAP_ENABLED": "on"}, "DYN_LORA_HOTSWAP_ENABLED"),
    ({"DYN_LORA_ENABLED": "TRUE", "DYN_LORA_HOTSWAP_ENABLED": "yes"}, None),
])
def test_a_dynamo_worker_without_its_lora_settings_refuses_adapter_epochs(environ, needle):
    """What a Dynamo worker's extension answers at Prepare from its environment (pure: the
    worker's own check runs in tests/test_dynamo_adapters.py): Dynamo's truthy values only
    ("on" is not one of them, as Dynamo's env_bool reads it)."""
    from refit_grpc.vllm_plugin.dynamo_extension import dynamo_lora_problem

    problem = dynamo_lora_problem(environ)
    if needle is None:
        assert problem is None
    else:
        assert problem is not None and problem.reason == Reason.ADAPTER_UNSUPPORTED
        assert needle in problem.message, problem


def test_the_adapter_uri_given_to_dynamo_resolves_to_a_path_the_workers_loader_reads():
    """Dynamo's LoRA manager hands vLLM `str()` of the Path its source returns; the workers'
    loader must read that as the same adapter and version, and nothing else as one."""
    import asyncio
    from pathlib import Path

    from refit_grpc.vllm_plugin.dynamo_lora import HeldAdapterSource
    from refit_grpc.wire.vllm import adapter_path, parse_adapter_path

    source, uri = HeldAdapterSource(), adapter_path("tenant-a", 7)
    assert asyncio.run(source.exists(uri))
    assert not asyncio.run(source.exists("file:///models/tenant-a"))
    local = asyncio.run(source.download(uri, Path("/unused")))
    assert parse_adapter_path(str(local)) == ("tenant-a", 7)
    with pytest.raises(ValueError, match="not an adapter URI"):
        asyncio.run(source.download("s3://bucket/tenant-a", Path("/unused")))
    for other in ("/models/tenant-a", "refit-grpc-adapter:/x/tenant-a", "refit-grpc-adapter://7"):
        assert parse_adapter_path(other) is None, other


def test_a_workers_info_says_its_adapters_and_an_older_worker_none():
    """What a Dynamo shim reads of a worker at its start (`WorkerInfo`, pure)."""
    from refit_grpc.wire.worker import WorkerInfo

    info = WorkerInfo(quantization="none", adapters={"tenant-a": 3})
    assert WorkerInfo.from_wire(info.to_wire()) == info
    assert WorkerInfo.from_wire({"quantization": "none"}).adapters == {}  # an older worker
    for bad in ({"tenant-a": "3"}, ["tenant-a"], {3: 3}):
        with pytest.raises(ValueError, match="adapters"):
            WorkerInfo.from_wire({"quantization": "none", "adapters": bad})
