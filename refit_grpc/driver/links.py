"""The trainer's end of a joined data group: what `Fleet.refit` broadcasts through.

`Fleet.connect` returns one of these; `Fleet.refit` accepts any object with this surface, so the
project's gloo link and the link to vLLM's own NCCL receiver (`driver/nccl.py`) are used the same
way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from refit_grpc.common import Deadline
from refit_grpc.dataplane.group import Group
from refit_grpc.dataplane.staging import StagedDigest
from refit_grpc.dataplane.transfer import Sender, TransferStats
from refit_grpc.plan import Bucket, RefitPlan


@runtime_checkable
class BucketSender(Protocol):
    plan: RefitPlan

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse, before any byte moves, tensors that do not match the plan."""

    def send(self, tensors: Mapping[str, torch.Tensor], deadline: Deadline,
             on_bucket: Callable[[Bucket], None] | None = None, *,
             checksums: StagedDigest | None = None) -> TransferStats:
        """Pack and broadcast every bucket of the plan; bounded by `deadline`; each bucket's
        bytes go to `checksums` (a staged epoch's digest) as they are sent."""


@runtime_checkable
class TrainerLink(Protocol):
    """Trainer rank 0 of a formed group: a sender for the plan, and the way to tear it down."""

    @property
    def plan(self) -> RefitPlan: ...

    @property
    def sender(self) -> BucketSender: ...

    @property
    def port(self) -> int:
        """The port this process's rendezvous store listened on (the one the shims were sent;
        the kernel's pick when `Fleet.connect` was given 0)."""

    def close(self) -> None:
        """Tear the group down; peers' pending receives fail at once. Never blocks."""


@dataclass
class GlooLink:
    """The project's own group (`dataplane.group.Group`, gloo or NCCL through torch) and its Sender."""

    group: Group
    plan: RefitPlan
    sender: Sender = field(init=False)

    def __post_init__(self) -> None:
        self.sender = Sender(self.group, self.plan)

    @property
    def port(self) -> int:
        return self.group.spec.master_port

    def adopt(self, other: GlooLink) -> None:
        """Take over `other`'s group and sender (a group re-formed without failed engines, as
        a staged epoch does), so the trainer's `link` stays the one to pass to `refit()`."""
        self.group, self.plan, self.sender = other.group, other.plan, other.sender

    def close(self) -> None:
        self.group.close()
