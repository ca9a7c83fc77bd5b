"""Bad input over all nine RPCs of RefitService, every field, against a real reference shim on
loopback that holds a committed copy (docs/protocol.md, "Field limits").

Two kinds of input: valid-looking requests (the right plan digest, instance id and committed copy,
from Describe) with 1-3 fields pushed to values the shim must refuse, and garbage (every field
random, or bytes that may not even be the method's message). For each: no UNKNOWN or INTERNAL,
every refusal typed (an ErrorInfo reason of refit_grpc's domain), nothing changed in the engine
(state, version, weights digest, committed copy), no call outliving its deadline, the shim
SERVING. At the end the shim takes any Abort, serves, and its next staged epoch commits.

`make fuzz` raises REFIT_FUZZ_EXAMPLES (per property) to put over 10,000 inputs through; with -s
a table of the inputs per RPC and each reason seen is printed at the end.
"""

from __future__ import annotations

import ipaddress
import math
import os
import threading
import time
from collections import Counter, defaultdict

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from refit_grpc.common import (
    MAX_ENGINE_WORLD_SIZE,
    MAX_ID_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TENSOR_NAME_BYTES,
    MAX_VERSION,
    MAX_WORLD_SIZE,
    Deadline,
    digest_problem,
)
from refit_grpc.dataplane.staging import STAGED_CHECKSUM
from refit_grpc.dataplane.transfer import Sender
from refit_grpc.driver import WorkerEndpoint
from refit_grpc.driver.failures import failure_from_status
from refit_grpc.errors import ERROR_DOMAIN, RefitError
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.fields import plan_from_request
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig
from refit_grpc.testing.ports import unused_port

from support import join, prepare_request, tensors_v

