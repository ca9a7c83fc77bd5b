"""`refit-grpc bench-scale`: what the control plane costs the trainer as the fleet widens (a
benchmark: it reports and asserts nothing).

Two series, each at the widths given:
- **processes**: real shim processes (reference engines in store mode, forked from one server
  that has imported torch), each its own gRPC server and gloo rank (to 64 on 2 cores);
- **simulated** (labelled so in the output and the figure): shim processes of up to
  `engines_per_process` engines each (`refit-grpc shim --engines K`): every engine its own gRPC
  server and state, the engines of a process sharing its one receiving gloo rank
  (`refit_grpc.dataplane.shared_rank`) and one UpdateEngines stream per epoch, as a host with K engines
  would run one shim. It reaches 1,000 engines on 2 cores; what it cannot show is K engines'
  own compute on separate GPUs.
- **sim/engine**: the same simulated fleet, each width measured right after the simulated
  row, with the driver opening a stream per engine (`FleetConfig.stream_per_process=False`):
  what the stream per process saves, side by side in one run.
- **staged** and **staged/eng**: the same simulated fleet running staged epochs (each stage,
  then the flip), with one UpdateEngines stream and one FlipEngines call per process, then with
  a stream and a Flip per engine.

The plan is tiny
(`buckets` buckets of 16 KiB), so what an epoch costs beyond its broadcast is control: the
UpdateWeights streams, the two-phase waits, the reports. Per width, medians of `epochs` in-place
epochs:

- trainer CPU per epoch and per engine (the trainer process's user + system time, the gloo
  broadcast included: the sender's part is in the broadcast column's time);
- epoch time, its broadcast part, and what control adds over the broadcast;
- the trainer's threads (the most seen during the epochs) and resident memory;
- trainer egress: the bytes it wrote per epoch (sockets included, /proc/self/io) over the plan's
  bytes, i.e. how many copies of each byte the trainer sends itself (gloo's broadcast);
- the group's formation and one `describe()` of the whole fleet;
- the floor: the trainer's CPU per engine of a round of UpdateWeights streams that every shim
  refuses at once (one grpc.aio stream per engine and nothing else, on channels of its own to
  the same servers). With one stream per engine per epoch, no driver can go below it; the
  ratio says what the driver's own work costs on top.

At the widest simulated width it also times `refit-grpc fleet status` (its rows: one Describe
per engine) and a `describe()`.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from refit_grpc.plan import Packing

_BUCKET_BYTES = 16 << 10


@dataclass(frozen=True)
class ScaleRow:
    """One width's medians (module docstring)."""

    engines: int
    series: str  # "processes", "simulated", "sim/engine", "staged" or "staged/eng"
    form_s: float
    epoch_s: float
    broadcast_s: float
    cpu_ms: float
    threads: int
    rss_mb: float
    egress_copies: float
    describe_s: float
    floor_per_engine_ms: float

    @property
    def cpu_per_engine_ms(self) -> float:
        return self.cpu_ms / self.engines

    @property
    def control_s(self) -> float:
        return self.epoch_s - self.broadcast_s


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _status(field: str) -> int:
    """A number from /proc/self/status (Threads, VmRSS in kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _written() -> int:
    """Bytes this process passed to write/send so far (/proc/self/io `wchar`)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _weights(version: int, buckets: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(buckets)}


