"""The names and shapes vLLM loads, read from the checkpoint it serves (safetensors headers), so a
plan naming a tensor the engine cannot load is refused at Prepare instead of failing mid-receive."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from refit_grpc.errors import InvalidPlanError
from refit_grpc.integrations.hf import fused_expert_hint
from refit_grpc.plan import RefitPlan
from refit_grpc.reasons import Reason

# A safetensors header is JSON behind an 8-byte length; anything larger than this is corrupt.
_MAX_HEADER_BYTES = 100 << 20
# Unknown names quoted in a refusal: enough to see the pattern, bounded for the status message.
_NAMES_SHOWN = 5


@dataclass(frozen=True)
class CheckpointIndex:
    directory: str
    shapes: dict[str, tuple[int, ...]]
    tied_embeddings: bool  # config.json's tie_word_embeddings: lm_head is embed_tokens

    @classmethod
    def read(cls, directory: str | Path) -> CheckpointIndex | None:
        """The index of a local checkpoint directory; None when it holds no safetensors files.
        Raises OSError or ValueError when a file cannot be read."""
        path = Path(directory)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            shapes.update(safetensors_shapes(f))
        tied = False
        config = path / "config.json"
        if config.is_file():
            tied = bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
        return cls(str(path), shapes, tied)

    def check_plan(self, plan: RefitPlan, engine: str = "vLLM") -> None:
        """Every name of `plan` is one this checkpoint has, with its shape (dtypes may differ:
        vLLM's loaders cast). Raises InvalidPlanError: UNKNOWN_TENSOR naming the unknown names
        (and what to send instead when they are transformers' in-memory names of fused
        experts), or TENSOR_MISMATCH naming the first tensor whose shape differs."""
        unknown = []
        for s in plan.tensors:
            shape = self.shapes.get(s.name)
            if shape is None:
                if s.name == "lm_head.weight" and self.tied_embeddings:
                    # Tied: one parameter under two names (a checkpoint stores it once); the
                    # trainer may send either or both (docs/vllm.md, Tied embeddings).
                    continue
                unknown.append(s.name)
            elif shape != s.shape:
                raise InvalidPlanError(
                    f"tensor {s.name!r}: checkpoint has shape {shape}, plan says {s.shape}",
                    reason=Reason.TENSOR_MISMATCH)
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:_NAMES_SHOWN])
            more = f" and {len(unknown) - _NAMES_SHOWN} more" if len(unknown) > _NAMES_SHOWN else ""
            raise InvalidPlanError(
                f"{engine} loads checkpoint names and {len(unknown)} of the plan's "
                f"{len(plan.tensors)} tensors are not among the {len(self.shapes)} of "
                f"{self.directory}: {shown}{more}{fused_expert_hint(unknown)}",
                reason=Reason.UNKNOWN_TENSOR)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: implausible header length {n}")
        header = json.loads(f.read(n))
    return {name: tuple(int(d) for d in meta["shape"])
            for name, meta in header.items() if name != "__metadata__"}
