"""Engines behind the shim, registered by name (the `--engine` flag).

Each engine registers its `EngineKind`: a frozen options class (`options.EngineOptions`, parsed
once from the `--engine-option KEY=VALUE` strings) and the factory that builds the engine from
it. The registry loads an engine's module only when that engine is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from refit_grpc.common import PauseMode
from refit_grpc.plan import Packing
from refit_grpc.shim.engines.base import Capabilities, Engine, EngineStatus
from refit_grpc.shim.engines.options import EngineKind, EngineOptions

_KINDS: dict[str, Callable[[], EngineKind]] = {}


def register_engine(name: str, load: Callable[[], EngineKind]) -> None:
    """Register engine `name`; `load` returns its EngineKind (importing its module then)."""
    if name in _KINDS:
        raise ValueError(f"engine {name!r} is already registered")
    _KINDS[name] = load


def engine_kind(name: str) -> EngineKind:
    if name not in _KINDS:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(_KINDS)}")
    return _KINDS[name]()


def create_engine(name: str, packing: Packing = Packing(), *,
                  flags: Mapping[str, Any] | None = None, **options: Any) -> Engine:
    """Engine `name` with `options` (strings from `--engine-option`, or typed values), parsed
    by its options class. `flags` are the shim's own flags that name an engine option
    (`--engine-url` as `url`, `--model`, `--seed`): an engine whose options have that field
    takes it, the others ignore it; `options` override them."""
    kind = engine_kind(name)
    values = {k: v for k, v in (flags or {}).items() if kind.takes(k)}
    values.update(options)
    return kind.create(packing, values)


def engine_names() -> list[str]:
    return sorted(_KINDS)


def _reference() -> EngineKind:
    from refit_grpc.shim.engines.reference import ENGINE

    return ENGINE


def _vllm() -> EngineKind:
    from refit_grpc.shim.engines.vllm.adapter import ENGINE

    return ENGINE


def _dynamo() -> EngineKind:
    from refit_grpc.shim.engines.dynamo.adapter import ENGINE

    return ENGINE


register_engine("reference", _reference)
register_engine("vllm", _vllm)
register_engine("dynamo", _dynamo)

__all__ = ["Capabilities", "Engine", "EngineKind", "EngineOptions", "EngineStatus", "PauseMode", "create_engine",
           "engine_kind", "engine_names", "register_engine"]
