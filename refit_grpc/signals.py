"""Waiting for SIGTERM/SIGINT without a handler that can deadlock.

A Python signal handler runs on the main thread between two bytecodes, wherever that thread is:
inside `threading.Event.wait`, or inside the handler itself when a second signal follows the first
(a parent's death signal, then a supervisor's SIGTERM). A handler that calls `Event.set()` then
takes the event's lock while the interrupted frame below it already holds it, and the process
hangs for good (CI caught a shim that outlived its parent this way, its stack `on_signal -> set ->
notify -> on_signal -> set`). So the handler here only appends to a list, which takes no lock,
and the waiting loop polls it; everything a stop does runs after the handler has returned.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType

# How late a signal is noticed at most; a stop takes seconds anyway.
_POLL_S = 0.1


class StopSignals:
    """Records SIGTERM and SIGINT while installed (a context manager, or `install()` for the
    process's life); `wait` blocks until one
    arrived or the timeout passed. Off the main thread (where Python refuses handlers) it installs
    nothing and `wait` is a plain sleep, so callers need no special case."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []  # list.append takes no lock a re-entered handler could wait on
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def install(self) -> StopSignals:
        """Installs the handlers for good (a process that ends after its stop: a signal then is
        recorded, where the default handler would end it with a signal's status)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in self.SIGNALS}
        return self

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]  # what signal.signal returned
        self._previous = {}

    @property
    def first(self) -> int | None:
        """The first signal received, None before any."""
        return self.received[0] if self.received else None

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once a signal arrived; False when `timeout_s` passed first (None: no timeout)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.received:
            left = _POLL_S if end is None else min(_POLL_S, end - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)  # the handler runs during the sleep; the next round sees its mark
        return True
