"""`refit-grpc bench-delta`: delta epochs against full ones, side by side in one run (a
benchmark: it reports and asserts nothing).

Two fleets of reference engines (store mode, one shim process per receiver each), one refit
with full staged epochs, the other with `delta=True`, refit with the same versions in turn: a
1 GiB bf16 decoder mix (the bench's realistic layer mix in bf16) whose versions differ from the
one before in a given fraction of the elements. Per fraction, medians of `reps` epochs: bytes on
the wire, epoch time and the trainer's CPU, delta against full. One more row measures the
fraction a real step changes: a tiny LM in bf16, one SGD step at a learning rate RL uses, the
words that changed.

On loopback by default; with `link_gbit`, every engine's shim runs in a network namespace of its
own behind a link limited to that rate in each direction (`refit_grpc.testing.netns`: a veth pair
on a bridge, tc's token-bucket filter on both ends; needs root), the trainer in the root
namespace, its gloo master on the bridge.
"""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from refit_grpc.driver.options import Staged
from refit_grpc.plan import Packing, RefitPlan, TensorSpec
from refit_grpc.testing.harness import Run
from refit_grpc.tools.bench import materialize, realistic_specs
from refit_grpc.tools.bench_memory import PROCESS_BASE_BYTES, Need, add_plan_arguments, fit

FRACTIONS = (0.001, 0.01, 0.1, 1.0)


def bf16_specs(total_bytes: int) -> list[TensorSpec]:
    """The bench's realistic decoder mix, in bf16, of about `total_bytes`."""
    return [TensorSpec(s.name, s.shape, torch.bfloat16)
            for s in realistic_specs(2 * total_bytes)]


def delta_need(total_mb: float, workers: int, buffer_size_bytes: int) -> Need:
    """The run's resident memory, from its plan: every shim (two fleets of `workers`) holds its
    live weights and its staged copy and a few buckets in flight; the trainer the version sent,
    the next one, the delta fleet's base copy, and while it times the CPU work alone three more
    copies (a base, an engine's copy, the next version)."""
    plan = RefitPlan(tuple(bf16_specs(int(total_mb * (1 << 20)))), Packing(buffer_size_bytes, 2))
    total, bucket = plan.total_bytes, max(b.nbytes for b in plan.buckets)
    shim = 2 * total + 4 * bucket + PROCESS_BASE_BYTES
    trainer = 6 * total + 6 * bucket + PROCESS_BASE_BYTES
    return Need({"two fleets and the CPU breakdown": trainer + 2 * workers * shim})


def perturbed(tensors: dict[str, torch.Tensor], fraction: float,
              g: torch.Generator) -> dict[str, torch.Tensor]:
    """A next version: `fraction` of each tensor's elements moved by a small step."""
    out = {}
    for name, t in tensors.items():
        new = t.clone()
        flat = new.view(-1)
        k = int(round(fraction * flat.numel()))
        if k:
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] = flat[idx] + torch.randn(k, generator=g, dtype=t.dtype) * 1e-2
        out[name] = new
    return out


def sgd_step_fraction(lr: float = 1e-6, seed: int = 0) -> float:
    """The fraction of 16-bit words one SGD step changes in a bf16 model (the tiny LM, one
    batch of random tokens, plain SGD at `lr`): what RL's small steps leave alone."""
    from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig

    torch.manual_seed(seed)
    model = TinyLM(TinyLMConfig(hidden_size=256, num_layers=4)).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, model.cfg.vocab_size, (8, 32))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None  # every parameter takes part in the loss
            p.sub_(lr * p.grad)
    changed = total = 0
    for n, p in model.named_parameters():
        changed += int((p.detach().view(torch.int16) != before[n].view(torch.int16)).sum())
        total += p.numel()
    return changed / total


