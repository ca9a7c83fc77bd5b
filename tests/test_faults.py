"""Faults with real processes and real signals: nothing hangs, nothing half-applied, recovery is
byte-exact. Each test prints its measured timings (pytest -s) for the fault table in docs/."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_grpc import EpochFailedError, Fleet, FleetError, Packing, RefitError, WorkerEndpoint
from refit_grpc.common import Deadline
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb, pb_grpc

from support import describe_or_none, fleet_mid_epoch, free_port, info

pytestmark = pytest.mark.slow

BUCKET = 1 << 20


def big_weights(version: int, mib: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layer.{i}": torch.randn(256 * 1024, generator=g) for i in range(mib)}


def wait_not_receiving(addresses: list[str], limit_s: float) -> float:
    """Seconds until no shim reports RECEIVING (fails past limit_s)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        ds = [describe_or_none(a) for a in addresses]
        if all(d is not None and d.state != pb.SHIM_STATE_RECEIVING for d in ds):
            return time.monotonic() - t0
        time.sleep(0.05)
    pytest.fail(f"a shim was still RECEIVING (or unreachable) after {limit_s}s")


def assert_survivors_safe(addresses: list[str]) -> list[int]:
    """Every survivor is out of RECEIVING; one that got bytes is BROKEN and stays paused."""
    states = []
    for a in addresses:
        d = describe_or_none(a)
        assert d is not None
        assert d.state in (pb.SHIM_STATE_BROKEN, pb.SHIM_STATE_PREPARED), d
        if d.state == pb.SHIM_STATE_BROKEN:
            assert d.paused, "a BROKEN engine must stay paused"
        states.append(d.state)
    return states


def recover_and_check(fleet: Fleet, version: int) -> float:
    """Re-prepare (restarted shims are EMPTY), re-form the group, run one full epoch."""
    t0 = time.monotonic()
    weights = big_weights(version)
    plan = fleet.prepare(info(weights))
    link = fleet.connect("127.0.0.1", free_port())
    fleet.refit(link, weights, version=version)
    link.close()
    want = weights_digest((s.name, weights[s.name]) for s in plan.tensors)
    for d in fleet.describe():
        assert d.state == pb.SHIM_STATE_READY and not d.paused and d.weight_version == version
        assert d.weights_digest == want
    return time.monotonic() - t0


def test_shim_sigkill_mid_broadcast(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    with Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
               packing=Packing(BUCKET, 2), epoch_timeout_s=10) as fleet:
        link, handle = fleet_mid_epoch(fleet, big_weights(2), 2, committed=big_weights(1))
        t0 = time.monotonic()
        killer = threading.Timer(0.02, shims[1].signal, args=(signal.SIGKILL,))
        killer.start()
        with pytest.raises(RefitError):
            link.sender.send(big_weights(2), Deadline(10))
        link.close()
        with pytest.raises(EpochFailedError) as e:
            handle.result()
        to_error = time.monotonic() - t0
        assert e.value.workers[0] == "w1", str(e.value)
        assert to_error < 10 + 2
        survivors = [shims[0].address, shims[2].address]
        wait_not_receiving(survivors, 5)
        states = assert_survivors_safe(survivors)
        if pb.SHIM_STATE_BROKEN in states:
            with pytest.raises(FleetError) as flush_error:
                fleet.flush_cache()
            assert "BROKEN" in flush_error.value.reasons
            assert all(describe_or_none(a).paused for a, s in zip(survivors, states)
                       if s == pb.SHIM_STATE_BROKEN)
        # The killed shim comes back on the same address as a new instance.
        shims[1] = shim_procs("--model", "none", "--instance-id", "w1",
                              "--address", shims[1].address)
        recovery = recover_and_check(fleet, 3)
    print(f"\nFAULT sigkill-shim: typed error after {to_error:.2f}s, survivors "
          f"{[pb.ShimState.Name(s) for s in states]}, recovery {recovery:.2f}s byte-exact")


def test_shim_frozen_longer_than_the_deadline(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}", "--max-epoch-s", "4")
             for i in range(3)]
    epoch_s = 4.0
    with Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
               packing=Packing(BUCKET, 2), epoch_timeout_s=epoch_s, control_timeout_s=3) as fleet:
        link, handle = fleet_mid_epoch(fleet, big_weights(2), 2, committed=big_weights(1))
        t0 = time.monotonic()
        shims[2].signal(signal.SIGSTOP)
        try:
            with pytest.raises(RefitError):
                link.sender.send(big_weights(2), Deadline(epoch_s))
            link.close()
            with pytest.raises(FleetError) as e:
                handle.result()
            to_error = time.monotonic() - t0
            assert e.value.workers[0] == "w2", str(e.value)
            assert to_error < epoch_s + 2, to_error
            survivors = [shims[0].address, shims[1].address]
            wait_not_receiving(survivors, 3)
            states = assert_survivors_safe(survivors)
        finally:
            shims[2].signal(signal.SIGCONT)
        # Thawed, the frozen shim finds its own watchdog already fired.
        wait_not_receiving([shims[2].address], epoch_s + 2)
        assert_survivors_safe([shims[2].address])
        recovery = recover_and_check(fleet, 3)
    print(f"\nFAULT sigstop-shim: typed error after {to_error:.2f}s, survivors "
          f"{[pb.ShimState.Name(s) for s in states]}, recovery {recovery:.2f}s byte-exact")


