"""Faults with real processes and real signals: nothing hangs, nothing half-applied, recovery is
byte-exact. Each test prints its measured timings (pytest -s) for the fault table in docs/."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from refit_grpc import (
    EpochFailedError,
    EpochRefusedError,
    Fleet,
    FleetError,
    Packing,
    RefitError,
    WorkerEndpoint,
)
from refit_grpc.common import Deadline
from refit_grpc.plan import weights_digest
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.testing.forked_shims import ShimForkServer

from support import connected, describe_or_none, endpoints, fleet_mid_epoch, info, tensors_v

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
    link = fleet.connect("127.0.0.1")
    fleet.refit(link, weights, version=version)
    link.close()
    want = weights_digest((s.name, weights[s.name]) for s in plan.tensors)
    for d in fleet.describe():
        assert d.state == pb.SHIM_STATE_READY and not d.paused and d.weight_version == version
        assert d.weights_digest == want
    return time.monotonic() - t0


def test_shim_sigkill_mid_broadcast(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    with Fleet(endpoints(shims),
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


# 16 delays 1.3 ms apart over the 20 ms window (30 before: 2x the CPU of `make check`'s longest
# test for little more coverage; SlowToTellRelay below makes the losing order certain).
RACE_TRIES = 16


def test_shim_killed_just_before_an_epoch_is_named():
    """The race behind a wrong blame: the shim at rank 1 is SIGKILLed 0-20 ms before an epoch
    starts. A survivor's receive then fails at once (COLLECTIVE_FAILED, connection reset) and
    its answer can reach the driver before the dead shim's own (UNAVAILABLE); the refusal must
    still name the dead shim, first. Every try forms a fresh group with a fresh victim; the three
    survivors are reused. Shims are forked from a preloaded server: a fresh interpreter would
    spend most of the run importing torch."""
    weights = tensors_v(1)
    delays = [0.020 * k / (RACE_TRIES - 1) for k in range(RACE_TRIES)]
    misses: list[str] = []
    to_error: list[float] = []
    t0 = time.monotonic()
    with ShimForkServer() as forks:
        survivors = [forks.start("--model", "none", "--instance-id", f"s{i}") for i in (1, 2, 3)]
        for k, delay in enumerate(delays):
            victim = forks.start("--model", "none", "--instance-id", f"v{k}")
            with Fleet(endpoints([victim, *survivors]),
                       packing=Packing(4096, 2), epoch_timeout_s=10,
                       control_timeout_s=5) as fleet:
                link = connected(fleet, weights)
                victim.signal(signal.SIGKILL)
                time.sleep(delay)
                started = time.monotonic()
                with pytest.raises(EpochRefusedError) as e:
                    fleet.refit(link, weights, version=1)
                to_error.append(time.monotonic() - started)
                link.close()
                assert victim.wait(5) == -signal.SIGKILL
                if not e.value.workers or e.value.workers[0] != victim.instance_id:
                    misses.append(f"try {k} ({delay * 1e3:.1f} ms): {e.value}")
    assert all(s.process.exitcode is not None for s in forks.started), "a shim outlived the test"
    elapsed = time.monotonic() - t0
    print(f"\nFAULT sigkill-before-epoch: {RACE_TRIES} tries in {elapsed:.1f}s, typed error "
          f"{min(to_error):.2f}-{max(to_error):.2f}s after the epoch began, the dead shim not "
          f"named first in {len(misses)}")
    assert not misses, "\n".join(misses)


class SlowToTellRelay:
    """A TCP relay in front of one shim's gRPC port that tells the driver late: when the shim's
    side of a connection closes (or cannot be opened: the shim is gone), the driver's side is
    held open `hold_s` longer before it is closed. A dead shim's UNAVAILABLE then reaches the
    driver after its survivors' COLLECTIVE_FAILED, every time: the race above, made certain."""

    def __init__(self, upstream: str, hold_s: float):
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._hold_s = hold_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self._upstream, timeout=2)
        except OSError:
            upstream = None
        if upstream is not None:
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            self._pump(upstream, client)  # until the shim's side ends
        time.sleep(self._hold_s)
        for s in (client, upstream):
            if s is not None:
                s.close()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def test_dead_shim_named_when_its_answer_comes_last(shim_procs):
    """SIGKILL the shim at rank 1, then start an epoch; the driver reaches that shim through a
    relay that reports the dead connection 0.5 s late, so the survivors' consequence
    (COLLECTIVE_FAILED: their receive reset by the dead peer) always arrives first. The refusal
    names the dead shim first all the same, and the survivors after it."""
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(4)]
    relay = SlowToTellRelay(shims[0].address, hold_s=0.5)
    weights = tensors_v(1)
    try:
        endpoints = [WorkerEndpoint("w0", relay.address)] + [
            WorkerEndpoint(s.instance_id, s.address) for s in shims[1:]]
        with Fleet(endpoints, packing=Packing(4096, 2), epoch_timeout_s=10,
                   control_timeout_s=5) as fleet:
            link = connected(fleet, weights)
            shims[0].signal(signal.SIGKILL)
            shims[0].proc.wait(5)
            with pytest.raises(EpochRefusedError) as e:
                fleet.refit(link, weights, version=1)
            link.close()
    finally:
        relay.close()
    failures = e.value.failures
    assert failures and failures[0].instance_id == "w0", str(e.value)
    assert failures[0].code == grpc.StatusCode.UNAVAILABLE, str(e.value)
    assert e.value.reason == failures[0].reason
    # The survivors' own failures, when they came before the abort, follow as consequences.
    assert all(f.reason == "COLLECTIVE_FAILED" for f in failures[1:]), str(e.value)
    print(f"\nFAULT sigkill-before-epoch, dead shim's answer last: {e.value}")


def test_shim_frozen_longer_than_the_deadline(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}", "--max-epoch-s", "4")
             for i in range(3)]
    epoch_s = 4.0
    # Abort's wait 2 s, not 1: the survivors' streams time out with the frozen one's (their
    # receives wait on its part of the broadcast), and what tells them apart is that they answer
    # Abort; on a machine loaded by other test modules an alive shim took over 1 s (seen once).
    with Fleet(endpoints(shims), packing=Packing(BUCKET, 2), epoch_timeout_s=epoch_s,
               control_timeout_s=3, abort_timeout_s=2.0) as fleet:
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
            # The epoch's deadline, Abort's wait, and a margin for a loaded machine (7.05 s seen
            # once in CI with the other test modules running beside it): seconds, not the join
            # timeout.
            assert to_error < epoch_s + 2.0 + 2.0, to_error
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
from refit_grpc import Fleet, InPlace, Packing, WorkerEndpoint
addresses = sys.argv[1:]
w = {f"layer.{i}": torch.randn(256 * 1024) for i in range(64)}
fleet = Fleet([WorkerEndpoint(f"w{i}", a) for i, a in enumerate(addresses)],
              packing=Packing(1 << 20, 2), epoch_timeout_s=60)
fleet.prepare({n: (t.shape, t.dtype) for n, t in w.items()})
link = fleet.connect("127.0.0.1")
print("connected", flush=True)
v = 0
while True:
    v += 1
    fleet.refit(link, w, version=v, epoch=InPlace(flush=False))
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
        link = connected(fleet, weights)
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
