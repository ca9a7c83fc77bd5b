"""Start shims as child processes (demo, tests, local fleets) and wait until they serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

READY_PREFIX = "refit-grpc shim serving on "


@dataclass
class ShimProcess:
    proc: subprocess.Popen
    address: str
    instance_id: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def spawn_shim(*args: str, timeout_s: float = 60.0, env: dict | None = None,
               stderr=None) -> ShimProcess:
    """`refit-grpc shim ARGS --address 127.0.0.1:0`; returns once it prints its address."""
    cmd = [sys.executable, "-m", "refit_grpc.cli", "shim", *args]
    if "--address" not in args:
        cmd += ["--address", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, **(env or {})})
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"shim exited with {proc.returncode} before serving: {cmd}")
            continue
        if line.startswith(READY_PREFIX):
            address, instance_id = line[len(READY_PREFIX):].split()
            return ShimProcess(proc, address, instance_id)
    proc.kill()
    raise TimeoutError(f"shim did not start within {timeout_s}s: {cmd}")
