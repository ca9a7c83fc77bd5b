"""A fleet wider than every pool the driver or a shim has: 160 engine servicers in 4 shim
processes (`refit-grpc shim --engines 40`, each process one receiving rank shared by its 40
engines), on real gRPC servers, real streams per engine and a real gloo group of 5 ranks.

Each engine is its own RefitService with its own port, state, plan, weights and epoch stream; the
engines of a process share its rank in the data group (`refit_grpc.dataplane.shared_rank`). The fleet
forms, commits in place and staged (and as deltas), is refused, aborts, forms again after a
membership change, serves a catch-up and flips with a quorum when a whole process dies mid-staging.
"""

from __future__ import annotations

import signal
import threading
from functools import partial

import pytest

from refit_grpc import Checks, Fleet, FleetError, Staged
from refit_grpc.plan import Packing
from refit_grpc.proto import pb
from refit_grpc.testing.forked_shims import ShimForkServer

from support import connected, digest_of, endpoint, endpoints, weights_in_mib
from support import weights as support_weights

PROCESSES = 4
ENGINES = 40  # per process: 160 in all, past the driver's old 64-thread pool and a shim's 32

weights = partial(support_weights, layers=8, shape=(64, 64), name="layer{i}.weight")


@pytest.fixture(scope="module")
def hosts():
    """PROCESSES shim processes of ENGINES engines each (forked: torch is imported once); the
    engines per process, in order."""
    with ShimForkServer() as server:
        yield [server.start_engines(ENGINES, "--model", "none", "--instance-id", f"h{h}",
                                    "--buffer-size-bytes", str(1 << 16), "--torch-threads", "1")
               for h in range(PROCESSES)]


def fleet_of(shims, **config) -> Fleet:
    config = {"packing": Packing(1 << 16, 2), "join_timeout_s": 90, "epoch_timeout_s": 90,
              **config}
    return Fleet(endpoints(shims), **config)


def flat(hosts) -> list:
    return [s for engines in hosts for s in engines]


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_engines_of_one_process_share_one_rank_and_the_world_counts_it_once(hosts):
    shims = flat(hosts)
    with fleet_of(shims) as fleet:
        link = connected(fleet, weights(1))
        about = fleet.describe(weights_digest=False)
        names = [{d.shared_rank for d in about[h * ENGINES:(h + 1) * ENGINES]}
                 for h in range(PROCESSES)]
        assert all(len(n) == 1 and "" not in n for n in names), names
        assert len(set.union(*names)) == PROCESSES
        assert fleet.inference_world_size == PROCESSES
        ranks = {d.rank_offset for d in about}
        assert ranks == set(range(1, PROCESSES + 1)), ranks
        link.close()


def test_a_fleet_wider_than_every_pool_commits_in_place_staged_and_as_deltas(hosts):
    shims = flat(hosts)
    threads: list[int] = []
    with fleet_of(shims) as fleet:
        link = connected(fleet, weights(1))
        report = fleet.refit(link, weights(1), version=1, checks=Checks(verify=True),
                             on_progress=lambda *p: threads.append(os_threads()))
        assert len(report.workers) == len(shims)
        assert {w.weights_digest for w in report.workers} == {digest_of(weights(1))}
        for version in (2, 3):
            report = fleet.refit(link, weights(version), version=version,
                                 epoch=Staged(delta=True), checks=Checks(verify=True))
            assert {w.weights_digest for w in report.workers} == {digest_of(weights(version))}
            assert report.delta == (version == 3)  # the first keeps the base, the next sends a delta
        # Refused by every engine, nothing applied: a version that is not newer.
        with pytest.raises(FleetError) as err:
            fleet.refit(link, weights(9), version=2)
        assert len(err.value.failures) == len(shims), len(err.value.failures)
        assert {f.reason for f in err.value.failures} == {"STALE_VERSION"}, \
            {f.reason for f in err.value.failures}
        assert {d.weights_digest for d in fleet.describe()} == {digest_of(weights(3))}
        link.close()
    print(f"trainer threads during an epoch to {len(shims)} engines: {max(threads)}")
    assert max(threads) < 40, threads  # the trainer's threads do not grow with the fleet


