"""`refit-grpc bench-catch-up`: an engine joining by catch-up from a peer against joining by the
trainer's epoch, side by side in one run (a benchmark: it reports and asserts nothing).

Reference engines in store mode, one shim process each: `peers` members that hold the fleet's
version in their committed copies, one newcomer caught up from them (`Fleet.catch_up`), and one
newcomer brought to the same version by the trainer (a staged epoch sent to it alone, which is
what joining by the next epoch costs that engine). The same bytes move in both; in the first the
trainer only makes the calls. Per rep the fleet first moves to a new version (a staged epoch to
the peers), then each newcomer is brought to it. Medians of `reps`.

One more row: an epoch the trainer asks for while a catch-up runs. Its peer cannot take a new
version into the copy it is sending, so `refit()` waits for the catch-up first; the row shows
that wait plus the epoch, against the epoch alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from refit_grpc.driver.options import Staged
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.testing.harness import Run
from refit_grpc.tools.bench import materialize
from refit_grpc.tools.bench_delta import bf16_specs, perturbed
from refit_grpc.tools.bench_memory import PROCESS_BASE_BYTES, Need, add_plan_arguments, fit


def catch_up_need(total_mb: float, peers: int, buffer_size_bytes: int) -> Need:
    """The run's resident memory, from its plan: `peers` + 2 shims, each with its live weights,
    its committed copy and a few buckets; the trainer two versions and two fleets' buffers."""
    plan = RefitPlan(tuple(bf16_specs(int(total_mb * (1 << 20)))), Packing(buffer_size_bytes, 2))
    total, bucket = plan.total_bytes, max(b.nbytes for b in plan.buckets)
    shim = 2 * total + 2 * bucket + PROCESS_BASE_BYTES
    trainer = 2 * total + 4 * bucket + PROCESS_BASE_BYTES
    return Need({f"{peers} peers and 2 newcomers": trainer + (peers + 2) * shim})


def run_bench_catch_up(peers: int = 2, total_mb: float = 1024, reps: int = 3,
                       buffer_size_bytes: int = 64 << 20, out=sys.stdout) -> dict[str, float]:
    """The comparison (module docstring); prints the table, returns the medians in seconds."""
    from refit_grpc.driver import Fleet, WorkerEndpoint

    run = Run("bench-catch-up", None, out)
    say = run.say
    specs = bf16_specs(int(total_mb * (1 << 20)))
    plan = RefitPlan(tuple(specs), Packing(buffer_size_bytes, 2))
    say(f"plan: {len(specs)} bf16 tensors, {plan.total_bytes / 1e6:.1f} MB, "
        f"{len(plan.buckets)} buckets; {peers} peer(s); {reps} reps")
    times: dict[str, list[float]] = {k: [] for k in (
        "peer_s", "peer_transfer_s", "peer_stall_s", "trainer_s", "epoch_s", "epoch_beside_s")}
    fleet = solo = None
    links = []
    try:
        shims = run.spawn_shims([("--model", "none", "--instance-id", name) for name in
                                 [*(f"peer-{i}" for i in range(peers)), "by-peer",
                                  "by-trainer"]], buffer_size_bytes)
        *peer_shims, by_peer, by_trainer = shims
        fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in peer_shims],
                      packing=plan.packing, epoch_timeout_s=600)
        fleet.prepare(plan.state_dict_info())
        link = fleet.connect("127.0.0.1")
        links.append(link)
        solo = Fleet([WorkerEndpoint(by_trainer.instance_id, by_trainer.address)],
                     packing=plan.packing, epoch_timeout_s=600)
        solo.prepare(plan.state_dict_info())
        solo_link = solo.connect("127.0.0.1")
        links.append(solo_link)
        newcomer = WorkerEndpoint(by_peer.instance_id, by_peer.address)
        g = torch.Generator().manual_seed(0)
        current = materialize(specs)
        version = 1
        fleet.refit(link, current, version=version, epoch=Staged())  # warm-up
        for _ in range(reps):
            current = perturbed(current, 0.01, g)
            version += 1
            t0 = time.monotonic()
            fleet.refit(link, current, version=version, epoch=Staged())
            times["epoch_s"].append(time.monotonic() - t0)

            fleet.add(newcomer)
            report = fleet.catch_up(newcomer.instance_id)
            times["peer_s"].append(report.seconds)
            times["peer_transfer_s"].append(report.transfer_seconds)
            times["peer_stall_s"].append(report.stall_seconds)
            fleet.remove(newcomer.instance_id)  # behind again for the next rep

            t0 = time.monotonic()
            solo.refit(solo_link, current, version=version, epoch=Staged())
            times["trainer_s"].append(time.monotonic() - t0)

        # An epoch asked for while a catch-up runs: the newcomer is caught up, then the group
        # formed again with it (one more member), then the epoch.
        current = perturbed(current, 0.01, g)
        version += 1
        fleet.refit(link, current, version=version, epoch=Staged())
        fleet.add(newcomer)
        fleet.catch_up_async(newcomer.instance_id)
        current = perturbed(current, 0.01, g)
        version += 1
        t0 = time.monotonic()
        fleet.refit(link, current, version=version, epoch=Staged())
        times["epoch_beside_s"].append(time.monotonic() - t0)
    finally:
        for ln in links:
            ln.close()
        for f in (fleet, solo):
            if f is not None:
                f.close()
        run.teardown()
    m = {k: statistics.median(v) for k, v in times.items() if v}
    mb = plan.total_bytes / 1e6
    say(f"{'to the fleet version':<44} {'ms':>8} {'vs trainer':>11}")
    say(f"{'newcomer from a peer (Fleet.catch_up)':<44} {m['peer_s'] * 1e3:8.0f} "
        f"{m['peer_s'] / m['trainer_s']:10.2f}x   (transfer {m['peer_transfer_s'] * 1e3:.0f} "
        f"ms, stall {m['peer_stall_s'] * 1e3:.0f} ms; the trainer sends 0 of {mb:.0f} MB)")
    say(f"{'newcomer from the trainer (a staged epoch)':<44} {m['trainer_s'] * 1e3:8.0f} "
        f"{1.0:10.2f}x   (the trainer sends {mb:.0f} MB)")
    say(f"{'the fleet epoch alone (' + str(peers) + ' peers)':<44} {m['epoch_s'] * 1e3:8.0f}")
    say(f"{'an epoch asked for during a catch-up':<44} {m['epoch_beside_s'] * 1e3:8.0f}"
        f"   (waits for the catch-up, then re-forms with the newcomer: one run)")
    return m


__all__ = ["catch_up_need", "run_bench_catch_up"]


def add_arguments(catch_up: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench-catch-up`."""
    add_plan_arguments(catch_up, reps="joins of each way", quick="one rep")
    catch_up.add_argument("--peers", type=int, default=2, help="members holding the version")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench-catch-up`: its plan fitted to the host's memory first."""
    if args.quick:
        args.total_mb, args.reps, args.buffer_size_bytes = args.total_mb or 8, 1, 1 << 20
    total_mb = fit(lambda mb: catch_up_need(mb, args.peers, args.buffer_size_bytes),
                   args.total_mb, f"bench-catch-up, {args.peers} peers")
    if total_mb is None:
        return 2
    run_bench_catch_up(peers=args.peers, total_mb=total_mb, reps=args.reps,
                       buffer_size_bytes=args.buffer_size_bytes)
    return 0
