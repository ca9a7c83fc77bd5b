"""Real NVIDIA Dynamo worker fleets behind the shim: two Dynamo 1.6.1 vLLM workers (CPU, the
project's worker extension), Dynamo's frontend with file discovery and its RL discovery listener,
a real `refit-grpc shim --engine dynamo` process next to each worker, and `Fleet` (through
`refit_grpc.integrations.dynamo.DynamoDiscovery`) as the trainer's driver.

One set of processes for the module (about 40-60 s to start); the tests run in the file's order:
discovery, three trained versions checked against transformers through the frontend, the cycle
timing, an operator Abort, a join bounded below Dynamo's init timeout, a worker killed
mid-receive (then restarted: discovery refuses the old fleet, a new one refits), and last a join
that outlives Dynamo's limit (Dynamo shuts the worker down). Never more than two workers at once;
the teardown proves that no process survived.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamo_support import require_dynamo
from support import fleet_mid_epoch, info
from vllm_support import require_vllm

require_vllm()  # the trainer's side: transformers, tokenizers (installed with vLLM)
require_dynamo()

pytestmark = [pytest.mark.timeout(900), pytest.mark.engine]

from refit_grpc import EpochFailedError, FleetError, MembershipChangedError  # noqa: E402
from refit_grpc.common import Deadline  # noqa: E402
from refit_grpc.driver import Fleet, WorkerEndpoint  # noqa: E402
from refit_grpc.errors import RefitError  # noqa: E402
from refit_grpc.integrations.dynamo import DynamoDiscovery, ShimAddressing, read_workers  # noqa: E402
from refit_grpc.proto import pb, pb_grpc  # noqa: E402
from refit_grpc.shim.process import ShimProcess, spawn_shim  # noqa: E402
from refit_grpc.testing.dynamo import (  # noqa: E402
    DynamoFrontend,
    DynamoWorker,
    build_dynamo_model,
    frontend_greedy,
    frontend_logprobs,
)
from refit_grpc.testing.harness import DYNAMO  # noqa: E402
from refit_grpc.testing.ports import unused_port  # noqa: E402
from refit_grpc.testing.vllm import PROMPT, hf_greedy  # noqa: E402
from refit_grpc.wire.dynamo import join_limit_s  # noqa: E402

from vllm_support.truth import (  # noqa: E402
    SEQUENCE,
    hf_logprobs,
    load_model,
    sgd_step,
    state_dict_to_send,
)

BUFFER = 256 * 1024  # the 1.7 MB model in 5 buckets
EPOCH_S = 60.0
# The module's workers run with DYN_RL_INIT_WEIGHTS_TIMEOUT_S=10 (Dynamo's default is 30) so the
# bounded-join test takes seconds; their shims are told the same.
INIT_LIMIT_S = 10.0
FP32_TOL = 2e-3
MIN_MOVE = 0.05
LR = 0.5
ROUTES = {"liveness_probe", "pause_generation", "resume_generation", "flush_cache",
          "init_weights_update_group", "update_weights_from_distributed",
          "destroy_weights_update_group", "get_weight_version", "set_weight_version"}
TESTS_DIR = Path(__file__).resolve().parent


class Rig:
    """The module's processes and what the trainer knows about each worker."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.model_dir = build_dynamo_model(logs / "tiny")
        self.discovery_dir = logs / "discovery"
        self.discovery_dir.mkdir()
        self.started: list = []        # every Dynamo process, for the teardown's check
        self.extra_shims: list[ShimProcess] = []
        self.workers: list[DynamoWorker] = []
        self.shims: list[ShimProcess] = []
        self.frontend: DynamoFrontend | None = None
        self.model = load_model(self.model_dir)            # the trainer's, trained in place
        self.scratch = load_model(self.model_dir)          # transformers on any weights
        initial = {n: t.clone() for n, t in self.model.state_dict().items()}
        self.weights = [initial, initial]                  # what each worker holds
        self.versions = [0, 0]

    def worker(self, i: int, port: int | None = None, **options) -> DynamoWorker:
        w = DynamoWorker(self.model_dir, self.discovery_dir, system_port=port,
                         log_path=self.logs / f"worker-{i}-{len(self.started)}.log",
                         cpu_bind=str(i % (os.cpu_count() or 1)), **options)
        self.started.append(w)
        return w.start()

    def shim(self, i: int, *options: str) -> ShimProcess:
        return spawn_shim("--engine", "dynamo", "--engine-url", self.workers[i].url,
                          "--instance-id", f"dynamo-{i}", "--buffer-size-bytes", str(BUFFER),
                          "--num-buffers", "2", "--max-epoch-s", str(EPOCH_S), *options)

    def discovery(self) -> DynamoDiscovery:
        """On one machine every worker's host is 127.0.0.1, so the convention (host + one shim
        port) cannot tell two shims apart: the operator's mapping, by system_url."""
        return DynamoDiscovery(self.frontend.rl_url, ShimAddressing(
            overrides={w.url: s.address for w, s in zip(self.workers, self.shims)}))

    def fleet(self, **options) -> Fleet:
        return self.discovery().fleet(control_timeout_s=30, join_timeout_s=30,
                                      epoch_timeout_s=EPOCH_S, **options)

    def instance_id(self, i: int) -> int:
        url = self.workers[i].url
        (record,) = [r for r in read_workers(self.frontend.rl_url) if r["system_url"] == url]
        return int(record["instance_id"])

    def logprobs(self, i: int) -> torch.Tensor:
        return frontend_logprobs(self.frontend.url, self.instance_id(i), SEQUENCE)

    def truth(self, weights: dict) -> torch.Tensor:
        self.scratch.load_state_dict(weights)
        return hf_logprobs(self.scratch)

    def gap(self, i: int) -> float:
        return (self.logprobs(i) - self.truth(self.weights[i])).abs().max().item()

    def committed(self, i: int, version: int, weights: dict) -> None:
        self.versions[i], self.weights[i] = version, {n: t.detach().clone()
                                                      for n, t in weights.items()}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    rig = Rig(tmp_path_factory.mktemp("dynamo"))
    try:
        t0 = time.monotonic()
        rig.workers = [rig.worker(i, init_timeout_s=INIT_LIMIT_S) for i in range(2)]
        rig.frontend = DynamoFrontend(rig.discovery_dir, log_path=rig.logs / "frontend.log")
        rig.started.append(rig.frontend)
        rig.frontend.start()
        for w in rig.workers:
            w.wait_ready(300)
        rig.frontend.wait_ready(60)
        rig.frontend.wait_for([w.url for w in rig.workers])
        print(f"2 Dynamo workers and the frontend ready in {time.monotonic() - t0:.1f}s")
        rig.shims = [rig.shim(i, "--engine-option", f"init_weights_timeout_s={INIT_LIMIT_S:g}")
                     for i in range(2)]
        yield rig
    finally:
        for s in rig.shims + rig.extra_shims:
            s.stop()
        shims_left = [s.pid for s in rig.shims + rig.extra_shims if s.proc.poll() is None]
        with ThreadPoolExecutor(len(rig.started) or 1) as pool:  # each stop waits for its exit
            list(pool.map(lambda p: p.stop(), rig.started))
        left = [pid for p in rig.started for pid in p.group_pids() if _alive(pid)]
        assert not shims_left and not left, \
            f"processes outlived the module: shims {shims_left}, Dynamo {left}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="refit_grpc.v1.RefitService"), timeout=5).status


