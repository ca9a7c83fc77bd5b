"""Staged epochs across a fleet, with real shim processes, real gloo groups and real signals:
a dead engine costs the others nothing (they serve the previous version, never paused, never
BROKEN), `min_engines` decides whether the survivors flip, a trainer that dies before the flip
costs only the flip timeout, and an engine that staged other bytes is the only one left out
(docs/protocol.md, invariants 7-10)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time

import pytest

from refit_grpc import (
    Checks,
    EpochMode,
    Fleet,
    FleetState,
    FleetStateError,
    Packing,
    QuorumError,
    Staged,
    WorkerEndpoint,
)
from refit_grpc.driver.status import render_status, status_rows
from refit_grpc.errors import InternalError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Capabilities
from refit_grpc.shim.engines.reference import ReferenceEngine
from refit_grpc.shim.service import ShimConfig

from support import (
    InProcessShim,
    connected,
    describe_or_none,
    digest_of,
    endpoints,
    weights_in_mib,
)

BUCKET = 1 << 20


weights = weights_in_mib(16)


class Watch:
    """Describes every address every few milliseconds on a thread: what each engine was doing
    the whole time (was it ever paused, ever BROKEN)."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.seen: dict[str, set[tuple[int, bool]]] = {a: set() for a in addresses}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for a in self.addresses:
                d = describe_or_none(a, timeout_s=1.0)
                if d is not None:
                    self.seen[a].add((d.state, d.paused))
            time.sleep(0.005)

    def stop(self) -> dict[str, set[tuple[int, bool]]]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def kill_at_first_bucket(victim) -> tuple:
    """An on_progress callback that SIGKILLs `victim` once the first bucket has landed anywhere:
    mid-staging, with bytes already in every staging copy."""
    fired = threading.Event()

    def on_progress(instance_id: str, index: int, count: int) -> None:
        if not fired.is_set():
            fired.set()
            victim.signal(signal.SIGKILL)

    return on_progress, fired


def connected_fleet(shims, **config) -> tuple[Fleet, object]:
    fleet = Fleet(endpoints(shims),
                  packing=Packing(BUCKET, 2), epoch_timeout_s=20, **config)
    return fleet, connected(fleet, weights(1))


def test_a_staged_fleet_flips_every_engine_to_exactly_the_trainers_weights(shim_procs):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(3)]
    fleet, link = connected_fleet(shims)
    with fleet:
        for version in (1, 2, 3):
            report = fleet.refit(link, weights(version), epoch=Staged(),
                                 checks=Checks(verify=True))
            assert report.mode is EpochMode.STAGED and report.left_behind == ()
            assert [w.instance_id for w in report.workers] == ["w0", "w1", "w2"]
            assert {w.weights_digest for w in report.workers} == {digest_of(weights(version))}
            assert all(0 < w.load_seconds <= w.stall_seconds for w in report.workers)
            for s in shims:
                d = describe_or_none(s.address)
                assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_READY, False,
                                                                 version)
                # The engine serves from the committed copy itself (store mode), so staging
                # adds nothing after the first epoch; from the second (reversible) epoch on,
                # the previous version's buffer beside it.
                assert d.staging_bytes == fleet.plan.total_bytes * (0 if version == 1 else 1)
        rows = status_rows(fleet)  # what `refit-grpc fleet status` shows
        assert [r.last_stall_s for r in rows] == \
            pytest.approx([w.stall_seconds for w in report.workers])
        assert "STALL" in render_status(rows)
        print(f"\nSTAGED 3 engines x 16 MiB: epoch {report.seconds:.3f}s, broadcast "
              f"{report.broadcast_seconds:.3f}s, stall {report.stall_seconds * 1e3:.1f} ms")


