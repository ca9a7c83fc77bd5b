"""`refit-grpc shim | call | health | fleet | demo | bench | bench-stall | bench-delta |
bench-catch-up | bench-scale | bench-lora-quant`: the command-line entry points.

The parser and `main` live here; each command's body in its own module: `shim` (serve one
engine), `call` (`call` and `health`), `fleet` (`fleet status | flush | abort`), and `security`
(the TLS flags the three client commands share). Process spawning stays in
`refit_grpc.shim.process`, which runs `python -m refit_grpc.cli shim`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from refit_grpc.cli.fleet import add_fleet_parser
from refit_grpc.cli.security import add_security_flags, security_from_args
from refit_grpc.plan import DEFAULT_BUFFER_SIZE_BYTES, DEFAULT_NUM_BUFFERS


def _demo(args: argparse.Namespace) -> int:
    from refit_grpc.tools.demo import run_demo

    return run_demo(workers=args.workers, steps=args.steps, buffer_size_bytes=args.buffer_size_bytes)


def _shim(args: argparse.Namespace) -> int:
    from refit_grpc.cli.shim import run_shim

    return run_shim(args)


def _call(args: argparse.Namespace) -> int:
    from refit_grpc.cli.call import call

    return call(args.address, args.method, args.json, security=security_from_args(args),
                timeout_s=args.timeout_s)


def _health(args: argparse.Namespace) -> int:
    from refit_grpc.cli.call import health

    return health(args.address, security=security_from_args(args), timeout_s=args.timeout_s)


def _fleet(args: argparse.Namespace) -> int:
    from refit_grpc.cli.fleet import run_fleet_command

    return run_fleet_command(args)


def _bench(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench import ARMS, run_bench, workload_need

    arms = [a for a in ARMS if a in args.arms.split(",")] if args.arms else list(ARMS)
    if args.quick:  # a small plan and one rep: that the bench runs, in seconds (CI)
        args.total_mb = args.total_mb or 16
        args.tensors, args.buffer_size_bytes, args.reps = min(args.tensors, 64), 1 << 20, 1
    for world in args.world:
        workload = ({"kind": "equal", "total_mb": 0.0, "tensors": args.tensors}
                    if args.equal else {"kind": "realistic", "total_mb": 0.0})
        need = workload_need(workload, world - 1, args.buffer_size_bytes, args.num_buffers, arms)
        total_mb = _fit(need, args.total_mb, f"bench, world {world}")
        if total_mb is None:
            return 2
        run_bench(workers=world - 1, workload={**workload, "total_mb": total_mb},
                  buffer_size_bytes=args.buffer_size_bytes, num_buffers=args.num_buffers,
                  reps=args.reps, arms=arms, flat_trainer=args.flat_trainer)
    return 0


def _bench_stall(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench_stall import run_stall_bench

    if args.quick:  # a 2-layer Llama of width 128, one epoch of each mode counted, no figure,
        # the Dynamo part beside the vLLM part
        args.pairs, args.streams, args.max_tokens, args.hidden, args.layers = 1, 2, 48, 128, 2
        args.buffer_size_bytes, args.steady_s, args.png = 1 << 20, 1.0, ""
    return run_stall_bench(pairs=args.pairs, streams=args.streams, max_tokens=args.max_tokens,
                           hidden=args.hidden, layers=args.layers,
                           buffer_size_bytes=args.buffer_size_bytes, steady_s=args.steady_s,
                           scale=args.scale, png=args.png or None, parts_together=args.quick)


def _fit(need, total_mb: float | None, what: str) -> float | None:
    """`fit_total_mb` with a 1024 MB default; None (said on stderr) where nothing fits."""
    from refit_grpc.tools.bench_memory import DoesNotFit, fit_total_mb

    try:
        return fit_total_mb(need, total_mb, 1024, what)
    except DoesNotFit as e:
        print(f"refit-grpc {what.split(',')[0]}: {e}", file=sys.stderr)
        return None


def _bench_delta(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench_delta import delta_need, run_bench_delta

    if args.quick:
        args.total_mb, args.reps, args.fractions = args.total_mb or 8, 1, "0.01"
        args.buffer_size_bytes = 1 << 20
    total_mb = _fit(lambda mb: delta_need(mb, args.world - 1, args.buffer_size_bytes),
                    args.total_mb, f"bench-delta, world {args.world}")
    if total_mb is None:
        return 2
    run_bench_delta(workers=args.world - 1, total_mb=total_mb, reps=args.reps,
                    fractions=[float(f) for f in args.fractions.split(",")],
                    buffer_size_bytes=args.buffer_size_bytes, lr=args.lr,
                    link_gbit=args.link_gbit)
    return 0


def _bench_catch_up(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench_catch_up import catch_up_need, run_bench_catch_up

    if args.quick:
        args.total_mb, args.reps, args.buffer_size_bytes = args.total_mb or 8, 1, 1 << 20
    total_mb = _fit(lambda mb: catch_up_need(mb, args.peers, args.buffer_size_bytes),
                    args.total_mb, f"bench-catch-up, {args.peers} peers")
    if total_mb is None:
        return 2
    run_bench_catch_up(peers=args.peers, total_mb=total_mb, reps=args.reps,
                       buffer_size_bytes=args.buffer_size_bytes)
    return 0


def _bench_lora_quant(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench_lora_quant import run_bench_lora_quant

    if args.quick:  # a 2-layer Llama of width 128, one epoch of each kind counted, the servers
        # booted together
        args.epochs, args.hidden, args.layers, args.buffer_size_bytes = 1, 128, 2, 1 << 20
    return run_bench_lora_quant(epochs=args.epochs, hidden=args.hidden, layers=args.layers,
                                buffer_size_bytes=args.buffer_size_bytes,
                                boot_together=args.quick)


def _bench_scale(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench_scale import run_bench_scale

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


def link_gbit(text: str) -> float:
    """`--link-gbit`: a link's rate in Gbit/s, positive and finite."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < rate < float("inf"):
        raise argparse.ArgumentTypeError(f"a link's rate must be positive and finite: {text!r}")
    return rate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit-grpc", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_shim_parser(sub)
    _add_client_parsers(sub)
    add_fleet_parser(sub, _fleet)
    _add_bench_parsers(sub)
    return parser