def wait_health(address: str, want: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if health(address) == want:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"shim health is {health(address)}, not {want}, after {timeout_s}s")


def dynamo_version(worker: DynamoWorker):
    status, body = worker.post("get_weight_version")
    assert status == 200 and body["status"] == "ok", body
    return body["version"]


def new_weights(base: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for n, t in base.items()}


# --- discovery --------------------------------------------------------------------------------


def test_discovery_lists_the_workers_and_maps_each_to_its_shim(rig):
    records = read_workers(rig.frontend.rl_url)  # protocol_version 1, checked there
    assert sorted(r["system_url"] for r in records) == sorted(w.url for w in rig.workers)
    for r in records:
        assert r["world_size"] == 1 and r["model"] == "tiny", r
        assert ROUTES <= set(r["routes"]), r["routes"]
    discovery = rig.discovery()
    by_url = {w.url: s.address for w, s in zip(rig.workers, rig.shims)}
    endpoints = discovery.endpoints()
    assert [(e.instance_id, e.address) for e in endpoints] == \
        [(str(r["instance_id"]), by_url[r["system_url"]]) for r in records]
    # The convention, for a shim on each worker's host at one port (one worker per host):
    assert WorkerEndpoint.from_metadata(records[0]) == \
        WorkerEndpoint(str(records[0]["instance_id"]), "127.0.0.1:50051")
    assert ShimAddressing(port=7001).address(records[0]) == "127.0.0.1:7001"
    # Unchanged fleet: the hook returns exactly what the fleet holds.
    held = [{"instance_id": e.instance_id, "address": e.address} for e in endpoints]
    assert discovery.validate_workers(held) == held
    for s in rig.shims:
        (d,) = Fleet([WorkerEndpoint("x", s.address)], control_timeout_s=10).describe()
        assert d.engine_kind == "dynamo" and d.engine_healthy and d.engine_world_size == 1, d


