"""Adapter epochs into a real NVIDIA Dynamo worker (issue 24; docs/adapters.md, Dynamo).

One Dynamo 1.6.1 vLLM worker (vLLM 0.31 CPU, the project's worker extension) serving the tiny
Llama with LoRA enabled (`--enable-lora`, rank up to 8) and Dynamo's URI-based LoRA loading with
hot swap (DYN_LORA_ENABLED, DYN_LORA_HOTSWAP_ENABLED), its own frontend (requests name the
adapter there, as users do), and a real `refit-grpc shim --engine dynamo` in front of the worker.
The trainer: the same base model with a PEFT LoRA adapter (rank 8 on every attention and MLP
projection) trained by plain SGD, as in tests/test_vllm_adapters.py; each version's adapter
tensors (PEFT's names, 128 KiB) are one staged adapter epoch, loaded at the flip through
Dynamo's `load_lora` route from the workers' memory (the project's LoRA source resolves the
adapter's URI; no file is written).

(a) Three trained versions: after each, the frontend's teacher-forced log-probabilities for
    requests naming the adapter equal PEFT's (base + adapter, transformers) and moved; the base
    model's are what they were; Describe lists the adapter at the version, the flip paused
    nothing. Two more versions while base-model requests stream through the frontend: each
    epoch's longest token gap is printed next to the steady gap, and tokens arrived during the
    epochs. A shim restarted beside the worker lists the adapter at the version the worker built.
(b) Bad adapters are refused at Prepare, typed and named, and nothing changes: a rank over the
    worker's maximum, a module the model cannot adapt.
(c) A failed adapter flip: the worker's build of the sixth version fails (a deliberate fault in
    its environment, `REFIT_GRPC_TEST_FAIL_ADAPTER_BUILD=tenant-a:6`) after Dynamo's hot swap
    removed the fifth. The epoch fails typed, naming the shim and the build's error; Dynamo puts
    the fifth version back (its own rollback, built again from the workers' memory), so the
    worker serves it, equal to PEFT's at it, nothing paused; after `readmit()` the next version
    flips. (A worker without LoRA or without
    Dynamo's LoRA settings: tests/test_adapters.py checks the worker's refusal from its
    environment; starting three more Dynamo workers to show it costs minutes.)
"""

from __future__ import annotations

import time

import pytest
import torch

from dynamo_support import require_dynamo
from support import describe
from vllm_support import require_vllm

require_vllm()  # the trainer's side: transformers, peft (installed with vLLM)
require_dynamo()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc import AdapterSpec, FleetError  # noqa: E402
from refit_grpc.driver import Fleet, WorkerEndpoint  # noqa: E402
from refit_grpc.integrations.dynamo import read_workers  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.reasons import Reason  # noqa: E402
from refit_grpc.shim.process import spawn_shim  # noqa: E402
from refit_grpc.testing.dynamo import (  # noqa: E402
    DynamoFrontend,
    DynamoWorker,
    build_dynamo_model,
    frontend_logprobs,
)
from refit_grpc.testing.vllm import http_json  # noqa: E402
from refit_grpc.vllm_plugin.faults import FAIL_ADAPTER_BUILD_ENV  # noqa: E402
from refit_grpc.wire.dynamo import LORA_ENABLED_ENV, LORA_HOTSWAP_ENV  # noqa: E402

from vllm_support.streams import base_streams_through  # noqa: E402
from vllm_support.truth import FP32_TOL, MIN_MOVE, SEQUENCE, hf_logprobs, load_model, sgd_step  # noqa: E402

NAME = "tenant-a"
RANK = 8
MAX_RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1.0  # as the vLLM module: moves some log-probability of the adapter by 0.08-0.12 a version
VERSIONS = 3
# (c): the worker's build of this version of the adapter fails (a deliberate fault): after (a)'s
# five versions and none in (b), the sixth.
FAILING_BUILD = VERSIONS + 3
# The base model across adapter epochs: the same worker, kernels and weights.
BASE_TOL = 1e-6
EPOCH_S = 120.0


