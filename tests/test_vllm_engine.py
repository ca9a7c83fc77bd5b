"""A real vLLM behind the shim: the session's shared CPU vLLM server of the tiny model (restarted
once, and handed back to the session), a real `refit-grpc shim --engine vllm` process in front of
it, and `Fleet` as the trainer's driver.

Order matters and is the file's order: refits, a stale version, a peer's refusal, a trainer gone
before the first byte, an operator's Abort, Flush on a busy engine, the cycle timing, and last
the crash (it kills the module's server and restarts it on the same port).
"""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from support import fleet_mid_epoch, info
from vllm_support import require_vllm, tiny_model_dir
from vllm_support.servers import module_pool

require_vllm()

# The first test may start the session's vLLM server (about a minute), the last restarts it.
pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

from refit_grpc import (  # noqa: E402
    EpochFailedError,
    EpochRefusedError,
    Fleet,
    InPlace,
    WorkerEndpoint,
)
from refit_grpc.common import Deadline  # noqa: E402
from refit_grpc.errors import RefitError  # noqa: E402
from refit_grpc.proto import pb, pb_grpc  # noqa: E402
from refit_grpc.shim.process import spawn_shim  # noqa: E402
from refit_grpc.testing.harness import VLLM  # noqa: E402
from refit_grpc.testing.vllm import (  # noqa: E402
    PROMPT,
    complete,
    hf_greedy,
    http_json,
    load_hf_model,
)

BUFFER = 256 * 1024  # the 1.7 MB model in 5 buckets
EPOCH_S = 60.0
GEN = 12


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with module_pool(tmp_path_factory, "vllm-logs") as pool:
        yield pool


@pytest.fixture(scope="module")
def rig(pool, vllm_servers):
    return pool.rig("vllm-0", tiny_model_dir(), buffer_size_bytes=BUFFER,
                    epoch_timeout_s=EPOCH_S,
                    server=vllm_servers.server(tiny_model_dir())).ready()


@pytest.fixture(scope="module")
def server(rig):
    return rig.server


@pytest.fixture(scope="module")
def shim(rig):
    proc = rig.shim
    yield proc
    assert proc.stop() is not None
    assert proc.proc.poll() is not None


@pytest.fixture
def fleet(rig):
    fleet = rig.new_fleet()
    (d,) = fleet.describe()
    if d.state == pb.SHIM_STATE_BROKEN or d.paused:  # say so now, not after a long timeout
        pytest.fail(f"an earlier test left the engine {pb.ShimState.Name(d.state)}, "
                    f"paused={d.paused}: {d.last_error}")
    yield fleet
    fleet.close()


@pytest.fixture(scope="module")
def trainer():
    """The trainer's model (transformers), and what the engine holds: {"version", "weights"}."""
    model = load_hf_model(tiny_model_dir())
    return {"model": model, "version": 0, "weights": {k: v.clone() for k, v in
                                                       model.state_dict().items()}}


def new_weights(base: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for n, t in base.items()}


def expected_tokens(trainer, weights: dict, prompt=PROMPT, n: int = GEN) -> list[int]:
    model = trainer["model"]
    model.load_state_dict(weights)
    return hf_greedy(model, prompt, n)


def assert_serving_the_old_version(server, d: pb.DescribeResponse, trainer) -> None:
    """After an epoch that moved no byte: the shim is PREPARED at the last committed version,
    the engine healthy and resumed, and vLLM still generates from the old weights."""
    assert (d.state, d.weight_version, d.paused, d.engine_healthy) == \
        (pb.SHIM_STATE_PREPARED, trainer["version"], False, True), d
    assert http_json("GET", server.url, "/is_paused")[1] == {"is_paused": False}
    assert complete(server.url, PROMPT, GEN)["token_ids"] == \
        expected_tokens(trainer, trainer["weights"])


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="refit_grpc.v1.RefitService"),
                          timeout=5).status


def wait_health(address: str, want: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if health(address) == want:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"shim health is {health(address)}, not {want}, after {timeout_s}s")


