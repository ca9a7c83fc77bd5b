"""The vLLM engine adapter's HTTP edge, without vLLM: an engine that is gone, one that accepts and
never answers, and scripted answers for the error mapping. Nothing here may hang: every case has
a bound it must beat. (What vLLM itself does is proven against a real server in
test_vllm_engine.py; these run everywhere, vLLM installed or not.)"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import (
    Code,
    CollectiveError,
    EngineUnavailableError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidPlanError,
    RefitError,
    RefitTimeoutError,
)
from refit_grpc.plan import Packing, RefitPlan, TensorSpec
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.engines import create_engine
from refit_grpc.shim.engines.vllm import VLLMEngine
from refit_grpc.shim.process import spawn_shim
from refit_grpc.wire.worker import applied_marker

PLAN = RefitPlan((TensorSpec("model.norm.weight", (8,), torch.float32),),
                 Packing(16, 2))
SPEC = GroupSpec("127.0.0.1", 29999, 2, 1, "gloo", "refit-test")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server():
    """Accepts connections and reads requests, never answers (a frozen engine)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conns.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in conns:
        c.close()
    listener.close()


class Scripted:
    """A stand-in for vLLM's routes: answers (status, body) per path, records every request. A
    path in `held` is read and never answered (until close): an engine frozen inside that call."""

    def __init__(self):
        self.answers: dict[str, list[tuple[int, object]]] = {}
        self.requests: list[tuple[str, object]] = []
        self.held: set[str] = set()
        self.released = threading.Event()  # set by close(): held calls end unanswered
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                path = self.path.split("?")[0]
                outer.requests.append((self.path, body))
                if path in outer.held:
                    outer.released.wait(60)
                    self.close_connection = True
                    return
                queue = outer.answers.get(path) or [(200, {})]
                status, reply = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p.split("?")[0] for p, _ in self.requests]

    def close(self):
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted():
    s = Scripted()
    yield s
    s.close()


def test_engine_url_must_be_loopback_unless_allowed():
    with pytest.raises(ValueError, match="loopback"):
        VLLMEngine("http://10.1.2.3:8000")
    create_engine("vllm", url="http://10.1.2.3:8000", allow_remote_engine="true")
    assert create_engine("vllm", url="http://localhost:8000").kind == "vllm"


def test_a_dead_engine_is_unhealthy_and_unavailable_at_once():
    engine = VLLMEngine(f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    status = engine.status()
    assert not status.healthy
    with pytest.raises(EngineUnavailableError) as e:
        engine.pause(PauseMode.KEEP, Deadline(10))
    assert e.value.code == Code.UNAVAILABLE
    assert time.monotonic() - t0 < 2.0


def test_a_frozen_engine_never_hangs_a_call(silent_server):
    engine = VLLMEngine(silent_server, request_timeout_s=1.0, status_timeout_s=0.5,
                        abort_grace_s=0.2)
    t0 = time.monotonic()
    assert not engine.status().healthy
    assert time.monotonic() - t0 < 1.5
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="did not answer"):
        engine.resume(Deadline(30))  # the cap, not the caller's 30 s: the engine is not answering
    assert 0.9 < time.monotonic() - t0 < 3.0
    t0 = time.monotonic()
    with pytest.raises(RefitTimeoutError):
        engine.reset_cache(Deadline(0.6))  # the caller's deadline comes first: DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2.0


def test_abort_cuts_a_blocked_join_short(scripted):
    # The engine answers the shutdown that precedes every join, then freezes inside the join.
    scripted.held.add("/init_weight_transfer_engine")
    engine = VLLMEngine(scripted.url, request_timeout_s=5.0, abort_grace_s=0.2)
    errors: list[BaseException] = []
    deadline = Deadline(30)

    def join() -> None:
        try:
            engine.init_transfer(SPEC, PLAN, deadline)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=join)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    deadline.cancel.set()  # what the service's Abort does
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 1.5
    assert isinstance(errors[0], EpochAbortedError)
    assert scripted.paths() == ["/shutdown_weight_transfer_engine", "/init_weight_transfer_engine"]