# Per property; `make fuzz` raises it (REFIT_FUZZ_EXAMPLES) to put over 10,000 inputs through.
EXAMPLES = int(os.environ.get("REFIT_FUZZ_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
TIMEOUT_S = 5.0
RPCS = ("Describe", "Prepare", "InitCollective", "UpdateWeights", "UpdateEngines", "Flush",
        "Abort", "Flip", "FlipEngines", "ServeCatchUp", "CatchUp", "Rollback")
STREAMING = {"InitCollective", "UpdateWeights", "UpdateEngines", "ServeCatchUp"}
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)

tried: Counter[str] = Counter()
answers: defaultdict[str, Counter[str]] = defaultdict(Counter)
mutated: defaultdict[str, set[str]] = defaultdict(set)
findings: Counter[str] = Counter()  # inputs that failed a check (hypothesis' replays included)


class Rig:
    """A reference shim (metrics on) at version 1 through a staged epoch and its flip: READY,
    with a live group and a committed copy; the trainer's rank 0 is this process."""

    def __init__(self) -> None:
        config = ShimConfig(max_epoch_s=20, max_plan_bytes=1 << 30, max_plan_tensors=10_000)
        self.server = ShimServer(ReferenceEngine(model=None), config,
                                 ServerOptions(address="127.0.0.1:0", grace_s=1,
                                               metrics_address="127.0.0.1:0")).start()
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.RefitServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        assert self.server.metrics is not None and self.server.metrics.address
        self.own_ports = (self.server.port,
                          int(self.server.metrics.address.rsplit(":", 1)[1]))
        self.plan = RefitPlan.from_tensors(tensors_v(1).items(), Packing(4096, 2))
        self.stub.Prepare(prepare_request(tensors_v(1)), timeout=5)
        self.group_id = "g1"
        self.group = join(self, self.plan.digest, self.group_id)
        self.staged_epoch(1)
        d = self.describe()
        assert (d.state, d.weight_version, d.committed_copy_version) == \
            (pb.SHIM_STATE_READY, 1, 1), d
        self.instance_id = d.instance_id
        self.copy_digest = d.committed_copy_digest
        with unused_port() as port:
            self.closed_port = port  # nothing listens there (held only while looked up)

    def describe(self) -> pb.DescribeResponse:
        return self.stub.Describe(pb.DescribeRequest(), timeout=5)

    def staged_epoch(self, version: int) -> pb.FlipResponse:
        """Stage `version` of tensors_v through the live group, then flip to it."""
        box: dict = {}

        def read(call) -> None:
            try:
                box["messages"] = list(call)
            except grpc.RpcError as e:
                box["error"] = e

        call = self.stub.UpdateWeights(pb.UpdateWeightsRequest(
            version=version, plan_digest=self.plan.digest, group_id=self.group_id,
            pause_mode=pb.PAUSE_MODE_KEEP, mode=pb.EPOCH_MODE_STAGED), timeout=20)
        reader = threading.Thread(target=read, args=(call,), daemon=True)
        reader.start()
        time.sleep(0.05)
        Sender(self.group, self.plan).send(tensors_v(version), Deadline(20))
        reader.join(20)
        assert "error" not in box, box.get("error")
        staged = box["messages"][-1]
        assert staged.phase == pb.UPDATE_WEIGHTS_PHASE_STAGED, box["messages"]
        return self.stub.Flip(pb.FlipRequest(version=version, staged_digest=staged.staged_digest,
                                             instance_id=self.describe().instance_id),
                              timeout=20)

    def snapshot(self) -> tuple:
        d = self.describe()
        return (d.state, d.plan_digest, d.group_id, d.weight_version, d.weights_digest,
                d.paused, d.committed_copy_version, d.committed_copy_digest, d.staged_version,
                d.rank_offset)

    def close(self) -> None:
        self.group.close()
        self.channel.close()
        self.server.stop(1)


@pytest.fixture(scope="module")
def rig():
    r = Rig()
    yield r
    r.close()


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    width = max(len(r) for r in RPCS)
    lines = [f"\nbad input: {sum(tried.values())} inputs, {sum(findings.values())} findings "
             f"{dict(findings) or ''}",
             f"{'RPC':<{width}}  {'inputs':>7}  answers (OK, or the refusal's code/reason: count)"]
    for rpc in RPCS:
        seen = ", ".join(f"{k}: {n}" for k, n in answers[rpc].most_common())
        lines.append(f"{rpc:<{width}}  {tried[rpc]:>7}  {seen}")
    print("\n".join(lines))


def reason_of(error: grpc.RpcError) -> str | None:
    """The ErrorInfo reason (refit_grpc's domain) a refusal carries, or None."""
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info.reason
    return None


def call(rig: Rig, rpc: str, request, **kw) -> None:
    """Send one bad input (`_call`); a check it fails is a finding, counted and raised."""
    try:
        _call(rig, rpc, request, **kw)
    except AssertionError:
        findings[rpc] += 1
        raise


def _call(rig: Rig, rpc: str, request, *, ok: bool = False, raw: bool = False,
          changes_nothing: bool = True) -> None:
    """Send one bad input; `ok`: an answer is allowed (Describe, Abort, a Flush that happens
    to be valid). A refusal must be typed; the call must end within its deadline; the engine
    must be as it was, the shim SERVING."""
    before = rig.snapshot() if changes_nothing else None
    if raw:
        method = rig.channel.unary_stream if rpc in STREAMING else rig.channel.unary_unary
        stub = method(f"/refit_grpc.v1.RefitService/{rpc}")
    else:
        stub = getattr(rig.stub, rpc)
    t0 = time.monotonic()
    try:
        result = stub(request, timeout=TIMEOUT_S)
        if rpc in STREAMING:
            first = next(iter(result), None)
            result.cancel()
            raise AssertionError(f"{rpc} accepted a bad request: {first}")
        assert ok, f"{rpc} answered a bad request: {result}"
        answer = "OK"
    except grpc.RpcError as e:
        code = e.code()
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (rpc, e)
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{rpc} outlived its deadline: {e}"
        reason = reason_of(e)
        assert reason, f"{rpc}: a refusal without a reason: {code.name} {e.details()!r:.200}"
        assert e.details(), (rpc, reason)
        answer = f"{code.name}/{reason}"
    took = time.monotonic() - t0
    assert took < TIMEOUT_S, f"{rpc} took {took:.1f}s, past its {TIMEOUT_S}s deadline"
    if before is not None:
        assert rig.snapshot() == before, (rpc, request)
    health = rig.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    tried[rpc] += 1
    answers[rpc][answer] += 1


# --- values a field must refuse -----------------------------------------------------------------


def _over(limit_bytes: int, max_len: int = 70_000):
    """Strings over `limit_bytes` UTF-8 bytes, of 1- to 4-byte characters, up to 70,000 long."""
    return st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\u5b57", "\U0001f642"]),
                     st.integers(limit_bytes + 1, max_len)).filter(
        lambda s: len(s.encode()) > limit_bytes)


