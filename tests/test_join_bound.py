"""`Group.join` ends at its timeout when no master ever listens. torch's TCPStore client alone
does not: it tries a timed-out connect once more after a random delay, so a 3 s timeout took
7.3 s and a 9 s one 16.9 s (measured, torch 2.13), which let Dynamo's own 10 s limit on group
init fire first and shut a worker down (docs/dynamo.md). The same retry would hold up an abort key
set for a trainer that is gone."""

from __future__ import annotations

import time

import pytest

from refit_grpc.common import GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.errors import RefitTimeoutError


@pytest.mark.parametrize("timeout_s", [1.0, 3.0])
def test_a_join_with_no_master_ends_at_its_timeout(timeout_s, closed_port):
    spec = GroupSpec("127.0.0.1", closed_port, 2, 1, "gloo", "no-master")
    t0 = time.monotonic()
    with pytest.raises(RefitTimeoutError) as info:
        Group.join(spec, timeout_s)
    took = time.monotonic() - t0
    assert info.value.reason == "RENDEZVOUS_TIMEOUT"
    assert timeout_s - 0.05 <= took < timeout_s + 0.5, took


def test_an_abort_key_for_a_gone_trainer_gives_up_at_once_and_reaches_a_live_one(closed_port):
    """The shims' way to reach a vLLM/Dynamo worker blocked in a receive is a key in the
    trainer's TCPStore. With the trainer gone, torch's client alone would retry its connect for
    seconds and hold the abort up; `set_store_key` probes first."""
    from refit_grpc.dataplane.rendezvous import bind_master_store, set_store_key

    t0 = time.monotonic()
    assert set_store_key("127.0.0.1", closed_port, "refit_grpc/g/abort/1", 2.0) is False
    assert time.monotonic() - t0 < 0.5
    master = bind_master_store("127.0.0.1", 0, 2, 5)
    assert set_store_key("127.0.0.1", master.port, "refit_grpc/g/abort/1", 2.0) is True
    assert master.get("refit_grpc/g/abort/1") == b"1"


def _join_in_thread(spec, timeout_s, **kw):
    import threading

    box: dict = {}

    def run():
        try:
            box["group"] = Group.join(spec, timeout_s, **kw)
        except Exception as e:  # handed to the test
            box["error"] = e
        box["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_rank_0_names_the_ranks_that_never_came_and_the_others_end_with_it():
    """Rank 0 waits for every rank to reach its store before the backend's own rendezvous:
    at its deadline it names the ranks that never came, and the ranks that did are told at once
    (RENDEZVOUS_FAILED), not left waiting for their own, later deadline inside gloo."""
    from refit_grpc.dataplane.rendezvous import RendezvousTimeoutError, bind_master_store

    store = bind_master_store("127.0.0.1", 0, 4, 30)
    spec = lambda rank: GroupSpec("127.0.0.1", store.port, 4, rank, "gloo", "partial")  # noqa: E731
    peers = [_join_in_thread(spec(r), 60.0) for r in (1, 2)]
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        Group.join(spec(0), 3.0, store=store)
    gave_up = time.monotonic()
    assert 2.9 <= gave_up - t0 < 4.0, gave_up - t0
    assert info.value.missing_ranks == (3,)
    assert "ranks 3" in info.value.message
    for t, box in peers:
        t.join(5)
        assert box["error"].reason == "RENDEZVOUS_FAILED", box["error"]
        assert box["at"] - gave_up < 1.0


def test_a_cancel_ends_a_rank_waiting_inside_the_backends_rendezvous():
    """A rank that arrived and then never built the backend group (it died) leaves the others
    inside gloo's rendezvous, which nothing interrupts: with a `cancel`, the wait is abandoned
    at once (EPOCH_ABORTED) and the build dropped when it ends."""
    import datetime
    import threading

    import torch.distributed as dist

    from refit_grpc.dataplane.rendezvous import bind_master_store
    from refit_grpc.errors import EpochAbortedError

    store = bind_master_store("127.0.0.1", 0, 3, 30)
    spec = lambda rank: GroupSpec("127.0.0.1", store.port, 3, rank, "gloo", "one-died")  # noqa: E731
    # Rank 2 arrives, as Group.join would, and then builds nothing.
    ghost = dist.PrefixStore("refit_grpc/one-died", dist.TCPStore(
        "127.0.0.1", store.port, 3, is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10)))
    ghost.set("arrived/2", "1")
    ghost.add("arrivals", 1)
    cancels = [threading.Event(), threading.Event()]
    ranks = [_join_in_thread(spec(0), 60.0, store=store, cancel=cancels[0]),
             _join_in_thread(spec(1), 60.0, cancel=cancels[1])]
    time.sleep(2.0)  # both are inside gloo's rendezvous, waiting for rank 2
    assert all(t.is_alive() for t, _ in ranks)
    cancelled = time.monotonic()
    for c in cancels:
        c.set()
    for t, box in ranks:
        t.join(5)
        assert isinstance(box["error"], EpochAbortedError), box
        assert box["at"] - cancelled < 0.5


def test_a_cancel_ends_a_rank_whose_store_connect_hangs():
    """A master whose listener takes the connection and never answers (a trainer's store gone
    silent, or one too busy to accept; seen at 64 shims under load) leaves torch's store client
    waiting out its connect, then retrying it once: about 7 s for the first 3 s attempt, which
    nothing interrupts. An Abort (the `cancel`) must end the join at once, or the shim stays
    busy in InitCollective after the driver has given the formation up, and the driver's next
    formation is refused BUSY (seen: test_width's re-formation under a loaded `make check`)."""
    import socket
    import threading

    from refit_grpc.errors import EpochAbortedError

    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # listens, never accepts
    try:
        spec = GroupSpec("127.0.0.1", silent.getsockname()[1], 2, 1, "gloo", "silent-master")
        cancel = threading.Event()
        t, box = _join_in_thread(spec, 60.0, cancel=cancel)
        time.sleep(1.0)  # inside the store client's first connect attempt
        assert t.is_alive(), box
        cancelled = time.monotonic()
        cancel.set()
        t.join(5)
        assert isinstance(box.get("error"), EpochAbortedError), box
        assert box["at"] - cancelled < 0.5, box["at"] - cancelled
    finally:
        silent.close()
