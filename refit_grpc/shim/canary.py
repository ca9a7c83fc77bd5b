"""The shim's side of the logprob canary (refit_grpc/canary.py says what it is for): checking the
one a request carries, and scoring the engine's log-probabilities against it."""

from __future__ import annotations

import logging
import math
import time

from refit_grpc.canary import canary_problem
from refit_grpc.common import Deadline
from refit_grpc.errors import FailedPreconditionError, InvalidArgumentError
from refit_grpc.proto import pb
from refit_grpc.reasons import Reason
from refit_grpc.shim.engines.base import Engine

log = logging.getLogger(__name__)


def check_canary(canary: pb.Canary, engine: Engine) -> None:
    """A well-formed canary, on an engine that can compute one: refused before ACCEPTED, so no
    canary is silently skipped (invariant 6)."""
    problem = canary_problem(canary.token_ids, canary.expected_logprobs)
    if not problem and not all(math.isfinite(x) for x in canary.expected_logprobs):
        problem = "expected log-probabilities must be finite"
    if problem:
        raise InvalidArgumentError(f"canary: {problem}", reason=Reason.INVALID_CANARY)
    if not engine.capabilities.canary:
        raise FailedPreconditionError(
            f"the {engine.kind} engine cannot compute a canary; open the epoch without one",
            reason=Reason.CANARY_UNSUPPORTED)


def score_canary(engine: Engine, canary: pb.Canary, deadline: Deadline) -> pb.CanaryResult:
    """The engine's log-probabilities of the canary, with the weights just committed and before
    it serves again. A failure to compute them is reported, not raised: the weights are whole
    and committed; the driver decides (it names the engine and keeps the fleet paused)."""
    t0 = time.monotonic()
    try:
        logprobs = engine.canary_logprobs(list(canary.token_ids), deadline)
    except Exception as e:  # noqa: BLE001  (any engine failure is the canary's result)
        log.warning("canary failed: %s", e)
        return pb.CanaryResult(max_abs_gap=-1.0, seconds=time.monotonic() - t0,
                               error=f"{type(e).__name__}: {e}")
    gap = -1.0
    expected = canary.expected_logprobs
    if expected:
        if len(logprobs) != len(expected):
            return pb.CanaryResult(max_abs_gap=-1.0, seconds=time.monotonic() - t0,
                                   error=f"engine computed {len(logprobs)} positions, "
                                         f"expected {len(expected)}")
        gap = max(abs(a - b) for a, b in zip(logprobs, expected))
    seconds = time.monotonic() - t0
    log.info("canary: %d positions in %.3fs, max gap %s", len(logprobs), seconds,
             f"{gap:.2e}" if gap >= 0 else "(no expectation)")
    return pb.CanaryResult(logprobs=logprobs, max_abs_gap=gap, seconds=seconds)


__all__ = ["check_canary", "score_canary"]
