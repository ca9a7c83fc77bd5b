"""The threads that destroy torch's data-plane objects off the caller's thread, and the wait for
them at exit.

Destroying a gloo group joins its worker threads, which wait for any pending operation to time
out, and a torch call that nothing can interrupt (a store's connect, a backend's rendezvous) may
still be running when its caller gives up. So a closed group's last references are dropped on a
reaper thread of its own (`reap`, started by `group.Group.close`), and an abandoned torch call
finishes on its own thread (`rendezvous`): each such thread is registered here
(`wait_at_exit`), and a process that exits first waits for them (`join_reapers`, at exit), since
one that exits while a gloo group is half destroyed dies in std::terminate (SIGABRT).

A module of its own because both the group's teardown and the rendezvous register threads here.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
import time

_reapers: list[threading.Thread] = []
_reapers_lock = threading.Lock()


def wait_at_exit(thread: threading.Thread) -> None:
    """Register `thread` (a reaper, or an abandoned torch call's) for `join_reapers`."""
    with _reapers_lock:
        _reapers.append(thread)


def reap(refs: list) -> None:
    """Drop the group's last references: that closes the gloo pairs (peers fail at once). A
    full collection only when something else still holds one (a cycle, an exception's
    traceback): it holds the GIL for its whole run, 0.4 s in a vLLM worker's heap, measured,
    and the worker's engine loop (its model steps) waits that long."""
    held = any(_held_elsewhere(r) for r in refs)
    refs.clear()
    if held:
        gc.collect()


def _held_elsewhere(obj: object) -> bool:
    # Inside the caller's loop `obj` is referenced by the list, the loop variable, this
    # parameter and getrefcount's own argument.
    return sys.getrefcount(obj) > 4


@atexit.register
def join_reapers(timeout_s: float = 30.0) -> None:
    """Let torn-down groups finish destroying themselves: a process that exits while a gloo
    group is half destroyed dies in std::terminate (SIGABRT) instead of exiting cleanly."""
    end = time.monotonic() + timeout_s
    with _reapers_lock:
        reapers = list(_reapers)
    for r in reapers:
        r.join(max(end - time.monotonic(), 0))
