"""The dynamo engine and Dynamo's discovery, without Dynamo: a local HTTP server answers as Dynamo
1.6.1 does (measured against the real one, tests/test_dynamo.py), so every mapping of an answer to
a typed error, the bodies the shim posts, and the discovery's membership logic run in seconds on
any machine."""

from __future__ import annotations

import datetime
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.driver.endpoint import WorkerEndpoint
from refit_grpc.errors import (
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    MembershipChangedError,
    RefitTimeoutError,
)
from refit_grpc.integrations.dynamo import DynamoDiscovery, ShimAddressing, read_workers
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.shim.engines import create_engine
from refit_grpc.shim.engines.dynamo import DynamoEngine
from refit_grpc.wire.dynamo import STAGE_RPC, join_limit_s, stage_status_key
from refit_grpc.wire.worker import STAGE_FAILED, STAGE_RECEIVING, STAGE_STAGED, StageStatus


class FakeDynamo:
    """`{url}/engine/<route>` and `/v1/rl/workers`; `replies[route]` is (status, body) or a
    callable of the request body; `"drop"` closes the connection without an answer."""

    def __init__(self):
        self.replies: dict = {}
        self.posted: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body):
                route = self.path.rsplit("/", 1)[-1] if self.path.startswith("/engine/") \
                    else self.path
                fake.posted.append((route, body))
                reply = fake.replies.get(route, (200, {"status": "ok"}))
                if callable(reply):
                    reply = reply(body)
                if reply == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                status, payload = reply
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(n) or b"{}"))

            def do_GET(self):  # noqa: N802
                self._answer(None)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    f = FakeDynamo()
    yield f
    f.close()


def plan() -> RefitPlan:
    return RefitPlan.from_tensors({"w": torch.zeros(4, 4), "b": torch.zeros(4)}.items(),
                                  Packing(32, 2))


def engine(fake: FakeDynamo, **options) -> DynamoEngine:
    return create_engine("dynamo", url=fake.url, packing=Packing(32, 2), abort_grace_s=0.5,
                         **options)


def error(message: str):
    return (200, {"status": "error", "message": message})


def test_status_pause_resume_flush_post_dynamos_routes(fake):
    e = engine(fake)
    assert e.status().healthy and e.world_size == 1 and e.kind == "dynamo"
    e.pause(PauseMode.WAIT, Deadline(5))
    assert e.status().paused
    assert e.reset_cache(Deadline(5))
    e.resume(Deadline(5))
    e.finish(7, Deadline(5))
    assert [r for r, _ in fake.posted] == ["liveness_probe", "pause_generation",
                                           "liveness_probe", "flush_cache",
                                           "resume_generation", "set_weight_version"]
    assert fake.posted[1][1] == {"mode": "wait", "clear_cache": True}
    assert fake.posted[-1][1] == {"weight_version": 7}
    fake.replies["liveness_probe"] = error("EngineCore dead")
    assert not e.status().healthy


def test_dynamos_http_200_errors_are_typed(fake):
    e = engine(fake)
    fake.replies["pause_generation"] = error("Invalid mode")
    with pytest.raises(FailedPreconditionError) as info:
        e.pause(PauseMode.KEEP, Deadline(5))
    assert info.value.reason == "ENGINE_ERROR" and "Invalid mode" in info.value.message
    fake.replies["resume_generation"] = (404, {"error": "Route not found"})
    with pytest.raises(FailedPreconditionError) as info:
        e.resume(Deadline(5))
    assert info.value.reason == "ENGINE_ROUTE_MISSING" and "--enable-rl" in info.value.message
    fake.replies["flush_cache"] = (400, {"error": "Invalid JSON"})
    with pytest.raises(InvalidArgumentError) as info:
        e.reset_cache(Deadline(5))
    assert info.value.reason == "ENGINE_REJECTED"
    fake.replies["update_weights_from_distributed"] = error(
        "Worker must be paused via pause_generation() before updating weights.")
    with pytest.raises(FailedPreconditionError) as info:
        e.receive(plan(), Deadline(5), lambda b: None)
    assert info.value.reason == "NOT_PAUSED"
    fake.replies["update_weights_from_distributed"] = error(
        "Call to collective_rpc method failed: Worker failed with error "
        "''CPUWorker' object has no attribute 'update_weights_from_path''")
    with pytest.raises(FailedPreconditionError) as info:
        e.receive(plan(), Deadline(5), lambda b: None)
    assert info.value.reason == "WEIGHT_TRANSFER_NOT_CONFIGURED"
    assert "--worker-extension-cls" in info.value.message