UNPRINTABLE = st.sampled_from(["\x00", "\n", "\r", "\t", "\x1b", "\x7f", "\u200b", "\u2028",
                               "\ufeff", "\ue000", "\U000e0001"])
with_unprintable = st.builds(lambda a, c, b: a + c + b, st.text(max_size=8), UNPRINTABLE,
                             st.text(max_size=8))
bad_id = st.one_of(_over(MAX_ID_BYTES), with_unprintable)  # an instance or group id
bad_group = st.one_of(st.just(""), bad_id)
bad_version = st.one_of(st.integers(INT64[0], 0), st.integers(MAX_VERSION + 1, INT64[1]))
bad_digest_shape = st.one_of(_over(64, 100_000), st.text(min_size=1, max_size=64).filter(
    lambda s: digest_problem(s) is not None))
other_digest = st.text(alphabet="0123456789abcdef", min_size=0, max_size=64)
bad_port = st.one_of(st.integers(INT32[0], 0), st.integers(65536, INT32[1]))
bad_enum = st.one_of(st.integers(INT32[0], -1), st.integers(4, INT32[1]))  # pause modes
bad_epoch_mode = st.one_of(st.integers(INT32[0], -1), st.integers(3, INT32[1]))
bad_backend = st.one_of(st.just(pb.BACKEND_UNSPECIFIED), st.integers(INT32[0], -1),
                        st.integers(3, INT32[1]))


def _not_allowed_ip(s: str) -> bool:
    try:
        return not ipaddress.ip_address(s).is_loopback or "%" in s
    except ValueError:
        return True


bad_address = st.one_of(
    st.just(""), _over(64, 70_000), st.text(max_size=40).filter(_not_allowed_ip),
    st.sampled_from(["0.0.0.0", "::", "255.255.255.255", "224.0.0.1", "ff02::1", "fe80::1%lo",
                     "10.1.2.3", "8.8.8.8", "::ffff:127.0.0.1", "127.0.0.1 ", " 127.0.0.1",
                     "localhost", "127.0.0.1:80", "127.1", "1.2.3.4.5", "::1%1"]))
bad_flip_timeout = st.one_of(st.floats(max_value=-1e-300, allow_infinity=True),
                             st.sampled_from([math.nan, math.inf, -math.inf]))
bad_canary = st.one_of(
    st.builds(lambda t: pb.Canary(token_ids=t), st.lists(st.integers(0, 10), max_size=1)),
    st.builds(lambda n: pb.Canary(token_ids=[1] * n), st.integers(4097, 6000)),
    st.builds(lambda t, i: pb.Canary(token_ids=t[:i] + [-1 - abs(t[i])] + t[i + 1:]),
              st.lists(st.integers(INT64[0] // 2, INT64[1]), min_size=2, max_size=8),
              st.integers(0, 1)),
    st.builds(lambda t, e: pb.Canary(token_ids=t, expected_logprobs=e),
              st.lists(st.integers(0, 100), min_size=2, max_size=8),
              st.lists(st.floats(allow_nan=True), min_size=1, max_size=9)).filter(
        lambda c: len(c.expected_logprobs) != len(c.token_ids) - 1
        or not all(math.isfinite(x) for x in c.expected_logprobs)))


def mutate(data, rpc: str, base: dict, bad: dict, free: dict | None = None) -> dict:
    """`base` with 1-3 of `bad`'s fields set to values the shim must refuse (and, at random,
    fields any value of which is valid set to one)."""
    fields = dict(base)
    for key in data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3,
                                  unique=True), label="mutated"):
        fields[key] = data.draw(bad[key], label=key)
        mutated[rpc].add(key)
    for key, strategy in (free or {}).items():
        if data.draw(st.booleans()):
            fields[key] = data.draw(strategy, label=key)
    return fields


def assert_every_field_fuzzed(rpc: str, request_type, unrefusable: set[str]) -> None:
    fields = {f.name for f in request_type.DESCRIPTOR.fields}
    assert fields - unrefusable - mutated[rpc] == set(), f"{rpc}: fields never fuzzed"