class Rig:
    """The module's worker, frontend and shim, and the trainer's PEFT model."""

    def __init__(self, root):
        from peft import LoraConfig, get_peft_model

        self.root = root
        self.model_dir = build_dynamo_model(root / "tiny")
        self.discovery_dir = root / "discovery"
        self.discovery_dir.mkdir()
        self.worker = DynamoWorker(
            self.model_dir, self.discovery_dir, log_path=root / "worker.log", cpu_bind="0",
            extra_args=("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2"),
            extra_env={LORA_ENABLED_ENV: "true", LORA_HOTSWAP_ENV: "true",
                       "DYN_LORA_PATH": str(root / "lora-cache"),
                       FAIL_ADAPTER_BUILD_ENV: f"{NAME}:{FAILING_BUILD}"})
        self.frontend = DynamoFrontend(self.discovery_dir, log_path=root / "frontend.log")
        self.shim = None
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                            target_modules=TARGETS)
        self.model = get_peft_model(load_model(self.model_dir), config)
        self.spec = AdapterSpec.of(NAME, config.to_dict())
        self.version = 0
        self.gen = torch.Generator().manual_seed(24)
        self.fleet: Fleet | None = None
        self.link = None

    def start(self) -> Rig:
        t0 = time.monotonic()
        self.worker.start()
        self.frontend.start()
        self.worker.wait_ready(300)
        self.frontend.wait_ready(60)
        self.frontend.wait_for([self.worker.url])
        print(f"\nthe LoRA Dynamo worker and its frontend ready in {time.monotonic() - t0:.1f}s")
        self.shim = spawn_shim("--engine", "dynamo", "--engine-url", self.worker.url,
                               "--instance-id", "dynamo-lora", "--max-epoch-s", str(EPOCH_S))
        self.fleet = Fleet([WorkerEndpoint(self.shim.instance_id, self.shim.address)],
                           control_timeout_s=30, join_timeout_s=30, epoch_timeout_s=EPOCH_S)
        return self

    def stop(self) -> list[int]:
        if self.link is not None:
            self.link.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.shim is not None:
            self.shim.stop()
        for p in (self.frontend, self.worker):
            p.stop()
        left = [p for p in (self.frontend, self.worker) for p in p.group_pids()]
        if self.shim is not None and self.shim.proc.poll() is None:
            left.append(self.shim.pid)
        return left

    def instance_id(self) -> int:
        (record,) = [r for r in read_workers(self.frontend.rl_url)
                     if r["system_url"] == self.worker.url]
        return int(record["instance_id"])

    def logprobs(self, model: str | None = None) -> torch.Tensor:
        """The worker's teacher-forced log-probabilities through the frontend: the base
        model's, or with `model` the adapter's."""
        extra = {} if model is None else {"model": model}
        return frontend_logprobs(self.frontend.url, self.instance_id(), SEQUENCE, **extra)

    def wait_served(self, name: str, timeout_s: float = 60.0) -> None:
        """Until the frontend lists the adapter (Dynamo publishes it to discovery after its
        first load)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            status, body = http_json("GET", self.frontend.url, "/v1/models", timeout_s=5)
            if status == 200 and any(m.get("id") == name for m in body.get("data", [])):
                return
            time.sleep(0.25)
        raise TimeoutError(f"the frontend does not list {name!r} after {timeout_s:.0f}s")

    def tensors(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {n: t.detach().contiguous().clone()
                for n, t in get_peft_model_state_dict(self.model).items()}

    def train(self, count: int) -> list[tuple[int, dict, torch.Tensor, float]]:
        """`count` more versions: (version, the adapter's tensors, PEFT's log-probabilities,
        how far they moved from the version before)."""
        out, before = [], hf_logprobs(self.model)
        for _ in range(count):
            sgd_step(self.model, LR, self.gen)
            self.version += 1
            want = hf_logprobs(self.model)
            out.append((self.version, self.tensors(), want, (want - before).abs().max().item()))
            before = want
        return out

    def refit(self, tensors: dict[str, torch.Tensor], version: int):
        assert self.fleet is not None
        if self.link is None:
            self.fleet.prepare({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                               adapter=self.spec)
            self.link = self.fleet.connect("127.0.0.1")
        return self.fleet.refit(self.link, tensors, version=version)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    rig = Rig(tmp_path_factory.mktemp("dynamo-adapters"))
    try:
        yield rig.start()
    finally:
        left = rig.stop()
        assert not left, f"processes outlived the module: {left}"


def check_version(rig: Rig, version: int, want: torch.Tensor, base: torch.Tensor) -> float:
    """The worker serves `version` of the adapter, equal to PEFT's; the base model is as it
    was; Describe says so, and that the flip paused nothing. Returns the adapter's gap."""
    gap = (rig.logprobs(NAME) - want).abs().max().item()
    base_moved = (rig.logprobs() - base).abs().max().item()
    assert gap <= FP32_TOL, f"v{version}: the adapter is {gap:.2e} from PEFT's"
    assert base_moved <= BASE_TOL, f"v{version}: the base model moved {base_moved:.2e}"
    assert rig.fleet is not None
    (d,) = rig.fleet.describe(weights_digest=False)
    assert [(a.name, a.version) for a in d.adapters] == [(NAME, version)], d
    assert (d.state, d.weight_version, d.paused) == (pb.SHIM_STATE_READY, version, False), d
    assert d.last_stall_seconds == 0.0, d  # the flip paused nothing
    return gap


