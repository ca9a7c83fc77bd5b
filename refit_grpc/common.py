"""The vocabulary every layer shares: pause modes, deadlines, the data group's spec, limits.

Pure (no gRPC, no torch), so the driver, the shim, the engines and the code that runs inside vLLM
workers can all import it without pulling in each other.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

from refit_grpc.errors import EpochAbortedError, InvalidArgumentError, RefitTimeoutError
from refit_grpc.reasons import Reason

BACKENDS = ("gloo", "nccl")

# gRPC's default 4 MiB is plenty: control messages never carry weights. A plan of a million
# tensors is ~60 MiB, so both ends raise the limit to what a shim's max_plan_tensors allows.
MAX_MESSAGE_BYTES = 128 << 20

# How often a blocked wait looks at its cancel flag; bounds how late an abort is noticed.
CANCEL_POLL_S = 0.05


class PauseMode(enum.Enum):
    KEEP = "keep"    # in-flight requests are suspended and continue after resume
    WAIT = "wait"    # in-flight requests finish first
    ABORT = "abort"  # in-flight requests are aborted


class EpochMode(enum.Enum):
    """Where an epoch's bytes land (docs/protocol.md, "Staged epochs")."""

    IN_PLACE = "in_place"  # pause, receive into the live weights, resume: no extra memory
    STAGED = "staged"      # serve on while the bytes land in a host copy; switch at the flip


class Deadline:
    """An absolute monotonic deadline plus a cancel flag, handed down every blocking call."""

    def __init__(self, seconds: float, cancel: threading.Event | None = None):
        self.at = time.monotonic() + seconds
        self.cancel = cancel or threading.Event()

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def check(self, what: str) -> float:
        """Seconds left; raises EpochAbortedError once cancelled, RefitTimeoutError once past."""
        if self.cancel.is_set():
            raise EpochAbortedError(f"{what}: aborted", reason=Reason.EPOCH_ABORTED)
        left = self.remaining()
        if left <= 0:
            raise RefitTimeoutError(f"{what}: deadline exceeded")
        return left


@dataclass(frozen=True)
class GroupSpec:
    """One member's view of a refit session's data group (trainer rank 0 is the master)."""

    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str = "gloo"
    group_id: str = "refit"

    def validate(self) -> None:
        if not self.master_address:
            raise InvalidArgumentError("master_address is empty",
                                       reason=Reason.INVALID_MASTER_ADDRESS)
        if not 0 < self.master_port < 65536:
            raise InvalidArgumentError(f"master_port {self.master_port} out of range",
                                       reason=Reason.INVALID_MASTER_PORT)
        if self.world_size < 2:
            raise InvalidArgumentError(f"world_size must be >= 2, got {self.world_size}",
                                       reason=Reason.INVALID_WORLD_SIZE)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} outside [0, {self.world_size})",
                                       reason=Reason.INVALID_RANK)
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(f"backend {self.backend!r} not in {BACKENDS}",
                                       reason=Reason.INVALID_BACKEND)
        if not self.group_id:
            raise InvalidArgumentError("group_id is empty", reason=Reason.INVALID_GROUP_ID)


# --- what a request's fields may hold (docs/protocol.md, "Field limits") ----------------------
# Every field of every RPC is checked against these before the shim allocates, listens or
# connects; the shim's checks are in shim/service.py.

# Group ids and instance ids, in UTF-8 bytes. A group id becomes part of TCPStore keys (torch's
# store server drops a connection whose key is over 8192 bytes) and of log lines; 256 is far
# more than any id the driver makes (`catchup-` + 12 hex, `refit-` + a digest's prefix).
MAX_ID_BYTES = 256
# A tensor name, in UTF-8 bytes (checkpoint names are well under 200).
MAX_TENSOR_NAME_BYTES = 1024
# A tensor's dimensions (torch's own limit is 64).
MAX_TENSOR_DIMS = 64
# A digest (plan, staged, delta base): a SHA-256 hex digest is 64 characters. Longer strings, or
# characters outside printable ASCII, equal no digest and are refused as malformed.
MAX_DIGEST_CHARS = 64
# Versions: 1 .. 2**53 - 1, so a version is exact wherever it is a float (metrics, JSON).
MAX_VERSION = (1 << 53) - 1
# A data group's ranks (trainer + every engine rank); one engine's ranks (a catch-up group is
# the serving engine's rank 0 plus the newcomer's ranks, so at most 1 + MAX_ENGINE_WORLD_SIZE).
MAX_WORLD_SIZE = 1 << 16
MAX_ENGINE_WORLD_SIZE = 256
# An Abort's reason is kept (last_error, the log) up to this many characters; never refused.
MAX_REASON_CHARS = 1024


def text_problem(value: str, max_bytes: int) -> str | None:
    """What is wrong with a name or id (`value` non-empty): over `max_bytes` UTF-8 bytes, or a
    control, format, surrogate, private-use or unassigned character or a line or paragraph
    separator (anything that could break a log line); None when fine."""
    import unicodedata

    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        return f"is {size} bytes, over {max_bytes}"
    for i, ch in enumerate(value):
        category = unicodedata.category(ch)
        if category[0] == "C" or category in ("Zl", "Zp"):
            return f"has a control or unprintable character (U+{ord(ch):04X}) at {i}"
    return None


def digest_problem(value: str) -> str | None:
    """What is wrong with a digest field's shape; None when it could be a digest."""
    if len(value) > MAX_DIGEST_CHARS:
        return f"is {len(value)} characters, over {MAX_DIGEST_CHARS}"
    if not all("!" <= ch <= "~" for ch in value):
        return "has characters outside printable ASCII"
    return None


def clip(value: str, limit: int = 64) -> str:
    """`value` for a message or a log line: at most `limit` characters, marked when cut."""
    return value if len(value) <= limit else f"{value[:limit]}...({len(value)} chars)"