# --- refits checked against transformers --------------------------------------------------------


def test_two_dynamo_workers_refit_three_trained_versions_to_transformers_log_probabilities(rig):
    for i in range(2):
        assert rig.gap(i) <= FP32_TOL, f"worker {i} differs from transformers before any refit"
    fleet = rig.fleet()
    gen = torch.Generator().manual_seed(0)
    try:
        plan = fleet.prepare(info(rig.model.state_dict()))
        assert len(plan.buckets) > 1
        link = fleet.connect("127.0.0.1")
        before = [rig.logprobs(i) for i in range(2)]
        try:
            for _ in range(3):
                loss = sgd_step(rig.model, LR, gen)
                weights = state_dict_to_send(rig.model, with_lm_head=True)
                report = fleet.refit(link, weights)
                version = report.version
                assert report.bytes == plan.total_bytes
                truth = hf_logprobs(rig.model)
                for i, w in enumerate(rig.workers):
                    rig.committed(i, version, weights)
                    got = rig.logprobs(i)
                    gap = (got - truth).abs().max().item()
                    moved = (got - before[i]).abs().max().item()
                    before[i] = got
                    print(f"worker {i} v{version} (loss {loss:.3f}): max |Dynamo - "
                          f"transformers| = {gap:.2e}, moved {moved:.3f}, epoch "
                          f"{report.seconds:.3f}s")
                    assert gap <= FP32_TOL, f"worker {i} v{version}: {got - truth}"
                    assert moved >= MIN_MOVE, f"worker {i} v{version}: moved {moved:.4f} only"
                    assert dynamo_version(w) == version
                for d in fleet.describe():
                    assert (d.state, d.weight_version, d.paused) == \
                        (pb.SHIM_STATE_READY, version, False), d
        finally:
            link.close()
        expected = hf_greedy(rig.model, PROMPT, 8)
        for i in range(2):
            assert frontend_greedy(rig.frontend.url, rig.instance_id(i), PROMPT, 8) == expected
    finally:
        fleet.close()


def test_refit_cycle_through_the_shim_next_to_the_same_cycle_posted_directly(rig):
    """docs/dynamo.md reports these numbers: one full cycle on worker 0 both ways (pause,
    update with the broadcast, version, drain, flush the cache, resume)."""
    shim = rig.shims[0]
    fleet = Fleet([WorkerEndpoint(shim.instance_id, shim.address)], control_timeout_s=30,
                  join_timeout_s=30, epoch_timeout_s=EPOCH_S)
    try:
        plan = fleet.prepare(info(rig.weights[0]))
        base, first, reps = rig.weights[0], rig.versions[0] + 1, 5
        times = DYNAMO.measure_refit_cycles(rig.workers[0].url, fleet, plan,
                                            lambda v: new_weights(base, seed=v), first, reps)
    finally:
        fleet.close()
    last = first + 2 * reps - 1
    rig.committed(0, last, new_weights(base, seed=last))
    via, direct = (statistics.median(times[k]) for k in ("shim", "direct"))
    print(f"full refit cycle of the tiny model through Dynamo ({plan.total_bytes} bytes, "
          f"{len(plan.buckets)} buckets), median of {len(times['shim'])} / "
          f"{len(times['direct'])}: through the shim {via * 1e3:.0f} ms, posted directly "
          f"{direct * 1e3:.0f} ms, ratio {via / direct:.2f}; shim "
          f"{[round(t * 1e3) for t in times['shim']]} ms, direct "
          f"{[round(t * 1e3) for t in times['direct']]} ms")
    assert dynamo_version(rig.workers[0]) == last
    assert rig.gap(0) <= FP32_TOL


# --- aborts and deadlines --------------------------------------------------------------------------


