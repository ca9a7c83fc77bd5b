"""`refit-grpc shim`: serve RefitService next to one engine, or K engines sharing one receiving
rank (`--engines K`); the process `spawn_shim` starts.

The command's flags (`add_arguments`) and body (`run`) live in the shim package, beside the
process code that starts it (`process.spawn_shim`, which runs `python -m refit_grpc.cli shim`)
and reads its READY lines: the CLI dispatches here, and `main` runs it in a process that runs
nothing else (a forked shim, `refit_grpc.testing.forked_shims`) without going through the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from refit_grpc.plan import DEFAULT_BUFFER_SIZE_BYTES, DEFAULT_NUM_BUFFERS, Packing

# How every `refit-grpc` command logs (to stderr, `--log-level`, WARNING by default).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(shim: argparse.ArgumentParser) -> None:
    """The flags of `refit-grpc shim`."""
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


def main(argv: list[str]) -> int:
    """`refit-grpc shim ARGV` in a process of its own: the shim's flags only, logging at the
    CLI's default level (a forked shim)."""
    parser = argparse.ArgumentParser(prog="refit-grpc shim")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr, format=LOG_FORMAT)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """`refit-grpc shim`: serve RefitService next to one engine until SIGTERM."""
    if args.allow_master is None:
        # An environment variable too, for containers whose command line is fixed.
        from_env = [c.strip() for c in os.environ.get("REFIT_GRPC_ALLOW_MASTER", "").split(",")]
        args.allow_master = [c for c in from_env if c] or ["127.0.0.0/8", "::1/128"]
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
    if args.engines < 1:
        raise SystemExit("--engines must be >= 1")
    if args.engines > 1 and args.metrics_address is not None:
        raise SystemExit("--metrics-address serves one engine's metrics; with --engines > 1 "
                         "there is no per-process endpoint yet (docs/scale.md)")
    # The flags that name an engine option go to the engine whose options have it.
    engines = [create_engine(args.engine, packing, **options, flags={
        "url": args.engine_url, "model": args.model, "seed": args.seed})
        for _ in range(args.engines)]
    if args.engines > 1:
        from refit_grpc.dataplane.shared_rank import SharedRank

        rank = SharedRank()
        try:
            for engine in engines:
                engine.share_rank(rank)
        except ValueError as e:
            raise SystemExit(f"--engines {args.engines}: {e}") from None
    import ipaddress

    for cidr in args.allow_master:
        try:
            ipaddress.ip_network(cidr)
        except ValueError as e:
            raise SystemExit(f"--allow-master / REFIT_GRPC_ALLOW_MASTER: {e}") from None
    config_kwargs = {"max_epoch_s": args.max_epoch_s,
                     "progress_interval_s": max(args.progress_interval_ms, 0.0) / 1000,
                     "allowed_master_networks": tuple(args.allow_master)}
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
    from refit_grpc.signals import StopSignals

    # Installed before the READY line: a supervisor's SIGTERM right after it must stop us
    # gracefully, not end us with the default handler's status.
    signals = StopSignals().install()
    servers = []
    for k, (engine, address) in enumerate(zip(engines, _addresses(args.address, len(engines)))):
        config = ShimConfig(**config_kwargs)
        if args.instance_id:
            config = dataclasses.replace(config, instance_id=_instance_id(args.instance_id, k,
                                                                         len(engines)))
        servers.append(ShimServer(
            engine, config, ServerOptions(address=address, grace_s=args.grace_s,
                                          metrics_address=args.metrics_address),
            credentials=tls.credentials() if tls else None,
            interceptors=(TokenAuthInterceptor(tokens),) if tokens else ()))
    # The engines share one receiving rank: an UpdateEngines stream to any runs their epochs.
    peers = {s.servicer.config.instance_id: s.servicer for s in servers}
    for server in servers:
        server.servicer.share_stream_with(peers)
    for server in servers:
        server.start()
        # Parent processes (demo, tests) read these lines to learn the ports (0 binds a free
        # one): the metrics line first, then one READY line per engine.
        if server.metrics is not None:
            print(f"{METRICS_PREFIX}http://{server.metrics.address}/metrics", flush=True)
        print(f"{READY_PREFIX}{server.address} {server.servicer.config.instance_id}", flush=True)
    if len(servers) == 1:
        servers[0].serve_until_signal(signals)
    else:
        from refit_grpc.shim.server import serve_all_until_signal

        serve_all_until_signal(servers, signals)
    return 0


def _addresses(address: str, count: int) -> list[str]:
    """One listen address per engine: the same host, port 0 for each (free ones), or `count`
    consecutive ports from the given one."""
    host, _, port = address.rpartition(":")
    if count == 1 or not port.isdigit():
        return [address] * count
    first = int(port)
    if first and first + count > 65536:
        raise SystemExit(f"--address {address}: {count} engines need ports up to "
                         f"{first + count - 1}")
    return [f"{host}:{first + k if first else 0}" for k in range(count)]


def _instance_id(given: str, k: int, count: int) -> str:
    """The engine's instance id from --instance-id: as given for one engine, INSTANCE_ID-k for
    several (without the flag each engine gets a random one)."""
    return given if count == 1 else f"{given}-{k}"


def _read_tokens(path: str | None) -> list[str]:
    """Tokens, one per line, from --token-file or the REFIT_GRPC_TOKEN variable (never a flag:
    flags show up in process listings)."""
    if path:
        return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    token = os.environ.get("REFIT_GRPC_TOKEN", "").strip()
    return [token] if token else []