def test_a_failed_receive_with_nothing_applied_leaves_the_weights_whole(fake):
    e = engine(fake)
    fake.replies["update_weights_from_distributed"] = error(
        "Worker failed with error 'refit_grpc[applied=0/1] receive failed (CollectiveError: "
        "peer closed)'")
    with pytest.raises(CollectiveError) as info:
        e.receive(plan(), Deadline(5), lambda b: None)
    assert info.value.reason == "COLLECTIVE_FAILED" and not e.partial_on_failure
    fake.replies["update_weights_from_distributed"] = error(
        "Worker failed with error 'refit_grpc[applied=1/1] receive failed ...'")
    with pytest.raises(CollectiveError):
        e.receive(plan(), Deadline(5), lambda b: None)
    assert e.partial_on_failure  # a bucket reached the model: BROKEN in the shim
    update = fake.posted[-1][1]
    assert update["engine_rpc"] == "update_weights_from_path" and update["names"] == ["w", "b"]
    assert update["allow_unpaused"] is False and update["reset_prefix_cache"] is True
    assert update["plan_digest"] == plan().digest and 0 < update["timeout_s"] < 5


def test_the_join_is_bounded_below_dynamos_limit_and_a_timeout_names_it(fake):
    e = engine(fake, init_weights_timeout_s="10")
    fake.replies["init_weights_update_group"] = error(
        "Worker failed with error 'rendezvous at 127.0.0.1:1 timed out after 8.0s'")
    spec = GroupSpec("127.0.0.1", 29500, 2, 1, "gloo", "g")
    with pytest.raises(RefitTimeoutError) as info:
        e.init_transfer(spec, plan(), Deadline(60))
    assert info.value.reason == "RENDEZVOUS_TIMEOUT"
    assert "DYN_RL_INIT_WEIGHTS_TIMEOUT_S=10" in info.value.message
    (_, body), = [p for p in fake.posted if p[0] == "init_weights_update_group"]
    assert body["timeout_s"] == join_limit_s(10) == 8.0 and body["engine_rpc"] == \
        "init_broadcaster" and body["rank_offset"] == 1 and body["group_id"] == "g"
    # A short deadline is the worker's bound, not Dynamo's limit.
    fake.posted.clear()
    fake.replies["init_weights_update_group"] = (200, {"status": "ok"})
    e.init_transfer(spec, plan(), Deadline(4))
    (_, body), = [p for p in fake.posted if p[0] == "init_weights_update_group"]
    assert body["timeout_s"] < 4
    with pytest.raises(InvalidArgumentError) as info:
        e.check_backend("nccl")
    assert info.value.reason == "BACKEND_UNAVAILABLE"


def test_a_worker_gone_mid_join_is_unavailable_and_named_gone(fake):
    e = engine(fake)

    def shut_down(body):  # Dynamo's os._exit(1): the connection drops, nothing answers after
        fake.replies["liveness_probe"] = "drop"
        return "drop"

    fake.replies["init_weights_update_group"] = shut_down
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError) as info:
        e.init_transfer(GroupSpec("127.0.0.1", 29500, 2, 1, "gloo", "g"), plan(), Deadline(30))
    assert time.monotonic() - t0 < 5
    assert "is gone" in info.value.message and "DYN_RL_INIT_WEIGHTS_TIMEOUT_S" in \
        info.value.message
    assert not e.status().healthy


# --- staged epochs: the worker's statuses come through the trainer's TCPStore -----------------


