"""Staged epochs on one shim (real gRPC on loopback, a real gloo group, the reference engine):
the engine serves the old version, never paused, while the new one lands in its staging copy;
it switches only at Flip, and only to the bytes the trainer sent (docs/protocol.md, invariants
7-9). The fleet-wide behaviour (quorum, faults) is in test_staged_fleet.py."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from refit_grpc.canary import teacher_forced_logprobs
from refit_grpc.common import Deadline
from refit_grpc.dataplane.staging import STAGED_CHECKSUM, StagedDigest, staged_digest
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.plan import Packing, RefitPlan, weights_digest
from refit_grpc.proto import pb
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.metrics import _StateCollector
from refit_grpc.shim.service import ShimConfig

from support import Epoch, InProcessShim, join, prepare_request, start_ready_shim, tensors_v


class StagedStream(Epoch):
    """A staged UpdateWeights stream read on a thread."""

    def __init__(self, stub, version: int, digest: str, group_id: str = "g1", **fields):
        self._open(stub, pb.UpdateWeightsRequest(version=version, plan_digest=digest,
                                                 group_id=group_id, mode=pb.EPOCH_MODE_STAGED,
                                                 **fields))


def stage(ready, tensors, version: int, **fields) -> tuple[StagedStream, str]:
    """Open a staged epoch on a ReadyShim and send `tensors`; returns the stream (ended) and the
    trainer's staged digest."""
    ep = StagedStream(ready.shim.stub, version, ready.plan.digest, **fields)
    assert ep.accepted.wait(10) and ep.error is None, ep.error
    checksums = StagedDigest(ready.plan)
    Sender(ready.group, ready.plan).send(tensors, Deadline(20), checksums=checksums)
    ep.join()
    assert ep.error is None, ep.error
    return ep, checksums.hexdigest()


def flip(stub, version: int, digest: str, **fields) -> pb.FlipResponse:
    return stub.Flip(pb.FlipRequest(version=version, staged_digest=digest, **fields), timeout=10)


def reason(err: grpc.RpcError) -> str:
    return failure_from_rpc(WorkerEndpoint("x", "x"), err).reason


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), reason(e.value)


def store_digest(ready, tensors) -> str:
    return weights_digest((s.name, tensors[s.name]) for s in ready.plan.tensors)


@pytest.fixture
def ready():
    r = start_ready_shim()
    yield r
    r.close()


def test_serves_the_old_version_until_the_flip_then_exactly_the_new(ready):
    stub, t1, t2 = ready.shim.stub, tensors_v(1), tensors_v(2)
    ep, trainer_digest = stage(ready, t2, 2)
    phases = [m.phase for m in ep.messages]
    assert phases[0] == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED
    assert phases[-1] == pb.UPDATE_WEIGHTS_PHASE_STAGED
    assert pb.UPDATE_WEIGHTS_PHASE_COMMITTED not in phases
    assert ep.messages[-1].staged_digest == trainer_digest
    assert trainer_digest == staged_digest(
        ready.plan, ((b, _packed(ready.plan, t2, b)) for b in ready.plan.buckets))

    assert gauges(ready)["refit_shim_staged_version"] == 2
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_STAGED, False, 1)
    assert (d.staged_version, d.staged_digest) == (2, trainer_digest)
    assert d.staging_bytes == ready.plan.total_bytes
    assert d.weights_digest == store_digest(ready, t1)  # the live weights did not move

    done = flip(stub, 2, trainer_digest)
    assert (done.version, done.state, done.resumed) == (2, pb.SHIM_STATE_READY, True)
    assert 0 < done.load_seconds <= done.stall_seconds
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version, d.staged_version) == \
        (pb.SHIM_STATE_READY, False, 2, 0)
    assert d.weights_digest == store_digest(ready, t2)
    assert d.last_stall_seconds == pytest.approx(done.stall_seconds)
    g = gauges(ready)
    assert g["refit_shim_staged_version"] == 0
    assert g["refit_shim_last_stall_seconds"] == pytest.approx(done.stall_seconds)

    # The group stays: the next staged epoch reuses it; the staging copy holds one copy of the
    # plan beside the weights served (the engine serves from the copy it flipped to).
    _, digest3 = stage(ready, tensors_v(3), 3)
    assert flip(stub, 3, digest3).version == 3
    assert ready.shim.describe().weights_digest == store_digest(ready, tensors_v(3))
    assert ready.shim.describe().staging_bytes == ready.plan.total_bytes


def gauges(ready) -> dict[str, float]:
    """The shim's unlabelled gauges, as its metrics endpoint would serve them at this moment."""
    collector = _StateCollector(ready.shim.server.servicer, "reference")
    return {m.name: m.samples[0].value for m in collector.collect() if len(m.samples) == 1}


