"""The reference engine: weights held in the shim's own process, received by the project's receiver.

Two modes:
- model (default): a `TinyLM` that also serves greedy generation, with a prefix cache and a
  pause gate with vLLM's three modes (keep, wait, abort). The demo and Flush tests use it.
- store (`model=None`): a plain name -> tensor store that adopts whatever layout the plan gives;
  the byte-exactness tests use it to cover every dtype and shape.

Options (`ReferenceOptions`): `model` (tiny-lm or none; the shim's `--model` flag) and `seed` (the
tiny LM's initial weights; `--seed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from refit_grpc.canary import teacher_forced_logprobs
from refit_grpc.common import Deadline, GroupSpec, PauseMode
from refit_grpc.dataplane.delta import receive_delta
from refit_grpc.dataplane.group import Group, ReceivingGroup
from refit_grpc.dataplane.packing import copy_bytes
from refit_grpc.dataplane.shared_rank import SharedRank
from refit_grpc.dataplane.staging import StagedDigest, StagingCopy
from refit_grpc.dataplane.transfer import broadcast_buckets, receive
from refit_grpc.errors import (
    CollectiveError,
    EpochAbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    InvalidPlanError,
)
from refit_grpc.models.tiny_lm import TinyLM, TinyLMConfig
from refit_grpc.plan import Bucket, Packing, RefitPlan, TensorSpec, weights_digest
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Capabilities, Engine, EngineStatus
from refit_grpc.shim.engines.options import EngineKind, EngineOptions
from refit_grpc.wire.worker import NO_QUANTIZATION

log = logging.getLogger(__name__)


class _PauseGate:
    """Generation steps pass the gate; pause closes it with vLLM's semantics.

    KEEP parks in-flight requests at their next step until resume; WAIT lets in-flight requests
    finish before the pause completes; ABORT fails in-flight requests at their next step.
    New requests wait while paused (bounded by their own deadline).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.paused = False
        self._requests = 0  # requests admitted and not finished
        self._stepping = 0  # requests inside a forward step right now
        self._abort_generation = 0

    def _wait(self, deadline: Deadline, what: str) -> None:
        """One bounded wait on the gate (the caller holds `_cond`): at most 50 ms, never past
        `deadline`, whose check raises with `what` once it has passed."""
        self._cond.wait(min(0.05, max(deadline.check(what), 0.0)))

    @contextlib.contextmanager
    def request(self, deadline: Deadline) -> Iterator[int]:
        """One request's admission: waits while paused; yields its ticket (the abort
        generation it was admitted in); counts it until it ends."""
        with self._cond:
            while self.paused:
                self._wait(deadline, "waiting for resume")
            self._requests += 1
            ticket = self._abort_generation
        try:
            yield ticket
        finally:
            with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    @property
    def requests(self) -> int:
        return self._requests

    @contextlib.contextmanager
    def step(self, ticket: int, deadline: Deadline) -> Iterator[None]:
        """One forward step of an admitted request: parked while paused, failed once a
        pause(mode=abort) came after its admission; weights do not change while it runs."""
        with self._cond:
            while True:
                if ticket != self._abort_generation:
                    raise EpochAbortedError("request aborted by pause(mode=abort)",
                                            reason=Reason.REQUEST_ABORTED)
                if not self.paused:
                    break
                self._wait(deadline, "paused mid-request")
            self._stepping += 1
        try:
            yield
        finally:
            with self._cond:
                self._stepping -= 1
                self._cond.notify_all()

    def pause(self, mode: PauseMode, deadline: Deadline) -> None:
        with self._cond:
            if mode is PauseMode.WAIT:
                while self._requests:
                    self._wait(deadline, "draining requests")
            self.paused = True
            if mode is PauseMode.ABORT:
                self._abort_generation += 1
            self._cond.notify_all()
            # Weights may change once no step is running; parked requests hold no step.
            while self._stepping:
                self._wait(deadline, "stopping steps")

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify_all()