def measure_width(shims: list, epochs: int, buckets: int, first_version: int,
                  series: str = "processes", *, stream_per_process: bool = True,
                  floor_ms: float | None = None, staged: bool = False) -> ScaleRow:
    """One width: a new Fleet of `shims`, formed, `epochs` in-place epochs from version
    `first_version` on, one more to warm up first (module docstring). `floor_ms`: the floor
    measured already on these shims (else measured here). `staged`: staged epochs (each
    staged, then flipped) instead."""
    from refit_grpc.driver import Fleet, InPlace, Staged, WorkerEndpoint

    endpoints = [WorkerEndpoint(s.instance_id, s.address) for s in shims]
    epoch = Staged() if staged else InPlace()
    peak_threads = [0]

    sampled = [0.0]

    def on_progress(instance_id: str, index: int, count: int) -> None:
        # Sampled mid-epoch, where the streams are open (it runs on the driver's I/O thread),
        # at most every 20 ms: reading /proc at every engine's PROGRESS showed in the CPU it
        # measures (a tenth of the I/O thread's at 256 engines).
        now = time.perf_counter()
        if now - sampled[0] >= 0.02:
            sampled[0] = now
            peak_threads[0] = max(peak_threads[0], _status("Threads"))

    fleet = Fleet(endpoints, packing=Packing(_BUCKET_BYTES, 2), join_timeout_s=120,
                  epoch_timeout_s=120, stream_per_process=stream_per_process)
    link = None
    try:
        t0 = time.perf_counter()
        first = _weights(0, buckets)
        fleet.prepare({k: (tuple(v.shape), v.dtype) for k, v in first.items()})
        link = fleet.connect("127.0.0.1")
        form_s = time.perf_counter() - t0
        # Warm: channels, buffers, first-epoch costs (a staged one: its copies' first touches).
        fleet.refit(link, first, version=first_version, epoch=epoch)
        walls, sends, cpus, copies = [], [], [], []
        for v in range(first_version + 1, first_version + 1 + epochs):
            w = _weights(v, buckets)
            plan_bytes = sum(t.numel() * t.element_size() for t in w.values())
            c0, b0, t0 = _cpu_s(), _written(), time.perf_counter()
            report = fleet.refit(link, w, version=v, on_progress=on_progress, epoch=epoch)
            walls.append(time.perf_counter() - t0)
            cpus.append(_cpu_s() - c0)
            copies.append((_written() - b0) / plan_bytes)
            sends.append(report.broadcast_seconds)
        t0 = time.perf_counter()
        fleet.describe()
        describe_s = time.perf_counter() - t0
        return ScaleRow(len(shims), series, form_s, statistics.median(walls), statistics.median(sends),
                        statistics.median(cpus) * 1e3, max(peak_threads[0], _status("Threads")),
                        _status("VmRSS") / 1024, statistics.median(copies), describe_s,
                        stream_floor_ms([s.address for s in shims], epochs)
                        if floor_ms is None else floor_ms)
    finally:
        if link is not None:
            link.close()
        fleet.close()


def stream_floor_ms(addresses: list[str], rounds: int) -> float:
    """The trainer's CPU per engine of one grpc.aio UpdateWeights stream per engine and nothing
    else (module docstring): every shim refuses the empty request at once (INVALID_ARGUMENT),
    on channels opened here, one event loop on this thread. Median of `rounds` rounds, after
    one to warm the channels."""
    import asyncio

    import grpc

    from refit_grpc.v1 import refit_pb2 as pb
    from refit_grpc.v1 import refit_pb2_grpc as pb_grpc

    async def refused(stub: pb_grpc.RefitServiceStub) -> None:
        try:
            async for _ in stub.UpdateWeights(pb.UpdateWeightsRequest(), timeout=60):
                pass
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            return
        raise RuntimeError("a shim accepted an empty UpdateWeightsRequest")

    async def rounds_cpu() -> list[float]:
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        stubs = [pb_grpc.RefitServiceStub(c) for c in channels]
        cpus = []
        try:
            for r in range(rounds + 1):
                c0 = _cpu_s()
                await asyncio.gather(*(refused(s) for s in stubs))
                if r:
                    cpus.append(_cpu_s() - c0)
        finally:
            await asyncio.gather(*(c.close() for c in channels))
        return cpus

    return statistics.median(asyncio.run(rounds_cpu())) * 1e3 / len(addresses)


