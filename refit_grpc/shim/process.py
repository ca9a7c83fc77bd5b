"""Start shims as child processes (demo, tests, local fleets) and wait until they serve."""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

# The shim's stdout lines a parent reads to learn its ports (both bound on port 0 where asked):
# the metrics line (only with --metrics-address; before the READY line), then the READY line.
METRICS_PREFIX = "refit-grpc shim metrics on "
READY_PREFIX = "refit-grpc shim serving on "


@dataclass
class ShimProcess:
    proc: subprocess.Popen
    address: str
    instance_id: str
    metrics_address: str | None = None  # HOST:PORT of its metrics endpoint, when it serves one

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


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, so a killed demo or test run
    leaves no shim behind (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def spawn_shim(*args: str, timeout_s: float = 60.0, env: dict | None = None,
               stderr=None) -> ShimProcess:
    """`refit-grpc shim ARGS --address 127.0.0.1:0`; returns once it prints its address (and,
    with `--metrics-address HOST:0`, its metrics endpoint's: the shim binds both ports itself).

    A child started from the main thread is tied to this process's life. A shim that neither
    serves nor exits within `timeout_s` gets SIGUSR1 first (it dumps every thread's stack to its
    stderr), then SIGKILL.
    """
    cmd = [sys.executable, "-m", "refit_grpc.cli", "shim", *args]
    if "--address" not in args:
        cmd += ["--address", "127.0.0.1:0"]
    # PDEATHSIG follows the creating *thread*: only the main thread's children get it, or a
    # shim started from a worker thread would be stopped when that thread ends.
    tie = _die_with_parent if threading.current_thread() is threading.main_thread() else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, **(env or {})}, preexec_fn=tie)
    # readline() on a pipe has no timeout: a thread reads, this one waits with one.
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_until_ready, args=(proc.stdout, lines), daemon=True,
                     name=f"shim-stdout-{proc.pid}").start()
    end = time.monotonic() + timeout_s
    metrics_address = None
    while True:
        try:
            line = lines.get(timeout=max(end - time.monotonic(), 0.001))
        except queue.Empty:
            line = None
        if line and line.startswith(METRICS_PREFIX):
            url = line[len(METRICS_PREFIX):].strip()
            metrics_address = url.removeprefix("http://").removesuffix("/metrics")
            continue
        break
    if line:
        address, instance_id = line[len(READY_PREFIX):].split()
        return ShimProcess(proc, address, instance_id, metrics_address)
    if line == "":  # EOF: the shim exited (or closed stdout) without serving
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(5)
        raise RuntimeError(f"shim exited with {code} before serving: {cmd}")
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
    proc.kill()
    proc.wait(5)
    raise TimeoutError(f"shim did not start within {timeout_s}s: {cmd}")


def _read_until_ready(stream, lines: queue.Queue) -> None:
    """Hands over the metrics and READY lines, or "" at EOF; anything else the shim prints is
    passed on."""
    for line in stream:
        if line.startswith(METRICS_PREFIX):
            lines.put(line)
            continue
        if line.startswith(READY_PREFIX):
            lines.put(line)
            return
        sys.stdout.write(line)
    lines.put("")
