"""Staged epochs on a real NVIDIA Dynamo worker (docs/dynamo.md, Staged epochs): one Dynamo 1.6.1
vLLM worker (CPU, the project's worker extension), Dynamo's frontend (to read the worker's
log-probabilities) and a real `refit-grpc shim --engine dynamo` process in front of the worker.

(a) A staged UpdateWeights through the shim: while the bytes land (the trainer paces its
    buckets), Describe says STAGING and not paused, and the worker answers a teacher-forced
    request through the frontend with the old version's log-probabilities; the stream ends at
    STAGED with the trainer's staged digest, the old version still served; the Flip loads the
    copy and the worker serves the new version (log-probabilities equal transformers'), with
    Dynamo's declared weight version the flipped one. Then `Fleet.refit(epoch=Staged())` does the
    same in one call. Describe says the worker's quantization ("none": it serves the weights as
    sent), which the worker publishes in a store the shim hosts.
(b) An operator Abort mid-stage ends the staged receive (nothing staged, Flip refused
    NOT_STAGED), the worker was never paused and still serves the last flipped version, and the
    next staged epoch goes through.
(c) Keeping the cache across a flip (FlipRequest.keep_cache: Dynamo's pause_generation with
    clear_cache false, no flush_cache): a completion through the frontend running when the flip
    is sent (pause mode KEEP parks it) returns every token, after a keep-cache flip and after a
    clearing one, and the worker then serves the new version. Dynamo's vLLM (0.31) has no
    per-token weight version spans, so the frontend passes none on.

The worker and the frontend are the session's shared ones (tests/conftest.py), serving their
checkpoint when this module takes them; the session's end proves that no process survived.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from dynamo_support import require_dynamo
from support import info
from vllm_support import require_vllm

require_vllm()  # the trainer's side: transformers, tokenizers (installed with vLLM)
require_dynamo()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc import Staged  # noqa: E402
from refit_grpc.common import Deadline  # noqa: E402
from refit_grpc.dataplane.staging import StagedDigest  # noqa: E402
from refit_grpc.driver import Fleet, WorkerEndpoint  # noqa: E402
from refit_grpc.integrations.dynamo import read_workers  # noqa: E402
from refit_grpc.proto import pb, pb_grpc  # noqa: E402
from refit_grpc.shim.process import ShimProcess, spawn_shim  # noqa: E402
from refit_grpc.testing.dynamo import (  # noqa: E402
    DynamoFrontend,
    DynamoWorker,
    frontend_greedy,
    frontend_logprobs,
)

from vllm_support.truth import (  # noqa: E402
    SEQUENCE,
    hf_logprobs,
    load_model,
    sgd_step,
    state_dict_to_send,
)

BUFFER = 256 * 1024  # the 1.7 MB model in 5 buckets
EPOCH_S = 60.0
FP32_TOL = 2e-3
MIN_MOVE = 0.05
LR = 0.5
PACE_S = 0.3  # the trainer's pause after each bucket: a staging window to look into


class Rig:
    """The module's processes, the trainer's model and what the worker serves."""

    def __init__(self, deployment: dict):
        self.model_dir = deployment["model_dir"]
        self.worker: DynamoWorker = deployment["worker"]
        self.frontend: DynamoFrontend = deployment["frontend"]
        self.shim: ShimProcess | None = None
        self.model = load_model(self.model_dir)      # the trainer's, trained in place
        self.scratch = load_model(self.model_dir)    # transformers on any weights
        self.served = {n: t.clone() for n, t in self.model.state_dict().items()}
        self.version = 0
        self.gen = torch.Generator().manual_seed(0)

    def instance_id(self) -> int:
        (record,) = [r for r in read_workers(self.frontend.rl_url)
                     if r["system_url"] == self.worker.url]
        return int(record["instance_id"])

    def gap_to(self, weights: dict) -> float:
        """max |the worker's log-probabilities - transformers' on `weights`|."""
        self.scratch.load_state_dict(weights)
        truth = hf_logprobs(self.scratch)
        got = frontend_logprobs(self.frontend.url, self.instance_id(), SEQUENCE)
        return (got - truth).abs().max().item()

    def next_version(self) -> tuple[int, dict]:
        sgd_step(self.model, LR, self.gen)
        weights = state_dict_to_send(self.model, with_lm_head=True)
        return self.version + 1, {n: t.detach().clone() for n, t in weights.items()}

    def flipped(self, version: int, weights: dict) -> None:
        self.version, self.served = version, weights

    def fleet(self) -> Fleet:
        return Fleet([WorkerEndpoint(self.shim.instance_id, self.shim.address)],
                     control_timeout_s=30, join_timeout_s=30, epoch_timeout_s=EPOCH_S)

    def stub(self, channel) -> pb_grpc.RefitServiceStub:
        return pb_grpc.RefitServiceStub(channel)


@pytest.fixture(scope="module")
def rig(dynamo_deployment):
    """The session's Dynamo worker (OpenMP threads on core 0, so the streams and the trainer
    have the other) serving its checkpoint, and a shim in front of it."""
    rig = Rig(dynamo_deployment.get(fresh=True, changed=True))
    rig.shim = spawn_shim("--engine", "dynamo", "--engine-url", rig.worker.url,
                          "--instance-id", "dynamo-staged-0", "--buffer-size-bytes",
                          str(BUFFER), "--num-buffers", "2", "--max-epoch-s", str(EPOCH_S))
    try:
        yield rig
    finally:
        rig.shim.stop()
        assert rig.shim.proc.poll() is not None, f"the shim {rig.shim.pid} outlived the module"


def dynamo_version(rig: Rig):
    status, body = rig.worker.post("get_weight_version")
    assert status == 200 and body["status"] == "ok", body
    return body["version"]


def test_a_staged_epoch_stages_while_the_worker_serves_then_the_flip_serves_the_new_version(rig):
    """(a) Module docstring."""
    assert rig.gap_to(rig.served) <= FP32_TOL, "the worker differs from transformers at start"
    fleet = rig.fleet()
    channel = grpc.insecure_channel(rig.shim.address)
    link = None
    try:
        version, weights = rig.next_version()
        plan = fleet.prepare(info(weights))
        assert len(plan.buckets) >= 3, plan.buckets
        link = fleet.connect("127.0.0.1")
        stub = rig.stub(channel)
        stream = stub.UpdateWeights(pb.UpdateWeightsRequest(
            version=version, plan_digest=plan.digest, group_id=fleet.group_id,
            instance_id=rig.shim.instance_id, mode=pb.EPOCH_MODE_STAGED), timeout=EPOCH_S)
        first = next(stream)
        assert first.phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED, first

        seen: list[tuple[int, int, bool, float, float]] = []

        def look_in(bucket) -> None:
            """After a bucket went out: the shim's view, and the worker serving (a request
            through the frontend answers, with the old version's log-probabilities)."""
            time.sleep(PACE_S)
            if bucket.index in (0, len(plan.buckets) // 2):
                (d,) = fleet.describe()
                t0 = time.monotonic()
                gap = rig.gap_to(rig.served)
                seen.append((bucket.index, d.state, d.paused, gap, time.monotonic() - t0))

        checksums = StagedDigest(plan)
        t0 = time.monotonic()
        link.sender.send(weights, Deadline(EPOCH_S), look_in, checksums=checksums)
        rest = list(stream)
        staged_s = time.monotonic() - t0
        sent = checksums.hexdigest()
        print(f"\nstaged {plan.total_bytes} bytes in {len(plan.buckets)} buckets over "
              f"{staged_s:.2f}s (paced {PACE_S}s a bucket); while staging (bucket, state, "
              f"paused, gap to the old version, request seconds): {seen}")
        assert [s[1:3] for s in seen] == [(pb.SHIM_STATE_STAGING, False)] * 2, seen
        assert all(gap <= FP32_TOL for *_, gap, _ in seen), seen
        phases = [m.phase for m in rest]
        assert phases[-1] == pb.UPDATE_WEIGHTS_PHASE_STAGED, rest
        assert pb.UPDATE_WEIGHTS_PHASE_COMMITTED not in phases, phases
        assert phases.count(pb.UPDATE_WEIGHTS_PHASE_PROGRESS) >= 1, phases
        assert rest[-1].staged_digest == sent
        (d,) = fleet.describe()
        assert (d.state, d.paused, d.staged_version, d.staged_digest, d.weight_version) == \
            (pb.SHIM_STATE_STAGED, False, version, sent, rig.version), d
        assert d.staging_bytes == plan.total_bytes, d
        assert rig.gap_to(rig.served) <= FP32_TOL, "staging touched the live weights"

        before = frontend_logprobs(rig.frontend.url, rig.instance_id(), SEQUENCE)
        done = stub.Flip(pb.FlipRequest(version=version, staged_digest=sent,
                                        instance_id=rig.shim.instance_id), timeout=EPOCH_S)
        assert (done.version, done.resumed) == (version, True), done
        rig.flipped(version, weights)
        gap = rig.gap_to(weights)
        moved = (frontend_logprobs(rig.frontend.url, rig.instance_id(), SEQUENCE)
                 - before).abs().max().item()
        print(f"flip through the shim: stall {done.stall_seconds * 1e3:.0f} ms (load "
              f"{done.load_seconds * 1e3:.0f} ms); max |Dynamo - transformers| = {gap:.2e}, "
              f"moved {moved:.3f}")
        assert gap <= FP32_TOL and moved >= MIN_MOVE, (gap, moved)
        assert dynamo_version(rig) == version
        (d,) = fleet.describe()
        assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_READY, False, version), d
        assert d.quantization == "none", d  # asked of the worker (refit_grpc_engine_info)

        # The trainer's one call: Fleet.refit(epoch=Staged()) stages, checks, flips.
        version, weights = rig.next_version()
        report = fleet.refit(link, weights, version=version, epoch=Staged())
        assert report.version == version and not report.left_behind, report
        rig.flipped(version, weights)
        gap = rig.gap_to(weights)
        print(f"Fleet.refit(epoch=Staged()): epoch {report.seconds * 1e3:.0f} ms, stall "
              f"{report.stall_seconds * 1e3:.0f} ms, max |Dynamo - transformers| = {gap:.2e}")
        assert gap <= FP32_TOL
        assert dynamo_version(rig) == version
        (d,) = fleet.describe()
        assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_READY, False, version), d
    finally:
        channel.close()
        if link is not None:
            link.close()
        fleet.close()


