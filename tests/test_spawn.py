"""spawn_shim from a process whose gRPC is busy: nothing runs between fork and exec (a
`preexec_fn` did, and gRPC's fork handlers killed some children with SIGABRT before they ran),
and the shims still die with their parent (the shim asks for PDEATHSIG itself)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

from support import describe

PARENT = """
import json, os, sys, threading
import grpc
from refit_grpc.proto import pb, pb_grpc
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.process import spawn_shim
from refit_grpc.shim.server import ServerOptions, ShimServer
from refit_grpc.shim.service import ShimConfig

# gRPC busy on other threads while the shims are spawned from the main thread.
server = ShimServer(ReferenceEngine(model=None), ShimConfig(),
                    ServerOptions(address="127.0.0.1:0", grace_s=1)).start()
stop = threading.Event()
calls = []

def hammer():
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.RefitServiceStub(channel)
        while not stop.is_set():
            stub.Describe(pb.DescribeRequest(skip_weights_digest=True), timeout=10)
            calls.append(1)

threads = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
for t in threads:
    t.start()
while len(calls) < 20:
    pass
# Python's own fork handlers run around a fork only when Python code runs in the child before
# exec (a preexec_fn); gRPC's are registered the same way.
python_forks = []
os.register_at_fork(before=lambda: python_forks.append(1))
shims = [spawn_shim("--model", "none", "--instance-id", f"s{i}", "--grace-s", "1")
         for i in range(3)]
stop.set()
print(json.dumps({"pids": [s.pid for s in shims], "addresses": [s.address for s in shims],
                  "python_forks": len(python_forks)}), flush=True)
sys.stdin.read()
"""


def _gone(pid: int) -> bool:
    """Exited (a zombie left to a parent that does not reap counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _survivors(pids: list[int], log) -> str:
    """What a failure needs to be understood: each survivor's signal masks and parent, then
    every thread's stack (the shim dumps them on SIGUSR1) and the log."""
    found = []
    for pid in pids:
        if _gone(pid):
            continue
        with open(f"/proc/{pid}/status") as f:
            fields = [line.strip() for line in f
                      if line.split(":")[0] in ("State", "PPid", "SigPnd", "ShdPnd", "SigBlk",
                                                "SigCgt")]
        found.append(f"pid {pid}: {fields}")
        os.kill(pid, signal.SIGUSR1)
    time.sleep(1)
    return "\n".join(found) + "\n" + log.read_text()[-6000:]


def test_shims_spawned_beside_busy_grpc_start_and_die_with_their_parent(tmp_path):
    log = tmp_path / "parent.log"  # the parent's stderr, and its shims'
    with open(log, "wb") as err:
        parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        lines = []
        for line in parent.stdout:  # anything a shim printed before its READY line comes first
            lines.append(line)
            if line.startswith("{"):
                break
        assert lines and lines[-1].startswith("{"), \
            f"the parent ended ({parent.wait(10)}): {lines} {log.read_text()[-3000:]}"
        spawned = json.loads(lines[-1])
        pids = spawned["pids"]
        assert spawned["python_forks"] == 0, "Python code ran between fork and exec"
        for address in spawned["addresses"]:
            assert describe(address, timeout_s=10).instance_id
        parent.kill()
        parent.wait(10)
        # Each shim gets SIGTERM from the kernel as its parent dies, and stops gracefully; a
        # stop that hangs ends at the shim's exit watchdog (grace 1 s + 30 s), stacks dumped.
        end = time.monotonic() + 45
        while not all(_gone(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), \
            f"a shim outlived the process that spawned it: {_survivors(pids, log)}"
        if "Timeout (" in log.read_text():  # faulthandler's header: the watchdog ended a hang
            warnings.warn(f"a shim's stop hung until its exit watchdog: {log.read_text()[-6000:]}",
                          stacklevel=1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
