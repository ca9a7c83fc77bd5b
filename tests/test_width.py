"""A fleet of 64 real shim processes (reference engines in store mode) forms, refits and forms
again (a new `Fleet`, a membership change), and a formation that cannot complete ends at once
and names the shim that caused it (issue: a fleet of a few dozen engines did not form, and the
error blamed the wrong shims).

Before: 40 shims never formed and 16 failed a second formation: torch's store listener formats
each accepted peer with a reverse lookup that stalled its accept loop for the resolver's 5 s
timeout now and then, the shims' store connects were capped at 3 s without retry, and the trainer
waited out its whole join timeout naming every shim DEADLINE_EXCEEDED
(`dataplane.rendezvous.bind_master_store`, `_connect_store`, `_await_arrivals`).
"""

from __future__ import annotations

import signal
import threading
import time
from functools import partial

import pytest

from refit_grpc import Checks, EpochFailedError, Fleet, FleetError, Staged
from refit_grpc.common import Deadline
from refit_grpc.errors import RefitError
from refit_grpc.plan import Packing
from refit_grpc.testing.forked_shims import ShimForkServer

from support import connected, digest_of, endpoint, endpoints, fleet_mid_epoch, info, weights_in_mib
from support import weights as support_weights

WIDTH = 64


weights = partial(support_weights, layers=8, shape=(64, 64), name="layer{i}.weight")


@pytest.fixture(scope="module")
def wide():
    """WIDTH shim processes for the whole module, forked from a server that has imported torch
    and the shim already (each its own process, gRPC server and gloo sockets; a fresh
    interpreter spends about 2 s importing torch, WIDTH of them minutes on 2 cores)."""
    with ShimForkServer() as server:
        shims = [server.start("--model", "none", "--instance-id", f"sc-{i}",
                              "--buffer-size-bytes", str(1 << 16), "--torch-threads", "1")
                 for i in range(WIDTH)]
        yield shims
        for s in shims:  # all at once: each takes about a second to stop gracefully
            if s.process.exitcode is None:
                s.signal(signal.SIGTERM)


def fleet_of(shims, **config) -> Fleet:
    """A Fleet of shims (forked or spawned: anything with an instance id and an address)."""
    config = {"packing": Packing(1 << 16, 2), "join_timeout_s": 90, "epoch_timeout_s": 60,
              **config}
    return Fleet(endpoints(shims), **config)


def refit_and_check(fleet: Fleet, link, version: int) -> None:
    w = weights(version)
    report = fleet.refit(link, w, version=version, checks=Checks(verify=True))
    expected = digest_of(w)
    assert len(report.workers) == len(fleet.members)
    assert {r.weights_digest for r in report.workers} == {expected}


def test_sixty_four_shims_form_refit_and_form_again(wide):
    with fleet_of(wide) as fleet:
        link = connected(fleet, weights(1))
        refit_and_check(fleet, link, 1)
        # A membership change forms the group again at the next epoch.
        fleet.remove(wide[-1].instance_id)
        refit_and_check(fleet, link, 2)
        fleet.add(endpoint(wide[-1].instance_id, wide[-1]))
        refit_and_check(fleet, link, 3)
        link.close()
    # A new Fleet (a trainer restarted) forms the same shims again.
    with fleet_of(wide) as fleet:
        link = connected(fleet, weights(1))
        refit_and_check(fleet, link, 4)
        link.close()


def test_a_join_that_fails_ends_the_formation_at_once_naming_its_shim(shim_procs, wide):
    """One shim of WIDTH + 1 refuses to join (the trainer's address is outside the networks it
    accepts a rendezvous from): the trainer stops waiting at once, not at its 90 s join
    deadline, names that shim first, and every other shim's join ends with it (the next
    formation of the WIDTH finds none of them busy)."""
    victim = shim_procs("--model", "none", "--instance-id", "victim", "--allow-master",
                        "10.0.0.0/8", "--buffer-size-bytes", str(1 << 16))
    shims = [*wide[:30], victim, *wide[30:]]
    with fleet_of(shims) as fleet:
        fleet.prepare(info(weights(1)))
        t0 = time.monotonic()
        with pytest.raises(FleetError) as err:
            fleet.connect("127.0.0.1")
        took = time.monotonic() - t0
    failures = err.value.failures
    assert failures[0].instance_id == "victim", [str(f) for f in failures[:3]]
    assert failures[0].reason == "MASTER_NOT_ALLOWED", str(failures[0])
    assert "victim" in str(err.value).split(";")[0]
    assert took < 10, took
    with fleet_of(wide) as fleet:
        link = connected(fleet, weights(1))
        refit_and_check(fleet, link, 5)
        link.close()


