"""The driver's one I/O thread (`driver.io_loop.IoLoop`): pure logic of the loop itself; the
calls it carries are tested against real shims everywhere else (test_fleet, test_width...)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from refit_grpc.driver.io_loop import IoLoop


def test_coroutines_run_on_the_loops_one_thread_and_their_results_come_back():
    io = IoLoop()
    try:
        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert io.run(where()) == "refit-io"
        futures = [io.submit(where()) for _ in range(100)]
        assert {f.result(timeout=5) for f in futures} == {"refit-io"}

        async def fails() -> None:
            raise ValueError("the coroutine's own error")

        with pytest.raises(ValueError, match="own error"):
            io.run(fails())
    finally:
        io.close()


def test_a_blocking_call_from_the_loops_own_thread_is_refused_not_deadlocked():
    io = IoLoop()
    try:
        async def nested() -> str:
            async def inner() -> int:
                return 1

            try:
                io.run(inner())  # what an on_progress callback calling the fleet would do
            except RuntimeError as e:
                return str(e)
            return "no error"

        assert "on the driver's I/O thread" in io.run(nested())
    finally:
        io.close()


def test_close_cancels_what_is_pending_and_ends_the_thread():
    before = set(threading.enumerate())
    io = IoLoop(name="refit-io-closing")
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    pending = io.submit(forever())
    assert started.wait(5)
    (thread,) = [t for t in set(threading.enumerate()) - before
                 if t.name == "refit-io-closing"]
    io.close()
    assert not thread.is_alive()
    assert pending.cancelled()
    with pytest.raises(RuntimeError, match="closed"):
        io.submit(forever())