def _packed(plan: RefitPlan, tensors, bucket) -> torch.Tensor:
    return torch.cat([tensors[s.name].reshape(-1).view(torch.uint8)
                      for s in plan.tensors[bucket.start:bucket.stop]])


def test_flip_refusals_change_nothing_but_a_wrong_digest_drops_the_copy(ready):
    stub, t1 = ready.shim.stub, tensors_v(1)
    assert refusal(lambda: flip(stub, 2, "x")) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "NOT_STAGED")
    _, digest = stage(ready, tensors_v(2), 2)
    assert refusal(lambda: flip(stub, 3, digest)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "STAGED_VERSION_MISMATCH")
    assert ready.shim.describe().staged_version == 2  # kept
    assert refusal(lambda: flip(stub, 2, digest, instance_id="someone-else")) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "MEMBERSHIP_CHANGED")
    # Another epoch, a join or another plan while a version waits for its flip: refused.
    assert refusal(lambda: list(stub.UpdateWeights(pb.UpdateWeightsRequest(
        version=3, plan_digest=ready.plan.digest, group_id="g1"), timeout=5))) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
    assert refusal(lambda: stub.Prepare(prepare_request(tensors_v(1), Packing(8192, 2)),
                                        timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")

    assert refusal(lambda: flip(stub, 2, "0" * 64)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "STAGED_DIGEST_MISMATCH")
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version, d.staged_version) == \
        (pb.SHIM_STATE_READY, False, 1, 0)
    assert d.weights_digest == store_digest(ready, t1)
    assert refusal(lambda: flip(stub, 2, digest)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "NOT_STAGED")


def test_no_flip_in_time_drops_the_copy_and_the_engine_serves_on(ready):
    _, digest = stage(ready, tensors_v(2), 2, flip_timeout_s=0.5)
    assert ready.shim.describe().state == pb.SHIM_STATE_STAGED
    end = time.monotonic() + 10
    while ready.shim.describe().state == pb.SHIM_STATE_STAGED and time.monotonic() < end:
        time.sleep(0.05)
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version, d.staged_version) == \
        (pb.SHIM_STATE_READY, False, 1, 0)
    assert "no Flip in time" in d.last_error
    assert refusal(lambda: flip(ready.shim.stub, 2, digest))[1] == "NOT_STAGED"
    # The next staged epoch on the same group works.
    _, digest3 = stage(ready, tensors_v(3), 3)
    assert flip(ready.shim.stub, 3, digest3).version == 3


@pytest.mark.parametrize("when", ["staging", "staged"])
def test_abort_before_the_flip_leaves_the_old_version_serving(ready, when):
    stub = ready.shim.stub
    if when == "staging":
        ep = StagedStream(stub, 2, ready.plan.digest)
        assert ep.accepted.wait(10) and ep.error is None
        assert ready.shim.describe().state == pb.SHIM_STATE_STAGING
    else:
        stage(ready, tensors_v(2), 2)
    answer = stub.Abort(pb.AbortRequest(reason="operator"), timeout=10)
    assert answer.epoch_aborted == (when == "staging")
    if when == "staging":
        ep.join()
        assert ep.error is not None and reason(ep.error) == "EPOCH_ABORTED"
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version, d.staged_version) == \
        (pb.SHIM_STATE_PREPARED, False, 1, 0)
    assert d.weights_digest == store_digest(ready, tensors_v(1))
    assert refusal(lambda: flip(stub, 2, "x"))[1] == "NOT_STAGED"


@pytest.mark.parametrize("when", ["staging", "staged"])
def test_an_abort_that_keeps_staged_copies_spares_a_complete_one_only(ready, when):
    """What a staged epoch's driver sends to its unfinished receives (keep_staged): one that
    finished before the Abort arrived keeps its copy and flips; one still receiving ends."""
    stub = ready.shim.stub
    if when == "staging":
        ep = StagedStream(stub, 2, ready.plan.digest)
        assert ep.accepted.wait(10) and ep.error is None
    else:
        _, digest = stage(ready, tensors_v(2), 2)
    answer = stub.Abort(pb.AbortRequest(reason="unfinished receives", keep_staged=True),
                        timeout=10)
    assert answer.epoch_aborted == (when == "staging")
    if when == "staging":
        ep.join()
        assert ep.error is not None and reason(ep.error) == "EPOCH_ABORTED"
        d = ready.shim.describe()
        assert (d.state, d.weight_version, d.staged_version) == (pb.SHIM_STATE_PREPARED, 1, 0)
        return
    d = ready.shim.describe()
    assert (d.state, d.weight_version, d.staged_version) == (pb.SHIM_STATE_STAGED, 1, 2)
    assert flip(stub, 2, digest).version == 2
    assert ready.shim.describe().weights_digest == store_digest(ready, tensors_v(2))