def cpu_breakdown(plan: RefitPlan, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
                  ) -> dict[str, float]:
    """The per-bucket CPU work of one delta epoch from `old` to `new`, with no wire, on this
    thread, in seconds: the trainer's encode (compare where the tensors lie, pack only a bucket
    that goes raw), base update and staged-digest checksum (as `send_delta` does them); one
    engine's apply and checksum. What bounds a delta epoch once the wire is not the
    bottleneck."""
    from refit_grpc.dataplane.delta import apply, encode_tensors, flat_copy
    from refit_grpc.dataplane.packing import copy_bytes
    from refit_grpc.dataplane.staging import bucket_checksum

    base = flat_copy(plan, old)
    engine = base.clone()  # the engine's committed copy
    biggest = max(b.nbytes for b in plan.buckets)
    packed = torch.empty(biggest, dtype=torch.uint8)
    scratch = torch.empty(biggest, dtype=torch.uint8)
    received = torch.empty(biggest, dtype=torch.uint8)
    t = dict.fromkeys(("encode", "base", "checksum", "apply", "engine checksum"), 0.0)
    offset = 0
    for b in plan.buckets:
        mine = base[offset:offset + b.nbytes]
        t0 = time.perf_counter()
        encoding, payload, _ = encode_tensors([new[s.name] for s in plan.tensors[b.start:b.stop]],
                                              mine, packed, scratch)
        t1 = time.perf_counter()
        apply(encoding, payload, mine)  # send_delta's base update
        t2 = time.perf_counter()
        bucket_checksum(mine)
        t3 = time.perf_counter()
        target = engine[offset:offset + b.nbytes]
        wire = received[:payload.numel()]
        copy_bytes(wire, payload)  # what gloo would have written (not timed)
        t4 = time.perf_counter()
        apply(encoding, wire, target)
        t5 = time.perf_counter()
        bucket_checksum(target)
        t6 = time.perf_counter()
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5)):
            t[k] += dt
        offset += b.nbytes
    assert torch.equal(engine, base), "the engine's copy differs from the trainer's"
    assert torch.equal(base, flat_copy(plan, new)), "the trainer's base is not the new version"
    return t


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_bench_delta(workers: int = 1, total_mb: float = 1024, reps: int = 3,
                    fractions: Sequence[float] = FRACTIONS, buffer_size_bytes: int = 64 << 20,
                    lr: float = 1e-6, link_gbit: float | None = None,
                    out=sys.stdout) -> dict[float, dict[str, float]]:
    """Both fleets side by side (module docstring); prints the table, returns the medians.
    `link_gbit`: each engine in its own network namespace behind a link of that rate."""
    from refit_grpc.driver import Fleet, WorkerEndpoint

    run = Run("bench-delta", None, out)
    say = run.say
    specs = bf16_specs(int(total_mb * (1 << 20)))
    plan = RefitPlan(tuple(specs), Packing(buffer_size_bytes, 2))
    step = sgd_step_fraction(lr)
    say(f"plan: {len(specs)} bf16 tensors, {plan.total_bytes / 1e6:.1f} MB, "
        f"{len(plan.buckets)} buckets; {workers} receiver(s) per fleet; {reps} reps per "
        f"fraction after one warm-up; one SGD step at lr {lr:g} on a bf16 tiny LM changes "
        f"{step:.4%} of its words")
    say("link: loopback" if link_gbit is None else
        f"link: each engine in its own network namespace behind a {link_gbit:g} Gbit/s link "
        "(tc tbf on both ends of its veth), the trainer in the root namespace; a full epoch's "
        f"bytes take {plan.total_bytes * 8 / (link_gbit * 1e9):.2f} s at that rate")
    fractions = sorted({*fractions, round(step, 6)} - {0.0})
    fleets = {}
    results: dict[float, dict[str, list[float]]] = {}
    breakdown: dict[float, dict[str, float]] = {}
    stack = ExitStack()
    try:
        if link_gbit is None:
            master, security = "127.0.0.1", None
            shims = run.spawn_shims([("--model", "none", "--instance-id", f"{arm}-{i}")
                                     for arm in ("full", "delta") for i in range(workers)],
                                    buffer_size_bytes)
        else:
            master, security, shims = _netns_shims(stack, workers, link_gbit,
                                                   buffer_size_bytes)
        for k, arm in enumerate(("full", "delta")):
            fleet = Fleet([WorkerEndpoint(s.instance_id, s.address)
                           for s in shims[k * workers:(k + 1) * workers]],
                          packing=plan.packing, epoch_timeout_s=600, security=security)
            fleet.prepare(plan.state_dict_info())
            fleets[arm] = (fleet, fleet.connect(master))
        g = torch.Generator().manual_seed(0)
        current = materialize(specs)
        version = 0

        def epoch(arm: str, tensors) -> tuple[float, float, int]:
            fleet, link = fleets[arm]
            cpu0, t0 = _cpu_s(), time.monotonic()
            report = fleet.refit(link, tensors, version=version,
                                 epoch=Staged(delta=arm == "delta"))
            return time.monotonic() - t0, _cpu_s() - cpu0, report.wire_bytes

        version += 1
        for arm in ("full", "delta"):  # warm-up: the delta fleet's first epoch is full
            epoch(arm, current)
        for fraction in fractions:
            rows = results.setdefault(fraction, {k: [] for k in (
                "full_s", "delta_s", "full_cpu", "delta_cpu", "full_bytes", "delta_bytes")})
            for _ in range(reps):
                current = perturbed(current, fraction, g)
                version += 1
                for arm in ("full", "delta"):
                    seconds, cpu, wire = epoch(arm, current)
                    rows[f"{arm}_s"].append(seconds)
                    rows[f"{arm}_cpu"].append(cpu)
                    rows[f"{arm}_bytes"].append(wire)
            before = current
            breakdown[fraction] = cpu_breakdown(plan, before, perturbed(before, fraction, g))
            say(f"fraction {fraction:g} done")
        base_mb = fleets["delta"][0].delta_base_bytes / 1e6
    finally:
        for fleet, link in fleets.values():
            link.close()
            fleet.close()
        run.teardown()
        stack.close()
    medians = {f: {k: statistics.median(v) for k, v in rows.items()}
               for f, rows in results.items()}
    gib = plan.total_bytes / (1 << 30)
    say(f"{'changed':>9} {'full ms':>8} {'delta ms':>9} {'time':>7} {'full MB':>8} "
        f"{'delta MB':>9} {'bytes':>7} {'full cpu s/GiB':>15} {'delta cpu s/GiB':>16}")
    for f, m in medians.items():
        say(f"{f:>9.4%} {m['full_s'] * 1e3:8.0f} {m['delta_s'] * 1e3:9.0f} "
            f"{m['delta_s'] / m['full_s']:6.2f}x {m['full_bytes'] / 1e6:8.1f} "
            f"{m['delta_bytes'] / 1e6:9.1f} {m['delta_bytes'] / m['full_bytes']:6.2%} "
            f"{m['full_cpu'] / gib:15.2f} {m['delta_cpu'] / gib:16.2f}")
    say("the CPU work of one delta epoch alone (no wire, after the epochs above; the compare in "
        "two parts as send_delta does it, the rest on one thread), seconds: the trainer's encode "
        "(compare where the tensors lie; a bucket that goes raw is packed), base update, "
        "checksum; one engine's apply, checksum")
    say(f"{'changed':>9} {'encode':>7} {'base':>6} {'cksum':>6} {'apply':>6} {'e.cksum':>7} "
        f"{'total':>6}")
    for f, t in breakdown.items():
        say(f"{f:>9.4%} " + " ".join(f"{v:{w}.3f}" for v, w in zip(t.values(), (7, 6, 6, 6, 7)))
            + f" {sum(t.values()):6.3f}")
    say(f"extra memory: the trainer keeps {base_mb:.1f} MB (one copy of the last version sent); "
        "each engine its committed copy, the staged copy it already keeps "
        f"({plan.total_bytes / 1e6:.1f} MB)")
    return medians


