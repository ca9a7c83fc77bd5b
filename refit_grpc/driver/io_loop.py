"""The driver's one I/O thread: an asyncio event loop that every call to every shim waits on
(grpc.aio), so the trainer's thread count does not grow with its fleet.

Before, a formation's joins held a thread each until the whole group had formed, and an epoch's
streams a consumer thread each until they ended: a fleet of 1,000 engines meant 1,000 threads in
the trainer for every epoch. On the loop each wait is a coroutine (a few KB), and gRPC's own
completion queue delivers the answers to it.

The driver's public API stays synchronous: a caller's thread hands a coroutine to the loop
(`submit`, a `concurrent.futures.Future`) or waits for it (`run`). Code on the loop (a stream's
consumer, a user's `on_progress`) must never wait for the loop itself: `run` refuses there, with
a clear error instead of a deadlock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class IoLoop:
    """An asyncio event loop on a daemon thread of its own (module docstring).

    Args:
        name: the thread's name, as thread dumps show it.
    """

    def __init__(self, name: str = "refit-io"):
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            # Whatever is still pending at close is cancelled and given a turn to unwind.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(
                    asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    @property
    def on_loop(self) -> bool:
        """The calling thread is the loop's own."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop; its future resolves (on the loop's thread) as it ends.

        Raises:
            RuntimeError: the loop was closed (the coroutine is closed, never run).
        """
        if self._loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the driver's I/O loop is closed (the fleet was closed)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (or its exception).

        Raises:
            RuntimeError: called on the loop's own thread (it would wait for itself forever).
        """
        if self.on_loop:
            coro.close()
            raise RuntimeError("a blocking fleet call was made on the driver's I/O thread "
                               "(from an on_progress callback?): callbacks must not call the "
                               "fleet; hand the work to a thread of your own")
        return self.submit(coro).result()

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop's thread, soon (grpc.aio objects are touched only there); a
        no-op once the loop is closed."""
        if not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn)
            except RuntimeError:  # closed between the check and the call
                pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (pending coroutines are cancelled) and join its thread, bounded."""
        if self._thread.is_alive():
            self.call_soon(self._loop.stop)
            if not self.on_loop:
                self._thread.join(timeout_s)


__all__ = ["IoLoop"]