# --- valid-looking requests, fields mutated -------------------------------------------------


def test_init_collective(rig):
    base = dict(master_address="127.0.0.1", master_port=rig.closed_port, world_size=2,
                rank_offset=1, backend=pb.BACKEND_GLOO, group_id="g-new",
                plan_digest=rig.plan.digest)
    bad = {
        "master_address": bad_address,
        "master_port": st.one_of(bad_port, st.sampled_from(rig.own_ports)),
        "world_size": st.one_of(st.integers(INT32[0], 1),
                                st.integers(MAX_WORLD_SIZE + 1, INT32[1])),
        "rank_offset": st.one_of(st.integers(INT32[0], 0), st.integers(2, INT32[1])),
        "backend": bad_backend,
        "group_id": bad_group,
        "plan_digest": st.one_of(bad_digest_shape, other_digest),
    }

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "InitCollective", pb.InitCollectiveRequest(
            **mutate(data, "InitCollective", base, bad)))

    check()
    assert_every_field_fuzzed("InitCollective", pb.InitCollectiveRequest, set())


def update_weights_fuzz(rig: Rig) -> tuple[dict, dict, dict]:
    """UpdateWeights' base request (a staged epoch the rig would accept), the bad values of each
    field, and the fields whose every value is valid."""
    base = dict(version=2, plan_digest=rig.plan.digest, group_id=rig.group_id,
                pause_mode=pb.PAUSE_MODE_KEEP, instance_id=rig.instance_id,
                mode=pb.EPOCH_MODE_STAGED)
    bad = {
        "version": st.one_of(bad_version, st.just(1)),  # 1 is applied: stale
        "plan_digest": st.one_of(bad_digest_shape, other_digest),
        "group_id": st.one_of(bad_id, st.sampled_from(["", "g2"])),
        "pause_mode": bad_enum,
        "instance_id": st.one_of(bad_id, st.just("another-instance")),
        "canary": bad_canary,
        "mode": bad_epoch_mode,
        "flip_timeout_s": bad_flip_timeout,
        # Not the committed copy (1, its digest): out of range, or another version.
        "delta_base_version": st.one_of(bad_version.filter(bool), st.integers(2, MAX_VERSION)),
        "delta_base_digest": st.one_of(bad_digest_shape, other_digest.filter(
            lambda d: d and d != rig.copy_digest)),  # "" with no base version: a full epoch
        # Another checksum than the shim's (empty: not checked).
        "staged_checksum": st.text(min_size=1).filter(lambda c: c != STAGED_CHECKSUM),
        # The base epoch is staged: it never pauses, so it has nothing to resume.
        "resume_on_commit": st.just(True),
    }
    return base, bad, {"verify_weights": st.booleans(), "reversible": st.booleans()}


def test_update_weights(rig):
    base, bad, free = update_weights_fuzz(rig)

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "UpdateWeights", pb.UpdateWeightsRequest(**mutate(
            data, "UpdateWeights", base, bad, free)))

    check()
    assert_every_field_fuzzed("UpdateWeights", pb.UpdateWeightsRequest, set(free))


def test_update_engines(rig):
    """The same bad epochs through UpdateEngines, for the rig's own engine: the stream ends OK and
    carries the engine's end in-band, a typed refusal, before any ACCEPTED; nothing changes."""
    base, bad, free = update_weights_fuzz(rig)

    def ends(one: pb.UpdateWeightsRequest) -> list[bytes]:
        updates = [u for m in rig.stub.UpdateEngines(
            pb.UpdateEnginesRequest(engines=[one]), timeout=TIMEOUT_S) for u in m.updates]
        assert [u.ended for u in updates] == [True], updates
        return [updates[0].status]

    @SETTINGS
    @given(st.data())
    def check(data):
        one = pb.UpdateWeightsRequest(**mutate(data, "UpdateEngines", base, bad, free))
        in_band(rig, "UpdateEngines", one, pb.UpdateEnginesRequest(engines=[one]), ends)

    check()


