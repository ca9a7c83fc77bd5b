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
from collections.abc import Sequence
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
# Set by spawn_shim to its own pid: the shim asks the kernel for SIGTERM when that parent dies.
DIE_WITH_PARENT_ENV = "REFIT_GRPC_DIE_WITH_PARENT"


def die_with_parent(parent_pid: int) -> None:
    """In a child, about itself: SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG; Linux,
    elsewhere a no-op), so a killed demo or test run leaves no shim behind. A parent already
    gone before the call (the child now belongs to another) means SIGTERM now.

    Called by the child itself once it runs, never as a `preexec_fn` between fork and exec:
    that runs Python in the forked child of a parent whose gRPC threads may hold locks, and
    gRPC's fork handlers killed such children with SIGABRT before they ran."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent_if_asked() -> None:
    """The shim's first step: `die_with_parent` when its spawner asked (DIE_WITH_PARENT_ENV,
    removed so that nothing the shim starts inherits it)."""
    value = os.environ.pop(DIE_WITH_PARENT_ENV, "")
    if value.isdigit():
        die_with_parent(int(value))


def spawn_shim(*args: str, timeout_s: float = 60.0, env: dict | None = None,
               stderr=None) -> ShimProcess:
    """`refit-grpc shim ARGS --address 127.0.0.1:0`; returns once it prints its address (and,
    with `--metrics-address HOST:0`, its metrics endpoint's: the shim binds both ports itself).

    A child started from the main thread is tied to this process's life: the shim itself asks
    for SIGTERM when this process dies (`die_with_parent`). Nothing runs between fork and exec
    (no `preexec_fn`), so starting shims beside live gRPC channels is safe. A shim that neither
    serves nor exits within `timeout_s` gets SIGUSR1 first (it dumps every thread's stack to its
    stderr), then SIGKILL.
    """
    return _StartingShim(args, env, stderr).ready(time.monotonic() + timeout_s)


def spawn_shims(shim_args: Sequence[Sequence[str]], *, timeout_s: float = 300.0,
                env: dict | None = None, stderr=None) -> list[ShimProcess]:
    """`spawn_shim` for each entry of `shim_args`, all started before any is waited for (a
    shim's start is mostly importing torch: started one by one, 64 shims took 64 times one
    start). Every one serves, or every one is stopped and the first failure raised."""
    starting = [_StartingShim(tuple(args), env, stderr) for args in shim_args]
    end = time.monotonic() + timeout_s
    ready: list[ShimProcess] = []
    try:
        for s in starting:
            ready.append(s.ready(end))
    except BaseException:
        for s in starting:
            if s.proc.poll() is None:
                s.proc.kill()
        for s in starting:
            s.proc.wait(5)
        raise
    return ready


class _StartingShim:
    """A shim process started, not yet known to serve."""

    def __init__(self, args: Sequence[str], env: dict | None, stderr) -> None:
        cmd = [sys.executable, "-m", "refit_grpc.cli", "shim", *args]
        if "--address" not in args:
            cmd += ["--address", "127.0.0.1:0"]
        child_env = {**os.environ, **(env or {})}
        child_env.pop(DIE_WITH_PARENT_ENV, None)
        # PDEATHSIG follows the creating *thread*: only the main thread's children ask for it,
        # or a shim started from a worker thread would be stopped when that thread ends.
        if threading.current_thread() is threading.main_thread():
            child_env[DIE_WITH_PARENT_ENV] = str(os.getpid())
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=child_env)
        # readline() on a pipe has no timeout: a thread reads, the waiter waits with one.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_read_until_ready, args=(self.proc.stdout, self.lines),
                         daemon=True, name=f"shim-stdout-{self.proc.pid}").start()

    def ready(self, end: float) -> ShimProcess:
        """Once it serves (its READY line), or raise at `end` (time.monotonic())."""
        proc, cmd = self.proc, self.cmd
        metrics_address = None
        while True:
            try:
                line: str | None = self.lines.get(timeout=max(end - time.monotonic(), 0.001))
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
        raise TimeoutError(f"shim did not start in time: {cmd}")


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