def test_fleet_refits_versions_and_vllm_generates_like_transformers(server, fleet, trainer):
    assert complete(server.url, PROMPT, GEN)["token_ids"] == \
        expected_tokens(trainer, trainer["weights"])  # the same checkpoint on both sides
    plan = fleet.prepare(info(trainer["model"].state_dict()))
    assert len(plan.buckets) > 1
    link = fleet.connect("127.0.0.1")
    seen = []
    try:
        for _ in range(3):
            version = trainer["version"] + 1
            weights = new_weights(trainer["weights"], seed=version)
            report = fleet.refit(link, weights)
            assert report.version == version and report.bytes == plan.total_bytes
            trainer["version"], trainer["weights"] = version, weights
            got = complete(server.url, PROMPT, GEN)["token_ids"]
            assert got == expected_tokens(trainer, weights), f"version {version}"
            (d,) = fleet.describe()
            assert (d.weight_version, d.state, d.engine_kind) == \
                (version, pb.SHIM_STATE_READY, "vllm")
            assert d.engine_healthy and not d.paused
            assert http_json("GET", server.url, "/weight_info")[1] == \
                {"weight_version": str(version)}
            seen.append(got)
            print(f"v={version}: epoch {report.seconds:.3f}s, tokens {got}")
    finally:
        link.close()
    assert len({tuple(s) for s in seen}) >= 2, "the weights changed but the tokens never did"


def test_stale_version_is_refused_before_any_byte_and_old_weights_keep_serving(
        server, fleet, trainer):
    assert trainer["version"] >= 1, "runs after the refit test"
    fleet.prepare(info(trainer["model"].state_dict()))
    link = fleet.connect("127.0.0.1")
    with pytest.raises(EpochRefusedError) as refused:
        fleet.refit(link, new_weights(trainer["weights"], seed=999), version=trainer["version"])
    assert refused.value.reasons == {"STALE_VERSION"}
    link.close()
    assert_serving_the_old_version(server, fleet.describe()[0], trainer)


def test_a_peer_refusing_the_epoch_leaves_the_vllm_engine_serving_its_weights(
        server, shim, fleet, trainer):
    """The vLLM shim accepts and blocks in /update_weights; a second worker refuses (stale
    version); the fleet aborts. No byte reached vLLM, its gloo backend rolled the session back
    (`applied=0`), so the shim returns to PREPARED and resumes the engine: not BROKEN."""
    other = spawn_shim("--engine", "reference", "--model", "none", "--instance-id", "ref-ahead",
                       "--buffer-size-bytes", str(BUFFER), "--num-buffers", "2")
    shapes = info(trainer["model"].state_dict())
    try:
        ahead = Fleet([WorkerEndpoint(other.instance_id, other.address)], epoch_timeout_s=30)
        ahead.prepare(shapes)
        link = ahead.connect("127.0.0.1")
        ahead.refit(link, trainer["weights"], version=trainer["version"] + 50,
                    epoch=InPlace(flush=False))
        link.close()
        ahead.close()
        both = Fleet([WorkerEndpoint(shim.instance_id, shim.address),
                      WorkerEndpoint(other.instance_id, other.address)],
                     control_timeout_s=30, join_timeout_s=60, epoch_timeout_s=EPOCH_S)
        try:
            both.prepare(shapes)
            link = both.connect("127.0.0.1")
            with pytest.raises(EpochRefusedError) as refused:
                both.refit(link, new_weights(trainer["weights"], seed=4242),
                           version=trainer["version"] + 1)
            assert [f.instance_id for f in refused.value.failures] == ["ref-ahead"]
            assert refused.value.reasons == {"STALE_VERSION"}
            d = both.describe()[0]
        finally:
            both.close()
    finally:
        other.stop()
    assert_serving_the_old_version(server, d, trainer)


def test_a_trainer_gone_before_the_first_byte_leaves_the_weights_intact(server, fleet, trainer):
    """The shim is inside /update_weights when the trainer's end of the group closes, before any
    byte: vLLM's worker fails the receive, the gloo backend rolls its session back with
    `refit_grpc[applied=0/N]`, and the shim, reading that, resumes the engine (PREPARED)."""
    link, handle = fleet_mid_epoch(fleet, trainer["weights"], trainer["version"] + 1)
    time.sleep(1.5)  # the shim posts /start_weight_update and /update_weights within ms
    t0 = time.monotonic()
    link.close()  # the trainer is gone; no byte was broadcast
    with pytest.raises(EpochFailedError) as failed:
        handle.result()
    (failure,) = failed.value.failures
    assert failure.reason == "COLLECTIVE_FAILED" and "applied=0/" in failure.message, failure
    print(f"epoch failed {time.monotonic() - t0:.2f}s after the trainer left: {failure}")
    assert_serving_the_old_version(server, fleet.describe()[0], trainer)


