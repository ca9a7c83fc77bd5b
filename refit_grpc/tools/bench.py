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

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from refit_grpc.common import Deadline, GroupSpec
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.rendezvous import bind_master_store
from refit_grpc.dataplane.transfer import Sender, receive
from refit_grpc.driver.options import InPlace, Staged
from refit_grpc.plan import Packing, RefitPlan, TensorSpec
from refit_grpc.testing.harness import Run
from refit_grpc.tools.bench_memory import PROCESS_BASE_BYTES, Need, Peaks, fit, gb

ARMS = ("floor", "floor-buckets", "per-tensor", "raw", "refit_grpc", "staged", "http")
# The arms without a control plane: the trainer and bare receiver processes, one group each.
BARE = ("floor", "floor-buckets", "per-tensor", "raw")
_TIMEOUT_S = 300.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- workloads ------------------------------------------------------------------------------


def realistic_specs(total_bytes: int = 1 << 30) -> list[TensorSpec]:
    """A decoder-only layer mix of about `total_bytes` in fp32 (at least one layer, about 14 MB):
    token embedding and untied output projection (~100 MB each at 1 GiB), then per layer
    q/k/v/o (GQA 4:1, q/k/v biases, q/k norms), a gated MLP and two norms: 14 tensors per
    layer, from 256 bytes to ~100 MB."""
    # The vocabulary shrinks with small totals (a plan of a few MB for a quick run is layers,
    # not two embeddings): 50,000 from about 1 GiB up.
    hidden, inter, kv = 512, 1408, 128
    vocab = min(50_000, max(256, total_bytes // (4 * hidden * 2 * 5)))
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
                  num_buffers: int, epochs: int, arms: Sequence[str] = BARE) -> None:
    """One receiver rank of the arms without a control plane: `epochs` epochs of each arm in
    turn, in the trainer's order, one group per arm (`ports`)."""
    torch.set_num_threads(1)
    plan = RefitPlan(tuple(workload_specs(workload)), Packing(buffer_size, num_buffers))
    groups = {arm: Group.join(GroupSpec("127.0.0.1", ports[arm], world, rank, "gloo", arm),
                              _TIMEOUT_S) for arm in arms}
    flat = torch.empty(plan.total_bytes, dtype=torch.uint8)
    flat.fill_(0)  # first touch outside the timed epochs
    views, offset = [], 0
    for s in plan.tensors:  # per-tensor lands every tensor in its place in one flat buffer
        views.append(flat[offset:offset + s.nbytes])
        offset += s.nbytes
    ack = torch.zeros(1)
    for arm in arms:
        group = groups[arm]
        for _ in range(epochs):
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
    # Stay until the trainer is done with the set: a process that tears down its groups and
    # frees its gigabytes while an arm is timed takes CPU from that arm (it made the last
    # refit_grpc rep of every run 1.5-2 s slower, once).
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


# --- memory: what a run holds at once --------------------------------------------------------

# The receiver sets. The receivers of one set are started for a rep and stopped after it, so the
# host holds one set's memory at a time (at world 5 every set alive at once needed more than 24
# GiB). The arms stay interleaved rep by rep; an arm's first epoch on fresh receivers is a
# warm-up, not counted. In the shims' set the in-place arm runs before the staged one, so its
# shims' peak is measured before any staged copy exists (a staged epoch keeps one).
# Uncounted epochs before the counted one, per arm (1 where not named). A staged epoch is
# reversible by default: the first on fresh shims makes the committed copy, the second sets it
# aside as the previous one and lands in a second copy (allocated then: 1 GiB of first touches
# inside the epoch, which counted so took 1.42 s against the floor's 0.35 s), and from the third
# on the two swap. The steady state a trainer sees is the third.
WARM_UPS = {"staged": 2}
SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("bare receivers", BARE),
    ("shims", ("refit_grpc", "staged")),
    ("HTTP servers", ("http",)),
)


