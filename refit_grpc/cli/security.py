"""The client-side security flags of `refit-grpc call | health | fleet`, declared once.

TLS material comes from `--ca/--cert/--key`; the bearer token only from the REFIT_GRPC_TOKEN
variable (never a flag: flags show up in process listings). Importing this module is cheap (no
gRPC), so the parser can use it before any command runs.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refit_grpc.driver.endpoint import ChannelSecurity


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--ca`, `--cert` and `--key` to `parser`.

    Args:
        parser: the (sub)command's parser.
    """
    parser.add_argument("--ca", help="CA certificate (PEM): use TLS")
    parser.add_argument("--cert", help="client certificate (PEM) for mTLS")
    parser.add_argument("--key", help="client key (PEM) for mTLS")


def security_from_args(args: argparse.Namespace) -> ChannelSecurity:
    """The channel security the flags of `add_security_flags` and REFIT_GRPC_TOKEN ask for.

    Args:
        args: parsed arguments carrying `ca`, `cert` and `key` (paths or None).

    Returns:
        A `ChannelSecurity`: TLS when `--ca` is given, the token when the variable is set.
    """
    from refit_grpc.driver.endpoint import ChannelSecurity

    read = (lambda p: open(p, "rb").read() if p else None)  # noqa: E731
    return ChannelSecurity(root_certificates=read(args.ca), private_key=read(args.key),
                           certificate_chain=read(args.cert),
                           token=os.environ.get("REFIT_GRPC_TOKEN") or None)