def test_three_adapter_versions_follow_peft_and_the_base_model_never_changes(rig):
    """(a) Module docstring."""
    with rig.model.disable_adapter():
        truth = hf_logprobs(rig.model)
    base = rig.logprobs()
    assert (base - truth).abs().max().item() <= FP32_TOL
    for version, tensors, want, moved in rig.train(VERSIONS):
        report = rig.refit(tensors, version)
        if version == 1:
            rig.wait_served(NAME)
        gap = check_version(rig, version, want, base)
        print(f"\nDynamo {NAME} v{version}: |Dynamo - PEFT| {gap:.2e}, moved {moved:.3f}, base "
              f"model unchanged, epoch {report.seconds * 1e3:.0f} ms, {report.bytes} bytes")
        assert moved >= MIN_MOVE, f"v{version}: moved {moved:.4f} only"

    streamed_versions = rig.train(2)
    base_streams_through(rig.frontend.url, [(v, tensors) for v, tensors, _, _ in
                                            streamed_versions], rig.refit, "Dynamo")
    version, _, want, _ = streamed_versions[-1]
    check_version(rig, version, want, base)

    # A shim started afresh beside the worker (a restart) lists the adapter at the version the
    # worker built, read from the workers (their engine info), not from flips of its own.
    restarted = spawn_shim("--engine", "dynamo", "--engine-url", rig.worker.url,
                           "--instance-id", "dynamo-lora-restarted")
    try:
        d = describe(restarted.address, timeout_s=30)
        assert [(a.name, a.version) for a in d.adapters] == [(NAME, version)], d
    finally:
        assert restarted.stop() is not None
    # Its stop tore down the worker's weight-update group (a stopping shim releases its
    # engine's group), which the module's shim had formed: the trainer forms it again.
    assert rig.link is not None
    rig.link.close()
    rig.link = None


def test_bad_adapters_are_refused_at_prepare_and_change_nothing(rig):
    """(b) Module docstring."""
    assert rig.version >= VERSIONS + 2, "runs after (a)"
    assert rig.fleet is not None
    (before,) = rig.fleet.describe(weights_digest=False)
    adapter_before = rig.logprobs(NAME)
    tensors = rig.tensors()
    info = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    config = rig.spec.config
    too_wide = AdapterSpec.of(NAME, {**config, "r": 2 * MAX_RANK})
    norm = {"base_model.model.model.norm.lora_A.weight": ((RANK, 128), torch.float32),
            "base_model.model.model.norm.lora_B.weight": ((128, RANK), torch.float32)}
    for plan_info, spec, needle in [(info, too_wide, "max_lora_rank"),
                                    ({**info, **norm}, rig.spec, "do not have")]:
        with pytest.raises(FleetError) as caught:
            rig.fleet.prepare(plan_info, adapter=spec)
        (failure,) = caught.value.failures
        print(f"\nrefused by Dynamo's worker: {failure.reason}: {failure.message}")
        assert failure.reason == Reason.INVALID_ADAPTER and needle in failure.message, failure
    (after,) = rig.fleet.describe(weights_digest=False)
    assert (after.plan_digest, after.weight_version, list(after.adapters)) == \
        (before.plan_digest, before.weight_version, list(before.adapters))
    assert torch.equal(rig.logprobs(NAME), adapter_before)


def test_a_failed_adapter_flip_leaves_the_version_before_serving_and_the_next_flips(rig):
    """(c) Module docstring."""
    assert rig.version == FAILING_BUILD - 1, "runs after (a) and (b)"
    assert rig.fleet is not None and rig.shim is not None
    served, served_want = rig.version, hf_logprobs(rig.model)
    base = rig.logprobs()
    ((version, tensors, _, _),) = rig.train(1)
    with pytest.raises(FleetError) as failed:
        rig.refit(tensors, version)
    (failure,) = failed.value.failures
    print(f"\nDynamo {NAME} v{version}, its build failing: {type(failed.value).__name__}: "
          f"{failure.reason}: {failure.message}")
    assert failure.instance_id == rig.shim.instance_id, failure
    assert "deliberate fault" in failure.message, failure
    gap = (rig.logprobs(NAME) - served_want).abs().max().item()
    assert gap <= FP32_TOL, f"after the failed v{version}: {gap:.2e} from v{served}"
    assert (rig.logprobs() - base).abs().max().item() <= BASE_TOL
    (d,) = rig.fleet.describe(weights_digest=False)
    assert [(a.name, a.version) for a in d.adapters] == [(NAME, served)], d
    assert not d.paused, d
    print(f"after the failed v{version}: Dynamo serves v{served} (gap to PEFT {gap:.1e}), "
          f"the base model unchanged, state {pb.ShimState.Name(d.state)}")
    rig.fleet.readmit(rig.shim.instance_id)
    ((version, tensors, want, _),) = rig.train(1)
    rig.refit(tensors, version)
    check_version(rig, version, want, base)