def in_band(rig: Rig, rpc: str, one, request, ends) -> None:
    """One bad request for the rig's own engine through a carrier (`rpc`: UpdateEngines,
    FlipEngines): it must come back in-band (`ends(one)`: each engine's status), a typed refusal
    decoded as the engine's own call's would be (code and reason), and change nothing. A request
    naming another engine refuses the whole call (`call()` checks that)."""
    if one.instance_id != rig.instance_id:
        call(rig, rpc, request)
        return
    before = rig.snapshot()
    try:
        (status,) = ends(one)
        failure = failure_from_status(WorkerEndpoint(rig.instance_id, rig.server.address),
                                      status)
        assert status and failure.code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN,
                                               grpc.StatusCode.INTERNAL), failure
        assert failure.reason and failure.message, failure
        assert rig.snapshot() == before, one
    except AssertionError:
        findings[rpc] += 1
        raise
    tried[rpc] += 1
    answers[rpc][f"in-band {failure.code.name}/{failure.reason}"] += 1


def test_rollback(rig):
    """The rig's version came through the first staged epoch: no previous copy, so every
    Rollback is refused; the bad fields before that (the field checks, the instance)."""
    base = dict(version=1, instance_id=rig.instance_id, pause_mode=pb.PAUSE_MODE_KEEP)
    bad = {
        "version": st.one_of(bad_version, st.integers(2, MAX_VERSION)),  # 1 is served
        "to_version": st.one_of(bad_version.filter(bool), st.integers(1, MAX_VERSION)),
        "instance_id": st.one_of(bad_id, st.just("another-instance")),
        "pause_mode": bad_enum,
    }

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "Rollback", pb.RollbackRequest(**mutate(
            data, "Rollback", base, bad, {"stay_paused": st.booleans(),
                                          "verify_weights": st.booleans()})))

    check()
    assert_every_field_fuzzed("Rollback", pb.RollbackRequest, {"stay_paused", "verify_weights"})


def flip_fuzz(rig: Rig) -> tuple[dict, dict, dict]:
    """Flip's base request, the bad values of each field, the fields any value of is valid."""
    base = dict(version=2, staged_digest=rig.copy_digest, instance_id=rig.instance_id,
                pause_mode=pb.PAUSE_MODE_KEEP)
    bad = {
        "version": st.one_of(bad_version, st.integers(1, MAX_VERSION)),  # nothing is staged
        "staged_digest": st.one_of(bad_digest_shape, other_digest),
        "instance_id": st.one_of(bad_id, st.just("another-instance")),
        "pause_mode": bad_enum,
    }
    return base, bad, {"stay_paused": st.booleans(), "keep_cache": st.booleans()}


def test_flip(rig):
    base, bad, free = flip_fuzz(rig)

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "Flip", pb.FlipRequest(**mutate(data, "Flip", base, bad, free)))

    check()
    # keep_cache alone is valid with KEEP; with another pause mode it is refused
    # (INVALID_KEEP_CACHE, tests/test_keep_cache.py).
    assert_every_field_fuzzed("Flip", pb.FlipRequest, set(free))


def test_flip_engines(rig):
    """The same bad flips through FlipEngines, for the rig's own engine: the call answers OK with
    the engine's typed refusal in it; nothing changes."""
    base, bad, free = flip_fuzz(rig)

    def ends(one: pb.FlipRequest) -> list[bytes]:
        answer = rig.stub.FlipEngines(pb.FlipEnginesRequest(engines=[one]), timeout=TIMEOUT_S)
        assert [e.instance_id for e in answer.engines] == [one.instance_id], answer
        assert not answer.engines[0].HasField("flip"), answer
        return [answer.engines[0].status]

    @SETTINGS
    @given(st.data())
    def check(data):
        one = pb.FlipRequest(**mutate(data, "FlipEngines", base, bad, free))
        in_band(rig, "FlipEngines", one, pb.FlipEnginesRequest(engines=[one]), ends)

    check()


