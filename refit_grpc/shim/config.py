"""The shim's limits and identity (`ShimConfig`), set once by the server or a test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShimConfig:
    max_epoch_s: float = 600.0        # cap when the caller set no deadline (or a longer one)
    max_join_s: float = 300.0
    max_control_s: float = 60.0
    # An epoch's PROGRESS: the first bucket at once, then at most one per interval (the newest
    # applied). The trainer reads every engine's stream: one message per bucket per engine
    # made its control cost grow with engines x buckets (`shim.receive.EpochReceive.buckets`).
    progress_interval_s: float = 0.2
    # How long a staged copy waits for its Flip when the epoch does not say (flip_timeout_s),
    # and the most it may ask: past it the copy is dropped, the engine serving the old version.
    default_flip_timeout_s: float = 120.0
    max_flip_timeout_s: float = 3600.0
    max_plan_tensors: int = 1_000_000
    max_plan_bytes: int = 1 << 40
    # Masters the shim may join; a hostile caller must not point the engine at its own rendezvous.
    allowed_master_networks: Sequence[str] = ("127.0.0.0/8", "::1/128")
    instance_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:12]}")


__all__ = ["ShimConfig"]