def test_an_operator_abort_reaches_the_worker_while_the_trainer_stays_connected(
        server, shim, fleet, trainer):
    """The trainer joined and stalls (sends nothing, keeps its end open). An operator's Abort
    must still free the engine: the shim sets the receive's abort key in the trainer's store,
    the worker gives up at once and rolls back, and the engine serves its weights again."""
    link, handle = fleet_mid_epoch(fleet, trainer["weights"], trainer["version"] + 1)
    time.sleep(1.5)  # the shim is inside /update_weights
    t0 = time.monotonic()
    try:
        with grpc.insecure_channel(shim.address) as channel:
            reply = pb_grpc.RefitServiceStub(channel).Abort(pb.AbortRequest(reason="operator"),
                                                            timeout=10)
        took = time.monotonic() - t0
        assert reply.epoch_aborted and reply.state == pb.SHIM_STATE_PREPARED, reply
        assert took < 3.0, f"Abort took {took:.2f}s"
        with pytest.raises(EpochFailedError) as failed:
            handle.result()
    finally:
        link.close()
    (failure,) = failed.value.failures
    assert failure.code == grpc.StatusCode.ABORTED, failure
    print(f"operator Abort answered in {took:.2f}s: {failure}")
    assert_serving_the_old_version(server, fleet.describe()[0], trainer)