def _add_shim_parser(sub: Any) -> None:
    shim = sub.add_parser("shim", help="serve RefitService next to one engine")
    shim.add_argument("--engine", default="reference", help="reference, vllm or dynamo")
    shim.add_argument("--address", default="127.0.0.1:50051",
                      help="listen address (default loopback; port 0 picks a free one)")
    shim.add_argument("--engine-url", default="http://127.0.0.1:8000",
                      help="where the engine's own server listens (vllm: its OpenAI server; "
                           "dynamo: the worker's system_url)")
    shim.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                      help="engine-specific option, parsed by the engine's options class")
    shim.add_argument("--model", choices=["tiny-lm", "none"], default="tiny-lm",
                      help="reference engine: the tiny LM, or a plain tensor store")
    shim.add_argument("--seed", type=int, default=0)
    shim.add_argument("--buffer-size-bytes", type=int, default=DEFAULT_BUFFER_SIZE_BYTES)
    shim.add_argument("--num-buffers", type=int, default=DEFAULT_NUM_BUFFERS)
    shim.add_argument("--max-epoch-s", type=float, default=600.0)
    shim.add_argument("--progress-interval-ms", type=float, default=200.0,
                      help="an epoch's PROGRESS: the first bucket at once, then at most one "
                           "per this many ms (0: every bucket)")
    shim.add_argument("--grace-s", type=float, default=30.0)
    shim.add_argument("--instance-id", default="")
    shim.add_argument("--engines", type=int, default=1, metavar="K",
                      help="serve K engines from this process (reference engine): one gRPC "
                           "server each (ports from --address's on, or free ones with port 0; "
                           "instance ids INSTANCE_ID-0 ...), one shared receiving rank in "
                           "every data group (a host's relay; the simulated wide fleet)")
    shim.add_argument("--torch-threads", type=int, default=1)
    shim.add_argument("--token-file", help="bearer tokens, one per line (or REFIT_GRPC_TOKEN)")
    shim.add_argument("--tls-cert", help="server certificate chain (PEM)")
    shim.add_argument("--tls-key", help="server private key (PEM)")
    shim.add_argument("--tls-client-ca", help="CA that client certificates must chain to (mTLS)")
    shim.add_argument("--insecure-listen", action="store_true",
                      help="allow a non-loopback address without TLS or a token (logs a warning)")
    shim.add_argument("--allow-master", action="append", default=None, metavar="CIDR",
                      help="networks whose rendezvous the shim may join (default loopback, or "
                           "REFIT_GRPC_ALLOW_MASTER: CIDRs separated by commas)")
    shim.add_argument("--metrics-address", metavar="HOST:PORT",
                      help="serve Prometheus metrics over HTTP there (off by default; a port "
                           "alone binds loopback; beyond loopback needs --insecure-listen)")
    shim.set_defaults(func=_shim)


def _add_client_parsers(sub: Any) -> None:
    demo = sub.add_parser("demo", help="train a tiny LM and refit a local fleet every step")
    demo.add_argument("--workers", type=int, default=3)
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--buffer-size-bytes", type=int, default=256 * 1024)
    demo.set_defaults(func=_demo)

    rpc = sub.add_parser("call", help="call one RefitService method with a JSON body "
                                      "(grpcurl's mapping; token from REFIT_GRPC_TOKEN)")
    rpc.add_argument("address")
    rpc.add_argument("method", help="Describe, Prepare, InitCollective, UpdateWeights, ...")
    rpc.add_argument("json", nargs="?", default="{}")
    rpc.add_argument("--timeout-s", type=float, default=30.0)
    add_security_flags(rpc)
    rpc.set_defaults(func=_call)

    check = sub.add_parser("health", help="exit 0 when the shim at ADDRESS is SERVING")
    check.add_argument("address")
    check.add_argument("--timeout-s", type=float, default=2.0)
    add_security_flags(check)
    check.set_defaults(func=_health)