TRAINER = """
import sys, time, torch
from refit_grpc import Fleet, Packing, WorkerEndpoint
from refit_grpc.testing.ports import free_port
addresses = sys.argv[1:]
w = {f"layer.{i}": torch.randn(256 * 1024) for i in range(64)}
fleet = Fleet([WorkerEndpoint(f"w{i}", a) for i, a in enumerate(addresses)],
              packing=Packing(1 << 20, 2), epoch_timeout_s=60)
fleet.prepare({n: (t.shape, t.dtype) for n, t in w.items()})
link = fleet.connect("127.0.0.1", free_port())
print("connected", flush=True)
v = 0
while True:
    v += 1
    fleet.refit(link, w, version=v, flush=False)
"""


def test_trainer_killed_mid_epoch(shim_procs):
    shims = [shim_procs("--model", "none", "--max-epoch-s", "5") for _ in range(3)]
    addresses = [s.address for s in shims]
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *addresses],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "connected"
        end = time.monotonic() + 30
        # Kill it while every shim is inside the epoch: a shim whose UpdateWeights had not
        # arrived yet never started one and rightly stays READY (its group's master is gone; the
        # next trainer's InitCollective replaces it).
        while time.monotonic() < end:
            if all((d := describe_or_none(a)) and d.state == pb.SHIM_STATE_RECEIVING for a in addresses):
                break
        else:
            pytest.fail("never caught the trainer mid-epoch")
        trainer.kill()
        t0 = time.monotonic()
        trainer.wait(10)
        settled = wait_not_receiving(addresses, 5 + 2)
        states = assert_survivors_safe(addresses)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
    print(f"\nFAULT sigkill-trainer: every shim out of RECEIVING after {settled:.2f}s (watchdog "
          f"5s), states {[pb.ShimState.Name(s) for s in states]}")
    del t0


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_thousand_concurrent_describes_during_an_epoch(shim_procs):
    shim = shim_procs("--model", "none", "--instance-id", "w0")
    weights = big_weights(1)
    with Fleet([WorkerEndpoint("w0", shim.address)], packing=Packing(BUCKET, 2),
               epoch_timeout_s=30) as fleet, grpc.insecure_channel(shim.address) as ch:
        fleet.prepare(info(weights))
        link = fleet.connect("127.0.0.1", free_port())
        fleet.refit(link, weights, version=1)
        stub = pb_grpc.RefitServiceStub(ch)
        rss_before = _rss_mb(shim.pid)
        codes: dict[str, int] = {}
        for round_ in range(3):
            handle = fleet.update_weights(2 + round_)
            handle.wait_accepted()
            calls = [stub.Describe.future(pb.DescribeRequest(), timeout=30) for _ in range(1000)]
            link.sender.send(big_weights(2 + round_), Deadline(30))
            handle.result()
            for c in calls:
                try:
                    c.result()
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.RpcError as e:
                    codes[e.code().name] = codes.get(e.code().name, 0) + 1
        rss_after = _rss_mb(shim.pid)
        link.close()
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes.get("RESOURCE_EXHAUSTED", 0) > 0, codes
        assert describe_or_none(shim.address).weight_version == 4
        assert rss_after - rss_before < 64, (rss_before, rss_after)
    print(f"\nLOAD 3x1000 Describe during epochs: {codes}; shim RSS {rss_before:.0f} -> "
          f"{rss_after:.0f} MB")


def test_sigterm_during_an_epoch_commits_within_grace_and_exits_zero(shim_procs):
    shim = shim_procs("--model", "none", "--instance-id", "w0", "--grace-s", "10")
    weights = big_weights(1)
    with Fleet([WorkerEndpoint("w0", shim.address)], packing=Packing(BUCKET, 2),
               epoch_timeout_s=30) as fleet, grpc.insecure_channel(shim.address) as ch:
        link, handle = fleet_mid_epoch(fleet, weights, 1)
        shim.signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(ch)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.01)
        not_serving = time.monotonic() - t0
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        link.sender.send(weights, Deadline(30))
        committed = handle.result()
        assert committed[0].phase == pb.UPDATE_WEIGHTS_PHASE_COMMITTED
        link.close()
        assert shim.proc.wait(15) == 0
    print(f"\nSIGTERM mid-epoch: NOT_SERVING after {not_serving * 1e3:.0f} ms, epoch committed, "
          "exit 0")
