"""Every transition of the shim's state machine, and every refused one, over real gRPC + gloo."""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from refit_grpc.common import Deadline
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import pb, ref_pb, ref_pb_grpc
from refit_grpc.shim.admission import ADMISSIONS, Busy, markdown_table, refusal
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.service import RefitServicer, ShimConfig

from support import Epoch, full_epoch, join, prepare_request, tensors_v

S = pb.ShimState


def reason_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    f = failure_from_rpc(WorkerEndpoint("x", "x"), err)
    return f.code, f.reason


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, pb.DescribeResponse):
            list(result)
    return reason_of(e.value)


def test_the_protocol_page_shows_the_codes_admission_table():
    page = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    assert markdown_table() in page, \
        "docs/protocol.md's admission table is not ADMISSIONS: paste what " \
        "`python -m refit_grpc.shim.admission` prints"


def test_every_rpc_has_one_admission_and_every_handler_asks_it():
    rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["RefitService"].methods]
    assert sorted(ADMISSIONS) == sorted(rpcs)
    source = inspect.getsource(RefitServicer)
    assert [rpc for rpc in rpcs if f'.admit_locked("{rpc}"' not in source] == []
    # Each long operation is held by exactly the RPC it is named after.
    assert {rpc: a.holds for rpc, a in ADMISSIONS.items() if a.holds} == \
        {busy.value: busy for busy in Busy}


@pytest.mark.parametrize("rpc,state,busy,draining,instance_id,expected", [
    # A restarted shim is EMPTY too: the instance is named first, not the state.
    ("UpdateWeights", S.SHIM_STATE_EMPTY, None, False, "old", "MEMBERSHIP_CHANGED"),
    ("Flip", S.SHIM_STATE_STAGED, None, True, "old", "MEMBERSHIP_CHANGED"),
    ("UpdateWeights", S.SHIM_STATE_READY, None, False, "me", None),
    # Flush never resumes partial weights, and says so before it says "shutting down".
    ("Flush", S.SHIM_STATE_BROKEN, None, True, "", "BROKEN"),
    ("Prepare", S.SHIM_STATE_READY, None, True, "", "SHUTTING_DOWN"),
    # The state is named before a long operation that holds it.
    ("Prepare", S.SHIM_STATE_RECEIVING, Busy.EPOCH, False, "", "WRONG_STATE"),
    ("CatchUp", S.SHIM_STATE_CATCHING_UP, Busy.CATCH_UP, False, "", "WRONG_STATE"),
    ("Prepare", S.SHIM_STATE_PREPARED, Busy.JOIN, False, "", "BUSY"),
    ("ServeCatchUp", S.SHIM_STATE_READY, Busy.SERVE, False, "", "BUSY"),
    # Flip is admitted in any state (its handler says NOT_STAGED), so BUSY comes first.
    ("Flip", S.SHIM_STATE_PREPARED, Busy.JOIN, False, "", "BUSY"),
    ("Flip", S.SHIM_STATE_READY, None, False, "", None),
    # Flush runs beside a flip, a join or a serve; only an epoch makes it BUSY.
    ("Flush", S.SHIM_STATE_STAGED, Busy.FLIP, False, "", None),
    ("Flush", S.SHIM_STATE_READY, Busy.EPOCH, False, "", "BUSY"),
    # Describe and Abort are never refused.
    ("Describe", S.SHIM_STATE_BROKEN, Busy.EPOCH, True, "", None),
    ("Abort", S.SHIM_STATE_RECEIVING, Busy.EPOCH, True, "", None),
])
def test_the_first_refusal_that_holds_is_named(rpc, state, busy, draining, instance_id,
                                                expected):
    refused = refusal(rpc, state=state, busy=busy, draining=draining, instance_id=instance_id,
                      own_instance_id="me")
    assert (refused.reason if refused else None) == expected