@pytest.fixture
def trainer_store():
    """The trainer's TCPStore (rank 0's rendezvous master), where the workers publish."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    yield store


def staged_worker(fake: FakeDynamo, store, rank: int, outcome: dict, pace_s: float = 0.05):
    """The extension's side of a staged epoch, as Dynamo reaches it: the stage call answers at
    once (Dynamo's fixed body), a thread publishes the receive's statuses in the store."""
    n = len(plan().buckets)

    def publish(key: str) -> None:
        for landed in range(n + 1):
            store.set(key, json.dumps(StageStatus(rank, STAGE_RECEIVING, landed, n,
                                                  staging_bytes=plan().total_bytes).to_wire()))
            time.sleep(pace_s)
        store.set(key, json.dumps(StageStatus(rank, total=n, staging_bytes=plan().total_bytes,
                                              landed=outcome.get("landed", n),
                                              **{k: v for k, v in outcome.items()
                                                 if k != "landed"}).to_wire()))

    def update(body):
        if body.get("engine_rpc") == STAGE_RPC:
            key = stage_status_key(body["status_key"], rank)
            threading.Thread(target=publish, args=(key,), daemon=True).start()
        return (200, {"status": "ok", "version": "unknown", "version_declared": False})

    fake.replies["update_weights_from_distributed"] = update


def joined(fake: FakeDynamo, store) -> DynamoEngine:
    e = engine(fake)
    e.init_transfer(GroupSpec("127.0.0.1", store.port, 2, 1, "gloo", "g"), plan(), Deadline(5))
    return e


def test_a_stage_starts_unpaused_follows_the_store_and_the_flip_loads_the_copy(fake,
                                                                              trainer_store):
    e = joined(fake, trainer_store)
    assert e.capabilities.staging and e.staging_bytes == 0
    staged_worker(fake, trainer_store, 1, {"state": STAGE_STAGED, "digest": "ab" * 16})
    landed: list[int] = []
    fake.posted.clear()
    assert e.stage(plan(), Deadline(10), lambda b: landed.append(b.index)) == "ab" * 16
    assert landed == list(range(len(plan().buckets)))
    assert e.staging_bytes == plan().total_bytes
    (route, body), = fake.posted
    assert route == "update_weights_from_distributed"
    assert (body["engine_rpc"], body["allow_unpaused"], body["reset_prefix_cache"]) == \
        (STAGE_RPC, True, False)
    assert body["status_key"].startswith("refit_grpc/g/staged/")
    assert body["names"] == ["w", "b"] and body["plan_digest"] == plan().digest
    assert not e.status().paused  # nothing paused the worker

    fake.posted.clear()
    assert e.flip(3, Deadline(5)) == ""
    (_, flip), (_, version) = fake.posted
    assert (flip["engine_rpc"], flip["source"], flip["staged_digest"]) == \
        ("update_weights_from_path", "staged", "ab" * 16)
    assert flip["allow_unpaused"] is False and flip["reset_prefix_cache"] is True
    assert version == {"weight_version": 3}
    with pytest.raises(FailedPreconditionError) as info:
        e.flip(4, Deadline(5))
    assert info.value.reason == "NOT_STAGED"


def test_a_staged_receive_that_fails_is_typed_and_nothing_is_staged(fake, trainer_store):
    e = joined(fake, trainer_store)
    staged_worker(fake, trainer_store, 1, {"state": STAGE_FAILED, "landed": 1,
                                           "error": "ConnectionError: peer left",
                                           "reason": "COLLECTIVE_FAILED"})
    with pytest.raises(CollectiveError) as info:
        e.stage(plan(), Deadline(10), lambda b: None)
    assert info.value.reason == "COLLECTIVE_FAILED" and "rank 1 failed after 1/" in \
        info.value.message
    with pytest.raises(FailedPreconditionError):
        e.flip(2, Deadline(5))


def test_a_worker_without_the_staged_receive_is_staging_unsupported(fake, trainer_store):
    e = joined(fake, trainer_store)
    fake.replies["update_weights_from_distributed"] = error(
        "'Worker' object has no attribute 'refit_grpc_stage'")
    with pytest.raises(FailedPreconditionError) as info:
        e.stage(plan(), Deadline(5), lambda b: None)
    assert info.value.reason == "STAGING_UNSUPPORTED"


def test_an_abort_ends_a_stage_at_once_and_drop_posts_in_the_background(fake, trainer_store):
    e = joined(fake, trainer_store)
    staged_worker(fake, trainer_store, 1, {"state": STAGE_STAGED, "digest": "cd" * 16},
                  pace_s=1.0)
    errors: list = []

    def run():
        try:
            e.stage(plan(), Deadline(20), lambda b: None)
        except Exception as ex:  # noqa: BLE001
            errors.append(ex)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    e.abort_transfer()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 1.0
    (ex,) = errors
    assert isinstance(ex, EpochAbortedError) and ex.reason == "EPOCH_ABORTED", ex
    fake.posted.clear()
    t0 = time.monotonic()
    e.drop_staged()
    assert time.monotonic() - t0 < 0.1  # never blocks
    # The abort's own teardown post (destroy_weights_update_group) may land after the clear:
    # look for the drop among whatever was posted.
    deadline = time.monotonic() + 5
    drops: list = []
    while not drops and time.monotonic() < deadline:
        drops = [(r, b) for r, b in list(fake.posted) if r == "update_weights_from_distributed"]
        time.sleep(0.02)
    (route, body), = drops
    assert body == {"engine_rpc": "refit_grpc_drop_staged", "allow_unpaused": True,
                    "reset_prefix_cache": False}


def test_engine_url_must_be_loopback_unless_allowed():
    with pytest.raises(ValueError, match="loopback"):
        DynamoEngine("http://10.0.0.7:8081")
    assert create_engine("dynamo", url="http://10.0.0.7:8081",
                         allow_remote_engine="true").url == "http://10.0.0.7:8081"


# --- discovery --------------------------------------------------------------------------------


def record(instance_id: int, port: int, **extra) -> dict:
    return {"namespace": "dynamo", "component": "backend", "endpoint": "rl",
            "instance_id": instance_id, "system_url": f"http://10.0.0.{port % 250}:{port}",
            "model": "tiny", "routes": ["init_weights_update_group"], "world_size": 1, **extra}


def test_records_map_to_shims_by_convention_or_the_operators_mapping():
    r = record(1457942389742175166, 8081)
    assert WorkerEndpoint.from_metadata(r) == WorkerEndpoint("1457942389742175166",
                                                             "10.0.0.81:50051")
    assert WorkerEndpoint.from_metadata(r, shim_port=6000).address == "10.0.0.81:6000"
    assert ShimAddressing(overrides={"http://10.0.0.81:8081": "shim-a:1"}).address(r) == \
        "shim-a:1"
    assert ShimAddressing(overrides={"1457942389742175166": "shim-b:1"}).address(r) == \
        "shim-b:1"
    assert WorkerEndpoint.from_metadata({**r, "shim_address": "x:9"}).address == "x:9"
    with pytest.raises(ValueError):
        WorkerEndpoint.from_metadata({"instance_id": 3})


def test_discovery_validates_the_protocol_and_sees_every_change(fake):
    fake.replies["/v1/rl/workers"] = (200, {"protocol_version": 2, "workers": []})
    with pytest.raises(FailedPreconditionError, match="protocol_version 2"):
        read_workers(fake.url)
    workers = [record(11, 8081), record(22, 8082)]
    fake.replies["/v1/rl/workers"] = lambda _: (200, {"protocol_version": 1,
                                                      "namespace": "dynamo",
                                                      "workers": workers})
    discovery = DynamoDiscovery(fake.url)
    held = [{"instance_id": e.instance_id, "address": e.address}
            for e in discovery.endpoints()]
    assert held == [{"instance_id": "11", "address": "10.0.0.81:50051"},
                    {"instance_id": "22", "address": "10.0.0.82:50051"}]
    assert discovery.validate_workers(held) == held
    assert discovery.validate_workers(list(reversed(held))) == list(reversed(held))
    # Killed: Dynamo keeps the record a while, with an error and no system_url.
    workers[1] = {k: v for k, v in record(22, 8082).items() if k != "system_url"} | {
        "routes": [], "error": "Unavailable: TCP connection to 127.0.0.1:1 failed"}
    assert discovery.validate_workers(held) != held
    assert [e.instance_id for e in discovery.endpoints()] == ["11"]
    # Restarted: a new instance on the same system_url.
    workers[1] = record(33, 8082)
    now = discovery.validate_workers(held)
    assert [m["instance_id"] for m in now] == ["11", "22", "33"] and now[1]["address"] is None
    # Added.
    workers[1] = record(22, 8082)
    workers.append(record(44, 8083))
    assert len(discovery.validate_workers(held)) == 3
    # Unreadable: the fleet cannot tell, so it refuses.
    fake.replies["/v1/rl/workers"] = (503, {"error": "down"})
    with pytest.raises(MembershipChangedError, match="membership unknown"):
        discovery.validate_workers(held)