@pytest.mark.parametrize("min_engines", [3, 4])
def test_sigkill_mid_staging_never_pauses_a_survivor(shim_procs, min_engines):
    shims = [shim_procs("--model", "none", "--instance-id", f"w{i}") for i in range(4)]
    fleet, link = connected_fleet(shims)
    with fleet:
        fleet.refit(link, weights(1), epoch=Staged())
        survivors = [s.address for i, s in enumerate(shims) if i != 1]
        watch = Watch(survivors)
        on_progress, fired = kill_at_first_bucket(shims[1])
        t0 = time.monotonic()
        if min_engines == 4:
            with pytest.raises(QuorumError) as e:
                fleet.refit(link, weights(2), epoch=Staged(min_engines=4),
                            on_progress=on_progress)
            assert e.value.workers[0] == "w1", str(e.value)
            expected_version, expected = 1, weights(1)
        else:
            report = fleet.refit(link, weights(2), epoch=Staged(min_engines=3),
                                 on_progress=on_progress)
            assert [f.instance_id for f in report.left_behind] == ["w1"], report.left_behind
            assert [w.instance_id for w in report.workers] == ["w0", "w2", "w3"]
            assert report.reforms == 1
            expected_version, expected = 2, weights(2)
        seconds = time.monotonic() - t0
        seen = watch.stop()
        assert fired.is_set()
        assert "w1" in fleet.left_behind and [e.instance_id for e in fleet.members] == \
            ["w0", "w2", "w3"]
        for address in survivors:
            states = {state for state, _ in seen[address]}
            # Only a flip pauses (briefly, in STAGED): staging and the re-forming never do.
            assert all(state == pb.SHIM_STATE_STAGED for state, paused in seen[address]
                       if paused), seen[address]
            assert pb.SHIM_STATE_BROKEN not in states and pb.SHIM_STATE_RECEIVING not in states
            d = describe_or_none(address)
            assert (d.weight_version, d.paused) == (expected_version, False)
            assert d.weights_digest == digest_of(expected)
        if min_engines == 4:
            # Nothing flipped, so no survivor was paused at any moment of it.
            assert all(not paused for a in survivors for _, paused in seen[a])
            link = fleet.connect("127.0.0.1")  # a failed epoch ends the group, as in place
        # The next epoch goes on with the three, the trainer calling nothing but refit.
        report = fleet.refit(link, weights(3), epoch=Staged())
        assert [w.instance_id for w in report.workers] == ["w0", "w2", "w3"]
        # The dead engine comes back (same address, same name), is readmitted, catches up.
        shims[1] = shim_procs("--model", "none", "--instance-id", "w1",
                              "--address", shims[1].address)
        fleet.readmit("w1")
        link = connected(fleet, weights(1))
        report = fleet.refit(link, weights(4), epoch=Staged(), checks=Checks(verify=True))
        assert [w.instance_id for w in report.workers] == ["w0", "w1", "w2", "w3"]
        assert {w.weights_digest for w in report.workers} == {digest_of(weights(4))}
    print(f"\nFAULT staged sigkill, min_engines={min_engines}: settled in {seconds:.2f}s, "
          f"survivors never BROKEN, states seen {sorted({s for a in survivors for s, _ in seen[a]})}")