def run_bench_scale(widths: tuple[int, ...] = (8, 16, 32, 64), epochs: int = 6,
                    buckets: int = 8, figure: str | None = "build/bench-scale.png",
                    simulated: tuple[int, ...] = (8, 64, 256, 1000),
                    engines_per_process: int = 50, faults: int = 5,
                    out=sys.stdout) -> list[ScaleRow]:
    """Both series (module docstring), each width's engines started once and shared by every
    narrower width of the series; returns the rows. `figure`: a PNG of cost against width
    (matplotlib), or None. `faults`: at the widest simulated width, that many engines killed
    mid-epoch, then twice as many mid-staging under a quorum (`faults_at_width`); 0: none."""
    from refit_grpc.testing.forked_shims import ShimForkServer

    say = lambda line: print(line, file=out, flush=True)  # noqa: E731
    say(f"bench-scale: reference engines in store mode, a plan of {buckets} x 16 KiB buckets, "
        f"medians of {epochs} in-place epochs per width; trainer pid {os.getpid()}, "
        f"{os.cpu_count()} cores")
    rows: list[ScaleRow] = []
    args = ("--model", "none", "--buffer-size-bytes", str(_BUCKET_BYTES), "--torch-threads", "1")
    version = 1
    with ShimForkServer() as server:
        if widths:
            say("processes: one shim process (one gRPC server, one gloo rank) per engine")
            shims: list = []
            for width in sorted(widths):
                shims += [server.start(*args, "--instance-id", f"sc-{i}")
                          for i in range(len(shims), width)]
                rows.append(measure_width(shims[:width], epochs, buckets, version))
                version += epochs + 1
                _print_row(say, rows[-1], header=len(rows) == 1)
            server.close()
            server.started.clear()
        if simulated:
            say(f"simulated: shim processes of up to {engines_per_process} engines each, every "
                "engine its own gRPC server, one shared receiving gloo rank and one "
                "UpdateEngines stream per process (a SIMULATION of a fleet on one host); "
                "sim/engine: the same fleet, the driver opening a stream per engine; staged, "
                "staged/eng: staged epochs, a stream and a flip call per process, then per "
                "engine")
            shims = []
            for width in sorted(simulated):
                while len(shims) < width:
                    host = len(shims) // engines_per_process
                    count = min(engines_per_process - len(shims) % engines_per_process,
                                width - len(shims))
                    shims += server.start_engines(count, *args, "--instance-id",
                                                  f"sim{host}-{len(shims)}")
                rows.append(measure_width(shims[:width], epochs, buckets, version,
                                          series="simulated"))
                version += epochs + 1
                _print_row(say, rows[-1], header=not widths and len(rows) == 1)
                rows.append(measure_width(shims[:width], epochs, buckets, version,
                                          series="sim/engine", stream_per_process=False,
                                          floor_ms=rows[-1].floor_per_engine_ms))
                version += epochs + 1
                _print_row(say, rows[-1], header=False)
                floor = rows[-1].floor_per_engine_ms
                for series, per_process in (("staged", True), ("staged/eng", False)):
                    rows.append(measure_width(shims[:width], epochs, buckets, version,
                                              series=series, stream_per_process=per_process,
                                              floor_ms=floor, staged=True))
                    version += epochs + 1
                    _print_row(say, rows[-1], header=False)
            say(_operator_calls(shims))
            if faults:
                victims = [server.start(*args, "--instance-id", f"victim-{i}")
                           for i in range(3 * faults)]
                faults_at_width(shims, victims, faults, buckets, version, say)
    for series in ("processes", "simulated", "sim/engine", "staged", "staged/eng"):
        mine = [r for r in rows if r.series == series]
        if len(mine) >= 2:
            a, b = mine[0], mine[-1]
            say(f"{series}, from {a.engines} to {b.engines} engines: trainer CPU per engine "
                f"{a.cpu_per_engine_ms:.2f} -> {b.cpu_per_engine_ms:.2f} ms, control over the "
                f"broadcast {a.control_s * 1e3:.0f} -> {b.control_s * 1e3:.0f} ms, threads "
                f"{a.threads} -> {b.threads}, RSS {a.rss_mb:.0f} -> {b.rss_mb:.0f} MB, egress "
                f"{a.egress_copies:.1f} -> {b.egress_copies:.1f} copies of each byte; the "
                f"floor of one stream per engine {a.floor_per_engine_ms:.2f} -> "
                f"{b.floor_per_engine_ms:.2f} ms, the driver at "
                f"{a.cpu_per_engine_ms / a.floor_per_engine_ms:.2f}x -> "
                f"{b.cpu_per_engine_ms / b.floor_per_engine_ms:.2f}x of it")
    if figure:
        try:
            _draw(rows, figure)
            say(f"figure: {figure}")
        except ImportError:
            say("figure: skipped, matplotlib is not installed (the dev extra has it)")
    return rows


