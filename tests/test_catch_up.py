"""Catch-up from a peer (docs/protocol.md, "Catch-up from a peer"): an engine that joins gets the
fleet's version from a member's committed copy over a two-rank group of their own, the trainer
out of the transfer; fenced by the staged digest; a peer that dies mid-transfer is named and the
next one serves. Real gRPC on loopback, real gloo groups, reference engines in store mode; the
faults with real shim processes and real SIGKILLs."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from refit_grpc import CatchUpError, Checks, Fleet, Packing, Staged, WorkerEndpoint
from refit_grpc.driver.failures import WorkerFailure, failure_from_rpc
from refit_grpc.driver.plans import prepare_on
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

from support import (
    InProcessShim,
    connected,
    describe_or_none,
    digest_of,
    endpoint,
    endpoints,
    weights_in_mib,
)

weights = weights_in_mib(2)


def test_a_new_worker_catches_up_from_a_peer_and_joins_the_next_epoch(store_shims):
    a, b, c = store_shims(), store_shims(), store_shims()
    with Fleet([endpoint("a", a), endpoint("b", b)], packing=Packing(1 << 18, 2),
               epoch_timeout_s=20) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1), epoch=Staged(delta=True))
        fleet.refit(link, weights(2), epoch=Staged(delta=True))
        group_before = fleet.group_id

        fleet.add(endpoint("c", c))  # no plan, no group, version 0
        report = fleet.catch_up("c")
        assert (report.instance_id, report.version) == ("c", 2)
        assert report.peer in ("a", "b") and report.failed_peers == ()
        assert report.bytes == fleet.plan.total_bytes
        d = c.describe()
        assert (d.state, d.weight_version, d.paused) == (pb.SHIM_STATE_PREPARED, 2, False)
        assert d.weights_digest == digest_of(weights(2))
        # Its committed copy is the fleet's, so the next epoch may be a delta for it too.
        peer = a.describe()
        assert (d.committed_copy_version, d.committed_copy_digest) == \
            (peer.committed_copy_version, peer.committed_copy_digest) == (2, d.committed_copy_digest)
        # The trainer's group was not involved: the peers are still in it, serving.
        assert fleet.group_id == group_before
        assert (peer.state, peer.paused, peer.group_id) == (pb.SHIM_STATE_READY, False,
                                                            group_before)

        epoch = fleet.refit(link, weights(3), epoch=Staged(delta=True),
                            checks=Checks(verify=True))
        assert epoch.delta and [w.instance_id for w in epoch.workers] == ["a", "b", "c"]
        assert {w.weights_digest for w in epoch.workers} == {digest_of(weights(3))}
        print(f"\nCATCH-UP {report.bytes / 2**20:.0f} MiB from {report.peer}: "
              f"{report.seconds * 1e3:.0f} ms (transfer {report.transfer_seconds * 1e3:.0f} ms, "
              f"stall {report.stall_seconds * 1e3:.1f} ms); next epoch a delta over all three")


def test_no_peer_after_an_in_place_epoch_and_a_target_refusing_is_not_retried(store_shims):
    """NO_CATCH_UP_PEER where no member keeps a committed copy; a target that refuses on its
    own (it already holds the version) fails the catch-up at once, no other peer tried, and
    stays left behind."""
    a, b = store_shims(), store_shims()
    with Fleet([endpoint("a", a), endpoint("b", b)], packing=Packing(1 << 18, 2),
               epoch_timeout_s=20) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1))  # in place: nobody keeps a committed copy
        with pytest.raises(CatchUpError) as e:
            fleet.catch_up("b")
        assert e.value.reason == Reason.NO_CATCH_UP_PEER

        fleet.refit(link, weights(2), epoch=Staged())
        # As if a staged epoch had gone on without b.
        fleet.membership.leave_behind({fleet.membership.find("b"): WorkerFailure(
            "b", b.address, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", "as if it had died")})
        with pytest.raises(CatchUpError) as e:  # b holds version 2 already
            fleet.catch_up("b")
        assert e.value.reason == Reason.CATCH_UP_FAILED
        assert [(f.instance_id, f.reason) for f in e.value.failures] == \
            [("b", Reason.STALE_VERSION)]
        assert "b" in fleet.left_behind


def serve_request(peer: InProcessShim, **fields) -> pb.ServeCatchUpRequest:
    d = peer.describe()
    values = dict(version=d.committed_copy_version, staged_digest=d.committed_copy_digest,
                  plan_digest=d.plan_digest, listen_address="127.0.0.1", group_id="cu-test",
                  target_instance_id="n")
    values.update(fields)
    return pb.ServeCatchUpRequest(**values)


def refused(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call(request, timeout=10)
        if not isinstance(result, pb.CatchUpResponse):
            list(result)
    return e.value.code(), failure_from_rpc(WorkerEndpoint("t", "t"), e.value).reason


def test_every_bad_catch_up_request_is_refused_with_its_reason_and_changes_nothing(store_shims):
    peer, newcomer = store_shims(), store_shims()
    with Fleet([endpoint("p", peer)], packing=Packing(1 << 18, 2), epoch_timeout_s=20) as fleet:
        link = connected(fleet, weights(1))
        fleet.refit(link, weights(1), epoch=Staged())
        fleet.add(endpoint("n", newcomer))
        prepare_on(fleet.calls, fleet.plan, [fleet.membership.find("n").link])
        good = serve_request(peer)
        serve = peer.stub.ServeCatchUp
        assert refused(serve, serve_request(peer, version=2)) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.PEER_COPY_MISMATCH)
        assert refused(serve, serve_request(peer, staged_digest="0" * 64)) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.PEER_COPY_MISMATCH)
        assert refused(serve, serve_request(peer, group_id="")) == \
            (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_CATCH_UP)
        assert refused(serve, serve_request(peer, listen_address="")) == \
            (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_CATCH_UP)
        assert refused(serve, serve_request(peer, listen_address="10.9.8.7")) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.MASTER_NOT_ALLOWED)
        assert refused(serve, serve_request(peer, plan_digest="x")) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.PLAN_DIGEST_MISMATCH)
        assert refused(serve, serve_request(peer, instance_id="someone-else")) == \
            (grpc.StatusCode.FAILED_PRECONDITION, Reason.MEMBERSHIP_CHANGED)

        catch_up = newcomer.stub.CatchUp
        base = dict(version=1, staged_digest=good.staged_digest, plan_digest=good.plan_digest,
                    master_address="127.0.0.1", master_port=1, group_id="cu-test")
        for fields, expected in [
            (dict(version=0), (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_CATCH_UP)),
            (dict(staged_digest=""), (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_CATCH_UP)),
            (dict(master_port=0), (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_MASTER_PORT)),
            (dict(master_address="10.9.8.7"),
             (grpc.StatusCode.FAILED_PRECONDITION, Reason.MASTER_NOT_ALLOWED)),
            (dict(plan_digest="x"),
             (grpc.StatusCode.FAILED_PRECONDITION, Reason.PLAN_DIGEST_MISMATCH)),
        ]:
            assert refused(catch_up, pb.CatchUpRequest(**{**base, **fields})) == expected, fields

        # Served bytes that are not what the newcomer was told to expect: nothing is loaded.
        stream = serve(good, timeout=10)
        listening = next(stream)
        wrong = pb.CatchUpRequest(**{**base, "master_port": listening.master_port,
                                     "staged_digest": "f" * 64})
        assert refused(catch_up, wrong) == (grpc.StatusCode.FAILED_PRECONDITION,
                                            Reason.STAGED_DIGEST_MISMATCH)
        assert [m.phase for m in stream] == [pb.SERVE_CATCH_UP_PHASE_SENT]
        d = newcomer.describe()
        assert (d.state, d.weight_version, d.committed_copy_version, d.paused) == \
            (pb.SHIM_STATE_PREPARED, 0, 0, False)
        assert "STAGED_DIGEST_MISMATCH" in d.last_error
        p = peer.describe()  # the peer serves on, in its group, copy intact
        assert (p.state, p.paused, p.committed_copy_version) == (pb.SHIM_STATE_READY, False, 1)


MIB = 128  # large enough that a transfer is under way for a few hundred milliseconds


def fleet_of(procs) -> Fleet:
    return Fleet(endpoints(procs),
                 packing=Packing(4 << 20, 2), epoch_timeout_s=30)


def wait_for_bytes_from(peer: str, address: str) -> None:
    """Until the engine at `address` has received some of a catch-up from `peer` (not all)."""
    t0 = time.monotonic()
    while True:
        d = describe_or_none(address)
        if d.catching_up_from == peer and d.catch_up_bytes_received > 0:
            assert d.catch_up_bytes_received < MIB << 20, "the catch-up was done already"
            return
        assert time.monotonic() - t0 < 20, f"no bytes from {peer} in 20 s: {d}"
        time.sleep(0.001)


def test_a_peer_killed_mid_catch_up_is_named_and_the_next_peer_serves(shim_procs):
    p0, p1, x = (shim_procs("--model", "none", "--instance-id", name) for name in ("p0", "p1", "x"))
    with fleet_of([p0, p1]) as fleet:
        link = connected(fleet, weights(1, MIB))
        fleet.refit(link, weights(1, MIB), epoch=Staged())
        fleet.add(WorkerEndpoint("x", x.address))

        future = fleet.catch_up_async("x")
        wait_for_bytes_from("p0", x.address)
        p0.signal(signal.SIGKILL)  # the first peer tried, mid-transfer
        killed_at = time.monotonic()
        report = future.result(timeout=60)
        assert report.peer == "p1", report
        assert [f.instance_id for f in report.failed_peers][:1] == ["p0"], report.failed_peers
        d = describe_or_none(x.address)
        assert (d.weight_version, d.weights_digest) == (1, digest_of(weights(1, MIB)))
        print(f"\nFAULT peer killed mid catch-up: {report.failed_peers[0].reason} "
              f"({report.failed_peers[0].code.name}); caught up from p1 "
              f"{time.monotonic() - killed_at:.2f}s after the kill "
              f"({report.bytes / 2**20:.0f} MiB)")

        # The fleet's epochs go on: the dead peer is left behind, the newcomer is in.
        epoch = fleet.refit(link, weights(2, MIB), epoch=Staged(min_engines=2),
                            checks=Checks(verify=True))
        assert [f.instance_id for f in epoch.left_behind] == ["p0"]
        assert [w.instance_id for w in epoch.workers] == ["p1", "x"]
        assert {w.weights_digest for w in epoch.workers} == {digest_of(weights(2, MIB))}


def test_the_only_peer_killed_mid_catch_up_leaves_the_newcomer_as_it_was(shim_procs):
    p0, p1, x = (shim_procs("--model", "none", "--instance-id", name) for name in ("p0", "p1", "x"))
    with fleet_of([p0, p1, x]) as fleet:
        link = connected(fleet, weights(1, MIB))
        fleet.refit(link, weights(1, MIB), epoch=Staged())
        x.signal(signal.SIGKILL)  # x dies and comes back empty (a new instance, no plan)
        x.proc.wait(10)
        x2 = shim_procs("--model", "none", "--instance-id", "x2", "--address", x.address)
        fleet.refit(link, weights(2, MIB), epoch=Staged(min_engines=2))
        assert "x" in fleet.left_behind
        fleet.remove("p1")  # leaves p0 as the only peer

        future = fleet.catch_up_async("x")
        wait_for_bytes_from("p0", x2.address)
        p0.signal(signal.SIGKILL)
        with pytest.raises(CatchUpError) as e:
            future.result(timeout=60)
        assert e.value.reason == Reason.CATCH_UP_FAILED
        assert e.value.workers[0] == "p0", str(e.value)  # the root cause first
        d = describe_or_none(x2.address)
        # Not caught up, nothing loaded, not serving another version: it holds no weights.
        assert (d.weight_version, d.committed_copy_version, d.state) == \
            (0, 0, pb.SHIM_STATE_PREPARED)
        assert "x" in fleet.left_behind  # still out of the fleet's groups
        print(f"\nFAULT only peer killed mid catch-up: {e.value}")
