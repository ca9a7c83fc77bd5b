"""Side-by-side refit timing, in one run, against the wire floor and the two ways users have today.

Every arm moves the same plan (same bytes, same order) from trainer rank 0 to the same number of
receiver processes over gloo on loopback, and ends when every receiver has the bytes:
- floor: ONE broadcast of a buffer of the plan's total bytes, already packed; receivers land it
  in a buffer and do nothing else. Bytes on the wire, nothing more: the target.
- per-tensor: one async broadcast per tensor (the naive refit), received into the tensors' places.
- raw: the project's own Sender and receive loop (packing, buckets, num_buffers in flight), no
  control plane: what the data path costs on top of the floor.
- refit_grpc: `Fleet.refit(..., flush=False)` against shim processes (reference engine, store
  mode): membership check, UpdateWeights, two-phase start, broadcast, apply, every COMMITTED.
- HTTP-JSON: NeMo RL's Dynamo refit (`refit_grpc.tools.bench_http`): per worker, JSON posts to start,
  update (blocking while the trainer broadcasts) and finish, the trainer sending with vLLM's
  packed producer (a fresh `torch.cat` per bucket); same engine and receiver as refit_grpc.

The arms are interleaved rep by rep (floor, per-tensor, raw, refit_grpc, HTTP-JSON, floor, ...) so
background load hits every arm alike; the first rep is a warm-up. Each arm's time is reported as
a ratio to the floor's median in the same run, and the resident-memory growth of the sender and of
every receiver is sampled during each epoch.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from refit_grpc.collective import Group, Sender, bind_master_store, receive
from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.plan import Packing, RefitPlan, TensorSpec
from refit_grpc.testing.harness import Run

ARMS = ("floor", "floor-buckets", "per-tensor", "raw", "refit_grpc", "staged", "http")
# The arms without a control plane: the trainer and bare receiver processes, one group each.
BARE = ("floor", "floor-buckets", "per-tensor", "raw")
_TIMEOUT_S = 300.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- workloads ------------------------------------------------------------------------------


def realistic_specs(total_bytes: int = 1 << 30) -> list[TensorSpec]:
    """A decoder-only layer mix of about `total_bytes` in fp32: token embedding and untied output
    projection (~100 MB each at 1 GiB), then per layer q/k/v/o (GQA 4:1, q/k/v biases, q/k
    norms), a gated MLP and two norms: 14 tensors per layer, from 256 bytes to ~100 MB."""
    hidden, inter, vocab, kv = 512, 1408, 50_000, 128
    per_layer = 4 * (hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * inter
                     + hidden + 2 * kv + 2 * 64 + 2 * hidden)
    fixed = 4 * (2 * vocab * hidden + hidden)
    layers = max(1, round((total_bytes - fixed) / per_layer))
    f32 = torch.float32
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), f32)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (hidden,), f32),
            TensorSpec(p + "self_attn.q_proj.weight", (hidden, hidden), f32),
            TensorSpec(p + "self_attn.q_proj.bias", (hidden,), f32),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, hidden), f32),
            TensorSpec(p + "self_attn.k_proj.bias", (kv,), f32),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, hidden), f32),
            TensorSpec(p + "self_attn.v_proj.bias", (kv,), f32),
            TensorSpec(p + "self_attn.q_norm.weight", (64,), f32),
            TensorSpec(p + "self_attn.k_norm.weight", (64,), f32),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, hidden), f32),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), f32),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), f32),
            TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), f32),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), f32),
        ]
    specs += [TensorSpec("model.norm.weight", (hidden,), f32),
              TensorSpec("lm_head.weight", (vocab, hidden), f32)]
    return specs


def equal_specs(total_mb: float, n: int) -> list[TensorSpec]:
    per = max(1, int(total_mb * (1 << 20) / 4 / n))
    return [TensorSpec(f"layer.{i}.weight", (per,), torch.float32) for i in range(n)]


def workload_specs(workload: dict) -> list[TensorSpec]:
    if workload["kind"] == "realistic":
        return realistic_specs(int(workload["total_mb"] * (1 << 20)))
    return equal_specs(workload["total_mb"], workload["tensors"])


def materialize(specs: Sequence[TensorSpec], seed: int = 0,
                flat: bool = False) -> dict[str, torch.Tensor]:
    """Random weights: one allocation per tensor, or (`flat`) views into one buffer in plan
    order, the way trainers with contiguous parameter buffers hold them."""
    g = torch.Generator().manual_seed(seed)
    if not flat:
        return {s.name: torch.randn(s.shape, generator=g, dtype=s.dtype) for s in specs}
    buffer = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8)
    out, offset = {}, 0
    for s in specs:
        view = buffer[offset:offset + s.nbytes].view(s.dtype).view(s.shape)
        view.copy_(torch.randn(s.shape, generator=g, dtype=s.dtype))
        out[s.name] = view
        offset += s.nbytes
    return out


# --- the bare receivers (floor, per-tensor, raw) ----------------------------------------------


def bucketed_broadcast(group: Group, flat: torch.Tensor, plan: RefitPlan,
                       deadline: Deadline) -> None:
    """The plan's pre-packed bytes (`flat`, plan order) broadcast bucket by bucket, with
    `num_buffers` in flight: the floor a bucketed protocol can reach (on 2 cores it beat one
    broadcast of the same bytes: gloo's one large send and receive do not overlap the copies)."""
    in_flight: list = []
    offset = 0
    for b in plan.buckets:
        in_flight.append(group.broadcast_async(flat[offset:offset + b.nbytes], deadline))
        offset += b.nbytes
        if len(in_flight) >= plan.packing.num_buffers:
            in_flight.pop(0).wait(deadline, "floor-buckets")
    for op in in_flight:
        op.wait(deadline, "floor-buckets")


def bare_receiver(ports: dict[str, int], world: int, rank: int, workload: dict, buffer_size: int,
                  num_buffers: int, reps: int, arms: Sequence[str] = BARE) -> None:
    """One receiver rank of the arms without a control plane, in the trainer's order."""
    torch.set_num_threads(1)
    plan = RefitPlan(tuple(workload_specs(workload)), Packing(buffer_size, num_buffers))
    groups = {arm: Group.join(GroupSpec("127.0.0.1", ports[arm], world, rank, "gloo", arm),
                              _TIMEOUT_S) for arm in BARE}
    flat = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.fill_(0)  # first touch outside the timed epochs
    views, offset = [], 0
    for s in plan.tensors:  # per-tensor lands every tensor in its place in one flat buffer
        views.append(flat[offset:offset + s.nbytes])
        offset += s.nbytes
    ack = torch.zeros(1)
    for _ in range(reps):
        for arm in arms:
            group = groups[arm]
            deadline = Deadline(_TIMEOUT_S)
            if arm == "floor":
                group.broadcast_async(flat, deadline).wait(deadline, "floor")
            elif arm == "floor-buckets":
                bucketed_broadcast(group, flat, plan, deadline)
            elif arm == "per-tensor":
                for op in [group.broadcast_async(v, deadline) for v in views]:
                    op.wait(deadline, "per-tensor")
            else:
                receive(group, plan, deadline, lambda b, it: None)
            group.broadcast_async(ack, deadline).wait(deadline, "ack")
    # Stay until the trainer is done with every arm: a process that tears down its groups and
    # frees its gigabytes while another arm is timed takes CPU from that arm (it made the last
    # refit_grpc rep of every run 1.5-2 s slower, before).
    sys.stdin.read()
    for group in groups.values():
        group.close()


# --- memory sampling -------------------------------------------------------------------------


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class PeakRss:
    """Samples the resident memory of some processes while an epoch runs: peak minus start."""

    def __init__(self, pids: Sequence[int], interval_s: float = 0.002):
        self.pids = list(pids)
        self._start = {p: _rss(p) for p in self.pids}
        self._peak = dict(self._start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for p in self.pids:
                self._peak[p] = max(self._peak[p], _rss(p))

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        for p in self.pids:
            self._peak[p] = max(self._peak[p], _rss(p))
        return {p: self._peak[p] - self._start[p] for p in self.pids}


# --- the run ---------------------------------------------------------------------------------


def run_bench(workers: int = 2, workload: dict | None = None, buffer_size_bytes: int = 64 << 20,
              num_buffers: int = 2, reps: int = 3, arms: Sequence[str] = ARMS,
              flat_trainer: bool = False, out=sys.stdout) -> dict[str, list[float]]:
    """Every arm side by side, interleaved rep by rep; prints the table and returns the times."""
    from refit_grpc.tools.bench_http import HttpFleet, SeedSender

    workload = workload or {"kind": "realistic", "total_mb": 1024}
    specs = workload_specs(workload)
    packing = Packing(buffer_size_bytes, num_buffers)
    plan = RefitPlan(tuple(specs), packing)
    plan.validate()
    weights = materialize(specs, flat=flat_trainer)
    world = workers + 1
    run = Run("bench", None, out)
    say = run.say
    say(f"plan: {len(plan.tensors)} tensors ({min(s.nbytes for s in specs)} B to "
        f"{max(s.nbytes for s in specs) / 1e6:.1f} MB), {plan.total_bytes / 1e6:.1f} MB, "
        f"{len(plan.buckets)} buckets of {buffer_size_bytes >> 20} MiB x {num_buffers} buffers; "
        f"{workers} receivers; {reps} interleaved reps after one warm-up; arms: {', '.join(arms)}"
        + ("; the trainer's weights are views into one buffer" if flat_trainer else ""))
    procs: list[subprocess.Popen] = []
    http = None
    staged_fleet = None
    times: dict[str, list[float]] = {a: [] for a in arms}
    stalls: dict[str, list[float]] = {"refit_grpc": [], "staged": []}  # per rep, warm-up first
    memory: dict[str, list[tuple[int, int]]] = {a: [] for a in arms}  # (sender, max receiver)
    cpu: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}  # (sender, all receivers)
    # Growth in the warm-up epoch, (sender, max receiver): the buffers a side allocates once and
    # keeps for every later epoch (bucket buffers), which the later epochs' growth cannot show.
    first: dict[str, tuple[int, int]] = {}
    try:
        runners: dict[str, Callable[[int], object]] = {}  # an arm's result is not used
        receivers: dict[str, list[int]] = {}
        bare = [a for a in BARE if a in arms]
        if bare:
            # Rank 0's stores listen before the receivers are told where (ports the kernel picks).
            stores = {a: bind_master_store("127.0.0.1", 0, world, _TIMEOUT_S) for a in BARE}
            ports = {a: s.port for a, s in stores.items()}
            bare_procs = [subprocess.Popen([sys.executable, "-c", (
                "from refit_grpc.tools.bench import bare_receiver; "
                f"bare_receiver({ports!r}, {world}, {r}, {workload!r}, {buffer_size_bytes}, "
                f"{num_buffers}, {reps + 1}, {tuple(bare)!r})")], stdin=subprocess.PIPE)
                for r in range(1, world)]
            procs += bare_procs
            groups = {a: Group.join(GroupSpec("127.0.0.1", ports[a], world, 0, "gloo", a),
                                    _TIMEOUT_S, store=stores.pop(a)) for a in BARE}
            ack = torch.zeros(1)
            flat = torch.empty(plan.total_bytes, dtype=torch.uint8)
            offset = 0
            for s in specs:  # the floor's bytes: the same plan, packed before the clock starts
                flat[offset:offset + s.nbytes].copy_(weights[s.name].reshape(-1).view(torch.uint8))
                offset += s.nbytes
            raw_sender = Sender(groups["raw"], plan)

            def bare_arm(arm: str) -> Callable[[int], None]:
                def run(_version: int) -> None:
                    group, deadline = groups[arm], Deadline(_TIMEOUT_S)
                    if arm == "floor":
                        group.broadcast_async(flat, deadline).wait(deadline, "floor")
                    elif arm == "floor-buckets":
                        bucketed_broadcast(group, flat, plan, deadline)
                    elif arm == "per-tensor":
                        ops = [group.broadcast_async(weights[s.name], deadline) for s in specs]
                        for op in ops:
                            op.wait(deadline, "per-tensor")
                    else:
                        raw_sender.send(weights, deadline)
                    group.broadcast_async(ack, deadline).wait(deadline, "ack")
                return run

            for a in bare:
                runners[a] = bare_arm(a)
                receivers[a] = [p.pid for p in bare_procs]

        if "refit_grpc" in arms:
            shims = run.spawn_shims([("--model", "none", "--instance-id", f"bench-{i}")
                                     for i in range(workers)], buffer_size_bytes, num_buffers)
            fleet = run.fleet_of_shims(packing=packing, epoch_timeout_s=_TIMEOUT_S)
            fleet.prepare(plan.state_dict_info())
            link = fleet.connect("127.0.0.1")
            # In place, the engines are paused from UpdateWeights to the flush: the stall is the
            # whole epoch and the flush (a client-side bound: what refit() takes with flush).
            def in_place(v: int) -> None:
                t0 = time.monotonic()
                fleet.refit(link, weights, version=v, flush=True)
                stalls["refit_grpc"].append(time.monotonic() - t0)

            runners["refit_grpc"] = in_place
            receivers["refit_grpc"] = [s.pid for s in shims]

        if "staged" in arms:
            from refit_grpc.driver import Fleet, WorkerEndpoint
            from refit_grpc.shim.process import spawn_shim

            staged_shims = [spawn_shim("--model", "none", "--instance-id", f"staged-{i}",
                                       "--buffer-size-bytes", str(buffer_size_bytes),
                                       "--num-buffers", str(num_buffers))
                            for i in range(workers)]
            run.shims += staged_shims
            staged_fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in staged_shims],
                                 packing=packing, epoch_timeout_s=_TIMEOUT_S)
            staged_fleet.prepare(plan.state_dict_info())
            staged_link = staged_fleet.connect("127.0.0.1")

            # Staged, the engines stop only for their flips (the report's stall: the longest).
            def staged(v: int) -> None:
                report = staged_fleet.refit(staged_link, weights, version=v, mode="staged")
                stalls["staged"].append(report.stall_seconds or 0.0)

            runners["staged"] = staged
            receivers["staged"] = [s.pid for s in staged_shims]

        if "http" in arms:
            http_servers = [subprocess.Popen([sys.executable, "-m", "refit_grpc.tools.bench_http"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True) for _ in range(workers)]
            procs += http_servers
            http_ports = []
            for p in http_servers:
                assert p.stdout is not None  # stdout=PIPE
                http_ports.append(int(p.stdout.readline()))
            http = HttpFleet([f"http://127.0.0.1:{port}" for port in http_ports])
            http_store = bind_master_store("127.0.0.1", 0, world, _TIMEOUT_S)
            http_port = http_store.port
            joins = http.init_collective(plan, http_port, world)
            http_group = Group.join(GroupSpec("127.0.0.1", http_port, world, 0, "gloo",
                                              "http-bench"), _TIMEOUT_S, store=http_store)
            for f in joins:
                f.result(_TIMEOUT_S)
            http_sender = SeedSender(http_group, plan)

            def http_arm(version: int) -> None:
                futures = http.update_weights(version)
                http_sender.send(weights, Deadline(_TIMEOUT_S))
                for f in futures:
                    f.result(_TIMEOUT_S)

            runners["http"] = http_arm
            receivers["http"] = [p.pid for p in http_servers]

        me = os.getpid()
        for i in range(reps + 1):
            for arm in arms:
                sampler = PeakRss([me, *receivers[arm]])
                cpu0 = [_cpu_seconds(p) for p in (me, *receivers[arm])]
                t0 = time.monotonic()
                runners[arm](i + 1)
                elapsed = time.monotonic() - t0
                cpu1 = [_cpu_seconds(p) for p in (me, *receivers[arm])]
                growth = sampler.stop()
                if not i:
                    first[arm] = (growth[me], max(growth[p] for p in receivers[arm]))
                if i:  # the first rep is a warm-up (first-touch allocations, connections)
                    times[arm].append(elapsed)
                    memory[arm].append((growth[me], max(growth[p] for p in receivers[arm])))
                    used = [b - a for a, b in zip(cpu0, cpu1)]
                    cpu[arm].append((used[0], sum(used[1:])))
            say(f"rep {i}{' (warm-up)' if i == 0 else ''} done")
    finally:
        if staged_fleet is not None:
            staged_fleet.close()
        run.teardown()  # the fleet and the shims
        if http is not None:
            http.close()
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    _report(times, memory, cpu, first, plan, workers, say)
    _report_stalls(stalls, times, say)
    return times


def _report_stalls(stalls: dict[str, list[float]], times: dict[str, list[float]],
                   say: Callable[[str], None]) -> None:
    """How long the engines stopped serving, in place against staged (the warm-up dropped)."""
    med = {a: statistics.median(s[1:]) for a, s in stalls.items() if len(s) > 1}
    if not med:
        return
    floor = min((statistics.median(times[a]) for a in ("floor", "floor-buckets")
                 if times.get(a)), default=None)
    say("stall (engines not serving): " + ", ".join(
        f"{'in place' if a == 'refit_grpc' else a} {m * 1e3:.1f} ms" for a, m in med.items())
        + (f"; staged/in place {med['staged'] / med['refit_grpc']:.2f}x"
           if len(med) == 2 and med["refit_grpc"] else "")
        + (f"; staged epoch/floor {statistics.median(times['staged']) / floor:.2f}x"
           if floor and times.get("staged") else ""))


def _report(times: dict[str, list[float]], memory: dict[str, list[tuple[int, int]]],
            cpu: dict[str, list[tuple[float, float]]], first: dict[str, tuple[int, int]],
            plan: RefitPlan, workers: int, say: Callable[[str], None]) -> None:
    med = {a: statistics.median(t) for a, t in times.items() if t}
    floor = med.get("floor")
    bound = plan.packing.num_buffers * plan.packing.buffer_size_bytes
    say(f"world {workers + 1} ({workers} receivers), {plan.total_bytes / 1e6:.1f} MB, "
        f"medians of {len(next(iter(times.values())))}:")
    say(f"{'arm':<11} {'median ms':>10} {'min..max ms':>17} {'GB/s':>6} {'/floor':>7} "
        f"{'sender +MB':>10} {'receiver +MB':>12} {'sender cpu s':>12} {'receivers cpu s':>15} "
        f"{'cores busy':>10}")
    for arm, t in times.items():
        m = med[arm]
        ratio = f"{m / floor:.2f}x" if floor else "-"
        send_mb = max(s for s, _ in memory[arm]) / 1e6
        recv_mb = max(r for _, r in memory[arm]) / 1e6
        # CPU time of the sender and of all receivers (shims, HTTP servers) during the epoch,
        # medians; "cores busy" = their sum over the wall time: on a saturated host the arms
        # trade CPU seconds, not wire time.
        send_cpu = statistics.median(c for c, _ in cpu[arm])
        recv_cpu = statistics.median(c for _, c in cpu[arm])
        busy = statistics.median((a + b) / w for (a, b), w in zip(cpu[arm], t))
        say(f"{arm:<11} {m * 1e3:10.1f} {min(t) * 1e3:8.1f}..{max(t) * 1e3:<8.1f} "
            f"{plan.total_bytes / m / 1e9:6.3f} {ratio:>7} {send_mb:10.1f} {recv_mb:12.1f} "
            f"{send_cpu:12.2f} {recv_cpu:15.2f} {busy:10.2f}")
    if "refit_grpc" in med and "http" in med:
        say(f"refit_grpc/HTTP-JSON {med['refit_grpc'] / med['http']:.2f}x")
    if "refit_grpc" in med and "per-tensor" in med:
        say(f"per-tensor/refit_grpc {med['per-tensor'] / med['refit_grpc']:.2f}x "
            "(how much faster refit_grpc is than the naive refit)")
    say(f"memory bound num_buffers x bucket = {bound / 1e6:.1f} MB (x1.1 = {1.1 * bound / 1e6:.1f})"
        f"; by vLLM's rule a bucket closes after the tensor that crosses the size, so this plan's "
        f"largest bucket is {max(b.nbytes for b in plan.buckets) / 1e6:.1f} MB")
    say("kept from the warm-up epoch (buffers allocated once), sender / worst receiver: " + ", ".join(
        f"{arm} {s / 1e6:.1f} / {r / 1e6:.1f} MB" for arm, (s, r) in first.items()))
