"""The names, shapes and dtypes vLLM loads, read from the checkpoint it serves (safetensors
headers), so a plan naming a tensor the engine cannot load is refused at Prepare instead of failing
mid-receive, or worse, loading into garbage.

dtypes: vLLM's loaders cast what they receive to the parameter's dtype. Between floating dtypes
that is what a trainer wants (fp32 masters into a bf16 engine, or into an engine that quantizes
online: it re-derives its quantized weights from whatever floating values arrive). Anything else
is not a conversion: int8 values cast into a bf16 parameter load as the numbers -128..127, not
as quantized weights, and a pre-quantized checkpoint's int8 or fp8 weight, stored with its
scales, is loaded as it is stored, so bf16 values cast into it lose their scale. Both are
refused (TENSOR_MISMATCH) with what to send instead."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from refit_grpc.errors import InvalidPlanError
from refit_grpc.plan import RefitPlan
from refit_grpc.reasons import Reason

# A safetensors header is JSON behind an 8-byte length; anything larger than this is corrupt.
_MAX_HEADER_BYTES = 100 << 20
# Unknown names quoted in a refusal: enough to see the pattern, bounded for the status message.
_NAMES_SHOWN = 5
# safetensors' dtype names (its header's "dtype") for the torch dtypes a plan can carry.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The stored dtypes of weights as trained (not pre-quantized): any floating tensor casts into them.
_TRAINED = frozenset({"F64", "F32", "F16", "BF16"})
# Names of fused expert tensors as transformers >= 5 holds them in memory (no `.weight`): a
# plan naming them gets a hint to send the checkpoint's names (`fused_expert_hint`).
FUSED_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_proj",
                         ".experts.up_proj")


@dataclass(frozen=True)
class CheckpointIndex:
    directory: str
    shapes: dict[str, tuple[int, ...]]
    tied_embeddings: bool  # config.json's tie_word_embeddings: lm_head is embed_tokens
    dtypes: dict[str, str] = field(default_factory=dict)  # safetensors names ("BF16", "I8")

    @classmethod
    def read(cls, directory: str | Path) -> CheckpointIndex | None:
        """The index of a local checkpoint directory; None when it holds no safetensors files.
        Raises OSError or ValueError when a file cannot be read."""
        path = Path(directory)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return None
        shapes: dict[str, tuple[int, ...]] = {}
        dtypes: dict[str, str] = {}
        for f in files:
            header = safetensors_header(f)
            shapes.update(_shapes(header))
            dtypes.update({name: str(meta.get("dtype", "")) for name, meta in header.items()
                           if name != "__metadata__"})
        tied = False
        config = path / "config.json"
        if config.is_file():
            tied = bool(json.loads(config.read_text()).get("tie_word_embeddings", False))
        return cls(str(path), shapes, tied, dtypes)

    def check_plan(self, plan: RefitPlan, engine: str = "vLLM", quantization: str = "") -> None:
        """Every name of `plan` is one this checkpoint has, with its shape, and a dtype the
        engine's loader can take (module docstring). Raises InvalidPlanError: UNKNOWN_TENSOR
        naming the unknown names (and what to send instead when they are transformers'
        in-memory names of fused experts), or TENSOR_MISMATCH naming the first tensor whose
        shape or dtype cannot be loaded. `quantization` (Describe's) is named in a dtype
        refusal."""
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
            else:
                self._check_dtype(s.name, s.dtype, engine, quantization)
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:_NAMES_SHOWN])
            more = f" and {len(unknown) - _NAMES_SHOWN} more" if len(unknown) > _NAMES_SHOWN else ""
            raise InvalidPlanError(
                f"{engine} loads checkpoint names and {len(unknown)} of the plan's "
                f"{len(plan.tensors)} tensors are not among the {len(self.shapes)} of "
                f"{self.directory}: {shown}{more}{fused_expert_hint(unknown)}",
                reason=Reason.UNKNOWN_TENSOR)


    def check_adapter(self, plan: RefitPlan) -> None:
        """Every LoRA factor of an adapter plan fits the base weight it adapts: PEFT's
        `base_model.model.<module>.lora_A.weight` is [r, in] and `...lora_B.weight` [out, r] for
        the checkpoint's `<module>.weight` [out, in] (r: the config's rank, or its
        rank_pattern's). A factor of another shape would pass vLLM's build and fail when vLLM
        copies it into its LoRA slots, after the old adapter was dropped. Raises
        InvalidPlanError (INVALID_ADAPTER) naming the first that does not fit; modules the
        checkpoint does not have are the engine's check (vLLM's adaptable modules)."""
        assert plan.adapter is not None
        config = plan.adapter.config
        ranks = {int(v) for v in (config.get("rank_pattern") or {}).values()} | {int(config["r"])}
        for s in plan.tensors:
            module, factor = _lora_factor(s.name)
            base = self.shapes.get(f"{module}.weight") if module else None
            if base is None or len(base) != 2 or len(s.shape) != 2:
                continue
            out, inp = base
            fits = (s.shape[1] == inp and s.shape[0] in ranks) if factor == "A" \
                else (s.shape[0] == out and s.shape[1] in ranks)
            if not fits:
                want = f"[r, {inp}]" if factor == "A" else f"[{out}, r]"
                raise InvalidPlanError(
                    f"adapter {plan.adapter.name!r}: {s.name!r} has shape {list(s.shape)}; "
                    f"for {module}.weight {list(base)} lora_{factor} is {want} with r in "
                    f"{sorted(ranks)}", reason=Reason.INVALID_ADAPTER)

    def _check_dtype(self, name: str, dtype: torch.dtype, engine: str, quantization: str) -> None:
        stored = self.dtypes.get(name, "")
        if stored in _TRAINED:
            if dtype.is_floating_point:
                return  # cast by the loader (and re-quantized, where the engine quantizes)
            online = f"; this engine quantizes online ({quantization}) from floating weights" \
                if quantization not in ("", "none") else ""
            raise InvalidPlanError(
                f"tensor {name!r} is {dtype} and the checkpoint holds it as {stored}: {engine} "
                f"casts what it receives to the parameter's dtype, so {dtype} values would load "
                f"as numbers, not as quantized weights{online}: send the trainer's floating "
                "weights (bf16, fp16 or fp32)", reason=Reason.TENSOR_MISMATCH)
        wanted = SAFETENSORS_DTYPES.get(stored)
        if wanted is not None and wanted != dtype:
            raise InvalidPlanError(
                f"tensor {name!r} is {dtype} and the checkpoint holds it pre-quantized as "
                f"{stored} (with its scales): {engine} loads such a tensor as it is stored, so "
                f"send it as {wanted}, quantized with its scales, or serve the model from "
                "trained weights with online quantization", reason=Reason.TENSOR_MISMATCH)
        # A stored dtype this project does not know (e.g. packed 4-bit): not judged here.


def _lora_factor(name: str) -> tuple[str, str]:
    """(the adapted module's checkpoint name, "A" or "B") of a PEFT factor name; ("", "") for
    anything else."""
    for factor in ("A", "B"):
        head, sep, _ = name.partition(f".lora_{factor}.")
        if sep:
            return head.removeprefix("base_model.model."), factor
    return "", ""


def safetensors_header(path: Path) -> dict:
    """A safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: implausible header length {n}")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return header


def _shapes(header: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in meta["shape"])
            for name, meta in header.items() if name != "__metadata__"}


def fused_expert_hint(names: Iterable[str]) -> str:
    """What to tell a trainer whose plan has names the engine cannot load.

    Args:
        names: the tensor names the engine refused.

    Returns:
        A hint to send `checkpoint_state_dict(model)` when one of `names` is a fused expert
        tensor as transformers >= 5 holds it in memory; "" otherwise.
    """
    if any(name.endswith(FUSED_EXPERT_SUFFIXES) for name in names):
        return ("; these are transformers' in-memory names (experts fused): send the "
                "checkpoint's names with refit_grpc.integrations.hf.checkpoint_state_dict(model)")
    return ""
