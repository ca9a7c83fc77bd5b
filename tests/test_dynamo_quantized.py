"""A bf16 trainer refits an NVIDIA Dynamo worker that quantizes its linear layers to fp8 online
(issue 24; docs/dynamo.md, Quantized workers).

One Dynamo 1.6.1 vLLM worker (vLLM 0.31 CPU, the project's worker extension) serving the planted
tiny Llama of tests/test_vllm_quantized_dense.py in bfloat16 with `--quantization
fp8_per_channel` (every linear layer float8_e4m3fn with one scale per output row, each token's
input quantized at run time), its own frontend (to read the worker's log-probabilities), and a
real `refit-grpc shim --engine dynamo` in front of the worker. The trainer keeps float32 master
weights and sends bf16 (`vllm_support.quantized.QuantizedTrainer`, the vLLM tests' trainer).

(a) Describe says `fp8_per_channel`: the worker publishes its vLLM quantization in the store the
    shim hosts (`refit_grpc_engine_info`), asked by the first Describe.
(b) Three trained versions, in place, staged, staged: after each, the worker's teacher-forced
    log-probabilities (through the frontend, on the shared sequence and on held-out tokens) equal
    the fp8 emulation's (`emulate_quantization`, written from the method's definition) within
    QUANT_TOL, are at least MIN_EFFECT from plain bf16 (the quantization matters, so a worker
    that served the bf16 bytes as sent would fail), and moved; Dynamo's declared weight version
    and Describe say the version. The worker re-derived its fp8 weights and scales from each
    version's bf16 weights (vLLM's layerwise reload re-runs `process_weights_after_loading`).

Not here: the canary (Dynamo has no per-worker forward: CANARY_UNSUPPORTED, docs/dynamo.md),
so the stale-scale fault of the vLLM tests has nothing on Dynamo to catch it at refit time; this
test's reference comparison is what would. MoE int8 needs AMX tiles (docs/vllm.md), absent here.
"""

from __future__ import annotations

import time

import pytest

from dynamo_support import require_dynamo
from support import info
from vllm_support import require_vllm, tiny_model_dir

require_vllm()  # the trainer's side: transformers, tokenizers (installed with vLLM)
require_dynamo()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc.driver import Fleet, WorkerEndpoint  # noqa: E402
from refit_grpc.integrations.dynamo import read_workers  # noqa: E402
from refit_grpc.integrations.quantization import FP8_DENSE  # noqa: E402
from refit_grpc.proto import pb  # noqa: E402
from refit_grpc.shim.process import spawn_shim  # noqa: E402
from refit_grpc.testing.dynamo import (  # noqa: E402
    DynamoFrontend,
    DynamoWorker,
    add_chat_template,
    frontend_logprobs,
)

from vllm_support.quantized import (  # noqa: E402
    EPOCHS,
    HELD_OUT,
    MIN_EFFECT,
    QUANT_TOL,
    QuantizedTrainer,
    plant_fp8,
)
from vllm_support.truth import MIN_MOVE, SEQUENCE, load_model  # noqa: E402

EPOCH_S = 120.0
BUFFER = 256 * 1024


