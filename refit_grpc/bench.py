"""Side-by-side refit timing: the full protocol against the raw collective, in one run.

Both arms move the same plan, packed the same way, to the same number of receiver processes:
- raw: receivers that only loop `receive()` on a gloo group (no gRPC, no state machine); the
  trainer times the broadcast of every bucket until every receiver has reported back.
- refit_grpc: `Fleet.refit()` against shim processes (UpdateWeights, two-phase start, broadcast,
  COMMITTED from every shim, no flush).
The ratio is the control plane's overhead on top of moving the bytes.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from refit_grpc.collective import Deadline, Group, GroupSpec, Sender, receive
from refit_grpc.driver import Fleet, WorkerEndpoint
from refit_grpc.plan import Packing, RefitPlan
from refit_grpc.shim.process import spawn_shim


def _tensors(total_mb: float, n: int) -> dict[str, torch.Tensor]:
    per = max(1, int(total_mb * (1 << 20) / 4 / n))
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def _raw_receiver(port: int, world: int, rank: int, total_mb: float, n: int, buf: int,
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


def _free_port() -> int:
    from refit_grpc.demo import free_port

    return free_port()


def run_bench(workers: int = 2, total_mb: float = 64, tensors: int = 64,
              buffer_size_bytes: int = 16 << 20, reps: int = 5, out=sys.stdout) -> int:
    weights = _tensors(total_mb, tensors)
    plan = RefitPlan.from_tensors(weights.items(), Packing(buffer_size_bytes, 2))
    print(f"plan: {len(plan.tensors)} tensors, {plan.total_bytes / 1e6:.1f} MB, "
          f"{len(plan.buckets)} buckets of <= {buffer_size_bytes >> 20} MiB; {workers} receivers; "
          f"{reps} reps", file=out, flush=True)

    # raw collective
    port = _free_port()
    world = workers + 1
    procs = [subprocess.Popen([sys.executable, "-c", (
        "from refit_grpc.bench import _raw_receiver; "
        f"_raw_receiver({port}, {world}, {r}, {total_mb}, {tensors}, {buffer_size_bytes}, "
        f"{reps + 1})")])
        for r in range(1, world)]
    group = Group.join(GroupSpec("127.0.0.1", port, world, 0, "gloo", "bench"), 60)
    sender, ack = Sender(group, plan), torch.zeros(1)
    raw = []
    for i in range(reps + 1):  # the first is a warm-up, as on the refit_grpc side
        t0 = time.monotonic()
        sender.send(weights, Deadline(120))
        group.broadcast_async(ack, Deadline(60)).wait(Deadline(60), "ack")
        if i:
            raw.append(time.monotonic() - t0)
    group.close()
    for p in procs:
        p.wait(60)

    # refit_grpc
    shims = [spawn_shim("--model", "none", "--instance-id", f"bench-{i}") for i in range(workers)]
    try:
        fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
                      packing=Packing(buffer_size_bytes, 2))
        fleet.prepare(plan.state_dict_info())
        link = fleet.connect("127.0.0.1", _free_port())
        fleet.refit(link, weights, version=1, flush=False)  # warm-up: first-touch allocation
        ours = [fleet.refit(link, weights, version=v, flush=False).seconds
                for v in range(2, reps + 2)]
        link.close()
        fleet.close()
    finally:
        for s in shims:
            s.stop()

    mb = plan.total_bytes / 1e6
    r, o = statistics.median(raw), statistics.median(ours)
    print(f"raw gloo broadcast   median {r * 1e3:8.1f} ms  {mb / r / 1e3:6.3f} GB/s", file=out)
    print(f"refit_grpc epoch     median {o * 1e3:8.1f} ms  {mb / o / 1e3:6.3f} GB/s", file=out)
    print(f"ratio refit_grpc/raw {o / r:.2f}x", file=out)
    return 0