def test_flush_wait_on_a_busy_engine_finishes_requests_and_empties_the_prefix_cache(
        server, shim, fleet):
    url = server.url
    long_prompt = [(7 * i + 3) % 500 + 3 for i in range(150)]  # > one 128-token block
    complete(url, long_prompt, 2)
    assert complete(url, long_prompt, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    results: list[tuple[dict, float]] = []
    errors: list[BaseException] = []

    def generate(i: int) -> None:
        try:
            out = complete(url, [(11 * i + j) % 500 + 3 for j in range(40)], 160)
            results.append((out, time.monotonic()))
        except BaseException as e:  # noqa: BLE001  (asserted below)
            errors.append(e)

    # Requests in flight when Flush comes. On 2 busy cores a /metrics scrape can take longer
    # than four short generations, so a batch may finish unobserved (measured once in a
    # fresh-clone run): then a new batch, up to three.
    for _ in range(3):
        results.clear()
        threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        if _wait_running(url, at_least=1, timeout_s=30,
                         finished=lambda batch=threads: not any(t.is_alive() for t in batch)):
            break
        for t in threads:
            t.join(120)
    else:
        raise AssertionError(f"no request seen running on {url} in three batches")
    t_flush = time.monotonic()
    with grpc.insecure_channel(shim.address) as channel:
        reply = pb_grpc.RefitServiceStub(channel).Flush(
            pb.FlushRequest(mode=pb.PAUSE_MODE_WAIT), timeout=60)
    t_flushed = time.monotonic()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 4
    for out, _ in results:
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 160
    # WAIT drained them: Flush answered once the engine had finished every in-flight request
    # (their HTTP answers trail the engine by the API server's output processing: a few ms on
    # a quiet host, 0.5 s measured once beside other tests on 2 cores, so the bound is loose).
    # Under KEEP they would have finished only after the resume, a whole generation later.
    last = max(done for _, done in results)
    print(f"Flush(WAIT) took {t_flushed - t_flush:.2f}s; last request answered "
          f"{last - t_flushed:+.3f}s after it")
    assert last - t_flushed < 1.5
    assert any(done >= t_flush for _, done in results), "nothing was in flight during Flush"
    assert reply.cache_cleared and reply.resumed
    # The prefix cache is empty: the prompt cached before the Flush is a miss now.
    assert complete(url, long_prompt, 2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert http_json("GET", url, "/is_paused")[1] == {"is_paused": False}


def test_refit_cycle_through_the_shim_next_to_the_same_cycle_posted_directly(
        server, fleet, trainer):
    """docs/vllm.md reports these numbers: one full cycle (pause, start, update with the
    broadcast, finish, drain, reset the prefix cache, resume) both ways, on the same engine."""
    plan = fleet.prepare(info(trainer["model"].state_dict()))
    base, first, reps = trainer["weights"], trainer["version"] + 1, 5
    times = VLLM.measure_refit_cycles(server.url, fleet, plan,
                                      lambda v: new_weights(base, seed=v), first, reps)
    last = first + 2 * reps - 1
    trainer["version"], trainer["weights"] = last, new_weights(base, seed=last)
    shim, direct = (statistics.median(times[k]) for k in ("shim", "direct"))
    print(f"full refit cycle of the tiny model ({plan.total_bytes} bytes, {len(plan.buckets)} "
          f"buckets), median of {len(times['shim'])} / {len(times['direct'])}: through the shim "
          f"{shim * 1e3:.0f} ms, posted directly {direct * 1e3:.0f} ms, ratio {shim / direct:.2f}"
          f"; shim {[round(t * 1e3) for t in times['shim']]} ms, direct "
          f"{[round(t * 1e3) for t in times['direct']]} ms")
    (d,) = fleet.describe()
    assert d.weight_version == last
    assert complete(server.url, PROMPT, GEN)["token_ids"] == \
        expected_tokens(trainer, trainer["weights"])


def test_engine_killed_mid_receive_fails_typed_then_a_restart_is_refit_through_the_same_shim(
        vllm_servers, server, shim, fleet, trainer):
    weights = new_weights(trainer["weights"], seed=trainer["version"] + 100)
    link, handle = fleet_mid_epoch(fleet, weights, trainer["version"] + 1)
    plan = fleet.plan
    killed_after = []

    def kill_mid_receive(bucket) -> None:
        # The sender waits for bucket i-2 before posting bucket i (two buffers): at bucket 2 the
        # worker has received bucket 0, so it is inside /update_weights, loading.
        if bucket.index == 2:
            server.kill()  # every process of the server, SIGKILL
            killed_after.append(bucket.index)

    t0 = time.monotonic()
    try:
        link.sender.send(weights, Deadline(EPOCH_S), kill_mid_receive)
    except RefitError:
        pass  # the receiver vanished under the broadcast
    link.close()
    with pytest.raises(EpochFailedError) as failed:
        handle.result()
    elapsed = time.monotonic() - t0
    assert killed_after == [2] and len(plan.buckets) > 3
    assert elapsed < EPOCH_S, f"failure took {elapsed:.1f}s, deadline {EPOCH_S}s"
    (failure,) = failed.value.failures
    assert failure.code == grpc.StatusCode.UNAVAILABLE and failure.reason == "ENGINE_UNAVAILABLE", \
        failure
    assert "update_weights" in failure.message, failure  # it died inside the receive
    print(f"epoch failed {elapsed:.2f}s after the kill: {failure}")
    took = wait_health(shim.address, health_pb2.HealthCheckResponse.NOT_SERVING, 10)
    print(f"shim NOT_SERVING {took:.2f}s after the epoch failed")
    (d,) = fleet.describe()
    assert not d.engine_healthy and d.state == pb.SHIM_STATE_BROKEN

    # A new vLLM on the same port: the shim sees it, and a full epoch makes it whole.
    restarted = vllm_servers.restart(server)  # the session's from now on
    wait_health(shim.address, health_pb2.HealthCheckResponse.SERVING, 10)
    fleet.prepare(info(trainer["model"].state_dict()))  # the same plan: allowed in BROKEN, a no-op
    link = fleet.connect("127.0.0.1")
    try:
        version = trainer["version"] + 2
        fleet.refit(link, weights, version=version)
    finally:
        link.close()
    trainer["version"], trainer["weights"] = version, weights
    (d,) = fleet.describe()
    assert (d.state, d.weight_version, d.engine_healthy) == (pb.SHIM_STATE_READY, version, True)
    assert complete(restarted.url, PROMPT, GEN)["token_ids"] == expected_tokens(trainer, weights)


def _wait_running(url: str, at_least: int, timeout_s: float,
                  finished=lambda: False) -> bool:
    """Until vLLM's metrics show `at_least` requests running: True; False once `finished()`
    says the requests are all done (they ran between two scrapes). Raises at the timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        done = finished()
        _, text = http_json("GET", url, "/metrics", timeout_s=5)
        for line in str(text).splitlines():
            if line.startswith("vllm:num_requests_running") and \
                    float(line.rsplit(" ", 1)[1]) >= at_least:
                return True
        if done:
            return False
        time.sleep(0.02)
    raise AssertionError(f"no request running on {url} after {timeout_s}s")