class Rig:
    """The module's worker, frontend and shim, and the trainer."""

    def __init__(self, root, trainer: QuantizedTrainer):
        self.root = root
        self.trainer = trainer
        self.discovery_dir = root / "discovery"
        self.discovery_dir.mkdir()
        add_chat_template(trainer.checkpoint)  # Dynamo's frontend insists on one
        self.worker = DynamoWorker(
            trainer.checkpoint, self.discovery_dir, log_path=root / "worker.log", cpu_bind="0",
            extra_args=("--dtype", "bfloat16", "--quantization", FP8_DENSE))
        self.frontend = DynamoFrontend(self.discovery_dir, log_path=root / "frontend.log")
        self.shim = None

    def start(self) -> Rig:
        t0 = time.monotonic()
        self.worker.start()
        self.frontend.start()
        self.worker.wait_ready(300)
        self.frontend.wait_ready(60)
        self.frontend.wait_for([self.worker.url])
        print(f"\nthe fp8 Dynamo worker and its frontend ready in {time.monotonic() - t0:.1f}s")
        self.shim = spawn_shim("--engine", "dynamo", "--engine-url", self.worker.url,
                               "--instance-id", "dynamo-fp8", "--buffer-size-bytes",
                               str(BUFFER), "--num-buffers", "2", "--max-epoch-s", str(EPOCH_S))
        return self

    def stop(self) -> list[int]:
        if self.shim is not None:
            self.shim.stop()
        for p in (self.frontend, self.worker):
            p.stop()
        left = [p for p in (self.frontend, self.worker) for p in p.group_pids()]
        if self.shim is not None and self.shim.proc.poll() is None:
            left.append(self.shim.pid)
        return left

    def logprobs(self, sequence) -> object:
        (record,) = [r for r in read_workers(self.frontend.rl_url)
                     if r["system_url"] == self.worker.url]
        return frontend_logprobs(self.frontend.url, int(record["instance_id"]), sequence)

    def fleet(self) -> Fleet:
        return Fleet([WorkerEndpoint(self.shim.instance_id, self.shim.address)],
                     control_timeout_s=30, join_timeout_s=30, epoch_timeout_s=EPOCH_S)

    def weight_version(self):
        status, body = self.worker.post("get_weight_version")
        assert status == 200 and body["status"] == "ok", body
        return body["version"]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    trainer = QuantizedTrainer(load_model(tiny_model_dir()), FP8_DENSE, plant_fp8,
                               tmp_path_factory.mktemp("dynamo-quantized-trainer"))
    rig = Rig(tmp_path_factory.mktemp("dynamo-quantized"), trainer)
    try:
        yield rig.start()
    finally:
        left = rig.stop()
        assert not left, f"processes outlived the module: {left}"


def test_describe_says_the_workers_quantization(rig):
    """(a) Module docstring."""
    fleet = rig.fleet()
    try:
        (d,) = fleet.describe(weights_digest=False)
        assert d.quantization == FP8_DENSE, d
    finally:
        fleet.close()


def test_refits_of_a_bf16_trainer_follow_the_fp8_reference_in_place_and_staged(rig):
    """(b) Module docstring."""
    trainer = rig.trainer
    before, gap, unquantized = trainer.gaps(rig.logprobs, SEQUENCE)
    _, held_gap, held_unquantized = trainer.gaps(rig.logprobs, HELD_OUT)
    print(f"\nDynamo fp8 v0 (started from it): |Dynamo - reference| {gap:.2e} (held out "
          f"{held_gap:.2e}), |Dynamo - bf16| {unquantized:.3f} (held out "
          f"{held_unquantized:.3f})")
    assert max(gap, held_gap) <= QUANT_TOL, (gap, held_gap)
    assert held_unquantized >= MIN_EFFECT, held_unquantized
    fleet = rig.fleet()
    link = None
    try:
        for kind, epoch in EPOCHS:
            version, tensors = trainer.next_version()
            if link is None:
                fleet.prepare(info(tensors))
                link = fleet.connect("127.0.0.1")
            report = fleet.refit(link, tensors, version=version, epoch=epoch)
            assert report.version == version and not report.left_behind, report
            got, gap, unquantized = trainer.gaps(rig.logprobs, SEQUENCE)
            _, held_gap, held_unquantized = trainer.gaps(rig.logprobs, HELD_OUT)
            moved = (got - before).abs().max().item()
            before = got
            stall = ("" if report.stall_seconds is None
                     else f", stall {report.stall_seconds * 1e3:.0f} ms")
            print(f"Dynamo fp8 v{version} {kind}: |Dynamo - reference| {gap:.2e} (held out "
                  f"{held_gap:.2e}), |Dynamo - bf16| {unquantized:.3f} (held out "
                  f"{held_unquantized:.3f}), moved {moved:.3f}, epoch "
                  f"{report.seconds * 1e3:.0f} ms{stall}")
            assert max(gap, held_gap) <= QUANT_TOL, \
                f"v{version} {kind}: {gap:.4f} / {held_gap:.4f} from the reference"
            assert held_unquantized >= MIN_EFFECT, \
                f"v{version}: the quantization changed little ({held_unquantized})"
            assert moved >= MIN_MOVE, f"v{version}: moved {moved:.4f} only"
            (d,) = fleet.describe(weights_digest=False)
            assert (d.state, d.weight_version, d.paused) == \
                (pb.SHIM_STATE_READY, version, False), d
            assert d.quantization == FP8_DENSE, d
            assert rig.weight_version() == version
    finally:
        if link is not None:
            link.close()
        fleet.close()