def test_bad_staged_requests_are_refused_before_accepted(ready):
    stub = ready.shim.stub
    base = dict(version=2, plan_digest=ready.plan.digest, group_id="g1")
    for fields, expected in [(dict(mode=7), "INVALID_EPOCH_MODE"),
                           (dict(mode=pb.EPOCH_MODE_STAGED, flip_timeout_s=-1),
                            "INVALID_FLIP_TIMEOUT"),
                           (dict(mode=pb.EPOCH_MODE_STAGED, flip_timeout_s=float("nan")),
                            "INVALID_FLIP_TIMEOUT")]:
        request = pb.UpdateWeightsRequest(**base, **fields)
        assert refusal(lambda r=request: list(stub.UpdateWeights(r, timeout=5))) == \
            (grpc.StatusCode.INVALID_ARGUMENT, expected)
    # A driver whose staged digest uses another checksum (an older release's CRC-32): refused
    # before any byte moves, naming both, instead of a digest that cannot match at the Flip.
    request = pb.UpdateWeightsRequest(**base, mode=pb.EPOCH_MODE_STAGED, staged_checksum="crc32")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.UpdateWeights(request, timeout=5))
    assert (e.value.code(), reason(e.value)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "STAGING_UNSUPPORTED")
    assert "'crc32'" in e.value.details() and f"'{STAGED_CHECKSUM}'" in e.value.details()
    d = ready.shim.describe()
    assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_READY, False, 1)
    assert d.staged_checksum == STAGED_CHECKSUM == "xxh3-64"


def test_the_model_keeps_generating_while_staging_and_the_canary_runs_at_the_flip():
    engine = ReferenceEngine(TinyLMConfig(), seed=0)
    shim = InProcessShim(engine, ShimConfig(max_epoch_s=30))
    try:
        t1 = {k: v.clone() for k, v in engine._weights.items()}
        t2 = {k: v + 0.01 * torch.randn_like(v) for k, v in t1.items()}
        plan = RefitPlan.from_tensors(t1.items(), Packing(1 << 16, 2))
        shim.stub.Prepare(prepare_request(t1, plan.packing), timeout=5)
        group = join(shim, plan.digest)
        before = engine.generate([1, 2, 3], 4, Deadline(5))[0]
        canary_ids = [5, 9, 2, 7, 7, 1, 30, 4]
        trained = TinyLM(TinyLMConfig()).eval()
        trained.load_state_dict(t2)
        with torch.no_grad():
            expected = teacher_forced_logprobs(trained(torch.tensor([canary_ids]))[0], canary_ids)
        ep = StagedStream(shim.stub, 1, plan.digest, verify_weights=True,
                          canary=pb.Canary(token_ids=canary_ids, expected_logprobs=expected))
        assert ep.accepted.wait(10) and ep.error is None
        # STAGING, no byte sent yet: an in-place epoch would hold every request now.
        assert engine.generate([1, 2, 3], 4, Deadline(2))[0] == before
        checksums = StagedDigest(plan)
        sender = threading.Thread(target=Sender(group, plan).send, args=(t2, Deadline(20)),
                                  kwargs={"checksums": checksums})
        sender.start()
        while sender.is_alive():
            assert engine.generate([1, 2, 3], 4, Deadline(2))[0] == before
        ep.join()
        assert ep.messages[-1].phase == pb.UPDATE_WEIGHTS_PHASE_STAGED
        assert engine.generate([1, 2, 3], 4, Deadline(2))[0] == before  # still the old model
        done = flip(shim.stub, 1, checksums.hexdigest())
        assert done.weights_digest == weights_digest((s.name, t2[s.name]) for s in plan.tensors)
        assert 0 <= done.canary.max_abs_gap < 1e-5 and not done.canary.error
        for name, t in t2.items():
            assert torch.equal(engine.tensor(name), t)
        group.close()
    finally:
        shim.close()


def test_a_second_trainers_epoch_during_a_staged_one_is_refused(ready):
    stub = ready.shim.stub
    ep = StagedStream(stub, 2, ready.plan.digest)
    assert ep.accepted.wait(10) and ep.error is None
    for mode in (pb.EPOCH_MODE_STAGED, pb.EPOCH_MODE_IN_PLACE):
        request = pb.UpdateWeightsRequest(version=3, plan_digest=ready.plan.digest,
                                          group_id="g1", mode=mode)
        assert refusal(lambda r=request: list(stub.UpdateWeights(r, timeout=5))) == \
            (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
    d = ready.shim.describe()
    assert (d.state, d.paused) == (pb.SHIM_STATE_STAGING, False)
    stub.Abort(pb.AbortRequest(reason="test over"), timeout=10)
    ep.join()
