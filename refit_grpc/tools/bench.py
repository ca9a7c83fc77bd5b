"""Side-by-side refit timing: the full protocol against the raw collective and against the
HTTP-JSON way (the seed's), in one run.

All arms move the same plan, packed the same way, to the same number of receiver processes:
- raw: receivers that only loop `receive()` on a gloo group (no gRPC, no state machine); the
  trainer times the broadcast of every bucket until every receiver has reported back.
- refit_grpc: `Fleet.refit()` against shim processes (UpdateWeights, two-phase start, broadcast,
  COMMITTED from every shim, no flush).
- HTTP-JSON: the seed's control plane (`refit_grpc.tools.bench_http`): per worker, JSON posts to start,
  update (blocking while the trainer broadcasts) and finish, same engine and receiver.
The ratios are each control plane's overhead on top of moving the bytes.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from refit_grpc.collective import Group, Sender, receive
from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.driver import Fleet, WorkerEndpoint
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.shim.process import spawn_shim
from refit_grpc.testing.ports import free_port


def _tensors(total_mb: float, n: int) -> dict[str, torch.Tensor]:
    per = max(1, int(total_mb * (1 << 20) / 4 / n))
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def raw_receiver(port: int, world: int, rank: int, total_mb: float, n: int, buf: int,
                  reps: int) -> None:
    torch.set_num_threads(1)
    plan = RefitPlan.from_tensors(_tensors(total_mb, n).items(), Packing(buf, 2))
    group = Group.join(GroupSpec("127.0.0.1", port, world, rank, "gloo", "bench"), 60)
    ack = torch.zeros(1)
    for _ in range(reps):
        receive(group, plan, Deadline(120), lambda b, it: [None for _ in it])
        # Report completion the cheapest way there is: one more broadcast round from rank 0.
        group.broadcast_async(ack, Deadline(60)).wait(Deadline(60), "ack")
    group.close()


def run_bench(workers: int = 2, total_mb: float = 64, tensors: int = 64,
              buffer_size_bytes: int = 16 << 20, reps: int = 5, out=sys.stdout) -> int:
    """Sets all three arms up side by side, then interleaves them rep by rep (raw, refit_grpc,
    HTTP-JSON, raw, ...) so background load hits every arm alike."""
    from refit_grpc.tools.bench_http import HttpFleet

    weights = _tensors(total_mb, tensors)
    plan = RefitPlan.from_tensors(weights.items(), Packing(buffer_size_bytes, 2))
    print(f"plan: {len(plan.tensors)} tensors, {plan.total_bytes / 1e6:.1f} MB, "
          f"{len(plan.buckets)} buckets of <= {buffer_size_bytes >> 20} MiB; {workers} receivers; "
          f"{reps} interleaved reps after one warm-up", file=out, flush=True)
    world = workers + 1
    procs: list[subprocess.Popen] = []
    shims = []
    try:
        # raw collective: receivers that only receive
        raw_port = free_port()
        procs += [subprocess.Popen([sys.executable, "-c", (
            "from refit_grpc.tools.bench import raw_receiver; "
            f"raw_receiver({raw_port}, {world}, {r}, {total_mb}, {tensors}, {buffer_size_bytes}, "
            f"{reps + 1})")]) for r in range(1, world)]
        raw_group = Group.join(GroupSpec("127.0.0.1", raw_port, world, 0, "gloo", "bench"), 60)
        raw_sender, ack = Sender(raw_group, plan), torch.zeros(1)

        # refit_grpc: shims with the reference engine in store mode
        shims = [spawn_shim("--model", "none", "--instance-id", f"bench-{i}")
                 for i in range(workers)]
        fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
                      packing=Packing(buffer_size_bytes, 2))
        fleet.prepare(plan.state_dict_info())
        link = fleet.connect("127.0.0.1", free_port())

        # HTTP-JSON: the seed's routes in front of the same engine
        http_servers = [subprocess.Popen([sys.executable, "-m", "refit_grpc.tools.bench_http"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                        for _ in range(workers)]
        procs += http_servers
        http = HttpFleet([f"http://127.0.0.1:{int(p.stdout.readline())}" for p in http_servers])
        http_port = free_port()
        joins = http.init_collective(plan, http_port, world)
        http_group = Group.join(GroupSpec("127.0.0.1", http_port, world, 0, "gloo",
                                          "http-bench"), 60)
        for f in joins:
            f.result(60)
        http_sender = Sender(http_group, plan)

        times: dict[str, list[float]] = {"raw": [], "refit_grpc": [], "http": []}
        for i in range(reps + 1):
            t0 = time.monotonic()
            raw_sender.send(weights, Deadline(120))
            raw_group.broadcast_async(ack, Deadline(60)).wait(Deadline(60), "ack")
            t1 = time.monotonic()
            fleet.refit(link, weights, version=i + 1, flush=False)
            t2 = time.monotonic()
            futures = http.update_weights(i + 1)
            http_sender.send(weights, Deadline(120))
            for f in futures:
                f.result(120)
            t3 = time.monotonic()
            if i:  # the first rep is a warm-up (first-touch allocations)
                times["raw"].append(t1 - t0)
                times["refit_grpc"].append(t2 - t1)
                times["http"].append(t3 - t2)
        raw_group.close()
        link.close()
        http_group.close()
        fleet.close()
        http.close()
    finally:
        for s in shims:
            s.stop()
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.wait(60)

    mb = plan.total_bytes / 1e6
    r, o, h = (statistics.median(times[k]) for k in ("raw", "refit_grpc", "http"))
    print(f"raw gloo broadcast   median {r * 1e3:8.1f} ms  {mb / r / 1e3:6.3f} GB/s", file=out)
    print(f"refit_grpc epoch     median {o * 1e3:8.1f} ms  {mb / o / 1e3:6.3f} GB/s", file=out)
    print(f"HTTP-JSON epoch      median {h * 1e3:8.1f} ms  {mb / h / 1e3:6.3f} GB/s", file=out)
    print(f"ratio refit_grpc/raw {o / r:.2f}x   HTTP-JSON/raw {h / r:.2f}x   "
          f"refit_grpc/HTTP-JSON {o / h:.2f}x", file=out)
    return 0
