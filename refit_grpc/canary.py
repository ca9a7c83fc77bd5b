"""The logprob canary: a runtime proof that every engine computes what the trainer computes.

A digest proves the bytes arrived; it cannot see an engine that holds the right bytes and
computes the wrong thing with them (experts left unpacked after a reload, a stale copy of a tied
head, a quantization scale not recomputed). The canary can: the trainer gives a fixed token
sequence and its own log-probabilities of it; after the commit, before the engine serves again,
each engine computes the same teacher-forced log-probabilities (COMMITTED carries them), and the
driver compares them position by position with the trainer's tolerance.

Default tolerances, from the gaps measured between a correct vLLM CPU engine and transformers on
the same weights (docs/vllm.md, tests/test_vllm_truth.py, tests/test_vllm_families.py):
float32 <= 7e-7 on every family, so 2e-3; bfloat16 <= 4e-3 (rounding order alone), so 2e-2.
The bugs the canary is for measured 0.024-0.1 (MoE experts not re-packed) and 0.16-0.21 (a stale
tied head): above both defaults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit_grpc.errors import InvalidArgumentError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason

MAX_CANARY_TOKENS = 4096  # the shim refuses more; a canary is a spot check, not an eval
FP32_TOLERANCE = 2e-3
BF16_TOLERANCE = 2e-2


def default_tolerance(dtype: torch.dtype) -> float:
    """The tolerance for an engine serving `dtype` (module docstring: measured noise x 5+).

    Args:
        dtype: the engine's weights dtype.

    Returns:
        `FP32_TOLERANCE` for float32 and float64, else `BF16_TOLERANCE`.
    """
    return FP32_TOLERANCE if dtype in (torch.float32, torch.float64) else BF16_TOLERANCE


@dataclass(frozen=True)
class Canary:
    """A token sequence, the trainer's log-probabilities of it and the tolerance per position.

    Args:
        token_ids: at least 2 token ids of the engines' vocabulary.
        logprobs: log P(token_ids[i] | token_ids[:i]) for i = 1 .. n-1, as the trainer computes
            them (`refit_grpc.integrations.hf.canary_from_model` does it for transformers).
        tolerance: the largest |engine - trainer| allowed at any position.

    Raises:
        InvalidArgumentError: INVALID_CANARY, a malformed canary, before any shim is asked.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float = FP32_TOLERANCE

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        problem = canary_problem(self.token_ids, self.logprobs)
        if problem is None and not self.tolerance > 0:
            problem = f"tolerance must be > 0, got {self.tolerance}"
        if problem is None and not all(math.isfinite(x) for x in self.logprobs):
            problem = "the trainer's log-probabilities must be finite"
        if problem:
            raise InvalidArgumentError(f"canary: {problem}", reason=Reason.INVALID_CANARY)

    def to_proto(self) -> pb.Canary:
        """The canary as UpdateWeightsRequest carries it (the tolerance stays with the driver)."""
        return pb.Canary(token_ids=self.token_ids, expected_logprobs=self.logprobs)

    def gap(self, result: pb.CanaryResult) -> float:
        """How far an engine's log-probabilities are from the trainer's.

        Args:
            result: the engine's canary result, from its COMMITTED.

        Returns:
            The largest |engine - trainer| over positions; inf when the engine computed none
            (its error) or not one per position.
        """
        if result.error or len(result.logprobs) != len(self.logprobs):
            return math.inf
        return max(abs(a - b) for a, b in zip(result.logprobs, self.logprobs))


def teacher_forced_logprobs(logits: torch.Tensor, token_ids: Sequence[int]) -> list[float]:
    """Teacher-forced log-probabilities: the one definition the trainer's side and the
    in-process engines use.

    Args:
        logits: the logits of one forward over `token_ids`, `[n, vocab]` (`logits[i]` predicts
            token i+1).
        token_ids: the sequence.

    Returns:
        log P(token_ids[i] | token_ids[:i]) for i = 1 .. n-1 (log_softmax in float64).
    """
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return lp.gather(1, ids[1:, None])[:, 0].tolist()


def canary_problem(token_ids: Sequence[int], expected: Sequence[float]) -> str | None:
    """One rule for the driver and the shim (which refuses with INVALID_CANARY).

    Args:
        token_ids: the canary's tokens.
        expected: the trainer's log-probabilities (may be empty: the shim's check of tokens).

    Returns:
        What is wrong with the canary's tokens and expectation, or None.
    """
    if not 2 <= len(token_ids) <= MAX_CANARY_TOKENS:
        return f"needs 2 to {MAX_CANARY_TOKENS} tokens, got {len(token_ids)}"
    if any(t < 0 for t in token_ids):
        return "token ids must be >= 0"
    if expected and len(expected) != len(token_ids) - 1:
        return (f"expected log-probabilities must be one per position after the first "
                f"({len(token_ids) - 1}), got {len(expected)}")
    return None