def _netns_shims(stack: ExitStack, workers: int, link_gbit: float, buffer_size_bytes: int):
    """Both fleets' shims, each in a namespace of its own behind a `link_gbit` link (torn down by
    `stack`): (the trainer's master address, the fleets' security, the shims: full's, then
    delta's). The shims take a fresh bearer token (they listen off loopback)."""
    from refit_grpc.driver import ChannelSecurity
    from refit_grpc.testing.netns import Hosts

    # Gloo advertises the address this host routes to the master from, not a fixed interface.
    ifname = os.environ.pop("GLOO_SOCKET_IFNAME", None)
    if ifname is not None:
        stack.callback(os.environ.__setitem__, "GLOO_SOCKET_IFNAME", ifname)
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="refit-bench-delta-")))
    hosts = stack.enter_context(Hosts(2 * workers, rate_gbit=link_gbit))
    token = secrets.token_hex(16)
    netns = hosts.start_shims(
        [("--model", "none", "--instance-id", f"{arm}-{i}", "--buffer-size-bytes",
          str(buffer_size_bytes), "--num-buffers", "2")
         for arm in ("full", "delta") for i in range(workers)], logs, token=token,
        log_level="WARNING")
    return hosts.master, ChannelSecurity(token=token), [s.shim for s in netns]


__all__ = ["delta_need", "run_bench_delta", "sgd_step_fraction"]


def link_gbit(text: str) -> float:
    """`--link-gbit`: a link's rate in Gbit/s, positive and finite."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"a link's rate must be positive and finite: {text!r}")
    return rate


def add_arguments(delta: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc bench-delta`."""
    add_plan_arguments(delta, reps="epochs per fraction and mode", quick="one rep of 1%% changed")
    delta.add_argument("--world", type=int, default=2, help="trainer + receivers, per fleet")
    delta.add_argument("--fractions", default="0.001,0.01,0.1,1",
                       help="fractions of the elements each version changes")
    delta.add_argument("--lr", type=float, default=1e-6,
                       help="the SGD step whose changed fraction is measured (and added)")
    delta.add_argument("--link-gbit", type=link_gbit, default=None, metavar="RATE",
                       help="each engine in its own network namespace behind a link limited to "
                            "RATE Gbit/s each way (tc; needs root); default: loopback")


def run(args: argparse.Namespace) -> int:
    """`refit-grpc bench-delta`: its plan fitted to the host's memory first."""
    if args.quick:
        args.total_mb, args.reps, args.fractions = args.total_mb or 8, 1, "0.01"
        args.buffer_size_bytes = 1 << 20
    total_mb = fit(lambda mb: delta_need(mb, args.world - 1, args.buffer_size_bytes),
                   args.total_mb, f"bench-delta, world {args.world}")
    if total_mb is None:
        return 2
    run_bench_delta(workers=args.world - 1, total_mb=total_mb, reps=args.reps,
                    fractions=[float(f) for f in args.fractions.split(",")],
                    buffer_size_bytes=args.buffer_size_bytes, lr=args.lr,
                    link_gbit=args.link_gbit)
    return 0