def test_serve_catch_up(rig):
    """The base request is one the shim would serve: each mutation alone must refuse it
    before anything listens."""
    base = dict(version=1, staged_digest=rig.copy_digest, plan_digest=rig.plan.digest,
                listen_address="127.0.0.1", group_id="cu-fuzz", instance_id=rig.instance_id,
                target_instance_id="newcomer", world_size=2)
    bad = {
        "version": st.one_of(bad_version, st.integers(2, MAX_VERSION)),
        "staged_digest": st.one_of(bad_digest_shape, other_digest.filter(
            lambda d: d != rig.copy_digest)),
        "plan_digest": st.one_of(bad_digest_shape, other_digest),
        "listen_address": bad_address,
        "group_id": bad_group,
        "instance_id": st.one_of(bad_id, st.just("another-instance")),
        "target_instance_id": bad_id,
        "world_size": st.one_of(st.integers(INT32[0], -1), st.just(1),
                                st.integers(MAX_ENGINE_WORLD_SIZE + 2, INT32[1]),
                                st.sampled_from([56655, 65536, INT32[1]])),
    }

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "ServeCatchUp", pb.ServeCatchUpRequest(**mutate(data, "ServeCatchUp", base,
                                                                   bad)))

    check()
    assert_every_field_fuzzed("ServeCatchUp", pb.ServeCatchUpRequest, set())


def test_catch_up(rig):
    """The base request would leave the group and connect: each mutation alone must refuse
    it before anything connects."""
    base = dict(version=2, staged_digest=rig.copy_digest, plan_digest=rig.plan.digest,
                master_address="127.0.0.1", master_port=rig.closed_port, group_id="cu-fuzz",
                instance_id=rig.instance_id, peer_instance_id="peer",
                pause_mode=pb.PAUSE_MODE_KEEP)
    bad = {
        "version": st.one_of(bad_version, st.just(1)),  # 1 is applied: stale
        "staged_digest": st.one_of(bad_digest_shape, st.just("")),
        "plan_digest": st.one_of(bad_digest_shape, other_digest),
        "master_address": bad_address,
        "master_port": st.one_of(bad_port, st.sampled_from(rig.own_ports)),
        "group_id": bad_group,
        "instance_id": st.one_of(bad_id, st.just("another-instance")),
        "peer_instance_id": bad_id,
        "pause_mode": bad_enum,
    }

    @SETTINGS
    @given(st.data())
    def check(data):
        call(rig, "CatchUp", pb.CatchUpRequest(**mutate(data, "CatchUp", base, bad)))

    check()
    assert_every_field_fuzzed("CatchUp", pb.CatchUpRequest, set())


def test_flush(rig):
    @SETTINGS
    @given(bad_enum)
    def check(mode):
        mutated["Flush"].add("mode")
        call(rig, "Flush", pb.FlushRequest(mode=mode))

    check()
    assert_every_field_fuzzed("Flush", pb.FlushRequest, set())


def test_prepare(rig):
    """The prepared plan with its tensors or packing mutated; a plan that is valid would be
    a legitimate change (and drop the group), so every mutation makes it invalid."""
    names = [t.name for t in prepare_request(tensors_v(1)).tensors]

    def tensor(name="w", shape=(4, 4), dtype=pb.D_TYPE_FLOAT32):
        return pb.TensorSpec(name=name, shape=list(shape), dtype=dtype)

    bad = {
        "name": st.one_of(_over(MAX_TENSOR_NAME_BYTES), with_unprintable, st.just(""),
                          st.sampled_from(names[1:])),  # a duplicate of another tensor's
        "shape": st.one_of(
            st.lists(st.integers(INT64[0], 0), min_size=1, max_size=4),  # negative or zero
            st.lists(st.integers(2, 4), min_size=MAX_TENSOR_DIMS + 1, max_size=200),
            st.lists(st.integers(1 << 20, INT64[1]), min_size=2, max_size=4)),  # too large
        "dtype": st.one_of(st.integers(INT32[0], -1),
                           st.integers(max(pb.DType.values()) + 1, INT32[1]),
                           st.just(pb.D_TYPE_UNSPECIFIED)),
        "tensors": st.sampled_from([0, 10_001]),
        "buffer_size_bytes": st.integers(INT64[0], 0),
        "num_buffers": st.integers(INT32[0], 0),
        # Any adapter: malformed (INVALID_ADAPTER: name, config, tensors that are not LoRA
        # factors) or not one the reference engine serves (ADAPTER_UNSUPPORTED).
        "adapter": st.tuples(st.one_of(st.text(max_size=300), st.just("tenant")),
                             st.one_of(st.text(max_size=200),
                                       st.just('{"r": 8, "target_modules": ["q_proj"]}'))),
    }

    @SETTINGS
    @given(st.data())
    def check(data):
        request = prepare_request(tensors_v(1))
        keys = data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3,
                                  unique=True))
        for key in sorted(keys, key=lambda k: k == "tensors"):  # the whole list last
            value = data.draw(bad[key], label=key)
            mutated["Prepare"].add(key)
            first = request.tensors[0]
            if key == "name":
                first.name = value
            elif key == "shape":
                del first.shape[:]
                first.shape.extend(value)
            elif key == "dtype":
                first.dtype = value
            elif key == "tensors":
                del request.tensors[:]
                request.tensors.extend(tensor(f"t{i}") for i in range(value))
            elif key == "buffer_size_bytes":
                request.packing.buffer_size_bytes = value
            elif key == "adapter":
                request.adapter.name, request.adapter.peft_config_json = value
            else:
                request.packing.num_buffers = value
        call(rig, "Prepare", request)

    check()
    assert {"name", "shape", "dtype", "tensors", "buffer_size_bytes", "num_buffers",
            "adapter"} <= mutated["Prepare"]


