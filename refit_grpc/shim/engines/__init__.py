"""Engines behind the shim, registered by name (the `--engine` flag)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from refit_grpc.common import PauseMode
from refit_grpc.shim.engines.base import Engine, EngineStatus

_FACTORIES: dict[str, Callable[..., Engine]] = {}


def register_engine(name: str, factory: Callable[..., Engine]) -> None:
    if name in _FACTORIES:
        raise ValueError(f"engine {name!r} is already registered")
    _FACTORIES[name] = factory


def create_engine(name: str, **options: Any) -> Engine:
    if name not in _FACTORIES:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(_FACTORIES)}")
    return _FACTORIES[name](**options)


def engine_names() -> list[str]:
    return sorted(_FACTORIES)


def _reference(**options: Any) -> Engine:
    from refit_grpc.shim.engines.reference import ReferenceEngine

    return ReferenceEngine(**options)


def _vllm(**options: Any) -> Engine:
    from refit_grpc.shim.engines.vllm import VLLMEngine

    return VLLMEngine(**options)


def _dynamo(**options: Any) -> Engine:
    from refit_grpc.shim.engines.dynamo import DynamoEngine

    return DynamoEngine(**options)


register_engine("reference", _reference)
register_engine("vllm", _vllm)
register_engine("dynamo", _dynamo)

__all__ = ["Engine", "EngineStatus", "PauseMode", "create_engine", "engine_names",
           "register_engine"]