@pytest.mark.parametrize("rpc,state,instance_id,version,expected", [
    # A stale version is named before the state: an epoch whose request an Abort overtook (the
    # shim is PREPARED then) must still say it was stale, not WRONG_STATE, which the driver
    # reads as its Abort's doing and names no one for.
    ("UpdateWeights", S.SHIM_STATE_PREPARED, "me", 3, "STALE_VERSION"),
    ("UpdateWeights", S.SHIM_STATE_PREPARED, "me", 4, "WRONG_STATE"),
    ("UpdateWeights", S.SHIM_STATE_READY, "me", 4, None),
    ("CatchUp", S.SHIM_STATE_CATCHING_UP, "", 2, "STALE_VERSION"),
    # ... but after the instance: a restarted shim's versions say nothing of the caller's.
    ("UpdateWeights", S.SHIM_STATE_READY, "old", 1, "MEMBERSHIP_CHANGED"),
    # Only the RPCs that carry a version to apply check it.
    ("Flip", S.SHIM_STATE_STAGED, "me", 1, None),
])
def test_a_stale_version_is_named_after_the_instance_and_before_the_state(
        rpc, state, instance_id, version, expected):
    # The shim applied version 2 and rolled back from 3.
    refused = refusal(rpc, state=state, busy=None, draining=False, instance_id=instance_id,
                      own_instance_id="me", version=version, applied=2, highest=3)
    assert (refused.reason if refused else None) == expected


def test_describe_when_empty(shim):
    sh = shim()
    d = sh.describe()
    assert d.state == S.SHIM_STATE_EMPTY and d.engine_kind == "reference"
    assert d.instance_id and d.weight_version == 0 and d.rank_offset == -1
    assert d.packing.buffer_size_bytes == 1 << 30 and d.packing.num_buffers == 2
    assert d.engine_healthy and not d.paused and d.weights_digest
    assert d.quantization == "none"  # it holds the bytes it is sent


