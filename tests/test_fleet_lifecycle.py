"""The driver owns what it starts: `Fleet.close()` ends open epochs and its one I/O thread, and
properties do no I/O (the packing is negotiated by a method, never by an attribute read)."""

from __future__ import annotations

import threading
import time

import pytest

from refit_grpc import EpochRefusedError, Fleet, Packing, WorkerEndpoint
from refit_grpc.driver.epoch import StreamPhase
from refit_grpc.driver.failures import odd_digests
from refit_grpc.shim.engines.reference import ReferenceEngine

from support import endpoints, fleet_mid_epoch, tensors_v


def driver_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("refit-io")}


def test_close_ends_an_open_epoch_and_joins_its_threads(shim):
    shims = [shim(ReferenceEngine(model=None)) for _ in range(2)]
    before = driver_threads()
    fleet = Fleet(endpoints(shims, "w"),
                  packing=Packing(4096, 2), epoch_timeout_s=60)
    link, handle = fleet_mid_epoch(fleet, tensors_v(2), 2, committed=tensors_v(1))
    # Two streams are open, on the fleet's one I/O thread: no thread per stream.
    (io_thread,) = driver_threads() - before
    assert not handle.closed and handle.phases() == [StreamPhase.ACCEPTED] * 2
    assert not [t for t in threading.enumerate() if t.name.startswith(("epoch-stream", "join"))]
    # The group stays up and nothing is sent: without close() the streams would wait out the
    # 60 s epoch deadline.
    t0 = time.monotonic()
    fleet.close()
    assert handle.closed and time.monotonic() - t0 < 10
    assert not io_thread.is_alive()
    link.close()
    with pytest.raises(RuntimeError, match="closed"):
        fleet.update_weights(3)


def test_sender_spec_does_no_io_and_negotiation_is_explicit(shim):
    s = shim(ReferenceEngine(model=None, packing=Packing(8192, 3)))
    # Nothing listens at port 1: a property that made an RPC would fail or hang here.
    unreachable = Fleet([WorkerEndpoint("w", "127.0.0.1:1")])
    with pytest.raises(RuntimeError, match="packing is not known yet"):
        _ = unreachable.sender_spec
    unreachable.close()
    fleet = Fleet([WorkerEndpoint("w", s.address)])
    try:
        assert fleet.negotiate_packing() == Packing(8192, 3)
        assert fleet.sender_spec == Packing(8192, 3)
    finally:
        fleet.close()


@pytest.mark.parametrize("digests,majority,odd", [
    (["a", "a", "a"], "a", []),
    (["a", "b", "a"], "a", [1]),
    (["a", "b"], None, [0, 1]),
    (["a", ""], "a", [1]),
    (["", ""], None, [0, 1]),
])
def test_odd_digests_names_every_engine_outside_the_largest_group(digests, majority, odd):
    assert odd_digests(digests) == (majority, odd)


def test_the_fleets_state_is_derived_and_misuse_is_typed(shim):
    """EMPTY -> PREPARED -> CONNECTED -> (an epoch refused) PREPARED -> CLOSED, each step
    derived from what the fleet holds; a call made in the wrong state raises FleetStateError
    (a RuntimeError) with a Reason a trainer can branch on, before any RPC."""
    from refit_grpc.driver.config import FleetState, FleetStateError
    from refit_grpc.errors import InvalidArgumentError
    from refit_grpc.reasons import Reason

    s = shim(ReferenceEngine(model=None))
    fleet = Fleet([WorkerEndpoint("w", s.address)], packing=Packing(4096, 2), epoch_timeout_s=30)
    assert fleet.state is FleetState.EMPTY
    for call in (lambda: fleet.update_weights(1), lambda: fleet.connect("127.0.0.1"),
                 lambda: fleet.init_collective("127.0.0.1", 1234, 2, train_world_size=1)):
        with pytest.raises(FleetStateError) as e:
            call()
        assert e.value.reason == Reason.FLEET_NOT_PREPARED and isinstance(e.value, RuntimeError)
    fleet.prepare({n: (t.shape, t.dtype) for n, t in tensors_v(1).items()})
    assert fleet.state is FleetState.PREPARED
    with pytest.raises(FleetStateError) as e:
        fleet.update_weights(1)
    assert e.value.reason == Reason.FLEET_NOT_CONNECTED
    link = fleet.connect("127.0.0.1")
    assert fleet.state is FleetState.CONNECTED
    fleet.refit(link, tensors_v(1), version=1)
    with pytest.raises(EpochRefusedError):  # version 1 is not newer
        fleet.refit(link, tensors_v(1), version=1)
    assert fleet.state is FleetState.PREPARED  # the refusal ended the group
    with pytest.raises(FleetStateError) as e:
        fleet.update_weights(2)
    assert e.value.reason == Reason.FLEET_NOT_CONNECTED and "connect()" in e.value.message
    link.close()
    fleet.close()
    assert fleet.state is FleetState.CLOSED
    with pytest.raises(FleetStateError) as e:
        fleet.prepare({n: (t.shape, t.dtype) for n, t in tensors_v(1).items()})
    assert e.value.reason == Reason.FLEET_CLOSED
    # The configuration is validated once, typed.
    for bad, reason in (({"engine_world_size": 0}, Reason.INVALID_WORLD_SIZE),
                        ({"backend": "mpi"}, Reason.INVALID_BACKEND),
                        ({"epoch_timeout_s": 0}, Reason.INVALID_ARGUMENT)):
        with pytest.raises(InvalidArgumentError) as e:
            Fleet([WorkerEndpoint("w", s.address)], **bad)
        assert e.value.reason == reason, bad
