"""`refit-grpc shim | call | health | fleet | demo | bench | bench-stall | bench-delta |
bench-catch-up | bench-scale | bench-lora-quant`: the command-line entry points.

Only the dispatch lives here: each command's module owns its flags (`add_arguments(parser)`) and
its body (`run(args)`): `shim` in `refit_grpc.shim.command`, `call` and `health` in `call`,
`fleet` in `fleet`, `demo` and the benches in `refit_grpc.tools`. A command's module is imported
only when that command is parsed (its `--help` included), so `refit-grpc shim` imports no bench.
Process spawning stays in `refit_grpc.shim.process`, which runs `python -m refit_grpc.cli shim`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """What the CLI needs of a command: its flags and its body."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _shim() -> Command:
    from refit_grpc.shim import command

    return Command(command.add_arguments, command.run)


def _call() -> Command:
    from refit_grpc.cli import call

    return Command(call.add_call_arguments, call.run_call)


def _health() -> Command:
    from refit_grpc.cli import call

    return Command(call.add_health_arguments, call.run_health)


def _fleet() -> Command:
    from refit_grpc.cli import fleet

    return Command(fleet.add_arguments, fleet.run)


def _demo() -> Command:
    from refit_grpc.tools import demo

    return Command(demo.add_arguments, demo.run)


def _bench() -> Command:
    from refit_grpc.tools import bench

    return Command(bench.add_arguments, bench.run)


def _bench_stall() -> Command:
    from refit_grpc.tools import bench_stall

    return Command(bench_stall.add_arguments, bench_stall.run)


def _bench_lora_quant() -> Command:
    from refit_grpc.tools import bench_lora_quant

    return Command(bench_lora_quant.add_arguments, bench_lora_quant.run)


def _bench_delta() -> Command:
    from refit_grpc.tools import bench_delta

    return Command(bench_delta.add_arguments, bench_delta.run)


def _bench_catch_up() -> Command:
    from refit_grpc.tools import bench_catch_up

    return Command(bench_catch_up.add_arguments, bench_catch_up.run)


def _bench_scale() -> Command:
    from refit_grpc.tools import bench_scale

    return Command(bench_scale.add_arguments, bench_scale.run)


# name -> (its line in `refit-grpc --help`, its command), in the order --help lists them.
COMMANDS: dict[str, tuple[str, Callable[[], Command]]] = {
    "shim": ("serve RefitService next to one engine", _shim),
    "demo": ("train a tiny LM and refit a local fleet every step", _demo),
    "call": ("call one RefitService method with a JSON body (grpcurl's mapping; token from "
             "REFIT_GRPC_TOKEN)", _call),
    "health": ("exit 0 when the shim at ADDRESS is SERVING", _health),
    "fleet": ("status, flush or abort a list of shims (token from REFIT_GRPC_TOKEN)", _fleet),
    "bench": ("refit_grpc against the wire floor, the per-tensor refit and the HTTP-JSON way, "
              "side by side", _bench),
    "bench-stall": ("the stall streamed generation on a real vLLM sees: in-place, staged and "
                    "keep-cache epochs", _bench_stall),
    "bench-lora-quant": ("an adapter epoch against a full one, and a quantized engine's refit "
                         "against the same model unquantized, on real vLLM engines",
                         _bench_lora_quant),
    "bench-delta": ("delta epochs against full ones (staged, the reference engine), side by "
                    "side", _bench_delta),
    "bench-catch-up": ("an engine joining by catch-up from a peer against by the trainer's "
                       "epoch", _bench_catch_up),
    "bench-scale": ("what control costs the trainer as the fleet widens: CPU per engine, "
                    "threads, egress", _bench_scale),
}


class _CommandParser(argparse.ArgumentParser):
    """A command's parser, given the command's own flags (`fill`) only when it parses: the
    first time argparse hands it the command's arguments, or its `--help`."""

    def __init__(self, *args: Any, fill: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fill = fill

    def parse_known_args(self, args=None, namespace=None):  # argparse's own signature
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill(self)
        return super().parse_known_args(args, namespace)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit-grpc", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for name, (help, load) in COMMANDS.items():
        sub.add_parser(name, help=help, fill=lambda p, load=load: load().add_arguments(p))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from refit_grpc.shim.command import LOG_FORMAT

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    return COMMANDS[args.command][1]().run(args)


if __name__ == "__main__":
    sys.exit(main())
