"""What the benches need in memory, checked before they start, and each process's peak after.

Every bench estimates its peak resident memory from its plan and the processes it holds at once
(`Need`), compares it with what the host can give (`MemAvailable` in /proc/meminfo) and, where it
does not fit, says so before it starts: a default plan is shrunk to one that fits (halved until it
does), a plan the user asked for is refused. After a run, each process's own high-water mark
(`VmHWM` in /proc/<pid>/status, reset per arm through /proc/<pid>/clear_refs) says what it held.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What a Python process with torch (and grpc, gloo) keeps resident before it holds any weights:
# a bare receiver or a store-mode shim measured 240-300 MB here; the trainer a little more.
PROCESS_BASE_BYTES = 350 << 20
# The share of MemAvailable a bench may plan to use: other processes allocate meanwhile, and the
# estimate leaves out what gloo and the allocator keep besides the plan's bytes.
FIT_SHARE = 0.85
SMALLEST_MB = 16.0


@dataclass(frozen=True)
class Need:
    """The peak a bench expects: the largest of its phases (processes held at one time), each
    named, in bytes."""

    phases: dict[str, int]

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)

    @property
    def worst(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else ""


def mem_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes; None where the kernel does not say (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


class DoesNotFit(Exception):
    """The bench would need more memory than the host has; the message says how much and what
    to do."""


def fit_total_mb(need_for: Callable[[float], Need], total_mb: float | None, default_mb: float,
                 what: str, available: int | None = None,
                 say: Callable[[str], None] = print) -> float:
    """The plan size to run: `total_mb` if given and it fits, else `default_mb` halved until it
    fits. Says what it decided; raises `DoesNotFit` (a message for the user) when an asked size
    does not fit, or no size down to `SMALLEST_MB` does.

    Args:
        need_for: the bench's estimate for a plan of so many MB.
        total_mb: the size the user asked for (None: the default, shrunk as needed).
        default_mb: the bench's default size.
        what: the bench and its shape, for the messages ("bench, world 5").
        available: bytes the host can give (default: MemAvailable; None where unknown: no check).
        say: where the decision is said.
    """
    if available is None:
        available = mem_available()
    size = default_mb if total_mb is None else total_mb
    need = need_for(size)
    if available is None:
        return size
    budget = FIT_SHARE * available
    line = (f"{what}: {size:g} MB needs about {gb(need.peak)} at its peak ({need.worst}); "
            f"MemAvailable {gb(available)}")
    if need.peak <= budget:
        say(f"memory: {line}: fits")
        return size
    if total_mb is not None:
        raise DoesNotFit(f"{line}: does not fit in {FIT_SHARE:.0%} of it. Pass a smaller "
                         "--total-mb (or fewer receivers), or free memory first.")
    while size > SMALLEST_MB:
        size /= 2
        need = need_for(size)
        if need.peak <= budget:
            say(f"memory: {line}: does not fit in {FIT_SHARE:.0%} of it; running {size:g} MB "
                f"instead (about {gb(need.peak)}); free memory to run the default")
            return size
    raise DoesNotFit(f"{line}: not even {SMALLEST_MB:g} MB fits ({gb(need.peak)}); free memory "
                     "or run fewer receivers.")


def fit(need: Callable[[float], Need], total_mb: float | None, what: str) -> float | None:
    """`fit_total_mb` with a 1024 MB default, for a bench's command line; None (said on stderr)
    where nothing fits."""
    try:
        return fit_total_mb(need, total_mb, 1024, what)
    except DoesNotFit as e:
        print(f"refit-grpc {what.split(',')[0]}: {e}", file=sys.stderr)
        return None


def add_plan_arguments(parser: argparse.ArgumentParser, reps: str, quick: str) -> None:
    """The flags of a bench on a bf16 plan (`bench-delta`, `bench-catch-up`): the plan's size,
    reps (3), the bucket size and --quick (an 8 MB plan, 1 MiB buckets, `quick`)."""
    parser.add_argument("--total-mb", type=float, default=None,
                        help="the bf16 plan's size (default 1024, halved until it fits)")
    parser.add_argument("--reps", type=int, default=3, help=reps)
    parser.add_argument("--buffer-size-bytes", type=int, default=64 << 20)
    parser.add_argument("--quick", action="store_true",
                        help=f"an 8 MB plan (unless --total-mb), 1 MiB buckets, {quick}: that it "
                             "runs, in seconds")


# --- each process's peak ----------------------------------------------------------------------


def reset_peak(pid: int) -> bool:
    """Resets a process's resident high-water mark (VmHWM) to its resident size now (writes 5
    to /proc/<pid>/clear_refs; Linux 4.0+). False where that is not allowed: its VmHWM is then
    the peak since it started."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(pid: int) -> int:
    """A process's resident high-water mark (VmHWM) in bytes; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


class Peaks:
    """Per process peaks over one stretch: `start` resets their high-water marks, `read`
    returns (the first pid's peak, the largest of the others'): the sender's and the worst
    receiver's."""

    def __init__(self) -> None:
        self.reset_ok = True

    def start(self, pids: Sequence[int]) -> None:
        for p in pids:
            self.reset_ok &= reset_peak(p)

    @staticmethod
    def read(pids: Sequence[int]) -> tuple[int, int]:
        first, *rest = pids
        return peak_rss(first), max((peak_rss(p) for p in rest), default=0)


__all__ = ["FIT_SHARE", "PROCESS_BASE_BYTES", "DoesNotFit", "Need", "Peaks", "fit_total_mb",
           "mem_available", "peak_rss", "reset_peak"]
