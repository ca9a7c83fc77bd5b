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
from typing import TYPE_CHECKING, Any

import torch

from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError
from refit_grpc.plan import Bucket, Packing, RefitPlan
from refit_grpc.reasons import Reason

if TYPE_CHECKING:
    from refit_grpc.dataplane.shared_rank import SharedRank


@dataclass(frozen=True)
class EngineStatus:
    """What an engine says of itself (Describe, health).

    Args:
        healthy: the engine answers and can serve.
        paused: generation is stopped (`pause()`).
        weights_digest: a digest of its weights, "" where the engine cannot compute an exact
            one (or was not asked).
    """

    healthy: bool
    paused: bool
    weights_digest: str = ""  # "" where the engine cannot compute an exact digest


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond an in-place epoch: one value, read by the shim before it
    admits a request that needs it, so a refusal comes before ACCEPTED and no weights move for
    nothing. The methods behind a capability the engine lacks keep `Engine`'s defaults, which
    refuse with the same reason.

    Args:
        canary: `canary_logprobs` works (else an epoch with a canary is CANARY_UNSUPPORTED).
        staging: `stage`, `flip` and `drop_staged` work: staged epochs, and catching up from a
            peer (else STAGING_UNSUPPORTED, CATCH_UP_UNSUPPORTED).
        delta: `stage(..., delta=True)` works: a delta epoch onto the committed copy (else
            DELTA_UNSUPPORTED).
        serving_copy: `serve_copy` works: a peer catches up from this engine's committed copy
            (else CATCH_UP_UNSUPPORTED).
        rollback: `stage(..., keep_previous=True)` keeps the committed copy as the previous
            version and `restore_previous` makes it the copy a flip loads: a reversible
            epoch can be rolled back (else ROLLBACK_UNSUPPORTED, and epochs are not kept
            reversible).
        keep_cache: `pause(..., keep_cache=True)` keeps the KV cache of the requests it parks
            and the prefix cache, and the engine does not need `reset_cache` after a flip:
            a Flip with `keep_cache` (else KEEP_CACHE_UNSUPPORTED).
        adapters: plans that carry a LoRA adapter (`RefitPlan.adapter`): `check_plan` checks
            it against what the engine serves, `stage` receives it, and `flip` loads or
            replaces the adapter while the engine serves, without a pause (else
            ADAPTER_UNSUPPORTED at Prepare).
        flip_in_loop: `flip_in_loop` works: a staged flip with the cache reset and the new
            version label in one turn of the engine's loop, between two steps, without a pause
            (else the shim pauses, flips, resumes). Not asked for by a request: the shim takes
            it for a Flip that needs nothing in between (`shim.flip.load`).
    """

    canary: bool = False
    staging: bool = False
    delta: bool = False
    serving_copy: bool = False
    rollback: bool = False
    keep_cache: bool = False
    adapters: bool = False
    flip_in_loop: bool = False


@dataclass(frozen=True)
class LoopFlipTimes:
    """A flip in one turn of the engine's loop, as the loop timed it.

    Args:
        stall_s: the turn: how long the engine stopped generating.
        load_s: the load of the staged copy within it.
    """

    stall_s: float
    load_s: float


class Engine(ABC):
    """An engine behind a shim: the local steps of a refit (module docstring).

    Every blocking method takes a `Deadline` and returns or raises a `RefitError` by then.
    `kind` names the engine (`--engine`); `offered_packing` is the packing it offers in
    Describe.
    """

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
        """Health and pause state.

        Args:
            with_digest: compute the weights digest too (it may read every byte).

        Returns:
            The engine's status.
        """

    @property
    def quantization(self) -> str:
        """How the engine quantizes the weights it is sent (Describe's `quantization`): the
        method's name, "none" when it serves them as sent, "" when this adapter cannot tell
        (the default)."""
        return ""

    @property
    def shared_rank(self) -> str:
        """The name of the data-group rank this engine shares with other engines of its shim
        process (Describe's `shared_rank`; `refit_grpc.dataplane.shared_rank`), "" when it receives
        through ranks of its own (the default)."""
        return ""

    def share_rank(self, rank: SharedRank) -> None:
        """Receive through `rank`, shared with the other engines of this process
        (`refit-grpc shim --engines K`). Only an engine of one rank whose receive runs in the
        shim's process can; by default, refused.

        Raises:
            ValueError: this engine cannot share a rank.
        """
        raise ValueError(f"the {self.kind} engine receives through its own workers' ranks; "
                         "only the reference engine shares a rank with other engines")

    @property
    def adapters(self) -> dict[str, int]:
        """The adapters this engine serves through adapter epochs: name -> the version the last
        one's flip committed (Describe's `adapters`); none by default."""
        return {}

    @property
    def capabilities(self) -> Capabilities:
        """What this engine can do beyond an in-place epoch (`Capabilities`); by default
        nothing. May change with the engine's set-up (vLLM stages over gloo only), so the shim
        reads it at each request."""
        return Capabilities()

    @property
    def pause_clears_cache(self) -> bool:
        """True when `pause()` (without keep_cache) already clears every cache the engine keeps,
        the running requests' KV included, and nothing can fill them again before `resume()`:
        a flip then need not clear them after its load (one round trip less in its stall).
        False by default: the flip calls `reset_cache` after the load."""
        return False

    def is_paused(self) -> bool:
        """Whether the engine is paused, as cheaply as the engine can tell (the epoch asks it
        on the refit path, to know whether to resume after a refusal)."""
        return self.status().paused

    @abstractmethod
    def check_plan(self, plan: RefitPlan) -> None:
        """Check a plan before it is stored.

        Args:
            plan: the plan Prepare carries.

        Raises:
            InvalidPlanError: the plan names tensors the engine cannot load.
        """

    @abstractmethod
    def pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool = False) -> None:
        """Stop generation so weights may change; returns once no forward step runs.

        KEEP parks in-flight requests (they continue after resume), WAIT lets them finish first,
        ABORT fails them. New requests wait while paused. Pausing a paused engine is a no-op
        (a WAIT drain then has nothing left to wait for).

        Args:
            mode: what happens to in-flight requests.
            deadline: when it must have returned or raised.
            keep_cache: keep the parked requests' KV cache and the prefix cache (only with
                `Capabilities.keep_cache`); by default the engine may drop them here.

        Raises:
            RefitError: the engine could not pause (e.g. `RefitTimeoutError`,
                `EngineUnavailableError`).
        """

    @abstractmethod
    def resume(self, deadline: Deadline) -> None:
        """Serve again (parked requests continue). Resuming a running engine is a no-op. The
        shim never resumes an engine whose weights may be partial (BROKEN).

        Args:
            deadline: when it must have returned or raised.

        Raises:
            RefitError: the engine could not resume.
        """

    @abstractmethod
    def reset_cache(self, deadline: Deadline) -> bool:
        """Clear the KV/prefix caches, which hold values computed with the old weights. Called
        while paused, so no request can refill them meanwhile.

        Args:
            deadline: when it must have returned or raised.

        Returns:
            True once cleared.

        Raises:
            RefitError: the engine could not clear them.
        """

    def check_backend(self, backend: str) -> None:
        """Refuse a backend this engine cannot join, before InitCollective says ACCEPTED.

        The default is for engines that join in the shim's own process; an engine whose
        workers join elsewhere (vLLM) lets those workers decide.

        Args:
            backend: "gloo" or "nccl".

        Raises:
            InvalidArgumentError: BACKEND_UNAVAILABLE, nccl without CUDA in this process.
        """
        if backend == "nccl" and not torch.cuda.is_available():
            raise InvalidArgumentError("backend nccl needs CUDA, which this engine's process "
                                       "lacks", reason=Reason.BACKEND_UNAVAILABLE)

    @abstractmethod
    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        """Join the data group; blocks until it is formed.

        Args:
            spec: the group, with `spec.rank` this engine's first rank.
            plan: the stored plan (its digest is part of the group).
            deadline: when it must have joined or raised.

        Raises:
            RefitError: the join failed (e.g. `CollectiveError`, `RefitTimeoutError`).
        """

    @abstractmethod
    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        """Start the update, receive and apply every bucket.

        Args:
            plan: the stored plan, which says how the bytes split into tensors.
            deadline: when every bucket must be applied, or the call must raise.
            on_bucket: runs after each bucket is applied; once it has run, the engine's
                weights are no longer the old version.

        Raises:
            RefitError: the receive failed (e.g. `CollectiveError`, `RefitTimeoutError`).
        """

    @abstractmethod
    def finish(self, version: int, deadline: Deadline) -> str:
        """Commit `version`.

        Args:
            version: the epoch's version.
            deadline: when it must have returned or raised.

        Returns:
            The new weights digest where the engine knows it without extra work, else ""
            (Describe still reports it).

        Raises:
            RefitError: the engine could not commit.
        """

    def weights_digest(self, deadline: Deadline) -> str:
        """A digest of the weights as the engine holds them (reads every byte).

        Args:
            deadline: when it must have returned or raised.

        Returns:
            The digest, "" where the engine cannot compute one. Engines holding the same
            weights give the same digest.
        """
        return self.status(with_digest=True).weights_digest

    def canary_logprobs(self, token_ids: Sequence[int], deadline: Deadline) -> list[float]:
        """The canary's log-probabilities with the weights just committed, computed before the
        engine serves again (the shim calls it right after `finish`, while the engine is still
        paused).

        Args:
            token_ids: the canary's tokens.
            deadline: when it must have returned or raised.

        Returns:
            log P(token_ids[i] | token_ids[:i]) for i = 1 .. n-1.

        Raises:
            RefitError: where it cannot (by default `FailedPreconditionError`,
                CANARY_UNSUPPORTED).
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot compute a canary",
                                      reason=Reason.CANARY_UNSUPPORTED)

    # --- staged epochs (docs/protocol.md, "Staged epochs") -----------------------------------

    @property
    def staging_bytes(self) -> int:
        """Host memory the staging copy holds (kept between staged epochs); 0 when none."""
        return 0

    @property
    def committed_copy(self) -> tuple[int, str] | None:
        """(version, staged digest) of the engine's committed copy: the staged copy its last
        flip loaded, while it still equals the live weights; what a delta applies to. None
        when there is none."""
        return None

    @property
    def previous_copy(self) -> tuple[int, str] | None:
        """(version, staged digest) of the previous copy: the committed copy as it was before
        the last reversible epoch's flip, what a rollback loads; None when none is kept."""
        return None

    def stage(self, plan: RefitPlan, deadline: Deadline,
              on_bucket: Callable[[Bucket], None], delta: bool = False,
              keep_previous: bool = False) -> str:
        """Receive every bucket of the epoch into the staging copy (`refit_grpc.dataplane.staging`)
        while the engine keeps serving: it is never paused for this, and its live weights are
        not touched.

        Args:
            plan: the stored plan.
            deadline: when every bucket must have landed, or the call must raise.
            on_bucket: runs after each bucket landed.
            delta: the buckets come as deltas against the committed copy (`refit_grpc.dataplane.delta`),
                which the shim checked is the trainer's base; only where `capabilities.delta`.
            keep_previous: the epoch is reversible: keep the committed copy (if any) as the
                previous copy and stage beside it; only where `capabilities.rollback`.

        Returns:
            The staged digest of what landed (`refit_grpc.dataplane.staging.StagedDigest`).

        Raises:
            RefitError: the receive failed; the staging copy is left invalid, the live weights
                are the old version, whole.
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot stage an epoch",
                                      reason=Reason.STAGING_UNSUPPORTED)

    def flip(self, version: int, deadline: Deadline) -> str:
        """Load the staged copy into the live weights and commit `version`: everything a
        receive and `finish` do in place (the tied head, post-load processing). Called while
        paused, only after `stage` returned the digest the trainer sent.

        Args:
            version: the staged epoch's version.
            deadline: when it must have returned or raised.

        Returns:
            As `finish`: the new weights digest where known without extra work, else "".

        Raises:
            RefitError: the load failed; the live weights may be partial (the shim goes
                BROKEN, this engine alone).
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot flip",
                                      reason=Reason.STAGING_UNSUPPORTED)

    def flip_in_loop(self, version: int, keep_cache: bool, deadline: Deadline) -> LoopFlipTimes:
        """`flip`, not paused: in one turn of the engine's loop (between two steps) the caches
        are reset as a pause would reset them (unless `keep_cache`), the version label set and
        the staged copy loaded; the engine generates before and after that turn only. Only
        where `Capabilities.flip_in_loop`.

        Raises:
            RefitError: as `flip`; the engine is then paused (nothing served from weights that
                may be partial).
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot flip in one turn of its "
                                      "loop", reason=Reason.STAGING_UNSUPPORTED)

    def drop_staged(self) -> None:
        """Forget the staged copy (its memory may be kept for the next epoch). Never blocks;
        a no-op when nothing is staged (by default: an engine that cannot stage). A committed
        copy a reversible epoch had set aside as the previous one is the committed copy
        again."""
        return None

    def restore_previous(self, deadline: Deadline) -> tuple[int, str]:
        """A rollback's first step: make the previous copy (`previous_copy`) the staged copy,
        which `flip` then loads (at its version) as it loads any staged copy; `drop_staged`
        instead puts both copies back as they were. The engine keeps serving meanwhile.

        Returns:
            (version, staged digest) of the copy to flip to.

        Raises:
            RefitError: no previous copy (NO_PREVIOUS_COPY), or where the engine cannot
                (by default ROLLBACK_UNSUPPORTED).
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot roll back",
                                      reason=Reason.ROLLBACK_UNSUPPORTED)

    # --- catch-up from a peer (docs/protocol.md, "Catch-up from a peer") ------------------------
    # The engine catching up needs nothing more than staging: the shim joins it to the peer's
    # two-rank group (`init_transfer`), stages (`stage`) and flips (`flip`). The peer needs this:

    def serve_copy(self, spec: GroupSpec, store: Any, deadline: Deadline,
                   on_bucket: Callable[[Bucket], None] | None = None) -> None:
        """Join `spec`'s group as its rank 0, hosting the rendezvous on `store` (a listening
        `torch.distributed.TCPStore`, `dataplane.rendezvous.bind_master_store`), broadcast the committed
        copy (`committed_copy`) bucket by bucket, and leave the group. The engine keeps
        serving; the shim guarantees nothing writes the copy meanwhile (no epoch runs).

        Args:
            spec: the two-rank (1 + the newcomer's world size) group, rank 0.
            store: the rendezvous store the shim bound at `spec.master_port`.
            deadline: when every bucket must have been sent, or the call must raise.
            on_bucket: runs after each bucket's broadcast was posted.

        Raises:
            RefitError: the transfer failed (the newcomer died, the deadline, an Abort); the
                copy and the live weights are untouched either way.
        """
        raise FailedPreconditionError(f"the {self.kind} engine cannot serve its committed copy",
                                      reason=Reason.CATCH_UP_UNSUPPORTED)

    @abstractmethod
    def abort_transfer(self) -> None:
        """Tear the data group down; any blocked receive fails promptly. Never blocks."""

    def close(self) -> None:
        """Release the engine (by default: tear the data group down)."""
        self.abort_transfer()