# --- garbage ------------------------------------------------------------------------------------


def _garbage(descriptor, depth: int = 0):
    """Any message of `descriptor`'s type: every field random over its whole type."""
    fd = descriptor.fields_by_name
    parts = {}
    for name, f in fd.items():
        if f.type == f.TYPE_STRING:
            s = st.one_of(st.text(max_size=80), _over(64, 20_000), st.just(""))
        elif f.type in (f.TYPE_INT32, f.TYPE_ENUM):
            s = st.integers(*INT32)
        elif f.type == f.TYPE_INT64:
            s = st.integers(*INT64)
        elif f.type == f.TYPE_BOOL:
            s = st.booleans()
        elif f.type == f.TYPE_DOUBLE:
            s = st.floats(allow_nan=True)
        elif f.type == f.TYPE_MESSAGE and depth < 2:
            s = _garbage(f.message_type, depth + 1)
        else:
            continue
        if f.is_repeated:
            s = st.lists(s, max_size=4)
        parts[name] = st.one_of(st.none(), s)
    cls = getattr(pb, descriptor.name)
    return st.fixed_dictionaries(parts).map(
        lambda kw: cls(**{k: v for k, v in kw.items() if v is not None}))


GARBAGE = {rpc: _garbage(getattr(pb, f"{rpc}Request").DESCRIPTOR) for rpc in RPCS
           if rpc not in ("Abort", "Describe")}  # any Abort is valid; Describe: one bool


def _would_change_state(rig: Rig, rpc: str, request) -> bool:
    """Garbage that happens to be a valid request may change the state legitimately: a new
    plan, a Flush (which answers), nothing else in practice (every other RPC needs the right
    digests, which garbage does not hit)."""
    if rpc != "Prepare":
        return False
    try:
        plan = plan_from_request(request, rig.server.servicer.config.max_plan_tensors)
        plan.validate(1 << 30, 10_000)
    except RefitError:
        return False
    return True


def test_garbage_requests(rig):
    @SETTINGS
    @given(st.data())
    def check(data):
        rpc = data.draw(st.sampled_from(sorted(GARBAGE)), label="rpc")
        request = data.draw(GARBAGE[rpc], label="request")
        assume(not _would_change_state(rig, rpc, request))
        call(rig, rpc, request, ok=rpc == "Flush")

    check()


def test_garbage_bytes(rig):
    """Bytes that may not even be the method's message: MALFORMED_REQUEST, never INTERNAL."""

    @SETTINGS
    @given(st.sampled_from(sorted(GARBAGE)),
           st.one_of(st.binary(max_size=200),
                     st.sampled_from([b"\x0a\x02\xff\xfe", b"\x12\x03\xc3\x28a", b"\xff" * 20,
                                      b"\x08" + b"\xff" * 10])))
    def check(rpc, raw):
        request = getattr(pb, f"{rpc}Request")
        try:
            assume(not _would_change_state(rig, rpc, request.FromString(raw)))
        except Exception:  # noqa: BLE001  (not a message: the point of the test)
            pass
        call(rig, rpc, raw, raw=True, ok=rpc == "Flush")

    check()


# --- the shim's own bounds ------------------------------------------------------------------