TRAINER = """
import sys, time, torch
from refit_grpc import Fleet, Packing, Staged, WorkerEndpoint
from refit_grpc.dataplane.staging import StagedDigest
addresses = sys.argv[1:]
w = {f"layer.{i}": torch.randn(256 * 1024) for i in range(8)}
fleet = Fleet([WorkerEndpoint(f"w{i}", a) for i, a in enumerate(addresses)],
              packing=Packing(1 << 20, 2), epoch_timeout_s=60, flip_timeout_s=30.0)
fleet.prepare({n: (t.shape, t.dtype) for n, t in w.items()})
link = fleet.connect("127.0.0.1")
handle = fleet.update_weights(1, epoch=Staged())
handle.wait_accepted()
link.sender.send(w, handle.send_deadline(), checksums=StagedDigest(fleet.plan))
finals, failures = handle.settle()
assert not failures and all(m.phase == 4 for m in finals), failures
print("staged", flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_before_the_flip_costs_only_the_flip_timeout(shim_procs):
    # The flip timeout (30 s) must outlast the status checks before the kill: on a loaded CI
    # machine (4 workers on 2 cores) 10 s once passed between STAGED and them.
    shims = [shim_procs("--model", "none") for _ in range(3)]
    addresses = [s.address for s in shims]
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, *addresses],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "staged"
        assert all(describe_or_none(a).state == pb.SHIM_STATE_STAGED for a in addresses)
        with Fleet([WorkerEndpoint(f"w{i}", a) for i, a in enumerate(addresses)]) as operator:
            rows = status_rows(operator)
        assert [(r.state, r.version, r.staged_version) for r in rows] == [("STAGED", 0, 1)] * 3
        assert "0 (staged 1)" in render_status(rows)
        watch = Watch(addresses)
        trainer.kill()
        trainer.wait(10)
        t0 = time.monotonic()
        while any(describe_or_none(a).staged_version for a in addresses):
            assert time.monotonic() - t0 < 45, "a staged copy outlived its flip timeout"
            time.sleep(0.05)
        dropped_after = time.monotonic() - t0
        seen = watch.stop()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
    for a in addresses:
        d = describe_or_none(a)
        assert (d.state, d.paused, d.weight_version) == (pb.SHIM_STATE_READY, False, 0)
        assert "no Flip in time" in d.last_error
        assert not any(paused for _, paused in seen[a])
    print(f"\nFAULT staged trainer killed before the flip: copies dropped {dropped_after:.2f}s "
          "after (flip timeout 30 s from STAGED), never paused")


class CorruptStaging(ReferenceEngine):
    """Flips one staged byte of the first bucket as it lands, before its checksum: the engine
    stages other bytes than the trainer sent."""

    def _on_staged(self, bucket, view) -> None:
        if bucket.index == 0:
            view[0] ^= 0xFF


@pytest.mark.parametrize("min_engines", [2, 3])
def test_an_engine_that_staged_other_bytes_is_the_only_one_left_out(min_engines):
    shims = [InProcessShim(engine, ShimConfig(max_epoch_s=20))
             for engine in (ReferenceEngine(model=None), CorruptStaging(model=None),
                            ReferenceEngine(model=None))]
    try:
        fleet = Fleet(endpoints(shims, "s"),
                      packing=Packing(1 << 16, 2), epoch_timeout_s=20)
        with fleet:
            t = weights(1, mib=1)
            link = connected(fleet, t)
            if min_engines == 3:
                with pytest.raises(QuorumError) as e:
                    fleet.refit(link, t, epoch=Staged(min_engines=3))
                assert e.value.workers == ["s1"] and e.value.reasons == {"STAGED_DIGEST_MISMATCH"}
                assert all(s.describe().weight_version == 0 for s in shims)
            else:
                report = fleet.refit(link, t, epoch=Staged(min_engines=2))
                assert [f.reason for f in report.left_behind] == ["STAGED_DIGEST_MISMATCH"]
                assert [w.instance_id for w in report.workers] == ["s0", "s2"]
                assert [s.describe().weight_version for s in shims] == [1, 0, 1]
            d = shims[1].describe()
            # Its copy is dropped at once (not at the flip timeout); it serves what it had.
            assert (d.state, d.paused, d.staged_version) == (pb.SHIM_STATE_PREPARED, False, 0)
    finally:
        for s in shims:
            s.close()


class CannotStage(ReferenceEngine):
    """An engine that refuses staged epochs (STAGING_UNSUPPORTED, before ACCEPTED)."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, staging=False)


def test_a_refusal_leaves_only_the_refusing_engine_behind():
    shims = [InProcessShim(engine, ShimConfig(max_epoch_s=20))
             for engine in (ReferenceEngine(model=None), CannotStage(model=None),
                            ReferenceEngine(model=None))]
    try:
        fleet = Fleet(endpoints(shims, "s"),
                      packing=Packing(1 << 16, 2), epoch_timeout_s=20)
        with fleet:
            t = weights(1, mib=1)
            link = connected(fleet, t)
            report = fleet.refit(link, t, epoch=Staged(min_engines=2))
            # The refusal aborted the round before any byte moved; the other two went on in a
            # group formed again without the refusing engine.
            assert [(f.instance_id, f.reason) for f in report.left_behind] == \
                [("s1", "STAGING_UNSUPPORTED")]
            assert report.reforms == 1
            assert [s.describe().weight_version for s in shims] == [1, 0, 1]
            assert not shims[1].describe().paused
            # The next epoch runs on the two without the trainer doing anything else.
            report = fleet.refit(link, weights(2, mib=1), epoch=Staged())
            assert [w.instance_id for w in report.workers] == ["s0", "s2"]
    finally:
        for s in shims:
            s.close()