def os_threads() -> int:
    """This process's threads as the kernel counts them (gRPC's and gloo's included)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_the_trainers_threads_do_not_grow_with_the_fleet(wide):
    """Every call to a shim is a coroutine on the driver's one I/O thread: an epoch to WIDTH
    shims runs on as many trainer threads as one to 4 (before, each stream held a thread of its
    own and the trainer ran about 3 more threads per engine: 204 at 64 engines, 36 at 8)."""
    def threads_during_an_epoch(shims, version: int) -> int:
        # Sampled every 10 ms by a thread of the test's own (not counted) for the whole refit,
        # its streams open included. (Not from on_progress: a shim whose receive ended before
        # its first PROGRESS went out sends none, COMMITTED says it all, so a loaded machine
        # may deliver no PROGRESS at all.)
        seen: list[int] = []
        with fleet_of(shims) as fleet:
            link = connected(fleet, weights(1))
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    seen.append(os_threads() - 1)
                    done.wait(0.01)

            sampler = threading.Thread(target=sample, daemon=True, name="thread-sampler")
            sampler.start()
            try:
                fleet.refit(link, weights(version), version=version)
            finally:
                done.set()
                sampler.join(5)
            link.close()
        return max(seen)

    narrow = threads_during_an_epoch(wide[:4], 6)
    full = threads_during_an_epoch(wide, 7)
    print(f"trainer threads during an epoch: {narrow} with 4 shims, {full} with {len(wide)}")
    assert full - narrow <= 4, (narrow, full)


def test_five_shims_killed_mid_epoch_are_named_first_within_a_small_fleets_bound(wide):
    """Five of WIDTH shims SIGKILLed once every shim ACCEPTED an epoch, before its bytes: the
    sender stops, and the epoch's failure names those five first (UNAVAILABLE: root causes),
    then the survivors whose receives the fleet's abort tore down, within the bound of a
    3-shim fleet (tests/test_fleet.py: 10 s), not the 60 s epoch deadline. The last test of
    the module: it leaves five shims dead."""
    victims = [wide[i] for i in (3, 17, 30, 45, 60)]
    big = weights_in_mib(4)(8)  # 4 MiB in 64 KiB buckets: 64 buckets, far from sent at once
    with fleet_of(wide) as fleet:
        link, handle = fleet_mid_epoch(fleet, big, 8)
        for v in victims:
            v.signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RefitError):
            link.sender.send(big, Deadline(60, cancel=handle.failed))
        link.close()
        with pytest.raises(EpochFailedError) as err:
            handle.result()
        took = time.monotonic() - t0
    failures = err.value.failures
    print(f"{len(failures)} failures named in {took:.1f}s; first: "
          f"{[f.instance_id for f in failures[:6]]}")
    assert {f.instance_id for f in failures[:5]} == {v.instance_id for v in victims}, \
        [str(f) for f in failures[:7]]
    assert all(f.code.name == "UNAVAILABLE" for f in failures[:5]), [str(f) for f in failures[:5]]
    assert took < 10, took


def test_a_staged_epoch_at_width_flips_the_quorum_when_five_die_mid_staging(wide):
    """The shims still alive (the test above killed five) stage an epoch with a quorum of all but
    five; five more are SIGKILLed at the first bucket anywhere. The epoch flips every survivor
    to the trainer's bytes (checked digests), leaves the five behind by name, and the fleet goes
    on without them. The last test of the module: it leaves these five dead too."""
    import threading

    alive = [s for s in wide if s.process.exitcode is None]
    victims = alive[5:55:10]
    fired = threading.Event()

    def on_progress(*_progress) -> None:  # on the driver's I/O thread: os.kill does not block
        if not fired.is_set():
            fired.set()
            for v in victims:
                v.signal(signal.SIGKILL)

    big = weights_in_mib(4)
    with fleet_of(alive) as fleet:
        link = connected(fleet, big(9))
        # Whole again first: the test above left the shims that got bytes BROKEN, and a BROKEN
        # engine whose staged receive a dead peer broke is left behind, not tried again.
        fleet.refit(link, big(9), version=9)
        report = fleet.refit(link, big(10), version=10, checks=Checks(verify=True),
                             epoch=Staged(min_engines=len(alive) - len(victims)),
                             on_progress=on_progress)
        assert fired.is_set()
        assert sorted(f.instance_id for f in report.left_behind) == \
            sorted(v.instance_id for v in victims), [str(f) for f in report.left_behind]
        assert len(report.workers) == len(alive) - len(victims)
        assert {w.weights_digest for w in report.workers} == {digest_of(big(10))}
        # The next epoch runs on the survivors alone.
        after = fleet.refit(link, big(11), version=11, checks=Checks(verify=True))
        assert len(after.workers) == len(alive) - len(victims)
        link.close()