def estimate_memory(plan: RefitPlan, workers: int, arms: Sequence[str]) -> Need:
    """The bench's resident memory per receiver set (trainer + every receiver), from the plan:
    each receiver holds the plan's bytes and `num_buffers` buckets (a staged shim one more
    copy of the plan); the trainer its weights, the floor's packed copy and its senders' buffers."""
    total = plan.total_bytes
    bufs = plan.packing.num_buffers * max(b.nbytes for b in plan.buckets)
    phases = {}
    for name, members in SETS:
        here = [a for a in members if a in arms]
        if not here:
            continue
        # A staged shim (the reference engine) serves from the copy it flipped to, so it holds
        # two buffers of the plan: the weights served and the previous version (reversible by
        # default), where the next epoch lands (measured: 2,576 MB for a 1,073 MB plan).
        receiver = total + bufs + (total if "staged" in here else 0)
        # One sender per set holds buffers (raw's, the fleet's, NeMo RL's fresh buckets).
        trainer = total + (bufs if set(here) - {"floor", "floor-buckets", "per-tensor"} else 0)
        trainer += total if {"floor", "floor-buckets"} & set(here) else 0
        phases[name] = trainer + (workers + 1) * PROCESS_BASE_BYTES + workers * receiver
    return Need(phases)


def workload_need(workload: dict, workers: int, buffer_size_bytes: int, num_buffers: int,
                  arms: Sequence[str]) -> Callable[[float], Need]:
    """`estimate_memory` for this workload at a given size in MB (`fit_total_mb`'s argument)."""
    def need(total_mb: float) -> Need:
        specs = workload_specs({**workload, "total_mb": total_mb})
        return estimate_memory(RefitPlan(tuple(specs), Packing(buffer_size_bytes, num_buffers)),
                               workers, arms)
    return need


# --- the receiver sets, each a context: started, its arms run, stopped -----------------------


@dataclass
class _Set:
    """A started receiver set: an epoch runner per arm (version -> the engines' stall or None),
    the receivers' pids, and a hook called once an arm's epochs are done."""

    runners: dict[str, Callable[[int], float | None]]
    pids: list[int]
    done: Callable[[str], None] = lambda arm: None