def faults_at_width(shims: list, victims: list, faults: int, buckets: int, version: int,
                    say) -> None:
    """Faults in a fleet of `len(shims)` engines: `faults` of them (single-engine processes,
    so a SIGKILL ends exactly those) killed once every engine ACCEPTED an in-place epoch, then
    `2 * faults` others killed at the first PROGRESS of a staged epoch whose quorum is all but
    them. Says how fast the sender stopped, whether the epoch's failure named the killed
    engines first, and the quorum's flip (or that it failed, and why). The simulated engines
    fill the rest of each fleet."""
    import signal

    from refit_grpc.driver import EpochFailedError, Fleet, FleetError, Staged, WorkerEndpoint
    from refit_grpc.errors import RefitError

    width = len(shims)
    weights = _weights(version, buckets * 8)  # 8x the bench's plan: still mid-send when killed
    spec = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}

    def fleet_of(engines: list) -> Fleet:
        # The killed ones spread through the fleet, not bunched at one end.
        return Fleet([WorkerEndpoint(s.instance_id, s.address) for s in engines],
                     packing=Packing(_BUCKET_BYTES, 2), join_timeout_s=120,
                     epoch_timeout_s=120)

    killed, rest = victims[:faults], victims[faults:]
    engines = shims[:width - faults]
    step = max(len(engines) // (faults + 1), 1)
    for k, v in enumerate(killed):
        engines.insert((k + 1) * step + k, v)
    with fleet_of(engines) as fleet:
        fleet.prepare(spec)
        link = fleet.connect("127.0.0.1")
        fleet.refit(link, weights, version=version)
        handle = fleet.update_weights(version + 1)
        handle.wait_accepted()
        t0 = time.perf_counter()
        for v in killed:
            v.signal(signal.SIGKILL)
        stopped_s = None
        try:
            link.sender.send(_weights(version + 1, buckets * 8), handle.send_deadline())
        except RefitError:
            stopped_s = time.perf_counter() - t0
        named_s, first = None, []
        try:
            handle.result()
        except EpochFailedError as e:
            named_s = time.perf_counter() - t0
            first = [f.instance_id for f in e.failures[:faults]]
        link.close()
    named = sorted(first) == sorted(v.instance_id for v in killed)
    say(
        f"faults at {len(engines)} engines (simulated): {faults} killed once all ACCEPTED; the "
        f"sender stopped {_secs(stopped_s)} after the kill, the epoch failed "
        f"{_secs(named_s)} after it, naming the {faults} first: {'yes' if named else 'NO'}")

    engines = shims[:width - len(rest)]
    step = max(len(engines) // (len(rest) + 1), 1)
    for k, v in enumerate(rest):
        engines.insert((k + 1) * step + k, v)
    fired: list[float] = []

    def on_progress(*_progress) -> None:
        if not fired:
            fired.append(time.perf_counter())
            for v in rest:
                v.signal(signal.SIGKILL)

    quorum = len(engines) - len(rest)
    with fleet_of(engines) as fleet:
        fleet.prepare(spec)
        link = fleet.connect("127.0.0.1")
        fleet.refit(link, weights, version=version + 2)
        t0 = time.perf_counter()
        try:
            report = fleet.refit(link, _weights(version + 3, buckets * 8), version=version + 3,
                                 epoch=Staged(min_engines=quorum), on_progress=on_progress)
        except FleetError as e:  # reported, not hidden: a result of the bench like the others
            reasons = collections.Counter(f"{f.code.name}/{f.reason}" for f in e.failures)
            say(f"quorum at {len(engines)} engines (simulated): {len(rest)} killed mid-staging, "
                f"quorum {quorum}: NOT MET after {time.perf_counter() - t0:.1f} s: "
                f"{len(e.failures)} failures ({dict(reasons.most_common())}); {str(e)[:300]}")
            return
        finally:
            link.close()
        took = time.perf_counter() - t0
    behind = sorted(f.instance_id for f in report.left_behind)
    say(f"quorum at {len(engines)} engines (simulated): {len(rest)} killed mid-staging, quorum "
        f"{quorum}: {len(report.workers)} flipped, left behind by name: "
        f"{'the killed ones' if behind == sorted(v.instance_id for v in rest) else behind}, "
        f"the epoch {took:.1f} s ({report.reforms} re-formed rounds)")


def _secs(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _operator_calls(shims: list) -> str:
    """What an operator's look at the whole fleet costs: `refit-grpc fleet status` (its rows)
    and `describe()` of every engine, timed once each."""
    from refit_grpc.driver import Fleet, WorkerEndpoint
    from refit_grpc.driver.status import render_status, status_rows

    with Fleet([WorkerEndpoint(s.instance_id, s.address) for s in shims],
               control_timeout_s=60) as fleet:
        t0 = time.perf_counter()
        table = render_status(status_rows(fleet))
        status_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fleet.describe()
        describe_s = time.perf_counter() - t0
    return (f"at {len(shims)} engines (simulated): `fleet status` {status_s * 1e3:.0f} ms "
            f"({len(table.splitlines())} lines), describe() {describe_s * 1e3:.0f} ms")


def _print_row(say, r: ScaleRow, header: bool) -> None:
    if header:
        say(f"{'series':>10} {'engines':>7} {'form s':>7} {'epoch ms':>9} {'bcast ms':>9} "
            f"{'control ms':>10} {'cpu ms':>7} {'cpu/eng ms':>10} {'threads':>7} {'rss MB':>7} "
            f"{'egress x':>8} {'describe ms':>11} {'floor/eng ms':>12}")
    say(f"{r.series:>10} {r.engines:>7} {r.form_s:>7.2f} {r.epoch_s * 1e3:>9.1f} "
        f"{r.broadcast_s * 1e3:>9.1f} {r.control_s * 1e3:>10.1f} {r.cpu_ms:>7.1f} "
        f"{r.cpu_per_engine_ms:>10.3f} {r.threads:>7} {r.rss_mb:>7.0f} {r.egress_copies:>8.1f} "
        f"{r.describe_s * 1e3:>11.1f} {r.floor_per_engine_ms:>12.3f}")


def _draw(rows: list[ScaleRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for series, mark in (("processes", "o"), ("simulated", "s"), ("sim/engine", "^"),
                         ("staged", "D"), ("staged/eng", "v")):
        mine = [r for r in rows if r.series == series]
        if not mine:
            continue
        n = [r.engines for r in mine]
        left.plot(n, [r.cpu_per_engine_ms for r in mine], mark + "-",
                  label=f"trainer CPU per engine, {series}")
        if series in ("processes", "simulated"):  # the simulated fleet's floor: measured once
            left.plot(n, [r.floor_per_engine_ms for r in mine], mark + "--",
                      label=f"floor: one refused stream per engine, {series}")
        right.plot(n, [r.control_s * 1e3 for r in mine], mark + "-",
                   label=f"control over broadcast, {series}")
        right.plot(n, [r.epoch_s * 1e3 for r in mine], mark + ":",
                   label=f"epoch, {series}")
    left.axhline(0.2, color="grey", linestyle=":", label="goal 0.2 ms")
    left.set_xlabel("engines")
    left.set_ylabel("ms per engine per epoch")
    left.set_xscale("log", base=2)
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    right.set_xlabel("engines")
    right.set_ylabel("ms per epoch")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.legend(fontsize=8)
    fig.suptitle("bench-scale: one 2-core host; 'simulated' = engines sharing shim processes")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(scale: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench-scale`."""
    scale.add_argument("--widths", default="8,16,32,64",
                       help="comma-separated fleet widths of real shim processes, one engine "
                            "each (the widest started once; empty: none)")
    scale.add_argument("--simulated", default="8,64,256,1000",
                       help="comma-separated widths of the simulated series: shim processes "
                            "of --engines-per-process engines sharing one receiving rank each "
                            "(empty: none)")
    scale.add_argument("--engines-per-process", type=int, default=50)
    scale.add_argument("--faults", type=int, default=5,
                       help="at the widest simulated width: engines killed mid-epoch, then "
                            "twice as many mid-staging under a quorum (0: none)")
    scale.add_argument("--epochs", type=int, default=6, help="in-place epochs per width")
    scale.add_argument("--buckets", type=int, default=8, help="16 KiB buckets per epoch")
    scale.add_argument("--png", default="build/bench-scale.png",
                       help="the figure of cost against width (empty: none; needs matplotlib)")
    scale.add_argument("--quick", action="store_true",
                       help="widths 2 and 4, simulated 3 and 8 (4 per process), 2 epochs, "
                            "1 fault: that it runs, in seconds")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench-scale`."""
    def widths_of(text: str) -> tuple[int, ...]:
        return tuple(int(w) for w in text.split(",") if w.strip())

    widths, simulated = widths_of(args.widths), widths_of(args.simulated)
    per_process, faults = args.engines_per_process, args.faults
    if args.quick:
        widths, simulated, per_process, args.epochs, faults = (2, 4), (3, 8), 4, 2, 1
    if any(w < 1 for w in widths + simulated) or per_process < 1:
        print(f"bench-scale: widths must be positive: {args.widths} / {args.simulated}",
              file=sys.stderr)
        return 2
    run_bench_scale(widths, epochs=args.epochs, buckets=args.buckets, figure=args.png or None,
                    simulated=simulated, engines_per_process=per_process, faults=faults)
    return 0


if __name__ == "__main__":  # a quick look: python -m refit_grpc.tools.bench_scale [simulated...]
    run_bench_scale(widths=(), simulated=tuple(int(a) for a in sys.argv[1:]) or (8, 64))
