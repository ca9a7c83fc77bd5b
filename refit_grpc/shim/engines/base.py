"""The one interface every engine behind a shim implements.

The shim owns the protocol (state machine, validation, deadlines); an engine only knows how to do
each local step. Every blocking method takes a `Deadline` and must return or raise by then.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit_grpc.collective import Deadline, GroupSpec
from refit_grpc.errors import InvalidArgumentError
from refit_grpc.plan import Bucket, Packing, RefitPlan


class PauseMode(enum.Enum):
    KEEP = "keep"    # in-flight requests are suspended and continue after resume
    WAIT = "wait"    # in-flight requests finish first
    ABORT = "abort"  # in-flight requests are aborted


@dataclass(frozen=True)
class EngineStatus:
    healthy: bool
    paused: bool
    weights_digest: str = ""  # "" where the engine cannot compute an exact digest


class Engine(ABC):
    kind: str = "abstract"
    world_size: int = 1
    offered_packing: Packing = Packing()
    # True when a failed receive may have overwritten weights without reporting a bucket (an
    # engine whose receive is one opaque call): the shim then treats any failure as BROKEN.
    partial_on_failure: bool = False

    @abstractmethod
    def status(self, with_digest: bool = False) -> EngineStatus:
        """Health and pause state; the weights digest only when asked (it may read every byte)."""

    @abstractmethod
    def check_plan(self, plan: RefitPlan) -> None:
        """Raise InvalidPlanError if the plan names tensors the engine cannot load."""

    @abstractmethod
    def pause(self, mode: PauseMode, deadline: Deadline) -> None: ...

    @abstractmethod
    def resume(self, deadline: Deadline) -> None: ...

    @abstractmethod
    def reset_cache(self, deadline: Deadline) -> bool: ...

    def check_backend(self, backend: str) -> None:
        """Refuse a backend this engine cannot join, before InitCollective says ACCEPTED.

        The default is for engines that join in the shim's own process; an engine whose
        workers join elsewhere (vLLM) lets those workers decide."""
        if backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend nccl needs CUDA, which this engine's process "
                                       "lacks", reason="BACKEND_UNAVAILABLE")

    @abstractmethod
    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        """Join the data group as `spec.rank` (this engine's first rank); blocks until formed."""

    @abstractmethod
    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        """Start the update, receive and apply every bucket. `on_bucket` runs after each one
        is applied; once it has run, the engine's weights are no longer the old version."""

    @abstractmethod
    def finish(self, version: int, deadline: Deadline) -> str:
        """Commit `version`; returns the new weights digest where the engine knows it without
        extra work, else "" (Describe still reports it)."""

    @abstractmethod
    def abort_transfer(self) -> None:
        """Tear the data group down; any blocked receive fails promptly. Never blocks."""

    def close(self) -> None:
        self.abort_transfer()