def test_an_operator_abort_frees_a_worker_blocked_in_the_receive(rig):
    """The trainer joined and stalls. The shim's Abort sets the update's abort key in the
    trainer's TCPStore, the extension gives up and rolls back (nothing applied), and the worker
    serves its old weights again, resumed."""
    shim = rig.shims[0]
    fleet = Fleet([WorkerEndpoint(shim.instance_id, shim.address)], control_timeout_s=30,
                  join_timeout_s=30, epoch_timeout_s=EPOCH_S)
    try:
        link, handle = fleet_mid_epoch(fleet, new_weights(rig.weights[0], 77),
                                       rig.versions[0] + 1)
        time.sleep(1.5)  # the shim is inside update_weights_from_distributed
        t0 = time.monotonic()
        try:
            with grpc.insecure_channel(shim.address) as channel:
                reply = pb_grpc.RefitServiceStub(channel).Abort(
                    pb.AbortRequest(reason="operator"), timeout=10)
            took = time.monotonic() - t0
            with pytest.raises(EpochFailedError) as failed:
                handle.result()
        finally:
            link.close()
        (d,) = fleet.describe()
    finally:
        fleet.close()
    assert reply.epoch_aborted and took < 3.0, (reply, took)
    (failure,) = failed.value.failures
    assert failure.code == grpc.StatusCode.ABORTED, failure
    print(f"operator Abort answered in {took:.2f}s: {failure}")
    assert (d.state, d.weight_version, d.paused, d.engine_healthy) == \
        (pb.SHIM_STATE_PREPARED, rig.versions[0], False, True), d
    assert rig.gap(0) <= FP32_TOL
    assert dynamo_version(rig.workers[0]) == rig.versions[0]


def test_a_join_is_bounded_below_dynamos_init_timeout_and_the_worker_lives_on(rig):
    """The trainer never comes. The fleet allows 30 s, Dynamo shuts a worker down after 10 s
    (DYN_RL_INIT_WEIGHTS_TIMEOUT_S here): the shim bounds the worker's join at 8 s, so the
    join fails typed and the same worker process keeps serving."""
    shim, worker = rig.shims[1], rig.workers[1]
    fleet = Fleet([WorkerEndpoint(shim.instance_id, shim.address)], control_timeout_s=30,
                  join_timeout_s=30, epoch_timeout_s=EPOCH_S)
    try:
        fleet.prepare(info(rig.weights[1]))
        t0 = time.monotonic()
        with unused_port() as nobody:  # where the trainer would listen, and never does
            (future,) = fleet.init_collective("127.0.0.1", nobody, 2, train_world_size=1)
            with pytest.raises(FleetError) as failed:
                future.result(60)
        took = time.monotonic() - t0
        (d,) = fleet.describe()
    finally:
        fleet.close()
    (failure,) = failed.value.failures
    print(f"join failed after {took:.1f}s: {failure}")
    assert failure.code == grpc.StatusCode.DEADLINE_EXCEEDED, failure
    assert failure.reason == "RENDEZVOUS_TIMEOUT" and "DYN_RL_INIT_WEIGHTS_TIMEOUT_S" in \
        failure.message, failure
    assert join_limit_s(INIT_LIMIT_S) - 1 <= took < INIT_LIMIT_S + 3, took
    assert worker.proc.poll() is None and d.engine_healthy, "the worker must live on"
    assert health(shim.address) == health_pb2.HealthCheckResponse.SERVING
    assert rig.gap(1) <= FP32_TOL


# --- a worker killed, restarted; membership ----------------------------------------------------