def test_calls_in_the_wrong_state_are_refused(shim, closed_port):
    sh = shim(ReferenceEngine(model=None))
    assert refused(lambda: sh.stub.InitCollective(pb.InitCollectiveRequest(
        master_address="127.0.0.1", master_port=closed_port, world_size=2, rank_offset=1,
        backend=pb.BACKEND_GLOO, group_id="g", plan_digest="x"), timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
    assert refused(lambda: sh.stub.UpdateWeights(pb.UpdateWeightsRequest(
        version=1, plan_digest="x", group_id="g"), timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
    sh.stub.Prepare(prepare_request(tensors_v(1)), timeout=5)
    assert sh.describe().state == S.SHIM_STATE_PREPARED
    assert refused(lambda: sh.stub.UpdateWeights(pb.UpdateWeightsRequest(
        version=1, plan_digest="x", group_id="g"), timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")


@pytest.mark.parametrize("mutate,code,reason", [
    (lambda r: r.tensors.add(name="x", shape=[2]), grpc.StatusCode.INVALID_ARGUMENT,
     "UNSUPPORTED_DTYPE"),
    (lambda r: r.tensors.add(name="w", shape=[2], dtype=pb.D_TYPE_FLOAT32),
     grpc.StatusCode.INVALID_ARGUMENT, "DUPLICATE_NAME"),
    (lambda r: r.tensors.add(name="", shape=[2], dtype=pb.D_TYPE_FLOAT32),
     grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_NAME"),
    (lambda r: r.tensors.add(name="n", shape=[-2], dtype=pb.D_TYPE_FLOAT32),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_SHAPE"),
    (lambda r: r.tensors.add(name="big", shape=[1 << 40], dtype=pb.D_TYPE_FLOAT32),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "PLAN_TOO_LARGE"),
    (lambda r: setattr(r.packing, "buffer_size_bytes", 0),
     grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PACKING"),
    (lambda r: r.ClearField("tensors"), grpc.StatusCode.INVALID_ARGUMENT, "EMPTY_PLAN"),
])
def test_bad_plans_are_refused_and_change_nothing(shim, mutate, code, reason):
    sh = shim(ReferenceEngine(model=None))
    request = prepare_request(tensors_v(1))
    mutate(request)
    assert refused(lambda: sh.stub.Prepare(request, timeout=5)) == (code, reason)
    d = sh.describe()
    assert d.state == S.SHIM_STATE_EMPTY and d.plan_digest == ""


def test_model_engine_refuses_a_plan_it_cannot_load(shim):
    sh = shim()
    assert refused(lambda: sh.stub.Prepare(prepare_request(tensors_v(1)), timeout=5)) == \
        (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_TENSOR")


def test_init_collective_validation(shim, closed_port):
    sh = shim(ReferenceEngine(model=None), ShimConfig(allowed_master_networks=("127.0.0.0/8",)))
    digest = sh.stub.Prepare(prepare_request(tensors_v(1)), timeout=5).plan_digest

    def init(**kw):
        fields = dict(master_address="127.0.0.1", master_port=closed_port, world_size=2,
                      rank_offset=1, backend=pb.BACKEND_GLOO, group_id="g", plan_digest=digest)
        fields.update(kw)
        return refused(lambda: sh.stub.InitCollective(pb.InitCollectiveRequest(**fields),
                                                       timeout=5))

    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert init(plan_digest="nope") == (grpc.StatusCode.FAILED_PRECONDITION, "PLAN_DIGEST_MISMATCH")
    assert init(rank_offset=0) == (bad, "INVALID_RANK")
    assert init(rank_offset=2) == (bad, "INVALID_RANK")
    assert init(world_size=1, rank_offset=0) == (bad, "INVALID_WORLD_SIZE")
    assert init(backend=pb.BACKEND_UNSPECIFIED) == (bad, "INVALID_BACKEND")
    assert init(master_port=0) == (bad, "INVALID_MASTER_PORT")
    assert init(master_address="not-an-ip") == (bad, "INVALID_MASTER_ADDRESS")
    assert init(master_address="10.1.2.3") == \
        (grpc.StatusCode.FAILED_PRECONDITION, "MASTER_NOT_ALLOWED")
    assert init(group_id="") == (bad, "INVALID_GROUP_ID")
    if not torch.cuda.is_available():  # with CUDA, nccl is valid here and the join would start
        # Refused before ACCEPTED: the reference engine joins in this process, which has no GPU.
        msgs = []
        with pytest.raises(grpc.RpcError) as e:
            msgs.extend(sh.stub.InitCollective(pb.InitCollectiveRequest(
                master_address="127.0.0.1", master_port=closed_port, world_size=2,
                rank_offset=1, backend=pb.BACKEND_NCCL, group_id="g", plan_digest=digest),
                timeout=5))
        assert msgs == [] and reason_of(e.value) == (bad, "BACKEND_UNAVAILABLE")
    assert sh.describe().state == S.SHIM_STATE_PREPARED


def test_join_times_out_when_the_trainer_never_comes(shim, closed_port):
    sh = shim(ReferenceEngine(model=None))
    digest = sh.stub.Prepare(prepare_request(tensors_v(1)), timeout=5).plan_digest
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(sh.stub.InitCollective(pb.InitCollectiveRequest(
            master_address="127.0.0.1", master_port=closed_port, world_size=2, rank_offset=1,
            backend=pb.BACKEND_GLOO, group_id="g", plan_digest=digest), timeout=2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 6
    # The shim sees the cancellation a moment after the caller gives up.
    end = time.monotonic() + 5
    while sh.describe().state != S.SHIM_STATE_PREPARED and time.monotonic() < end:
        time.sleep(0.02)
    assert sh.describe().state == S.SHIM_STATE_PREPARED


def test_epoch_lifecycle_and_refusals(shim):
    sh = shim(ReferenceEngine(model=None))
    t1 = tensors_v(1)
    plan = RefitPlan.from_tensors(t1.items(), Packing(4096, 2))
    assert sh.stub.Prepare(prepare_request(t1), timeout=5).plan_digest == plan.digest
    group = join(sh, plan.digest)
    d = sh.describe()
    assert d.state == S.SHIM_STATE_READY and d.group_id == "g1" and d.rank_offset == 1

    def update(**kw):
        fields = dict(version=1, plan_digest=plan.digest, group_id="g1")
        fields.update(kw)
        return refused(lambda: sh.stub.UpdateWeights(pb.UpdateWeightsRequest(**fields), timeout=5))

    assert update(version=0) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_VERSION")
    assert update(plan_digest="x") == (grpc.StatusCode.FAILED_PRECONDITION, "PLAN_DIGEST_MISMATCH")
    assert update(group_id="other") == (grpc.StatusCode.FAILED_PRECONDITION, "GROUP_MISMATCH")
    assert sh.describe().state == S.SHIM_STATE_READY

    ep = full_epoch(sh, group, plan, t1, 1)
    phases = [m.phase for m in ep.messages]
    assert phases[0] == pb.UPDATE_WEIGHTS_PHASE_ACCEPTED
    assert phases[-1] == pb.UPDATE_WEIGHTS_PHASE_COMMITTED
    # PROGRESS: applied buckets in order, each at most once; a stream behind its receive gets
    # only the newest (COMMITTED says the rest).
    progress = [m.bucket_index for m in ep.messages if m.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS]
    assert progress == sorted(set(progress)) and set(progress) <= set(range(len(plan.buckets)))
    assert all(pb.UPDATE_WEIGHTS_PHASE_PROGRESS == p for p in phases[1:-1])
    assert ep.messages[-1].bytes_received == plan.total_bytes
    d = sh.describe()
    assert d.state == S.SHIM_STATE_READY and d.weight_version == 1
    from refit_grpc.plan import weights_digest
    assert d.weights_digest == weights_digest(t1.items())

    # Invariant 4: versions only move forward, refused before data moves.
    assert update(version=1) == (grpc.StatusCode.FAILED_PRECONDITION, "STALE_VERSION")
    assert sh.describe().weight_version == 1
    flushed = sh.stub.Flush(pb.FlushRequest(), timeout=5)
    assert flushed.resumed and flushed.cache_cleared and not sh.describe().paused
    group.close()


def test_failure_mid_epoch_breaks_and_flush_refuses_until_a_full_update(shim):
    sh = shim(ReferenceEngine(model=None))
    t1, t2, t3 = tensors_v(1), tensors_v(2), tensors_v(3)
    plan = RefitPlan.from_tensors(t1.items(), Packing(4096, 2))
    sh.stub.Prepare(prepare_request(t1), timeout=5)
    group = join(sh, plan.digest)
    full_epoch(sh, group, plan, t1, 1)

    # The trainer sends one bucket of version 2, then its group goes away.
    ep = Epoch(sh, 2, plan.digest)
    assert ep.accepted.wait(10)
    from refit_grpc.dataplane.packing import pack_into
    first = plan.buckets[0]
    buf = torch.empty(first.nbytes, dtype=torch.uint8)
    pack_into(buf, [t2[s.name] for s in plan.tensors[first.start:first.stop]])
    group.broadcast_async(buf, Deadline(10)).wait(Deadline(10), "first bucket")
    end = time.monotonic() + 10  # until the shim reports the bucket applied (PROGRESS)
    while not any(m.phase == pb.UPDATE_WEIGHTS_PHASE_PROGRESS for m in ep.messages):
        assert time.monotonic() < end
        time.sleep(0.01)
    group.close()
    ep.join()
    assert reason_of(ep.error)[0] == grpc.StatusCode.ABORTED
    d = sh.describe()
    # Invariant 1: partial weights are never served.
    assert d.state == S.SHIM_STATE_BROKEN and d.paused and d.weight_version == 1
    assert d.last_error
    assert refused(lambda: sh.stub.Flush(pb.FlushRequest(), timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "BROKEN")
    assert sh.describe().paused
    assert refused(lambda: sh.stub.UpdateWeights(pb.UpdateWeightsRequest(
        version=3, plan_digest=plan.digest, group_id="g1"), timeout=5)) == \
        (grpc.StatusCode.FAILED_PRECONDITION, "NO_GROUP")

    # Recovery: a new group and one full update.
    group = join(sh, plan.digest, "g2")
    assert sh.describe().state == S.SHIM_STATE_BROKEN
    ep = Epoch(sh, 3, plan.digest, "g2")
    assert ep.accepted.wait(10)
    Sender(group, plan).send(t3, Deadline(20))
    ep.join()
    assert ep.error is None
    from refit_grpc.plan import weights_digest
    d = sh.describe()
    assert d.state == S.SHIM_STATE_READY and d.weight_version == 3
    assert d.weights_digest == weights_digest(t3.items())
    assert sh.stub.Flush(pb.FlushRequest(), timeout=5).resumed
    group.close()


def test_abort_before_any_byte_keeps_weights_and_resumes(shim):
    sh = shim(ReferenceEngine(model=None))
    t1 = tensors_v(1)
    plan = RefitPlan.from_tensors(t1.items(), Packing(4096, 2))
    sh.stub.Prepare(prepare_request(t1), timeout=5)
    group = join(sh, plan.digest)
    full_epoch(sh, group, plan, t1, 1)
    sh.stub.Flush(pb.FlushRequest(), timeout=5)
    before = sh.describe().weights_digest
    ep = Epoch(sh, 2, plan.digest)
    assert ep.accepted.wait(10) and sh.describe().state == S.SHIM_STATE_RECEIVING
    t0 = time.monotonic()
    answer = sh.stub.Abort(pb.AbortRequest(reason="test"), timeout=5)
    ep.join()
    assert time.monotonic() - t0 < 2
    assert answer.epoch_aborted and answer.state == S.SHIM_STATE_PREPARED
    assert reason_of(ep.error)[0] == grpc.StatusCode.ABORTED
    d = sh.describe()
    assert d.state == S.SHIM_STATE_PREPARED and not d.paused and d.weights_digest == before
    assert "test" in d.last_error
    group.close()


def test_receive_watchdog_fires_at_the_deadline_without_a_driver(shim):
    sh = shim(ReferenceEngine(model=None), ShimConfig(max_epoch_s=1.5))
    t1 = tensors_v(1)
    plan = RefitPlan.from_tensors(t1.items(), Packing(4096, 2))
    sh.stub.Prepare(prepare_request(t1), timeout=5)
    group = join(sh, plan.digest)
    t0 = time.monotonic()
    ep = Epoch(sh, 1, plan.digest)  # no sender ever broadcasts
    ep.join()
    assert reason_of(ep.error)[0] == grpc.StatusCode.DEADLINE_EXCEEDED, ep.error.details()
    assert time.monotonic() - t0 < 4
    assert sh.describe().state == S.SHIM_STATE_PREPARED
    group.close()


def _generate(sh, prompt, n, out, key):
    stub = ref_pb_grpc.ReferenceEngineServiceStub(sh.channel)
    try:
        out[key] = stub.Generate(ref_pb.GenerateRequest(prompt=prompt, max_new_tokens=n),
                                 timeout=30)
    except grpc.RpcError as e:
        out[key] = e


def _wait_in_flight(sh, n: int = 1) -> None:
    """Until the engine has admitted `n` Generate calls: a fixed sleep races a loaded host."""
    end = time.monotonic() + 10
    while sh.engine.requests_in_flight < n:
        assert time.monotonic() < end, "the Generate call never reached the engine"
        time.sleep(0.005)


def test_flush_waits_for_inflight_requests_and_clears_the_prefix_cache(shim):
    sh = shim()
    out: dict = {}
    _generate(sh, [1, 2, 3], 2, out, "warm")
    _generate(sh, [1, 2, 3], 2, out, "cached")
    assert out["cached"].prefix_cache_hit
    slow = threading.Thread(target=_generate, args=(sh, [4, 5], 48, out, "inflight"))
    slow.start()
    _wait_in_flight(sh)
    flushed = sh.stub.Flush(pb.FlushRequest(mode=pb.PAUSE_MODE_WAIT), timeout=30)
    slow.join(30)
    assert flushed.cache_cleared and flushed.resumed
    assert not isinstance(out["inflight"], grpc.RpcError) and len(out["inflight"].tokens) == 48
    _generate(sh, [1, 2, 3], 2, out, "after")
    assert not out["after"].prefix_cache_hit
    assert list(out["after"].tokens) == list(out["warm"].tokens)


def test_flush_with_abort_mode_fails_inflight_requests(shim):
    sh = shim()
    out: dict = {}
    # Long enough that it cannot finish before the Flush lands (it is aborted at its next step).
    slow = threading.Thread(target=_generate, args=(sh, [4, 5], 100_000, out, "inflight"))
    slow.start()
    _wait_in_flight(sh)
    sh.stub.Flush(pb.FlushRequest(mode=pb.PAUSE_MODE_ABORT), timeout=30)
    slow.join(30)
    assert isinstance(out["inflight"], grpc.RpcError)
    assert reason_of(out["inflight"]) == (grpc.StatusCode.ABORTED, "REQUEST_ABORTED")
