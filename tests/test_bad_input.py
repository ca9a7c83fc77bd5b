"""Property-based bad input over every RPC and field: each gets the right status code with a
machine-readable reason, the shim stays SERVING, and its state does not change."""

from __future__ import annotations

import os
import string

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_rpc
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig

# Per property; `make fuzz` raises it (REFIT_FUZZ_EXAMPLES) to put over 10,000 inputs through.
EXAMPLES = int(os.environ.get("REFIT_FUZZ_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
KNOWN_REASONS = {
    "UNSUPPORTED_DTYPE", "EMPTY_NAME", "DUPLICATE_NAME", "INVALID_SHAPE", "EMPTY_PLAN",
    "INVALID_PACKING", "PLAN_TOO_LARGE", "INVALID_RANK", "INVALID_WORLD_SIZE",
    "INVALID_BACKEND", "BACKEND_UNAVAILABLE", "INVALID_MASTER_PORT", "INVALID_MASTER_ADDRESS",
    "MASTER_NOT_ALLOWED", "INVALID_GROUP_ID", "PLAN_DIGEST_MISMATCH", "INVALID_VERSION",
    "STALE_VERSION", "GROUP_MISMATCH", "INVALID_PAUSE_MODE",
}
tried: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def report_tried():
    yield
    print(f"\nbad inputs tried per RPC: {tried} (total {sum(tried.values())})")


def _snapshot(sh):
    d = sh.describe()
    return (d.state, d.plan_digest, d.group_id, d.weight_version, d.weights_digest, d.paused)


def _expect_refusal(sh, rpc: str, call, codes: set[grpc.StatusCode]):
    before = _snapshot(sh)
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if rpc in ("InitCollective", "UpdateWeights"):
            list(result)
    f = failure_from_rpc(WorkerEndpoint("x", "x"), e.value)
    assert f.code in codes, (rpc, f)
    assert f.reason in KNOWN_REASONS, (rpc, f)
    assert f.message
    assert _snapshot(sh) == before
    health = health_pb2_grpc.HealthStub(sh.channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    tried[rpc] = tried.get(rpc, 0) + 1


names = st.text(alphabet=string.ascii_letters + "._-/ \u00e9", max_size=12)
dims = st.integers(min_value=-3, max_value=1 << 40)
dtypes = st.one_of(st.sampled_from(list(pb.DType.values())), st.integers(-5, 60))
tensor_specs = st.tuples(names, st.lists(dims, max_size=4), dtypes)
packings = st.one_of(st.none(), st.tuples(st.integers(-5, 1 << 40), st.integers(-3, 8)))


@SETTINGS
@given(st.lists(tensor_specs, max_size=6), packings)
def test_prepare_garbage(ready_shim, specs, packing):
    sh = ready_shim.shim
    request = pb.PrepareRequest(
        tensors=[pb.TensorSpec(name=n, shape=s, dtype=d) for n, s, d in specs])
    if packing is not None:
        request.packing.CopyFrom(pb.Packing(buffer_size_bytes=packing[0], num_buffers=packing[1]))
    plan_ok = _valid_plan(request)
    if plan_ok:
        return  # a valid plan is a legitimate state change; this test is about refusals
    _expect_refusal(sh, "Prepare", lambda: sh.stub.Prepare(request, timeout=5),
                    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


def _valid_plan(request) -> bool:
    from refit_grpc.errors import RefitError
    from refit_grpc.plan import TensorSpec
    from refit_grpc.proto import DTYPE_FROM_PROTO

    if any(t.dtype not in DTYPE_FROM_PROTO for t in request.tensors):
        return False
    packing = Packing(request.packing.buffer_size_bytes, request.packing.num_buffers) \
        if request.HasField("packing") else Packing()
    plan = RefitPlan(tuple(TensorSpec(t.name, tuple(t.shape), DTYPE_FROM_PROTO[t.dtype])
                           for t in request.tensors), packing)
    try:
        plan.validate(1 << 30, 10_000)
    except RefitError:
        return False
    return True


bad_port = st.one_of(st.integers(-(1 << 31), 0), st.integers(65536, (1 << 31) - 1))
bad_address = st.one_of(st.text(max_size=20).filter(lambda s: not _is_ip(s)),
                        st.sampled_from(["10.1.2.3", "8.8.8.8", "192.168.0.1", "::2", "0.0.0.0"]))
bad_world = st.integers(-(1 << 31), 1)
bad_backend = st.one_of(st.just(pb.BACKEND_UNSPECIFIED), st.integers(3, 100))


def _is_ip(s: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(s).is_loopback
    except ValueError:
        return False


@SETTINGS
@given(st.data())
def test_init_collective_garbage(ready_shim, data):
    sh, plan = ready_shim.shim, ready_shim.plan
    fields = dict(master_address="127.0.0.1", master_port=29999, world_size=2, rank_offset=1,
                  backend=pb.BACKEND_GLOO, group_id="g-new", plan_digest=plan.digest)
    bad = {
        "master_address": bad_address,
        "master_port": bad_port,
        "world_size": bad_world,
        "rank_offset": st.one_of(st.integers(-(1 << 31), 0), st.integers(2, (1 << 31) - 1)),
        "backend": bad_backend,
        "group_id": st.just(""),
        "plan_digest": st.text(max_size=64).filter(lambda s: s != plan.digest),
    }
    for key in data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3,
                                  unique=True)):
        fields[key] = data.draw(bad[key])
    request = pb.InitCollectiveRequest(**fields)
    _expect_refusal(sh, "InitCollective", lambda: sh.stub.InitCollective(request, timeout=5),
                    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


@SETTINGS
@given(st.data())
def test_update_weights_garbage(ready_shim, data):
    sh, plan = ready_shim.shim, ready_shim.plan
    fields = dict(version=2, plan_digest=plan.digest, group_id="g1",
                  pause_mode=pb.PAUSE_MODE_KEEP)
    bad = {
        "version": st.integers(-(1 << 63), 1),  # 1 is the applied version: stale
        "plan_digest": st.text(max_size=64).filter(lambda s: s != plan.digest),
        "group_id": st.text(max_size=16).filter(lambda s: s != "g1"),
        "pause_mode": st.integers(4, 1000),
    }
    for key in data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3,
                                  unique=True)):
        fields[key] = data.draw(bad[key])
    request = pb.UpdateWeightsRequest(**fields)
    _expect_refusal(sh, "UpdateWeights", lambda: sh.stub.UpdateWeights(request, timeout=5),
                    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


@SETTINGS
@given(st.integers(4, 1 << 20))
def test_flush_garbage_mode(ready_shim, mode):
    sh = ready_shim.shim
    _expect_refusal(sh, "Flush", lambda: sh.stub.Flush(pb.FlushRequest(mode=mode), timeout=5),
                    {grpc.StatusCode.INVALID_ARGUMENT})


def test_message_over_the_size_limit_is_resource_exhausted():
    server = ShimServer(ReferenceEngine(model=None), ShimConfig(),
                        ServerOptions(address="127.0.0.1:0", max_message_bytes=64 * 1024)).start()
    try:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.RefitServiceStub(channel)
        request = pb.PrepareRequest(tensors=[pb.TensorSpec(name="x" * 1000 + str(i), shape=[1],
                                                           dtype=pb.D_TYPE_FLOAT32)
                                             for i in range(100)])
        with pytest.raises(grpc.RpcError) as e:
            stub.Prepare(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        d = stub.Describe(pb.DescribeRequest(), timeout=5)
        assert d.state == pb.SHIM_STATE_EMPTY
        channel.close()
    finally:
        server.stop(0)


def test_abort_and_describe_take_any_input():
    """Abort's reason is free text and Describe's one field a bool: any value is answered, the
    shim stays EMPTY and SERVING, and Describe reports the reason it was given."""
    server = ShimServer(ReferenceEngine(model=None), ShimConfig(),
                        ServerOptions(address="127.0.0.1:0")).start()
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.RefitServiceStub(channel)

    @SETTINGS
    @given(st.text(max_size=2000), st.booleans())
    def check(reason, skip_digest):
        answer = stub.Abort(pb.AbortRequest(reason=reason), timeout=5)
        assert (answer.state, answer.epoch_aborted) == (pb.SHIM_STATE_EMPTY, False)
        tried["Abort"] = tried.get("Abort", 0) + 1
        d = stub.Describe(pb.DescribeRequest(skip_weights_digest=skip_digest), timeout=5)
        assert d.state == pb.SHIM_STATE_EMPTY
        assert d.last_error == f"aborted: {reason or 'Abort called'}"
        tried["Describe"] = tried.get("Describe", 0) + 1

    try:
        check()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
        server.stop(0)