def test_a_worker_killed_mid_receive_fails_typed_and_broken_then_discovery_refuses_the_old_fleet(
        rig):
    fleet = rig.fleet()
    victim, victim_shim = rig.workers[1], rig.shims[1]
    old_id = str(rig.instance_id(1))
    version = max(rig.versions) + 1
    weights = new_weights(rig.weights[1], seed=version)
    link, handle = fleet_mid_epoch(fleet, weights, version)
    killed_after = []

    def kill_mid_receive(bucket) -> None:
        # The sender waits for bucket i-2 before posting bucket i (two buffers): at bucket 2
        # the workers have received bucket 0, so they are inside the update, loading.
        if bucket.index == 2:
            victim.kill()  # every process of the worker (Dynamo, EngineCore, vLLM worker)
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
    assert killed_after == [2] and elapsed < EPOCH_S, (killed_after, elapsed)
    by_id = {f.instance_id: f for f in failed.value.failures}
    failure = by_id[old_id]
    print(f"epoch failed {elapsed:.2f}s after the kill: {failure}")
    assert failure.code == grpc.StatusCode.UNAVAILABLE and failure.reason == \
        "ENGINE_UNAVAILABLE", failure
    assert "update_weights_from_distributed" in failure.message and "gone" in failure.message
    took = wait_health(victim_shim.address, health_pb2.HealthCheckResponse.NOT_SERVING, 10)
    print(f"shim NOT_SERVING {took:.2f}s after the epoch failed")
    states = {x.instance_id: x for x in fleet.describe_each()
              if isinstance(x, pb.DescribeResponse)}
    assert states["dynamo-1"].state == pb.SHIM_STATE_BROKEN, states["dynamo-1"]
    assert not states["dynamo-1"].engine_healthy
    listed = read_workers(rig.frontend.rl_url)
    print(f"after the kill, discovery lists {[(r['instance_id'], r.get('error')) for r in listed]}")
    held = [{"instance_id": e.instance_id, "address": e.address} for e in fleet.endpoints]
    assert rig.discovery().validate_workers(held) != held, "discovery must show the change"

    # A new worker on the same system_url: a new Dynamo instance. The old fleet is refused
    # before any byte; one from discovery refits both workers to the trainer's weights.
    rig.workers[1] = rig.worker(1, port=victim.port, init_timeout_s=INIT_LIMIT_S)
    rig.workers[1].wait_ready(300)
    rig.frontend.wait_for([w.url for w in rig.workers])
    wait_until(lambda: old_id not in {str(r["instance_id"])
                                      for r in read_workers(rig.frontend.rl_url)}, 60)
    wait_health(victim_shim.address, health_pb2.HealthCheckResponse.SERVING, 20)
    link = None
    with pytest.raises(MembershipChangedError):
        link = fleet.connect("127.0.0.1")
    if link is not None:
        link.close()
    fleet.close()
    fleet = rig.fleet()
    try:
        fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1")
        try:
            report = fleet.refit(link, weights, version=version + 1)
        finally:
            link.close()
        states = {x.instance_id: x for x in fleet.describe()}
    finally:
        fleet.close()
    for i in range(2):
        rig.committed(i, report.version, weights)
        assert rig.gap(i) <= FP32_TOL
        assert dynamo_version(rig.workers[i]) == report.version
    assert (states["dynamo-1"].state, states["dynamo-1"].weight_version) == \
        (pb.SHIM_STATE_READY, report.version)


def test_a_join_that_outlives_dynamos_limit_is_typed_and_the_shim_reports_the_worker_gone(rig):
    """A shim told a longer limit than the worker's (misconfigured), and a join that never ends
    inside the worker (a test extension that sleeps): Dynamo's own timeout (4 s here) shuts the
    worker down. The shim must say so, typed, and go NOT_SERVING."""
    rig.workers[1].stop()  # never more than two workers at once
    worker = rig.worker(1, port=rig.workers[1].port, init_timeout_s=4,
                        extension="dynamo_support.slow_join.SlowJoinExtension",
                        extra_env={"PYTHONPATH": str(TESTS_DIR)})
    rig.workers[1] = worker
    worker.wait_ready(300)
    shim = rig.shim(1, "--engine-option", "init_weights_timeout_s=60")
    rig.extra_shims.append(shim)
    fleet = Fleet([WorkerEndpoint(shim.instance_id, shim.address)], control_timeout_s=30,
                  join_timeout_s=30, epoch_timeout_s=EPOCH_S)
    try:
        fleet.prepare(info(rig.weights[1]))
        t0 = time.monotonic()
        with unused_port() as nobody:  # where the trainer would listen, and never does
            (future,) = fleet.init_collective("127.0.0.1", nobody, 2, train_world_size=1)
            with pytest.raises(FleetError) as failed:
                future.result(60)
        took = time.monotonic() - t0
    finally:
        fleet.close()
    (failure,) = failed.value.failures
    print(f"join failed after {took:.1f}s: {failure}")
    assert failure.code == grpc.StatusCode.UNAVAILABLE and failure.reason == \
        "ENGINE_UNAVAILABLE", failure
    assert "is gone" in failure.message and "DYN_RL_INIT_WEIGHTS_TIMEOUT_S" in failure.message
    assert 4 <= took < 20, took
    wait_until(lambda: worker.proc.poll() is not None, 20)
    assert worker.proc.returncode == 1  # Dynamo's os._exit(1)
    wait_health(shim.address, health_pb2.HealthCheckResponse.NOT_SERVING, 10)
    # Dynamo's exit leaves its vLLM worker asleep in the join (it ignores SIGTERM for the 20 s
    # the teardown would wait): what is left of it goes now.
    worker.kill()


def wait_until(predicate, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s")