def _add_bench_parsers(sub: Any) -> None:
    bench = sub.add_parser("bench", help="refit_grpc against the wire floor, the per-tensor "
                                         "refit and the HTTP-JSON way, side by side")
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
    bench.set_defaults(func=_bench)

    stall = sub.add_parser("bench-stall", help="the stall streamed generation on a real vLLM "
                                               "sees: in-place, staged and keep-cache epochs")
    stall.add_argument("--pairs", type=int, default=5,
                       help="epochs of each mode counted, interleaved, after a warm-up of each")
    stall.add_argument("--streams", type=int, default=4, help="concurrent streamed completions")
    stall.add_argument("--max-tokens", type=int, default=240, help="per completion")
    stall.add_argument("--hidden", type=int, default=512, help="the Llama's width")
    stall.add_argument("--layers", type=int, default=6, help="the Llama's layers")
    stall.add_argument("--buffer-size-bytes", type=int, default=4 << 20)
    stall.add_argument("--steady-s", type=float, default=3.0,
                       help="steady generation before and between epochs")
    stall.add_argument("--scale", type=float, default=1e-3,
                       help="standard deviation of each version's noise on the checkpoint")
    stall.add_argument("--png", default="build/bench-stall.png",
                       help="the figure of tokens over time (empty: none; needs matplotlib)")
    stall.add_argument("--quick", action="store_true",
                       help="a 2-layer Llama of width 128, 2 streams, one epoch of each mode "
                            "counted, no figure: that it runs (vLLM's start is most of it)")
    stall.set_defaults(func=_bench_stall)

    lq = sub.add_parser("bench-lora-quant", help="an adapter epoch against a full one, and a "
                                                 "quantized engine's refit against the same "
                                                 "model unquantized, on real vLLM engines")
    lq.add_argument("--epochs", type=int, default=5,
                    help="epochs of each kind counted, after a warm-up of each")
    lq.add_argument("--hidden", type=int, default=512, help="the Llama's width")
    lq.add_argument("--layers", type=int, default=6, help="the Llama's layers")
    lq.add_argument("--buffer-size-bytes", type=int, default=4 << 20)
    lq.add_argument("--quick", action="store_true",
                    help="a 2-layer Llama of width 128, one epoch of each kind counted: that it "
                         "runs (vLLM's starts are most of it)")
    lq.set_defaults(func=_bench_lora_quant)

    delta = _plan_bench(sub, "bench-delta", "delta epochs against full ones (staged, the "
                        "reference engine), side by side", reps="epochs per fraction and mode",
                        quick="one rep of 1%% changed", func=_bench_delta)
    delta.add_argument("--world", type=int, default=2, help="trainer + receivers, per fleet")
    delta.add_argument("--fractions", default="0.001,0.01,0.1,1",
                       help="fractions of the elements each version changes")
    delta.add_argument("--lr", type=float, default=1e-6,
                       help="the SGD step whose changed fraction is measured (and added)")
    delta.add_argument("--link-gbit", type=link_gbit, default=None, metavar="RATE",
                       help="each engine in its own network namespace behind a link limited to "
                            "RATE Gbit/s each way (tc; needs root); default: loopback")

    catch_up = _plan_bench(sub, "bench-catch-up", "an engine joining by catch-up from a peer "
                           "against by the trainer's epoch", reps="joins of each way",
                           quick="one rep", func=_bench_catch_up)
    catch_up.add_argument("--peers", type=int, default=2, help="members holding the version")

    scale = sub.add_parser("bench-scale", help="what control costs the trainer as the fleet "
                                               "widens: CPU per engine, threads, egress")
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
    scale.set_defaults(func=_bench_scale)


def _plan_bench(sub: Any, name: str, help: str, reps: str, quick: str,
                func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """A bench on a bf16 plan, with the flags those benches share: the plan's size, reps (3),
    the bucket size and --quick (an 8 MB plan, 1 MiB buckets, `quick`)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help)
    parser.add_argument("--total-mb", type=float, default=None,
                        help="the bf16 plan's size (default 1024, halved until it fits)")
    parser.add_argument("--reps", type=int, default=3, help=reps)
    parser.add_argument("--buffer-size-bytes", type=int, default=64 << 20)
    parser.add_argument("--quick", action="store_true",
                        help=f"an 8 MB plan (unless --total-mb), 1 MiB buckets, {quick}: that it "
                             "runs, in seconds")
    parser.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is _bench and not args.world:
        args.world = [2]
    if getattr(args, "allow_master", "unset") is None:
        # An environment variable too, for containers whose command line is fixed.
        from_env = [c.strip() for c in os.environ.get("REFIT_GRPC_ALLOW_MASTER", "").split(",")]
        args.allow_master = [c for c in from_env if c] or ["127.0.0.0/8", "::1/128"]
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