def test_error_mapping_and_what_is_posted(scripted):
    engine = VLLMEngine(scripted.url, abort_grace_s=0.2)
    scripted.answers["/sleep"] = [(404, {"detail": "Not Found"})]
    with pytest.raises(FailedPreconditionError) as e:
        engine.pause(PauseMode.WAIT, Deadline(5))
    assert e.value.reason == "ENGINE_ROUTE_MISSING"
    # vLLM's scheduler pause without /pause's fixed 20 ms sleep
    assert scripted.requests[-1][0] == "/sleep?level=0&mode=wait"

    # then the caches, the parked requests' blocks included, as /pause?clear_cache=true did;
    # the workers did not say whether the model is multimodal, so those caches go as well
    del scripted.answers["/sleep"]
    scripted.answers["/reset_prefix_cache"] = [(200, {"success": True})]
    engine.pause(PauseMode.KEEP, Deadline(5))
    assert engine.pause_clears_cache
    # the reset runs beside the next call to the paused engine; the resume waits for it
    engine.resume(Deadline(5))
    assert [p for p, _ in scripted.requests[-5:]] == [
        "/sleep?level=0&mode=keep",
        "/reset_prefix_cache?reset_running_requests=true&reset_external=true",
        "/reset_mm_cache", "/reset_encoder_cache", "/wake_up?tags=scheduling"]
    engine.pause(PauseMode.KEEP, Deadline(5), keep_cache=True)  # a flip that keeps them
    assert scripted.requests[-1][0] == "/sleep?level=0&mode=keep"
    engine.resume(Deadline(5))
    assert scripted.requests[-1][0] == "/wake_up?tags=scheduling"
    # a connector's cache vLLM could not reset fails the pause, as /pause?clear_cache=true did:
    # at the resume, which then wakes nothing, or at the next pause
    scripted.answers["/reset_prefix_cache"] = [(200, {"success": False}), (200, {"success": False})]
    engine.pause(PauseMode.KEEP, Deadline(5))
    with pytest.raises(RefitError, match="connector") as e:
        engine.resume(Deadline(5))
    assert e.value.reason == "ENGINE_REJECTED"
    assert scripted.requests[-1][0] == "/reset_encoder_cache"
    engine.pause(PauseMode.KEEP, Deadline(5))
    with pytest.raises(RefitError, match="connector") as e:
        engine.pause(PauseMode.KEEP, Deadline(5))
    assert e.value.reason == "ENGINE_REJECTED"

    # resume is level 0's wake-up; an engine whose memory someone put to sleep is not resumed
    scripted.answers["/wake_up"] = [(200, {"status": "sleeping", "tags": ["scheduling"]})]
    with pytest.raises(FailedPreconditionError, match="asleep"):
        engine.resume(Deadline(5))
    assert scripted.requests[-1][0] == "/wake_up?tags=scheduling"

    scripted.answers["/init_weight_transfer_engine"] = [
        (500, {"error": {"message": "Worker failed with error 'Timed out waiting 5000ms'"}})]
    with pytest.raises(RefitTimeoutError) as e:
        engine.init_transfer(SPEC, PLAN, Deadline(10))
    assert e.value.reason == "RENDEZVOUS_TIMEOUT"
    path, body = scripted.requests[-1]
    assert path == "/init_weight_transfer_engine"
    info = body["init_info"]
    assert (info["rank_offset"], info["world_size"], info["group_id"]) == (1, 2, "refit-test")
    assert (info["packed_buffer_size_bytes"], info["packed_num_buffers"]) == (16, 2)
    assert 0 < info["timeout_s"] < 10
    assert scripted.paths()[-2] == "/shutdown_weight_transfer_engine"


def test_a_receive_that_failed_with_nothing_applied_leaves_the_weights_intact(scripted):
    engine = VLLMEngine(scripted.url)
    scripted.answers["/update_weights"] = [
        (500, {"error": {"message": f"{applied_marker(0, 1)} receive failed (peer closed)"}}),
        (500, {"error": {"message": f"{applied_marker(1, 3)} receive failed (peer closed)"}}),
        (200, {"message": "Weights updated"})]
    with pytest.raises(CollectiveError):
        engine.receive(PLAN, Deadline(5), lambda b: None)
    assert not engine.partial_on_failure  # rolled back with nothing loaded
    with pytest.raises(CollectiveError):
        engine.receive(PLAN, Deadline(5), lambda b: None)
    assert engine.partial_on_failure  # a bucket reached the model: BROKEN
    buckets = []
    engine.receive(PLAN, Deadline(5), buckets.append)
    assert buckets == list(PLAN.buckets)
    engine.finish(7, Deadline(5))
    assert scripted.requests[-1] == ("/finish_weight_update", {"weight_version": "7"})
    update = next(b for p, b in scripted.requests if p == "/update_weights")["update_info"]
    assert update["plan_digest"] == PLAN.digest and update["names"] == ["model.norm.weight"]


