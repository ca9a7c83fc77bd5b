"""The names and shapes vLLM loads, read from the checkpoint it serves (safetensors headers), so a
plan naming a tensor the engine cannot load is refused at Prepare instead of failing mid-receive."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# A safetensors header is JSON behind an 8-byte length; anything larger than this is corrupt.
_MAX_HEADER_BYTES = 100 << 20


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


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: implausible header length {n}")
        header = json.loads(f.read(n))
    return {name: tuple(int(d) for d in meta["shape"])
            for name, meta in header.items() if name != "__metadata__"}
