"""refit_grpc: a typed gRPC control plane for pushing trainer weights into inference engines.

The public names resolve lazily: vLLM imports `refit_grpc.vllm_plugin` in every engine process,
and that must not drag in the driver (gRPC channels, thread pools) it never uses.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The public names: the one list of them. Type checkers read these imports (`X as X`: exported
# even under --no-implicit-reexport); at runtime they never run (that is the laziness), and
# `_public_names()` reads them from this file instead, for `__all__` and `__getattr__`.
if TYPE_CHECKING:
    from refit_grpc.canary import Canary as Canary
    from refit_grpc.common import Deadline as Deadline
    from refit_grpc.common import EpochMode as EpochMode
    from refit_grpc.common import PauseMode as PauseMode
    from refit_grpc.driver import ChannelSecurity as ChannelSecurity
    from refit_grpc.driver import EpochHandle as EpochHandle
    from refit_grpc.driver import EpochReport as EpochReport
    from refit_grpc.driver import Fleet as Fleet
    from refit_grpc.driver import TrainerLink as TrainerLink
    from refit_grpc.driver import WorkerEndpoint as WorkerEndpoint
    from refit_grpc.driver.catch_up import CatchUpError as CatchUpError
    from refit_grpc.driver.catch_up import CatchUpReport as CatchUpReport
    from refit_grpc.driver.checks import Checks as Checks
    from refit_grpc.driver.config import FleetConfig as FleetConfig
    from refit_grpc.driver.config import FleetState as FleetState
    from refit_grpc.driver.config import FleetStateError as FleetStateError
    from refit_grpc.driver.failures import CanaryMismatchError as CanaryMismatchError
    from refit_grpc.driver.failures import EpochFailedError as EpochFailedError
    from refit_grpc.driver.failures import EpochRefusedError as EpochRefusedError
    from refit_grpc.driver.failures import FleetError as FleetError
    from refit_grpc.driver.failures import FleetTimeoutError as FleetTimeoutError
    from refit_grpc.driver.failures import MembershipRefusedError as MembershipRefusedError
    from refit_grpc.driver.failures import QuorumError as QuorumError
    from refit_grpc.driver.failures import WeightsMismatchError as WeightsMismatchError
    from refit_grpc.driver.failures import WorkerFailure as WorkerFailure
    from refit_grpc.driver.options import InPlace as InPlace
    from refit_grpc.driver.options import Staged as Staged
    from refit_grpc.driver.reports import RollbackReport as RollbackReport
    from refit_grpc.driver.rollback import RollbackError as RollbackError
    from refit_grpc.errors import InvalidArgumentError as InvalidArgumentError
    from refit_grpc.errors import MembershipChangedError as MembershipChangedError
    from refit_grpc.errors import RefitError as RefitError
    from refit_grpc.plan import AdapterSpec as AdapterSpec
    from refit_grpc.plan import Packing as Packing
    from refit_grpc.plan import RefitPlan as RefitPlan
    from refit_grpc.plan import TensorSpec as TensorSpec
    from refit_grpc.reasons import Reason as Reason


def _public_names() -> dict[str, str]:
    """`{name: module}` from the `if TYPE_CHECKING:` imports above (about 1 ms)."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: node.module for node in block.body
            if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}


_EXPORTS = _public_names()
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refit_grpc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