def test_a_stale_weight_update_session_is_ended_before_a_new_one(scripted):
    engine = VLLMEngine(scripted.url)
    scripted.answers["/start_weight_update"] = [
        (500, {"error": {"message": "start_weight_update called while a weight update is "
                                    "already active. Call finish_weight_update first."}}),
        (200, {})]
    engine.receive(PLAN, Deadline(5), lambda b: None)
    assert scripted.paths()[:4] == ["/start_weight_update", "/finish_weight_update",
                                    "/start_weight_update", "/update_weights"]


def test_nccl_refuses_a_plan_vllms_nccl_receiver_cannot_unpack():
    engine = VLLMEngine(f"http://127.0.0.1:{closed_port()}")
    plan = RefitPlan((TensorSpec("a", (3,), torch.int8), TensorSpec("b", (2,), torch.float32)),
                     Packing(1 << 20, 2))
    nccl = GroupSpec("127.0.0.1", 29999, 2, 1, "nccl", "g")
    with pytest.raises(InvalidPlanError) as e:  # before any call to the (dead) engine
        engine.init_transfer(nccl, plan, Deadline(5))
    assert e.value.reason == "UNALIGNED_FOR_NCCL" and "'b'" in e.value.message


def test_check_plan_uses_the_checkpoint_names(tmp_path):
    header = {"model.norm.weight": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(32))
    engine = VLLMEngine("http://127.0.0.1:1", checkpoint_dir=str(tmp_path))
    engine.check_plan(PLAN)
    with pytest.raises(InvalidPlanError) as e:
        engine.check_plan(RefitPlan((TensorSpec("model.nope", (8,), torch.float32),)))
    assert e.value.reason == "UNKNOWN_TENSOR"
    with pytest.raises(InvalidPlanError) as e:
        engine.check_plan(RefitPlan((TensorSpec("model.norm.weight", (9,), torch.float32),)))
    assert e.value.reason == "TENSOR_MISMATCH"