def test_an_abort_mid_stage_leaves_the_served_version_and_the_next_staged_epoch_goes_through(
        rig):
    """(b) Module docstring."""
    assert rig.version >= 1, "runs after (a)"
    fleet = rig.fleet()
    channel = grpc.insecure_channel(rig.shim.address)
    link = None
    try:
        version, weights = rig.next_version()
        plan = fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1")
        stub = rig.stub(channel)
        stream = stub.UpdateWeights(pb.UpdateWeightsRequest(
            version=version, plan_digest=plan.digest, group_id=fleet.group_id,
            instance_id=rig.shim.instance_id, mode=pb.EPOCH_MODE_STAGED), timeout=EPOCH_S)
        assert next(stream).phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED
        took: list[float] = []

        def abort_after_first(bucket) -> None:
            if bucket.index == 0:
                time.sleep(PACE_S)  # the worker is receiving
                t0 = time.monotonic()
                reply = stub.Abort(pb.AbortRequest(reason="operator"), timeout=10)
                took.append(time.monotonic() - t0)
                assert reply.epoch_aborted, reply

        try:  # the worker left the group: the rest of the broadcast fails, or is lost
            link.sender.send(weights, Deadline(15.0), abort_after_first)
        except Exception as e:  # noqa: BLE001  (either is fine; the shim's answer is the test)
            print(f"\nthe trainer's broadcast after the abort: {type(e).__name__}")
        with pytest.raises(grpc.RpcError) as failed:
            list(stream)
        assert failed.value.code() == grpc.StatusCode.ABORTED, failed.value
        (d,) = fleet.describe()
        assert (d.state, d.paused, d.weight_version, d.staged_version) == \
            (pb.SHIM_STATE_PREPARED, False, rig.version, 0), d
        with pytest.raises(grpc.RpcError) as refused:
            stub.Flip(pb.FlipRequest(version=version, staged_digest="0" * 16,
                                     instance_id=rig.shim.instance_id), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value
        gap = rig.gap_to(rig.served)
        print(f"Abort mid-stage answered in {took[0]:.2f}s; the worker serves "
              f"v{rig.version} (gap {gap:.1e})")
        assert gap <= FP32_TOL
        assert dynamo_version(rig) == rig.version
        link.close()

        link = fleet.connect("127.0.0.1")  # the abort closed the group: a new one
        report = fleet.refit(link, weights, version=version, epoch=Staged())
        assert report.version == version, report
        rig.flipped(version, weights)
        assert rig.gap_to(weights) <= FP32_TOL
        assert dynamo_version(rig) == version
    finally:
        channel.close()
        if link is not None:
            link.close()
        fleet.close()


def test_a_keep_cache_flip_parks_a_running_completion_and_it_completes(rig):
    """(c) Module docstring. Each flip (keep-cache, then clearing) is sent while a 240-token
    greedy completion through the frontend is running (sent 0.15 s before); the completion
    returns every token. The frontend delivers a streamed completion's chunks all at its end
    (measured: one to two hundred chunks within a millisecond), so what a stream feels across
    the flip is not observable through it: only each completion's latency is printed, next to
    one without a flip."""
    assert rig.version >= 1, "runs after (a)"
    fleet = rig.fleet()
    channel = grpc.insecure_channel(rig.shim.address)
    link = None
    prompt, tokens = [5, 17, 42, 9, 101, 77, 3, 250], 240
    instance = rig.instance_id()

    def complete(box: dict) -> None:
        t0 = time.monotonic()
        try:
            box["ids"] = frontend_greedy(rig.frontend.url, instance, prompt, tokens)
        except Exception as e:  # noqa: BLE001  (asserted below)
            box["error"] = e
        box["seconds"] = time.monotonic() - t0

    try:
        alone: dict = {}
        complete(alone)
        assert len(alone.get("ids", ())) == tokens, alone
        version, weights = rig.next_version()
        plan = fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1")
        stub = rig.stub(channel)
        for keep_cache in (True, False):
            stream = stub.UpdateWeights(pb.UpdateWeightsRequest(
                version=version, plan_digest=plan.digest, group_id=fleet.group_id,
                instance_id=rig.shim.instance_id, mode=pb.EPOCH_MODE_STAGED), timeout=EPOCH_S)
            assert next(stream).phase == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED
            checksums = StagedDigest(plan)
            link.sender.send(weights, Deadline(EPOCH_S), checksums=checksums)
            assert list(stream)[-1].phase == pb.UPDATE_WEIGHTS_PHASE_STAGED

            box: dict = {}
            running = threading.Thread(target=complete, args=(box,), daemon=True)
            running.start()
            time.sleep(0.15)
            done = stub.Flip(pb.FlipRequest(
                version=version, staged_digest=checksums.hexdigest(),
                instance_id=rig.shim.instance_id, pause_mode=pb.PAUSE_MODE_KEEP,
                keep_cache=keep_cache), timeout=EPOCH_S)
            running.join(60)
            assert done.resumed, done
            assert running.is_alive() is False and "error" not in box, box.get("error")
            assert len(box["ids"]) == tokens, len(box["ids"])
            assert box["seconds"] > 0.15, "the completion ended before the flip was sent"
            rig.flipped(version, weights)
            kind = "keep-cache" if keep_cache else "clearing"
            print(f"\n{kind} flip on Dynamo under a running completion: stall "
                  f"{done.stall_seconds * 1e3:.0f} ms; the completion took "
                  f"{box['seconds'] * 1e3:.0f} ms ({alone['seconds'] * 1e3:.0f} ms without a "
                  "flip), every token returned")
            assert rig.gap_to(weights) <= FP32_TOL
            assert dynamo_version(rig) == version
            version, weights = rig.next_version()
    finally:
        channel.close()
        if link is not None:
            link.close()
        fleet.close()