class ReferenceEngine(Engine):
    kind = "reference"

    def __init__(self, model: TinyLMConfig | None = TinyLMConfig(), seed: int = 0,
                 packing: Packing = Packing(), shared_rank: SharedRank | None = None):
        self.offered_packing = packing
        # The rank this engine receives through when it shares one with the other engines of
        # its process (`refit-grpc shim --engines K`); None: a rank of its own.
        self._shared_rank = shared_rank
        self._model: TinyLM | None = None
        self._weights: dict[str, torch.Tensor] = {}
        if model is not None:
            torch.manual_seed(seed)
            self._model = TinyLM(model).eval()
            self._weights = dict(self._model.state_dict(keep_vars=False))
        self._gate = _PauseGate()
        self._prefix_cache: dict[tuple[int, ...], int] = {}
        self._cache_lock = threading.Lock()
        # Guards the group, the plan, the digest cache and the receiving flag: status() runs
        # on Describe and health threads while a receive runs on the epoch's thread.
        self._lock = threading.Lock()
        self._group: ReceivingGroup | None = None
        self._plan: RefitPlan | None = None
        self._digest: str | None = None
        self._receiving = False  # weights are mid-update: no digest of them is meaningful
        # Store mode: the plan's tensors in one buffer in wire order (see _adopt_flat_layout).
        self._flat: torch.Tensor | None = None
        self._flat_digest = ""
        self._flat_offsets: list[int] = []
        # Staged epochs land here while the live weights keep serving (allocated at the first).
        self._staging = StagingCopy()
        self._serving: ReceivingGroup | None = None  # the group a catch-up is served over, while it runs

    @property
    def world_size(self) -> int:
        return 1

    @property
    def partial_on_failure(self) -> bool:
        return False  # every applied bucket is reported, so no bucket means no change

    @property
    def quantization(self) -> str:
        return NO_QUANTIZATION  # it holds exactly the bytes it is sent

    @property
    def shared_rank(self) -> str:
        return "" if self._shared_rank is None else self._shared_rank.key

    def share_rank(self, rank: SharedRank) -> None:
        with self._lock:
            if self._group is not None:
                raise ValueError("share_rank() before the engine joins any group")
            self._shared_rank = rank

    # --- state -----------------------------------------------------------------------------

    def status(self, with_digest: bool = False) -> EngineStatus:
        digest = ""
        if with_digest:
            with self._lock:
                # Hashing reads every byte, so it is done on demand (Describe) and cached until
                # the weights change, never on the refit path.
                if not self._receiving:
                    if self._digest is None:
                        names = self._plan_order()
                        self._digest = weights_digest(
                            (n, self._weights[n]) for n in names) if names else ""
                    digest = self._digest
        return EngineStatus(healthy=True, paused=self._gate.paused, weights_digest=digest)

    @property
    def requests_in_flight(self) -> int:
        """Generate calls admitted and not yet finished (parked ones included)."""
        return self._gate.requests

    def _plan_order(self) -> list[str]:
        """The digest covers the plan's tensors in plan order (what the trainer can recompute)."""
        if self._plan is not None:
            return [s.name for s in self._plan.tensors if s.name in self._weights]
        return list(self._weights)

    def check_plan(self, plan: RefitPlan) -> None:
        if self._model is None:
            return  # store mode adopts any layout
        for s in plan.tensors:
            have = self._weights.get(s.name)
            if have is None:
                raise InvalidPlanError(f"engine has no tensor {s.name!r}", reason=Reason.UNKNOWN_TENSOR)
            if tuple(have.shape) != s.shape or have.dtype != s.dtype:
                raise InvalidPlanError(
                    f"tensor {s.name!r}: engine has {tuple(have.shape)} {have.dtype}, plan says "
                    f"{s.shape} {s.dtype}", reason=Reason.TENSOR_MISMATCH)

    # --- serving ---------------------------------------------------------------------------

    def pause(self, mode: PauseMode, deadline: Deadline, keep_cache: bool = False) -> None:
        # Nothing to drop here: the tiny LM keeps no KV cache (each step runs the whole
        # sequence) and its prefix cache is cleared by reset_cache, which a keep_cache flip skips.
        self._gate.pause(mode, deadline)

    def resume(self, deadline: Deadline) -> None:
        self._gate.resume()

    def reset_cache(self, deadline: Deadline) -> bool:
        with self._cache_lock:
            self._prefix_cache.clear()
        return True

    def generate(self, prompt: list[int], max_new_tokens: int,
                 deadline: Deadline) -> tuple[list[int], bool]:
        """Greedy tokens, and whether the first one came from the prefix cache."""
        if self._model is None:
            raise FailedPreconditionError("store-mode engine has no model to generate with",
                                          reason=Reason.NO_MODEL)
        if not prompt or max_new_tokens < 1:
            raise InvalidArgumentError("prompt must be non-empty and max_new_tokens >= 1",
                                       reason=Reason.INVALID_GENERATE_REQUEST)
        vocab = self._model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidArgumentError(f"prompt tokens must be in [0, {vocab})",
                                       reason=Reason.INVALID_PROMPT_TOKEN)
        with self._gate.request(deadline) as ticket:
            tokens, cached = list(prompt), False
            for i in range(max_new_tokens):
                with self._gate.step(ticket, deadline):
                    key = tuple(tokens)
                    with self._cache_lock:
                        hit = self._prefix_cache.get(key) if i == 0 else None
                    if hit is not None:
                        nxt, cached = hit, True
                    else:
                        nxt = self._model.generate(tokens, 1)[0]
                        if i == 0:
                            with self._cache_lock:
                                self._prefix_cache[key] = nxt
                tokens.append(nxt)
            return tokens[len(prompt):], cached

    @property
    def capabilities(self) -> Capabilities:
        """Everything; a canary only with a model (store mode computes no log-probabilities)."""
        return Capabilities(canary=self._model is not None, staging=True, delta=True,
                            serving_copy=True, rollback=True, keep_cache=True)

    def canary_logprobs(self, token_ids: Sequence[int], deadline: Deadline) -> list[float]:
        """One forward of the model over the whole sequence; the pause gate is not entered:
        the shim asks while the engine is paused, before any request is served."""
        if self._model is None:
            return super().canary_logprobs(token_ids, deadline)
        cfg = self._model.cfg
        if any(not 0 <= t < cfg.vocab_size for t in token_ids):
            raise InvalidArgumentError(f"canary tokens must be in [0, {cfg.vocab_size})",
                                       reason=Reason.INVALID_CANARY)
        if len(token_ids) > cfg.max_positions:
            raise InvalidArgumentError(f"canary of {len(token_ids)} tokens is longer than the "
                                       f"model's {cfg.max_positions} positions",
                                       reason=Reason.INVALID_CANARY)
        deadline.check("canary")
        with torch.no_grad():
            logits = self._model(torch.tensor([list(token_ids)]))[0]
        return teacher_forced_logprobs(logits, token_ids)

    # --- weight transfer -------------------------------------------------------------------

    def init_transfer(self, spec: GroupSpec, plan: RefitPlan, deadline: Deadline) -> None:
        self.abort_transfer()
        join = Group.join if self._shared_rank is None else self._shared_rank.join
        group = join(spec, deadline.check("rendezvous"), cancel=deadline.cancel)
        with self._lock:
            self._group = group

    def receive(self, plan: RefitPlan, deadline: Deadline,
                on_bucket: Callable[[Bucket], None]) -> None:
        with self._lock:
            group = self._group
            if group is None or group.closed:
                raise CollectiveError("no data group; call InitCollective",
                                      reason=Reason.NO_GROUP)
            if not self._gate.paused:
                raise FailedPreconditionError("engine must be paused to receive",
                                              reason=Reason.NOT_PAUSED)
            self._plan = plan
            self._receiving = True
            self._digest = None
            self._allocate(plan)
        # The live weights change without the staging copy: it is no longer the committed copy.
        self._staging.invalidate()
        try:
            receive(group, plan, deadline, self._apply, on_bucket, land=self._land)
        finally:
            with self._lock:
                self._digest = None
                self._receiving = False

    def _allocate(self, plan: RefitPlan) -> None:
        if self._model is None:
            if self._flat_digest != plan.digest:
                self._adopt_flat_layout(plan)
            if self._flat is not None:
                return
        for s in plan.tensors:
            have = self._weights.get(s.name)
            if have is None or tuple(have.shape) != s.shape or have.dtype != s.dtype:
                self._weights[s.name] = torch.zeros(s.shape, dtype=s.dtype)

    def _adopt_flat_layout(self, plan: RefitPlan) -> None:
        """Store mode: hold the plan's tensors back to back in one buffer, in plan order (the
        wire's layout), so buckets can be received in place (`_land`). Values of tensors the
        old layout held with the same shape and dtype are kept. Where a tensor would start at an
        offset its dtype cannot be viewed at, tensors stay separate and every bucket is copied."""
        offsets = _flat_offsets(plan)
        if offsets is None:
            self._flat, self._flat_digest, self._flat_offsets = None, plan.digest, []
            return
        flat = torch.zeros(plan.total_bytes, dtype=torch.uint8)
        weights = _views(flat, plan, offsets)
        for spec in plan.tensors:
            have = self._weights.get(spec.name)
            if have is not None and tuple(have.shape) == spec.shape and have.dtype == spec.dtype:
                weights[spec.name].copy_(have)
        self._weights, self._flat = weights, flat
        self._flat_digest, self._flat_offsets = plan.digest, offsets

    @property
    def receives_in_place(self) -> bool:
        """True when the current plan's tensors live in one buffer in wire order (store mode,
        every tensor aligned): buckets after the first are then received straight into it."""
        return self._flat is not None

    def _land(self, bucket: Bucket) -> torch.Tensor | None:
        """Where a bucket may be received in place: its slice of the flat store, if any."""
        if self._flat is None:
            return None
        start = self._flat_offsets[bucket.start]
        return self._flat[start:start + bucket.nbytes]

    def _apply(self, bucket: Bucket, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
        with torch.no_grad():
            for spec, raw in tensors:
                copy_bytes(self._weights[spec.name].reshape(-1).view(torch.uint8), raw)

    def finish(self, version: int, deadline: Deadline) -> str:
        return ""

    # --- staged epochs -----------------------------------------------------------------------

    @property
    def staging_bytes(self) -> int:
        # Not the weights it serves from, where they are one of the copy's buffers (flip()).
        return self._staging.held_bytes(besides=self._flat)

    @property
    def committed_copy(self) -> tuple[int, str] | None:
        version, digest = self._staging.live_version, self._staging.digest
        return (version, digest) if version and digest else None

    @property
    def previous_copy(self) -> tuple[int, str] | None:
        return self._staging.previous

    def stage(self, plan: RefitPlan, deadline: Deadline,
              on_bucket: Callable[[Bucket], None], delta: bool = False,
              keep_previous: bool = False) -> str:
        """Every bucket lands in place in the staging copy (a delta: applied onto it, the
        committed copy, or with `keep_previous` onto a copy of it beside it); generation goes
        on (the pause gate is not touched, nor the live weights)."""
        with self._lock:
            group = self._group
            if group is None or group.closed:
                raise CollectiveError("no data group; call InitCollective",
                                      reason=Reason.NO_GROUP)
            if delta and self.committed_copy is None:
                raise FailedPreconditionError("no committed copy to apply a delta to",
                                              reason=Reason.DELTA_BASE_MISMATCH)
            # Keeps the bytes of the same plan (a delta's base); marks the copy incomplete; never
            # lands in the buffer the weights are served from (flip()).
            self._staging.allocate(plan, keep_previous=keep_previous, delta=delta,
                                   serving=self._flat)
        digest = StagedDigest(plan)

        def landed(bucket: Bucket) -> None:
            view = self._staging.bucket_view(bucket)
            self._on_staged(bucket, view)
            digest.add(bucket, view)
            on_bucket(bucket)

        if delta:
            receive_delta(group, plan, deadline, self._staging.bucket_view, landed)
        else:
            receive(group, plan, deadline, _never_applied, landed,
                    land=self._staging.bucket_view, land_from_first=True)
        staged = digest.hexdigest()
        self._staging.complete(staged)
        return staged

    def _on_staged(self, bucket: Bucket, view: torch.Tensor) -> None:
        """A bucket landed in the staging copy, before its checksum (a test's fault hook)."""

    def flip(self, version: int, deadline: Deadline) -> str:
        """The staged copy becomes the live weights. In store mode with every tensor aligned,
        the engine serves from the copy itself: its weights become views of the copy's buffer
        (no bytes move; the buffer it served from before is the copy's second one, where the
        next epoch lands or, after a reversible epoch, the previous version stays). Otherwise
        (a model's own parameters, or a layout that cannot be viewed) a copy per tensor."""
        deadline.check("flip")
        if self._staging.digest is None:
            raise FailedPreconditionError("nothing staged to flip", reason=Reason.NOT_STAGED)
        with self._lock:
            self._receiving = True
            self._digest = None
            plan = self._staging_plan()
            self._plan = plan
            offsets = _flat_offsets(plan) if self._model is None else None
            if offsets is None:
                self._allocate(plan)
        try:
            if offsets is not None:
                flat = self._staging.flat_bytes()
                weights = _views(flat, plan, offsets)
                with self._lock:
                    self._weights, self._flat = weights, flat
                    self._flat_digest, self._flat_offsets = plan.digest, offsets
            else:
                with torch.no_grad():
                    for spec, raw in self._staging.tensors():
                        copy_bytes(self._weights[spec.name].reshape(-1).view(torch.uint8), raw)
        finally:
            with self._lock:
                self._receiving = False
        self._staging.mark_live(version)
        return ""

    def _staging_plan(self) -> RefitPlan:
        plan = self._staging.plan
        assert plan is not None  # a complete copy has a plan
        return plan

    def drop_staged(self) -> None:
        self._staging.drop_pending()  # a committed copy stays: the base, what catch-ups read

    def restore_previous(self, deadline: Deadline) -> tuple[int, str]:
        deadline.check("restore_previous")
        try:
            return self._staging.restore_previous()
        except ValueError as e:
            raise FailedPreconditionError(str(e), reason=Reason.NO_PREVIOUS_COPY) from None

    # --- catch-up: serving the committed copy to a peer ---------------------------------------

    def serve_copy(self, spec: GroupSpec, store: Any, deadline: Deadline,
                   on_bucket: Callable[[Bucket], None] | None = None) -> None:
        plan = self._staging.plan
        if self.committed_copy is None or plan is None:
            raise FailedPreconditionError("no committed copy to serve",
                                          reason=Reason.PEER_COPY_MISMATCH)
        group = Group.join(spec, deadline.check("catch-up rendezvous"), store=store)
        with self._lock:
            self._serving = group  # abort_transfer() closes it too
        try:
            broadcast_buckets(group, plan, self._staging.bucket_view, deadline, on_bucket)
        finally:
            with self._lock:
                self._serving = None
            group.close()

    def abort_transfer(self) -> None:
        with self._lock:
            groups = [g for g in (self._group, self._serving) if g is not None]
            self._group = self._serving = None
        for group in groups:
            group.close()

    def tensor(self, name: str) -> torch.Tensor:
        return self._weights[name]


def _flat_offsets(plan: RefitPlan) -> list[int] | None:
    """Each tensor's byte offset with the plan's tensors back to back in plan order (the wire's
    and the staging copy's layout); None where one would start at an offset its dtype cannot be
    viewed at."""
    offsets, offset = [], 0
    for spec in plan.tensors:
        if offset % spec.dtype.itemsize:
            return None
        offsets.append(offset)
        offset += spec.nbytes
    return offsets


def _views(flat: torch.Tensor, plan: RefitPlan, offsets: list[int]) -> dict[str, torch.Tensor]:
    """The plan's tensors as views of `flat` at `offsets`."""
    return {spec.name: flat[start:start + spec.nbytes].view(spec.dtype).view(spec.shape)
            for spec, start in zip(plan.tensors, offsets)}


def _never_applied(bucket: Bucket, tensors: Iterator[tuple[TensorSpec, torch.Tensor]]) -> None:
    raise AssertionError("a staged receive lands every bucket in the staging copy")


MODELS = ("tiny-lm", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceOptions(EngineOptions):
    """The reference engine's options: the tiny LM or a plain tensor store, and the LM's seed."""

    model: str = "tiny-lm"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")


def _build(options: ReferenceOptions, packing: Packing) -> ReferenceEngine:
    return ReferenceEngine(model=None if options.model == "none" else TinyLMConfig(),
                           seed=options.seed, packing=packing)


ENGINE = EngineKind(ReferenceOptions, _build)
