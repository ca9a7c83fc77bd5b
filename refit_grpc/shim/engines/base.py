"""The one interface every engine behind a shim implements.

The shim owns the protocol (state machine, validation, deadlines); an engine only knows how to do
each local step. Every blocking method takes a `Deadline` and must return or raise (a typed
`RefitError`) by then; none may block past it. `tests/test_engine_contract.py` runs the same
contract against every engine.

Thread safety: the shim calls `status()` from its health watcher and from Describe while an epoch
runs on another thread, and `abort_transfer()` from any thread at any time. Each engine guards
its own shared state with its own lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError
from refit_grpc.plan import Bucket, Packing, RefitPlan
from refit_grpc.reasons import Reason


@dataclass(frozen=True)
class EngineStatus:
    healthy: bool
    paused: bool
    weights_digest: str = ""  # "" where the engine cannot compute an exact digest


class Engine(ABC):
    kind: str = "abstract"
    offered_packing: Packing = Packing()

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Ranks this engine takes in the data group (TP x PP x DP of its workers)."""

    @property
    @abstractmethod
    def partial_on_failure(self) -> bool:
        """True when a failed receive may have overwritten weights without reporting a bucket
        (an engine whose receive is one opaque call): the shim then treats any failure of the
        epoch as BROKEN instead of trusting that no bucket means no change."""

    @abstractmethod
    def status(self, with_digest: bool = False) -> EngineStatus:
        """Health and pause state; the weights digest only when asked (it may read every byte)."""

    def is_paused(self) -> bool:
        """Whether the engine is paused, as cheaply as the engine can tell (the epoch asks it
        on the refit path, to know whether to resume after a refusal)."""
        return self.status().paused

    @abstractmethod
    def check_plan(self, plan: RefitPlan) -> None:
        """Raise InvalidPlanError if the plan names tensors the engine cannot load."""

    @abstractmethod
    def pause(self, mode: PauseMode, deadline: Deadline) -> None:
        """Stop generation so weights may change; returns once no forward step runs.

        KEEP parks in-flight requests (they continue after resume), WAIT lets them finish first,
        ABORT fails them. New requests wait while paused. Pausing a paused engine is a no-op
        (a WAIT drain then has nothing left to wait for)."""

    @abstractmethod
    def resume(self, deadline: Deadline) -> None:
        """Serve again (parked requests continue). Resuming a running engine is a no-op. The
        shim never resumes an engine whose weights may be partial (BROKEN)."""

    @abstractmethod
    def reset_cache(self, deadline: Deadline) -> bool:
        """Clear the KV/prefix caches, which hold values computed with the old weights; True
        once cleared. Called while paused, so no request can refill them meanwhile."""

    def check_backend(self, backend: str) -> None:
        """Refuse a backend this engine cannot join, before InitCollective says ACCEPTED.

        The default is for engines that join in the shim's own process; an engine whose
        workers join elsewhere (vLLM) lets those workers decide."""
        if backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend nccl needs CUDA, which this engine's process "
                                       "lacks", reason=Reason.BACKEND_UNAVAILABLE)

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

    def weights_digest(self, deadline: Deadline) -> str:
        """A digest of the weights as the engine holds them (reads every byte); "" where the
        engine cannot compute one. Engines holding the same weights give the same digest."""
        return self.status(with_digest=True).weights_digest

    @property
    def supports_canary(self) -> bool:
        """Whether `canary_logprobs` works; the shim refuses an epoch with a canary before
        ACCEPTED (CANARY_UNSUPPORTED) when it does not, so no weights move for nothing."""
        return False

    def canary_logprobs(self, token_ids: Sequence[int], deadline: Deadline) -> list[float]:
        """log P(token_ids[i] | token_ids[:i]) for i = 1 .. n-1 with the weights just
        committed, computed before the engine serves again (the shim calls it right after
        `finish`, while the engine is still paused). Raises a RefitError where it cannot."""
        raise FailedPreconditionError(f"the {self.kind} engine cannot compute a canary",
                                      reason=Reason.CANARY_UNSUPPORTED)

    @abstractmethod
    def abort_transfer(self) -> None:
        """Tear the data group down; any blocked receive fails promptly. Never blocks."""

    def close(self) -> None:
        self.abort_transfer()