def test_a_wide_fleet_aborts_forms_again_and_catches_an_engine_up(hosts):
    shims = flat(hosts)
    newcomer, members = shims[-1], shims[:-1]
    with fleet_of(members) as fleet:
        link = connected(fleet, weights(4))
        fleet.refit(link, weights(4), version=4, epoch=Staged())
        fleet.abort("operator")
        assert {d.state for d in fleet.describe(weights_digest=False)} == {pb.SHIM_STATE_PREPARED}
        # A membership change: the next epoch forms the group again, without one engine.
        fleet.remove(members[7].instance_id)
        report = fleet.refit(link, weights(5), version=5, epoch=Staged(),
                             checks=Checks(verify=True))
        assert len(report.workers) == len(members) - 1
        # The newcomer catches up from a peer's committed copy (a two-rank group of its own).
        fleet.add(endpoint(newcomer.instance_id, newcomer))
        caught = fleet.catch_up(newcomer.instance_id)
        assert caught.version == 5 and caught.peer in {s.instance_id for s in members}
        assert newcomer_digest(newcomer) == digest_of(weights(5))
        fleet.add(endpoint(members[7].instance_id, members[7]))
        report = fleet.refit(link, weights(6), version=6, epoch=Staged(),
                             checks=Checks(verify=True))
        assert len(report.workers) == len(members) + 1
        assert {w.weights_digest for w in report.workers} == {digest_of(weights(6))}
        assert fleet.describe()  # every member answers
        link.close()


def newcomer_digest(shim) -> str:
    import grpc

    from refit_grpc.proto import pb_grpc

    with grpc.insecure_channel(shim.address) as channel:
        return pb_grpc.RefitServiceStub(channel).Describe(pb.DescribeRequest(), timeout=30
                                                          ).weights_digest


def test_a_quorum_flips_when_a_whole_process_dies_mid_staging(hosts):
    """One process's 40 engines SIGKILLed (one signal) at the first bucket anywhere, the quorum
    all but 40: the other 120 flip to the trainer's bytes, the 40 are left behind by name. The
    last test of the module: it leaves that process dead."""
    shims = flat(hosts)
    victims = hosts[2]
    fired = threading.Event()

    def on_progress(*_progress) -> None:
        if not fired.is_set():
            fired.set()
            victims[0].signal(signal.SIGKILL)

    big = weights_in_mib(4)
    with fleet_of(shims) as fleet:
        link = connected(fleet, big(20))
        fleet.refit(link, big(20), version=20)
        report = fleet.refit(link, big(21), version=21, checks=Checks(verify=True),
                             epoch=Staged(min_engines=len(shims) - len(victims)),
                             on_progress=on_progress)
        assert fired.is_set()
        assert sorted(f.instance_id for f in report.left_behind) == \
            sorted(v.instance_id for v in victims), [str(f) for f in report.left_behind[:5]]
        assert len(report.workers) == len(shims) - len(victims)
        assert {w.weights_digest for w in report.workers} == {digest_of(big(21))}
        after = fleet.refit(link, big(22), version=22, checks=Checks(verify=True))
        assert len(after.workers) == len(shims) - len(victims)
        link.close()


@pytest.mark.parametrize("flags, says", [
    (["--engine", "vllm"], "the vllm engine receives through its own workers' ranks"),
    (["--metrics-address", "0"], "no per-process endpoint yet"),
])
def test_a_shim_of_several_engines_refuses_what_cannot_share_a_process(flags, says):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "refit_grpc.cli", "shim", "--engines", "2",
                           "--address", "127.0.0.1:0", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and says in proc.stderr, (proc.returncode, proc.stderr[-2000:])
