"""Engine options: one frozen dataclass per engine, parsed once from `--engine-option KEY=VALUE`.

The model is the shim's own `ShimConfig`: typed fields with defaults, checked when built. An
engine's options class subclasses `EngineOptions` and is registered with the engine's factory
(`refit_grpc.shim.engines.register_engine`); `parse` turns the command line's strings into it,
once, so engine constructors only ever see typed values. A value that is already of its field's
type passes through (`create_engine("vllm", url=..., request_timeout_s=5.0)`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

if TYPE_CHECKING:
    from refit_grpc.plan import Packing
    from refit_grpc.shim.engines.base import Engine

_TRUE = ("1", "true", "yes", "on")


def truthy(value: str) -> bool:
    """A boolean option's string: 1, true, yes or on (any case) is true; anything else false."""
    return value.strip().lower() in _TRUE


def _allowed(hint: Any) -> tuple[type, ...]:
    """The types a field annotated `hint` accepts (`str | None` -> (str, NoneType))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(typing.get_args(hint))
    return (hint,)


def _convert(name: str, hint: Any, value: str) -> Any:
    allowed = _allowed(hint)
    if bool in allowed:
        return truthy(value)
    for kind in (int, float):
        if kind in allowed:
            try:
                return kind(value)
            except ValueError:
                raise ValueError(f"engine option {name}={value!r}: not a {kind.__name__}") from None
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The options every engine takes: none. Subclasses add typed fields, each with a default."""

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> Self:
        """The options from `KEY=VALUE` pairs (`-` in a key reads as `_`); strings are converted
        by their field's type, other values must already have it. Raises ValueError naming an
        unknown key or a value that does not convert."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown engine option {key!r}; this engine takes: "
                                 f"{', '.join(sorted(names)) or 'none'}")
            kwargs[name] = _convert(name, hints[name], value) if isinstance(value, str) \
                else value
        return cls(**kwargs)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = _allowed(hints[f.name])
            if float in allowed and isinstance(value, int) and not isinstance(value, bool):
                continue
            if bool not in allowed and isinstance(value, bool) and int in allowed:
                raise TypeError(f"engine option {f.name}: {value!r} is not an int")
            if not isinstance(value, allowed):
                raise TypeError(f"engine option {f.name}: {value!r} is not "
                                f"{' or '.join(t.__name__ for t in allowed)} (strings are "
                                "parsed by EngineOptions.parse)")


OptionsT = TypeVar("OptionsT", bound=EngineOptions)


@dataclasses.dataclass(frozen=True)
class EngineKind(Generic[OptionsT]):
    """What the registry holds for one engine: its options class and its factory, which builds
    the engine from parsed options and the offered packing."""

    options: type[OptionsT]
    build: Callable[[OptionsT, Packing], Engine]

    def create(self, packing: Packing, values: Mapping[str, Any]) -> Engine:
        return self.build(self.options.parse(values), packing)

    def takes(self, name: str) -> bool:
        return any(f.name == name for f in dataclasses.fields(self.options))


__all__ = ["EngineKind", "EngineOptions", "truthy"]