def idle(server: ShimServer) -> bool:
    """Whether every admitted call gave its slot back (a call's slot is freed just after its
    status went out, so wait a little)."""
    end = time.monotonic() + 5
    while server.admission.in_flight and time.monotonic() < end:
        time.sleep(0.01)
    return server.admission.in_flight == 0


def test_a_message_over_the_limit_is_message_too_large():
    server = ShimServer(ReferenceEngine(model=None), ShimConfig(),
                        ServerOptions(address="127.0.0.1:0", max_message_bytes=64 * 1024)).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RefitServiceStub(channel)
            request = pb.PrepareRequest(tensors=[
                pb.TensorSpec(name="x" * 1000 + str(i), shape=[1], dtype=pb.D_TYPE_FLOAT32)
                for i in range(100)])
            with pytest.raises(grpc.RpcError) as e:
                stub.Prepare(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason_of(e.value) == "MESSAGE_TOO_LARGE", e.value
            assert stub.Describe(pb.DescribeRequest(), timeout=5).state == pb.SHIM_STATE_EMPTY
            assert idle(server)
    finally:
        server.stop(0)


def test_too_many_calls_is_its_own_reason_and_every_slot_comes_back():
    """Past `max_concurrent_rpcs` in flight: RESOURCE_EXHAUSTED with reason TOO_MANY_CALLS;
    health is not counted; once the calls are done (or cancelled) every slot is free again."""
    server = ShimServer(ReferenceEngine(model=None), ShimConfig(),
                        ServerOptions(address="127.0.0.1:0", max_concurrent_rpcs=2)).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.RefitServiceStub(channel)
            seen: Counter[str] = Counter()
            for _ in range(20):
                calls = [stub.Describe.future(pb.DescribeRequest(), timeout=10)
                         for _ in range(40)]
                calls[-1].cancel()
                for c in calls[:-1]:
                    try:
                        c.result()
                        seen["OK"] += 1
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.CANCELLED:
                            continue
                        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                        reason = reason_of(e)
                        assert reason == "TOO_MANY_CALLS", e
                        seen[reason] += 1
                if seen["TOO_MANY_CALLS"]:
                    break
            assert seen["OK"] and seen["TOO_MANY_CALLS"], seen
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                               timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert idle(server)
            stub.Describe(pb.DescribeRequest(), timeout=5)
            print(f"\n40 concurrent Describes x {sum(seen.values()) // 40 + 1} rounds on a "
                  f"bound of 2: {dict(seen)}")
    finally:
        server.stop(0)


# --- last: any Abort, then the shim serves and its next epoch commits ----------------------------


def test_abort_and_describe_take_any_input(rig):
    """Abort's reason is free text (kept up to 1024 characters, escaped) and Describe's one
    field a bool: any value is answered. An Abort drops the group (that is what it is for),
    never the version, the weights or the committed copy."""
    before = rig.snapshot()

    @SETTINGS
    @given(st.one_of(st.text(max_size=2000), _over(1024, 100_000), with_unprintable),
           st.booleans())
    def check(reason, skip_digest):
        call(rig, "Abort", pb.AbortRequest(reason=reason), ok=True, changes_nothing=False)
        d = rig.describe()
        assert d.last_error.startswith("aborted: ") and len(d.last_error) < 1200, d.last_error
        call(rig, "Describe", pb.DescribeRequest(skip_weights_digest=skip_digest), ok=True)

    check()
    after = rig.snapshot()
    keep = slice(3, 9)  # version, weights digest, paused, committed copy, staged
    assert after[keep] == before[keep]
    assert after[0] == pb.SHIM_STATE_PREPARED and after[2] == ""


def test_the_shim_serves_on_and_the_next_epoch_commits(rig):
    rig.group.close()
    rig.group_id = "g2"
    rig.group = join(rig, rig.plan.digest, rig.group_id)
    flip = rig.staged_epoch(2)
    d = rig.describe()
    assert (d.state, d.weight_version, d.committed_copy_version, flip.version) == \
        (pb.SHIM_STATE_READY, 2, 2, 2), d
    assert d.committed_copy_digest != rig.copy_digest
    assert idle(rig.server)
    engine = rig.server.engine
    assert isinstance(engine, ReferenceEngine)
    for name, value in tensors_v(2).items():
        assert torch.equal(engine.tensor(name), value), name
