"""`Group.join` ends at its timeout when no master ever listens. torch's TCPStore client alone
does not: it tries a timed-out connect once more after a random delay, so a 3 s timeout took
7.3 s and a 9 s one 16.9 s (measured, torch 2.13), which let Dynamo's own 10 s limit on group
init fire first and shut a worker down (docs/dynamo.md). The same retry would hold up an abort key
set for a trainer that is gone."""

from __future__ import annotations

import time

import pytest

from refit_grpc.collective import Group
from refit_grpc.common import GroupSpec
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
    from refit_grpc.collective import bind_master_store, set_store_key

    t0 = time.monotonic()
    assert set_store_key("127.0.0.1", closed_port, "refit_grpc/g/abort/1", 2.0) is False
    assert time.monotonic() - t0 < 0.5
    master = bind_master_store("127.0.0.1", 0, 2, 5)
    assert set_store_key("127.0.0.1", master.port, "refit_grpc/g/abort/1", 2.0) is True
    assert master.get("refit_grpc/g/abort/1") == b"1"
