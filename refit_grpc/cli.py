"""`refit-grpc shim | call | health | fleet | demo | bench`: the command-line entry points."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from refit_grpc.plan import DEFAULT_BUFFER_SIZE_BYTES, DEFAULT_NUM_BUFFERS, Packing


def _shim(args: argparse.Namespace) -> int:
    import faulthandler
    import signal

    from refit_grpc.shim.process import die_with_parent_if_asked

    die_with_parent_if_asked()  # spawn_shim's tie to its life, set here rather than before exec
    # Operators (and spawn_shim on a start that hangs) get every thread's stack on SIGUSR1.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch

    from refit_grpc.shim.auth import (
        ExposureError,
        TlsFiles,
        TokenAuthInterceptor,
        check_exposure,
    )
    from refit_grpc.shim.engines import create_engine
    from refit_grpc.shim.process import METRICS_PREFIX, READY_PREFIX
    from refit_grpc.shim.server import ServerOptions, ShimServer
    from refit_grpc.shim.service import ShimConfig

    # The shim's torch work is byte copies and single-threaded decoding; intra-op thread pools
    # only spin against the trainer and the other shims for the machine's cores.
    torch.set_num_threads(args.torch_threads)
    packing = Packing(args.buffer_size_bytes, args.num_buffers)
    options: dict[str, str] = {}
    for item in args.engine_option:
        key, _, value = item.partition("=")
        options[key] = value
    # The flags that name an engine option go to the engine whose options have it.
    engine = create_engine(args.engine, packing, **options, flags={
        "url": args.engine_url, "model": args.model, "seed": args.seed})
    import ipaddress

    for cidr in args.allow_master:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as e:
            raise SystemExit(f"--allow-master / REFIT_GRPC_ALLOW_MASTER: {e}") from None
    config_kwargs = {"max_epoch_s": args.max_epoch_s,
                     "allowed_master_networks": tuple(args.allow_master)}
    if args.instance_id:
        config_kwargs["instance_id"] = args.instance_id
    tokens = _read_tokens(args.token_file)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = TlsFiles(Path(args.tls_cert), Path(args.tls_key),
                       Path(args.tls_client_ca) if args.tls_client_ca else None)
    elif args.tls_client_ca:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
    try:
        check_exposure(args.address, tls=tls is not None, token=bool(tokens),
                       allow_insecure=args.insecure_listen)
    except ExposureError as e:
        raise SystemExit(str(e)) from None
    if args.metrics_address is not None:
        from refit_grpc.shim.metrics import (
            MetricsAddressError,
            check_metrics_exposure,
            parse_metrics_address,
        )

        try:
            host, _ = parse_metrics_address(args.metrics_address)
            check_metrics_exposure(host, allow_insecure=args.insecure_listen)
        except MetricsAddressError as e:
            raise SystemExit(str(e)) from None
    server = ShimServer(engine, ShimConfig(**config_kwargs),
                        ServerOptions(address=args.address, grace_s=args.grace_s,
                                      metrics_address=args.metrics_address),
                        credentials=tls.credentials() if tls else None,
                        interceptors=(TokenAuthInterceptor(tokens),) if tokens else ()).start()
    # Parent processes (demo, tests) read these lines to learn the ports (0 binds a free one).
    if server.metrics is not None:
        print(f"{METRICS_PREFIX}http://{server.metrics.address}/metrics", flush=True)
    print(f"{READY_PREFIX}{server.address} {server.servicer.config.instance_id}", flush=True)
    server.serve_until_signal()
    return 0


def _read_tokens(path: str | None) -> list[str]:
    """Tokens, one per line, from --token-file or the REFIT_GRPC_TOKEN variable (never a flag:
    flags show up in process listings)."""
    if path:
        return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    token = os.environ.get("REFIT_GRPC_TOKEN", "").strip()
    return [token] if token else []


def _demo(args: argparse.Namespace) -> int:
    from refit_grpc.tools.demo import run_demo

    return run_demo(workers=args.workers, steps=args.steps, buffer_size_bytes=args.buffer_size_bytes)


def _call(args: argparse.Namespace) -> int:
    from refit_grpc.operator_call import call, security_from_args

    return call(args.address, args.method, args.json, security=security_from_args(args),
                timeout_s=args.timeout_s)


def _health(args: argparse.Namespace) -> int:
    from refit_grpc.operator_call import health, security_from_args

    return health(args.address, security=security_from_args(args), timeout_s=args.timeout_s)


def _fleet(args: argparse.Namespace) -> int:
    from refit_grpc.operator_fleet import run_fleet_command

    return run_fleet_command(args)


def _bench(args: argparse.Namespace) -> int:
    from refit_grpc.tools.bench import ARMS, run_bench

    workload = ({"kind": "equal", "total_mb": args.total_mb, "tensors": args.tensors}
                if args.equal else {"kind": "realistic", "total_mb": args.total_mb})
    arms = [a for a in ARMS if a in args.arms.split(",")] if args.arms else list(ARMS)
    for world in args.world:
        run_bench(workers=world - 1, workload=workload, buffer_size_bytes=args.buffer_size_bytes,
                  num_buffers=args.num_buffers, reps=args.reps, arms=arms,
                  flat_trainer=args.flat_trainer)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refit-grpc", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

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
    shim.add_argument("--grace-s", type=float, default=30.0)
    shim.add_argument("--instance-id", default="")
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
    rpc.add_argument("--ca", help="CA certificate (PEM): use TLS")
    rpc.add_argument("--cert", help="client certificate (PEM) for mTLS")
    rpc.add_argument("--key", help="client key (PEM) for mTLS")
    rpc.set_defaults(func=_call)

    check = sub.add_parser("health", help="exit 0 when the shim at ADDRESS is SERVING")
    check.add_argument("address")
    check.add_argument("--timeout-s", type=float, default=2.0)
    check.add_argument("--ca", help="CA certificate (PEM): use TLS")
    check.add_argument("--cert", help="client certificate (PEM) for mTLS")
    check.add_argument("--key", help="client key (PEM) for mTLS")
    check.set_defaults(func=_health)

    from refit_grpc.operator_fleet import add_fleet_parser

    add_fleet_parser(sub, _fleet)

    bench = sub.add_parser("bench", help="refit_grpc against the wire floor, the per-tensor "
                                         "refit and the HTTP-JSON way, side by side")
    bench.add_argument("--world", type=int, action="append",
                       help="trainer + receivers (repeatable; default 2)")
    bench.add_argument("--total-mb", type=float, default=1024)
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
    bench.add_argument("--arms", default="", help="comma-separated subset of "
                                                  "floor,per-tensor,raw,refit_grpc,http")
    bench.set_defaults(func=_bench)

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
