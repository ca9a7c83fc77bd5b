"""The shim process as an operator meets it: health, reflection, SIGTERM."""

from __future__ import annotations

import signal
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from refit_grpc.proto import pb, pb_grpc


def test_reflection_lists_every_service(shim):
    sh = shim()
    db = ProtoReflectionDescriptorDatabase(sh.channel)
    services = set(db.get_services())
    assert {"refit_grpc.v1.RefitService", "grpc.health.v1.Health",
            "refit_grpc.v1.ReferenceEngineService"} <= services
    # grpcurl needs the full descriptors, not only names.
    desc = db.FindFileContainingSymbol("refit_grpc.v1.RefitService")
    assert desc.package == "refit_grpc.v1"


def test_health_and_sigterm_exit_cleanly(shim_procs):
    p = shim_procs()
    with grpc.insecure_channel(p.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "refit_grpc.v1.RefitService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.RefitServiceStub(channel)
        assert stub.Describe(pb.DescribeRequest(), timeout=5).instance_id == p.instance_id
    t0 = time.monotonic()
    p.signal(signal.SIGTERM)
    assert p.proc.wait(15) == 0
    assert time.monotonic() - t0 < 10


def test_stop_signals_arriving_throughout_the_stop_still_end_the_shim_cleanly(shim_procs):
    """A parent's death signal followed by a supervisor's SIGTERM once hung a shim for good: the
    handler took locks (an event's, the health servicer's) that the main thread, interrupted
    below it, already held. Signals keep arriving here, SIGTERM and SIGINT mixed, back to back
    through the whole graceful stop; the shim must still end with status 0."""
    procs = [shim_procs() for _ in range(3)]
    end = time.monotonic() + 20
    i = 0
    while any(p.proc.poll() is None for p in procs) and time.monotonic() < end:
        for p in procs:
            try:
                p.signal(signal.SIGINT if i % 5 == 4 else signal.SIGTERM)
            except ProcessLookupError:  # it ended
                pass
        i += 1
    for p in procs:
        assert p.proc.poll() == 0, f"{p.instance_id}: {p.proc.returncode} after {i} rounds"


def test_a_killed_parent_leaves_no_shim_behind_and_sigusr1_dumps_stacks():
    """A demo or test run killed outright must not orphan its shims (they would hold ports and
    memory on a CI host): spawn_shim ties each child to its parent's life."""
    import os
    import subprocess
    import sys

    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from refit_grpc.shim.process import spawn_shim\n"
         "p = spawn_shim('--model', 'none', stderr=sys.stderr)\n"
         "print(p.pid, p.address, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid_text, address = parent.stdout.readline().split()
        shim_pid = int(pid_text)
        os.kill(shim_pid, signal.SIGUSR1)  # an operator asks a live shim for its stacks
        with grpc.insecure_channel(address) as channel:  # and it keeps serving afterwards
            d = pb_grpc.RefitServiceStub(channel).Describe(pb.DescribeRequest(), timeout=10)
            assert d.state == pb.SHIM_STATE_EMPTY
        parent.kill()
        parent.wait(10)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            if not _alive(shim_pid):
                break
            time.sleep(0.05)
        else:
            os.kill(shim_pid, signal.SIGKILL)
            raise AssertionError("the shim outlived its killed parent")
        stderr = parent.stderr.read()
        assert "Current thread" in stderr or "Thread 0x" in stderr, stderr[-2000:]
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (exited, not yet reaped by whoever adopted it) is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