def _checkpoint(directory, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of zeros: name -> (safetensors dtype, shape)."""
    sizes = {"F32": 4, "BF16": 2, "I8": 1, "F8_E4M3": 1}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw
                                                  + bytes(offset))


def test_check_plan_refuses_a_dtype_the_engine_would_load_as_garbage(tmp_path):
    """Floating dtypes cast (fp32 masters into bf16, or into an engine that quantizes online);
    integer values into a floating parameter, or trained values into a pre-quantized one, are
    refused at Prepare, named, with what to send instead."""
    _checkpoint(tmp_path, {"w": ("BF16", [4, 8]), "q": ("F8_E4M3", [4, 8])})
    engine = VLLMEngine("http://127.0.0.1:1", checkpoint_dir=str(tmp_path))
    engine._quantization = "fp8_per_channel"  # as the workers would say (engine_info)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        engine.check_plan(RefitPlan((TensorSpec("w", (4, 8), dtype),)))
    engine.check_plan(RefitPlan((TensorSpec("q", (4, 8), torch.float8_e4m3fn),)))
    with pytest.raises(InvalidPlanError) as e:
        engine.check_plan(RefitPlan((TensorSpec("w", (4, 8), torch.int8),)))
    assert e.value.reason == "TENSOR_MISMATCH" and "'w'" in e.value.message, e.value
    assert "online (fp8_per_channel)" in e.value.message and "bf16" in e.value.message
    with pytest.raises(InvalidPlanError) as e:
        engine.check_plan(RefitPlan((TensorSpec("q", (4, 8), torch.bfloat16),)))
    assert e.value.reason == "TENSOR_MISMATCH" and "pre-quantized as F8_E4M3" in e.value.message


def test_a_shim_whose_engine_is_gone_reports_not_serving_and_unavailable():
    shim = spawn_shim("--engine", "vllm", "--engine-url", f"http://127.0.0.1:{closed_port()}",
                      "--instance-id", "vllm-gone")
    try:
        with grpc.insecure_channel(shim.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="refit_grpc.v1.RefitService"), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = pb_grpc.RefitServiceStub(channel)
            d = stub.Describe(pb.DescribeRequest(), timeout=5)
            assert d.engine_kind == "vllm" and not d.engine_healthy
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Flush(pb.FlushRequest(mode=pb.PAUSE_MODE_WAIT), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 3
    finally:
        shim.stop()


# --- staged epochs: the stage's polling and what it makes of the workers' answers -------------


def _workers(*statuses: dict) -> tuple[int, dict]:
    """/collective_rpc's answer: one result per worker."""
    return 200, {"results": list(statuses)}


def _w(rank: int, state: str, landed: int, digest: str = "", **extra) -> dict:
    return {"rank": rank, "state": state, "landed": landed, "total": 3, "digest": digest,
            "staging_bytes": 96, **extra}


STAGED_PLAN = RefitPlan(tuple(TensorSpec(f"model.layers.{i}.w", (8,), torch.float32)
                              for i in range(3)), Packing(16, 2))


# The workers' answer to a flip whose staged copy was dropped behind the shim's back.
NOTHING_STAGED = (500, {"error": {"message": (
    f"{applied_marker(0, 3)} load of the staged copy failed (RuntimeError: nothing is staged); "
    "rolled back (0 partly loaded layers restored, weights unchanged)")}})


def _infos(flip_in_one_call: bool, flip_in_loop: bool = False) -> tuple[int, dict]:
    """Two workers' `WorkerInfo`: the first question of a stage (no status() asked it yet)."""
    return _workers(*[{"quantization": "none", "flip_in_one_call": flip_in_one_call,
                       "flip_in_loop": flip_in_loop}] * 2)


def test_a_stage_reports_buckets_as_every_worker_lands_them_and_flips_from_the_copy(scripted):
    """Two workers (TP=2): a bucket is reported once both landed it, the digest once both
    staged the same. Workers that cannot flip in one call (a LoRA engine's, an older
    worker's): the flip is a weight-update session naming the staged copy, no abort key."""
    engine = VLLMEngine(scripted.url)
    assert engine.capabilities.staging
    scripted.answers["/collective_rpc"] = [
        _infos(False),
        _workers(_w(1, "receiving", 0), _w(2, "receiving", 0)),
        _workers(_w(1, "receiving", 2), _w(2, "receiving", 1)),
        _workers(_w(1, "staged", 3, "d" * 64), _w(2, "staged", 3, "d" * 64))]
    buckets = []
    assert engine.stage(STAGED_PLAN, Deadline(10), buckets.append) == "d" * 64
    assert buckets == list(STAGED_PLAN.buckets)
    assert engine.staging_bytes == 2 * 96
    ops = [b["kwargs"]["op"] for p, b in scripted.requests if p == "/collective_rpc"]
    assert ops == ["engine_info", "stage", "stage_status", "stage_status"]
    start = next(b for p, b in scripted.requests
                 if p == "/collective_rpc" and b["kwargs"]["op"] == "stage")
    assert start["method"] == "weight_transfer_engine"
    assert json.loads(start["kwargs"]["payload"])["plan_digest"] == STAGED_PLAN.digest
    assert not engine.partial_on_failure and not engine.is_paused()

    scripted.requests.clear()
    engine.flip(5, Deadline(10))
    assert scripted.paths() == ["/start_weight_update", "/update_weights",
                                "/finish_weight_update"]
    update = scripted.requests[1][1]["update_info"]
    assert (update["source"], update["staged_digest"]) == ("staged", "d" * 64)
    assert "abort_key" not in update
    assert scripted.requests[2][1] == {"weight_version": "5"}
    with pytest.raises(FailedPreconditionError) as e:  # consumed: nothing staged any more
        engine.flip(6, Deadline(10))
    assert e.value.reason == "NOT_STAGED"


def test_workers_that_can_flip_in_one_call_get_one_call_and_the_version_beside_it(scripted):
    """The flip is one POST /collective_rpc "flip" (the workers' whole session) with the
    version set beside it (POST /update_weight_version); one that fails with nothing applied
    leaves the weights intact and sets vLLM's version label back to what it was."""
    engine = VLLMEngine(scripted.url)
    scripted.answers["/weight_info"] = [(200, {"weight_version": "4"})]
    staged = _workers(_w(1, "staged", 3, "d" * 64), _w(2, "staged", 3, "d" * 64))
    scripted.answers["/collective_rpc"] = [_infos(True), staged]
    assert engine.stage(STAGED_PLAN, Deadline(10), lambda b: None) == "d" * 64
    scripted.requests.clear()
    engine.flip(5, Deadline(10))
    assert sorted(scripted.paths()) == ["/collective_rpc", "/update_weight_version"]
    (flip,) = [b for p, b in scripted.requests if p == "/collective_rpc"]
    assert flip["kwargs"]["op"] == "flip"
    update = json.loads(flip["kwargs"]["payload"])
    assert (update["source"], update["staged_digest"], update["version"]) == \
        ("staged", "d" * 64, 5)
    assert "abort_key" not in update
    assert ("/update_weight_version", {"new_version": "5"}) in scripted.requests
    assert not engine.partial_on_failure

    scripted.answers["/collective_rpc"] = [staged, NOTHING_STAGED]
    assert engine.stage(STAGED_PLAN, Deadline(10), lambda b: None) == "d" * 64
    scripted.requests.clear()
    with pytest.raises(RefitError, match="nothing is staged"):
        engine.flip(6, Deadline(10))
    assert not engine.partial_on_failure  # rolled back with nothing loaded
    # the label went to 6 beside the load, and back to 5 once it failed
    labels = [b["new_version"] for p, b in scripted.requests if p == "/update_weight_version"]
    assert labels == ["6", "5"], labels


def test_an_engine_loop_that_flips_in_one_turn_gets_one_call_and_nothing_else(scripted):
    """Where the EngineCore says it flips in one turn (`WorkerInfo.flip_in_loop`), the flip is
    one POST /collective_rpc "flip" carrying the `LoopFlip` (version label, cache reset): no
    pause, no resume, no label route. Its answer is the loop's timing. One that fails leaves
    the engine paused (its loop paused it) and nothing set back by the shim: the loop did."""
    engine = VLLMEngine(scripted.url)
    assert not engine.capabilities.flip_in_loop  # unknown until the workers were asked
    staged = _workers(_w(1, "staged", 3, "d" * 64), _w(2, "staged", 3, "d" * 64))
    scripted.answers["/collective_rpc"] = [
        _infos(True, flip_in_loop=True), staged,
        (200, {"results": [{"loop_flip": {"stall_s": 0.004, "load_s": 0.003}}]})]
    assert engine.stage(STAGED_PLAN, Deadline(10), lambda b: None) == "d" * 64
    assert engine.capabilities.flip_in_loop
    scripted.requests.clear()
    times = engine.flip_in_loop(5, False, Deadline(10))
    assert (times.stall_s, times.load_s) == (0.004, 0.003)
    assert scripted.paths() == ["/collective_rpc"]
    (flip,) = [b for _, b in scripted.requests]
    assert flip["kwargs"]["op"] == "flip"
    assert json.loads(flip["kwargs"]["loop_flip"]) == \
        {"weight_version": "5", "reset_caches": True, "multimodal": False}
    assert json.loads(flip["kwargs"]["payload"])["staged_digest"] == "d" * 64
    assert not engine.is_paused() and not engine.partial_on_failure

    # An answer without the loop's timing (the turn succeeded: HTTP 200) is not a failure: the
    # round trip stands for the stall.
    scripted.answers["/collective_rpc"] = [staged, (200, {"results": [None, None]})]
    assert engine.stage(STAGED_PLAN, Deadline(10), lambda b: None) == "d" * 64
    times = engine.flip_in_loop(6, False, Deadline(10))
    assert 0 < times.stall_s == times.load_s < 10
    assert not engine.is_paused()

    scripted.answers["/collective_rpc"] = [staged, NOTHING_STAGED]
    assert engine.stage(STAGED_PLAN, Deadline(10), lambda b: None) == "d" * 64
    scripted.requests.clear()
    with pytest.raises(RefitError, match="nothing is staged"):
        engine.flip_in_loop(7, True, Deadline(10))
    assert json.loads(scripted.requests[0][1]["kwargs"]["loop_flip"])["reset_caches"] is False
    assert scripted.paths() == ["/collective_rpc"]
    assert engine.is_paused() and not engine.partial_on_failure


@pytest.mark.parametrize("answers, error, reason", [
    ([_workers(_w(1, "staged", 3, "a" * 64), _w(2, "staged", 3, "b" * 64))],
     CollectiveError, "RECEIVE_FAILED"),
    ([_workers(_w(1, "receiving", 1), _w(2, "failed", 1, error="CollectiveError: receive of "
                                         "bucket 1/3: peer failed", reason="COLLECTIVE_FAILED"))],
     CollectiveError, "COLLECTIVE_FAILED"),
    ([_workers(_w(1, "failed", 0, error="RefitTimeoutError: receive of bucket 0/3: deadline "
                                        "exceeded", reason="DEADLINE_EXCEEDED"))],
     RefitTimeoutError, "DEADLINE_EXCEEDED"),
    ([(500, {"error": {"message": "Worker failed with error ''NCCLWeightTransferEngine' object "
                                  "is not callable'"}})],
     FailedPreconditionError, "STAGING_UNSUPPORTED"),
])
def test_a_stage_that_fails_anywhere_fails_typed_and_stages_nothing(scripted, answers, error,
                                                                     reason):
    engine = VLLMEngine(scripted.url)
    scripted.answers["/collective_rpc"] = answers
    with pytest.raises(error) as e:
        engine.stage(STAGED_PLAN, Deadline(10), lambda b: None)
    assert e.value.reason == reason, e.value
    with pytest.raises(FailedPreconditionError) as refused:
        engine.flip(1, Deadline(5))
    assert refused.value.reason == "NOT_STAGED"
    assert not engine.partial_on_failure


def test_drop_staged_and_abort_never_block_and_end_the_poll(scripted):
    """A stage polling a receive that never completes: abort_transfer ends it at its next poll;
    drop_staged returns at once even when the engine does not answer it."""
    engine = VLLMEngine(scripted.url, request_timeout_s=2.0)
    scripted.answers["/collective_rpc"] = [_workers(_w(1, "receiving", 0))]
    failed: list[BaseException] = []

    def stage() -> None:
        try:
            engine.stage(STAGED_PLAN, Deadline(30), lambda b: None)
        except BaseException as e:  # noqa: BLE001  (asserted below)
            failed.append(e)

    t = threading.Thread(target=stage, daemon=True)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    engine.abort_transfer()
    scripted.held.add("/collective_rpc")  # the drop's call is never answered
    engine.drop_staged()
    assert time.monotonic() - t0 < 0.2
    t.join(5)
    assert not t.is_alive() and isinstance(failed[0], EpochAbortedError), failed
    # The teardown is posted from a background thread: on a loaded machine it may land after
    # the stage has already failed, so wait for it (bounded) rather than expect it at once.
    until = time.monotonic() + 5
    while ("/shutdown_weight_transfer_engine" not in scripted.paths()
           and time.monotonic() < until):
        time.sleep(0.02)
    assert "/shutdown_weight_transfer_engine" in scripted.paths()


def test_check_adapter_fits_each_lora_factor_to_its_base_weight(tmp_path):
    """lora_A is [r, in] and lora_B [out, r] for the base weight [out, in]; other shapes are
    refused at Prepare (INVALID_ADAPTER), before vLLM could drop the old adapter for it."""
    from refit_grpc.plan import AdapterSpec
    from refit_grpc.shim.engines.checkpoint import CheckpointIndex

    _checkpoint(tmp_path, {"model.layers.0.q_proj.weight": ("F32", [16, 8])})
    index = CheckpointIndex.read(tmp_path)
    assert index is not None
    spec = AdapterSpec.of("t", {"r": 4, "target_modules": ["q_proj"]})
    a, b = ("base_model.model.model.layers.0.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.q_proj.lora_B.weight")

    def plan(a_shape, b_shape):
        return RefitPlan.from_state_dict_info({a: (a_shape, "float32"), b: (b_shape, "float32")},
                                              adapter=spec)

    index.check_adapter(plan((4, 8), (16, 4)))
    for a_shape, b_shape, needle in (((4, 9), (16, 4), "lora_A is [r, 8]"),
                                     ((4, 8), (15, 4), "lora_B is [16, r]"),
                                     ((2, 8), (16, 2), "r in [4]")):
        with pytest.raises(InvalidPlanError) as e:
            index.check_adapter(plan(a_shape, b_shape))
        assert e.value.reason == "INVALID_ADAPTER" and needle in e.value.message, e.value