def _stop_all(procs: Sequence[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Close every child's stdin (each exits when it reads EOF), then wait for each; the memory
    is the host's again when this returns."""
    for p in procs:
        if p.stdin:
            p.stdin.close()
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@contextmanager
def _bare_set(plan: RefitPlan, weights: dict[str, torch.Tensor], workers: int, workload: dict,
              arms: Sequence[str]) -> Iterator[_Set]:
    world = workers + 1
    specs = plan.tensors
    # Rank 0's stores listen before the receivers are told where (ports the kernel picks).
    stores = {a: bind_master_store("127.0.0.1", 0, world, _TIMEOUT_S) for a in arms}
    ports = {a: s.port for a, s in stores.items()}
    procs = [subprocess.Popen([sys.executable, "-c", (
        "from refit_grpc.tools.bench import bare_receiver; "
        f"bare_receiver({ports!r}, {world}, {r}, {workload!r}, "
        f"{plan.packing.buffer_size_bytes}, {plan.packing.num_buffers}, 2, {tuple(arms)!r})")],
        stdin=subprocess.PIPE) for r in range(1, world)]
    groups: dict[str, Group] = {}
    try:
        groups = {a: Group.join(GroupSpec("127.0.0.1", ports[a], world, 0, "gloo", a),
                                _TIMEOUT_S, store=stores.pop(a)) for a in arms}
        ack = torch.zeros(1)
        floors = [a for a in arms if a in ("floor", "floor-buckets")]
        held: dict[str, torch.Tensor] = {}
        if floors:  # the floor's bytes: the same plan, packed before the clock starts
            flat = held["flat"] = torch.empty(plan.total_bytes, dtype=torch.uint8)
            offset = 0
            for s in specs:
                flat[offset:offset + s.nbytes].copy_(weights[s.name].reshape(-1).view(torch.uint8))
                offset += s.nbytes
            del flat
        raw_sender = Sender(groups["raw"], plan) if "raw" in arms else None

        def bare_arm(arm: str) -> Callable[[int], None]:
            def run(_version: int) -> None:
                group, deadline = groups[arm], Deadline(_TIMEOUT_S)
                if arm == "floor":
                    group.broadcast_async(held["flat"], deadline).wait(deadline, "floor")
                elif arm == "floor-buckets":
                    bucketed_broadcast(group, held["flat"], plan, deadline)
                elif arm == "per-tensor":
                    ops = [group.broadcast_async(weights[s.name], deadline) for s in specs]
                    for op in ops:
                        op.wait(deadline, "per-tensor")
                else:
                    assert raw_sender is not None
                    raw_sender.send(weights, deadline)
                group.broadcast_async(ack, deadline).wait(deadline, "ack")
            return run

        def done(arm: str) -> None:
            if floors and arm == floors[-1]:
                held.clear()  # the other arms send from the trainer's tensors

        yield _Set({a: bare_arm(a) for a in arms}, [p.pid for p in procs], done)
    finally:
        _stop_all(procs)
        for g in groups.values():
            g.close()


def _spawn_shims(names: Sequence[str], plan: RefitPlan, timeout_s: float = 120.0) -> list:
    """Store-mode reference shims, started at once (on 2 cores, one after the other took twice
    as long) from this thread, each tied to this process's life; returns once all serve."""
    from refit_grpc.shim.process import spawn_shims

    return spawn_shims([("--model", "none", "--instance-id", name, "--buffer-size-bytes",
                         str(plan.packing.buffer_size_bytes), "--num-buffers",
                         str(plan.packing.num_buffers)) for name in names], timeout_s=timeout_s)


def _stop_shims(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every shim first (each takes about a second to stop), then wait for each."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


@contextmanager
def _shim_set(plan: RefitPlan, weights: dict[str, torch.Tensor], workers: int,
              arms: Sequence[str], rep: int) -> Iterator[_Set]:
    from refit_grpc.driver import Fleet, WorkerEndpoint

    shims = _spawn_shims([f"bench-{rep}-{i}" for i in range(workers)], plan)
    fleet = link = None
    try:
        fleet = Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
                      packing=plan.packing, epoch_timeout_s=_TIMEOUT_S)
        fleet.prepare(plan.state_dict_info())
        link = fleet.connect("127.0.0.1")

        # In place, the engines are paused from UpdateWeights to the flush: the stall is the
        # whole epoch and the flush (a client-side bound: what refit() takes with flush).
        def in_place(v: int) -> float:
            t0 = time.monotonic()
            fleet.refit(link, weights, version=v, epoch=InPlace(flush=True))
            return time.monotonic() - t0

        # Staged, the engines stop only for their flips (the report's stall: the longest).
        def staged(v: int) -> float:
            report = fleet.refit(link, weights, version=v, epoch=Staged())
            return report.stall_seconds or 0.0

        runners: dict[str, Callable[[int], float | None]] = {"refit_grpc": in_place,
                                                              "staged": staged}
        yield _Set({a: runners[a] for a in arms}, [s.pid for s in shims])
    finally:
        if link is not None:
            link.close()
        if fleet is not None:
            fleet.close()
        _stop_shims([s.proc for s in shims])


@contextmanager
def _http_set(plan: RefitPlan, weights: dict[str, torch.Tensor], workers: int) -> Iterator[_Set]:
    from refit_grpc.tools.bench_http import HttpFleet, SeedSender

    world = workers + 1
    servers = [subprocess.Popen([sys.executable, "-m", "refit_grpc.tools.bench_http"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(workers)]
    http = group = None
    try:
        ports = []
        for p in servers:
            assert p.stdout is not None  # stdout=PIPE
            ports.append(int(p.stdout.readline()))
        http = HttpFleet([f"http://127.0.0.1:{port}" for port in ports])
        store = bind_master_store("127.0.0.1", 0, world, _TIMEOUT_S)
        joins = http.init_collective(plan, store.port, world)
        group = Group.join(GroupSpec("127.0.0.1", store.port, world, 0, "gloo", "http-bench"),
                           _TIMEOUT_S, store=store)
        for f in joins:
            f.result(_TIMEOUT_S)
        sender = SeedSender(group, plan)

        def http_arm(version: int) -> None:
            assert http is not None
            futures = http.update_weights(version)
            sender.send(weights, Deadline(_TIMEOUT_S))
            for f in futures:
                f.result(_TIMEOUT_S)

        yield _Set({"http": http_arm}, [p.pid for p in servers])
    finally:
        if http is not None:
            http.close()
        _stop_all(servers)
        if group is not None:
            group.close()


# --- the run ---------------------------------------------------------------------------------


def run_bench(workers: int = 2, workload: dict | None = None, buffer_size_bytes: int = 64 << 20,
              num_buffers: int = 2, reps: int = 3, arms: Sequence[str] = ARMS,
              flat_trainer: bool = False, out=sys.stdout) -> dict[str, list[float]]:
    """Every arm side by side, interleaved rep by rep, one receiver set alive at a time (`SETS`);
    prints the table and returns the times (the warm-ups left out)."""
    workload = workload or {"kind": "realistic", "total_mb": 1024}
    specs = workload_specs(workload)
    packing = Packing(buffer_size_bytes, num_buffers)
    plan = RefitPlan(tuple(specs), packing)
    plan.validate()
    weights = materialize(specs, flat=flat_trainer)
    run = Run("bench", None, out)
    say = run.say
    need = estimate_memory(plan, workers, arms)
    say(f"plan: {len(plan.tensors)} tensors ({min(s.nbytes for s in specs)} B to "
        f"{max(s.nbytes for s in specs) / 1e6:.1f} MB), {plan.total_bytes / 1e6:.1f} MB, "
        f"{len(plan.buckets)} buckets of {buffer_size_bytes >> 20} MiB x {num_buffers} buffers; "
        f"{workers} receivers; {reps} interleaved reps, each arm's first epoch on fresh "
        f"receivers a warm-up (staged: its first two); arms: {', '.join(arms)}"
        + ("; the trainer's weights are views into one buffer" if flat_trainer else ""))
    say("receivers: one set alive at a time, started and stopped every rep: " + ", ".join(
        f"{name} ({', '.join(a for a in members if a in arms)}: about {gb(need.phases[name])})"
        for name, members in SETS if name in need.phases))
    times: dict[str, list[float]] = {a: [] for a in arms}
    stalls: dict[str, list[float]] = {"refit_grpc": [], "staged": []}
    memory: dict[str, list[tuple[int, int]]] = {a: [] for a in arms}  # (sender, max receiver)
    peaks: dict[str, list[tuple[int, int]]] = {a: [] for a in arms}  # VmHWM, (sender, max recv)
    cpu: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}  # (sender, all receivers)
    # Growth in the warm-up epochs, (sender, max receiver): the buffers a side allocates once and
    # keeps for every later epoch (bucket buffers), which the later epochs' growth cannot show.
    first: dict[str, tuple[int, int]] = {}
    first_rep = True
    probe = Peaks()
    me = os.getpid()
    version = 0

    def epoch(arm: str, runner: Callable[[int], float | None], pids: list[int],
              counted: bool) -> None:
        nonlocal version
        version += 1
        sampler = PeakRss([me, *pids])
        cpu0 = [_cpu_seconds(p) for p in (me, *pids)]
        t0 = time.monotonic()
        stall = runner(version)
        elapsed = time.monotonic() - t0
        cpu1 = [_cpu_seconds(p) for p in (me, *pids)]
        growth = sampler.stop()
        grown = (growth[me], max(growth[p] for p in pids))
        if not counted:
            if first_rep:  # every warm-up of the first rep: what a side allocates once
                was = first.get(arm, (0, 0))
                first[arm] = (was[0] + grown[0], was[1] + grown[1])
            return
        times[arm].append(elapsed)
        memory[arm].append(grown)
        used = [b - a for a, b in zip(cpu0, cpu1)]
        cpu[arm].append((used[0], sum(used[1:])))
        if stall is not None and arm in stalls:
            stalls[arm].append(stall)

    t_run = time.monotonic()
    for i in range(reps):
        for name, members in SETS:
            here = [a for a in members if a in arms]
            if not here:
                continue
            if name == "bare receivers":
                started = _bare_set(plan, weights, workers, workload, here)
            elif name == "shims":
                started = _shim_set(plan, weights, workers, here, i)
                version = 0  # fresh shims
            else:
                started = _http_set(plan, weights, workers)
            first_rep = i == 0
            with started as rs:
                for arm in here:
                    probe.start([me, *rs.pids])
                    for _ in range(WARM_UPS.get(arm, 1)):
                        epoch(arm, rs.runners[arm], rs.pids, counted=False)
                    epoch(arm, rs.runners[arm], rs.pids, counted=True)
                    peaks[arm].append(Peaks.read([me, *rs.pids]))
                    rs.done(arm)
        say(f"rep {i + 1} of {reps} done ({time.monotonic() - t_run:.0f} s)")
    _report(times, memory, peaks, cpu, first, plan, workers, say)
    _report_stalls(stalls, times, say)
    measured = max(s + workers * r for ps in peaks.values() for s, r in ps)
    say(f"memory: estimated peak {gb(need.peak)} ({need.worst}); measured {gb(measured)} (the "
        "trainer's and the receivers' peaks, worst arm)"
        + ("" if probe.reset_ok else "; peaks are since each process started (could not reset "
           "VmHWM through /proc/<pid>/clear_refs)"))
    return times


def _report_stalls(stalls: dict[str, list[float]], times: dict[str, list[float]],
                   say: Callable[[str], None]) -> None:
    """How long the engines stopped serving, in place against staged (counted epochs)."""
    med = {a: statistics.median(s) for a, s in stalls.items() if s}
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
            peaks: dict[str, list[tuple[int, int]]], cpu: dict[str, list[tuple[float, float]]],
            first: dict[str, tuple[int, int]], plan: RefitPlan, workers: int,
            say: Callable[[str], None]) -> None:
    med = {a: statistics.median(t) for a, t in times.items() if t}
    floor = med.get("floor")
    bound = plan.packing.num_buffers * plan.packing.buffer_size_bytes
    say(f"world {workers + 1} ({workers} receivers), {plan.total_bytes / 1e6:.1f} MB, "
        f"medians of {len(next(iter(times.values())))}:")
    say(f"{'arm':<13} {'median ms':>10} {'min..max ms':>17} {'GB/s':>6} {'/floor':>7} "
        f"{'sender peak MB':>14} {'receiver peak MB':>16} {'sender +MB':>10} "
        f"{'receiver +MB':>12} {'sender cpu s':>12} {'receivers cpu s':>15} {'cores busy':>10}")
    for arm, t in times.items():
        m = med[arm]
        ratio = f"{m / floor:.2f}x" if floor else "-"
        send_mb = max(s for s, _ in memory[arm]) / 1e6
        recv_mb = max(r for _, r in memory[arm]) / 1e6
        # Resident high-water marks over the arm's epochs (VmHWM), the worst rep: what the
        # trainer and the worst receiver process held, not only what an epoch added.
        send_peak = max(s for s, _ in peaks[arm]) / 1e6
        recv_peak = max(r for _, r in peaks[arm]) / 1e6
        # CPU time of the sender and of all receivers (shims, HTTP servers) during the epoch,
        # medians; "cores busy" = their sum over the wall time: on a saturated host the arms
        # trade CPU seconds, not wire time.
        send_cpu = statistics.median(c for c, _ in cpu[arm])
        recv_cpu = statistics.median(c for _, c in cpu[arm])
        busy = statistics.median((a + b) / w for (a, b), w in zip(cpu[arm], t))
        say(f"{arm:<13} {m * 1e3:10.1f} {min(t) * 1e3:8.1f}..{max(t) * 1e3:<8.1f} "
            f"{plan.total_bytes / m / 1e9:6.3f} {ratio:>7} {send_peak:14.0f} {recv_peak:16.0f} "
            f"{send_mb:10.1f} {recv_mb:12.1f} {send_cpu:12.2f} {recv_cpu:15.2f} {busy:10.2f}")
    if "refit_grpc" in med and "http" in med:
        say(f"refit_grpc/HTTP-JSON {med['refit_grpc'] / med['http']:.2f}x")
    if "refit_grpc" in med and "per-tensor" in med:
        say(f"per-tensor/refit_grpc {med['per-tensor'] / med['refit_grpc']:.2f}x "
            "(how much faster refit_grpc is than the naive refit)")
    say("peak MB: the process's resident high-water mark over the arm's warm-up and counted "
        "epoch (VmHWM), the worst rep: for the sender, the trainer (its weights, and for the "
        "floor arms their packed copy); for receivers, the worst one. +MB: what one counted "
        "epoch added")
    say(f"memory bound num_buffers x bucket = {bound / 1e6:.1f} MB (x1.1 = {1.1 * bound / 1e6:.1f})"
        f"; by vLLM's rule a bucket closes after the tensor that crosses the size, so this plan's "
        f"largest bucket is {max(b.nbytes for b in plan.buckets) / 1e6:.1f} MB")
    say("kept from the warm-up epochs (buffers allocated once), sender / worst receiver: " + ", ".join(
        f"{arm} {s / 1e6:.1f} / {r / 1e6:.1f} MB" for arm, (s, r) in first.items()))


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench`."""
    bench.add_argument("--world", type=int, action="append",
                       help="trainer + receivers (repeatable; default 2)")
    bench.add_argument("--total-mb", type=float, default=None,
                       help="the plan's size (default 1024, halved until it fits in memory)")
    bench.add_argument("--equal", action="store_true",
                       help="equal-size tensors (--tensors of them) instead of the realistic "
                            "decoder layer mix")
    bench.add_argument("--tensors", type=int, default=1000)
    bench.add_argument("--buffer-size-bytes", type=int, default=64 << 20)
    bench.add_argument("--num-buffers", type=int, default=2)
    bench.add_argument("--reps", type=int, default=3)
    bench.add_argument("--flat-trainer", action="store_true",
                       help="the trainer holds its weights as views into one buffer in plan "
                            "order (Megatron-style), which refit_grpc sends without packing")
    bench.add_argument("--arms", default="", help="comma-separated subset of floor,"
                                                  "floor-buckets,per-tensor,raw,refit_grpc,"
                                                  "staged,http")
    bench.add_argument("--quick", action="store_true",
                       help="a 16 MB plan (unless --total-mb), 1 MiB buckets, one rep: that it "
                            "runs, in seconds; its times mean nothing")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench`: each world in turn, its plan fitted to the host's memory first."""
    if not args.world:
        args.world = [2]
    arms = [a for a in ARMS if a in args.arms.split(",")] if args.arms else list(ARMS)
    if args.quick:  # a small plan and one rep: that the bench runs, in seconds (CI)
        args.total_mb = args.total_mb or 16
        args.tensors, args.buffer_size_bytes, args.reps = min(args.tensors, 64), 1 << 20, 1
    for world in args.world:
        workload = ({"kind": "equal", "total_mb": 0.0, "tensors": args.tensors}
                    if args.equal else {"kind": "realistic", "total_mb": 0.0})
        need = workload_need(workload, world - 1, args.buffer_size_bytes, args.num_buffers, arms)
        total_mb = fit(need, args.total_mb, f"bench, world {world}")
        if total_mb is None:
            return 2
        run_bench(workers=world - 1, workload={**workload, "total_mb": total_mb},
                  buffer_size_bytes=args.buffer_size_bytes, num_buffers=args.num_buffers,
                  reps=args.reps, arms=arms, flat_trainer=args.flat_trainer)
    return 0