class FailsOnceStaged(ReferenceEngine):
    """Lands every byte, then fails its staging (a lost copy, once the other engines staged
    theirs): the round fails after everyone else staged, so no engine is left to re-form the
    group for and the epoch's abort ends it."""

    def stage(self, plan, deadline, on_bucket, delta=False, keep_previous=False) -> str:
        super().stage(plan, deadline, on_bucket, delta, keep_previous)
        time.sleep(0.5)  # the others' STAGED reach the trainer first
        raise InternalError("the staging copy was lost (the test's fault)")


def test_a_quorum_flipped_with_its_group_gone_lets_the_next_refit_form_it_again():
    """Found in CI at 160 engines (a whole process SIGKILLed as its bytes landed): every
    survivor had staged, so nothing re-formed the group the epoch's abort ended, and the next
    refit() raised FLEET_NOT_CONNECTED. It forms the group again, as after any membership
    change."""
    shims = [InProcessShim(engine, ShimConfig(max_epoch_s=20))
             for engine in (ReferenceEngine(model=None), FailsOnceStaged(model=None),
                            ReferenceEngine(model=None))]
    try:
        fleet = Fleet(endpoints(shims, "s"), packing=Packing(1 << 16, 2), epoch_timeout_s=20)
        with fleet:
            link = connected(fleet, weights(1, mib=1))
            report = fleet.refit(link, weights(1, mib=1), epoch=Staged(min_engines=2))
            assert [(f.instance_id, f.reason) for f in report.left_behind] == \
                [("s1", "INTERNAL_ERROR")], report.left_behind
            assert report.reforms == 0  # nobody was left to send to again
            assert [s.describe().weight_version for s in shims] == [1, 0, 1]
            report = fleet.refit(link, weights(2, mib=1), epoch=Staged(),
                                 checks=Checks(verify=True))
            assert [w.instance_id for w in report.workers] == ["s0", "s2"]
            assert {w.weights_digest for w in report.workers} == {digest_of(weights(2, mib=1))}
            assert fleet.state is FleetState.CONNECTED
            # And an in-place epoch after it, the same way.
            report = fleet.refit(link, weights(3, mib=1), checks=Checks(verify=True))
            assert [w.instance_id for w in report.workers] == ["s0", "s2"]
    finally:
        for s in shims:
            s.close()


def test_a_fleet_whose_every_engine_is_left_behind_refuses_typed_until_one_is_readmitted():
    """A one-engine fleet whose staged epoch failed (its engine left behind, serving what it
    had): the failed epoch ended the group (the next refit() says FLEET_NOT_CONNECTED), and
    connect() has nobody to form one with. It is refused at once, typed (NO_MEMBERS, naming
    the engine left behind and why), not a group of the trainer alone (before: "world_size
    must be >= 2"); `readmit()` brings the engine back and the next epoch goes through."""
    shim = InProcessShim(FailsOnceStaged(model=None), ShimConfig(max_epoch_s=20))
    try:
        with Fleet(endpoints([shim], "s"), packing=Packing(1 << 16, 2),
                   epoch_timeout_s=20) as fleet:
            link = connected(fleet, weights(1, mib=1))
            with pytest.raises(QuorumError):
                fleet.refit(link, weights(1, mib=1), epoch=Staged())
            assert list(fleet.left_behind) == ["s0"]
            with pytest.raises(FleetStateError) as refused:  # the failed epoch ended the group
                fleet.refit(link, weights(1, mib=1), epoch=Staged())
            assert refused.value.reason == Reason.FLEET_NOT_CONNECTED, refused.value
            with pytest.raises(FleetStateError) as refused:
                fleet.connect("127.0.0.1")
            assert refused.value.reason == Reason.NO_MEMBERS, refused.value
            assert "s0: " in str(refused.value) and "INTERNAL_ERROR" in str(refused.value)
            fleet.readmit("s0")
            link = fleet.connect("127.0.0.1")
            # In place: this engine fails every staging.
            report = fleet.refit(link, weights(2, mib=1), checks=Checks(verify=True))
            assert [w.weights_digest for w in report.workers] == [digest_of(weights(2, mib=1))]
    finally:
        shim.close()
