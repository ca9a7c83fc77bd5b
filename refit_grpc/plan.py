"""The refit plan: ordered tensor specs, the packing contract, its digest and bucket boundaries.

Pure functions and frozen values, no I/O. Sender and receiver both call `bucket_boundaries`, so
they can never disagree on where one bucket ends. The rule is vLLM's packed format
(`vllm/distributed/weight_transfer/packed_tensor.py`): tensors in plan order, flattened to bytes,
and a bucket closes right AFTER the tensor that makes its total exceed the buffer size. A bucket
therefore overshoots by at most one tensor, and one oversized tensor gets a bucket of its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from refit_grpc.errors import InvalidPlanError
from refit_grpc.reasons import Reason

# vLLM's defaults (1 GiB, 2 buffers); a shim offers these unless configured otherwise.
DEFAULT_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_NUM_BUFFERS = 2

# Names are those vLLM puts in `dtype_names` (torch's, without the "torch." prefix).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """`"torch.float32"` or `"float32"` -> `torch.float32`; InvalidPlanError for anything else."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise InvalidPlanError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}",
                               reason=Reason.UNSUPPORTED_DTYPE)
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise InvalidPlanError(f"unsupported dtype {dtype}", reason=Reason.UNSUPPORTED_DTYPE)
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class Packing:
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    num_buffers: int = DEFAULT_NUM_BUFFERS

    def validate(self) -> None:
        if self.buffer_size_bytes <= 0:
            raise InvalidPlanError(f"buffer_size_bytes must be > 0, got {self.buffer_size_bytes}",
                                   reason=Reason.INVALID_PACKING)
        if self.num_buffers < 1:
            raise InvalidPlanError(f"num_buffers must be >= 1, got {self.num_buffers}",
                                   reason=Reason.INVALID_PACKING)


@dataclass(frozen=True)
class Bucket:
    """Tensors `[start, stop)` of the plan, packed back to back into `nbytes` bytes."""

    index: int
    start: int
    stop: int
    nbytes: int


def bucket_boundaries(sizes: Sequence[int], buffer_size_bytes: int) -> list[tuple[int, int]]:
    """Half-open tensor index ranges of each bucket, by vLLM's rule (see module docstring)."""
    bounds: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            bounds.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


# An adapter's name is what requests select it by (vLLM: a request's "model"); bounded so that it
# fits a status message and a metric label.
MAX_ADAPTER_NAME_BYTES = 256
MAX_PEFT_CONFIG_BYTES = 64 * 1024


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter epoch carries (docs/adapters.md): the plan's tensors are a LoRA adapter's,
    under PEFT's names (`base_model.model.<module>.lora_A.weight`), loaded or replaced in the
    engine under `name`; the base model is not touched.

    Args:
        name: what requests name to use it.
        peft_config: PEFT's adapter_config.json as JSON text (rank `r`, `lora_alpha`,
            `target_modules`, ...): what the engine needs to build the adapter from tensors.
    """

    name: str
    peft_config: str

    @classmethod
    def of(cls, name: str, peft_config: Mapping[str, object] | str) -> AdapterSpec:
        """From a PEFT config (a `LoraConfig.to_dict()`, or its JSON), written canonically (sorted
        keys) so that every side computes the same plan digest."""
        config = json.loads(peft_config) if isinstance(peft_config, str) else dict(peft_config)
        spec = cls(name, json.dumps(config, sort_keys=True, default=_json_default))
        spec.validate()
        return spec

    @property
    def config(self) -> dict:
        return json.loads(self.peft_config)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def validate(self) -> None:
        """Raise InvalidPlanError (INVALID_ADAPTER) naming what is wrong; what the engine can
        serve (its maximum rank, the modules it can adapt) is the engine's check."""
        if not self.name or len(self.name.encode()) > MAX_ADAPTER_NAME_BYTES \
                or not self.name.isprintable() or self.name != self.name.strip():
            raise InvalidPlanError(f"adapter name {self.name[:64]!r}: 1 to "
                                   f"{MAX_ADAPTER_NAME_BYTES} printable bytes, no surrounding "
                                   "space", reason=Reason.INVALID_ADAPTER)
        if len(self.peft_config.encode()) > MAX_PEFT_CONFIG_BYTES:
            raise InvalidPlanError(f"adapter {self.name!r}: its PEFT config is over "
                                   f"{MAX_PEFT_CONFIG_BYTES} bytes", reason=Reason.INVALID_ADAPTER)
        try:
            config = json.loads(self.peft_config)
        except ValueError as e:
            raise InvalidPlanError(f"adapter {self.name!r}: its PEFT config is not JSON ({e})",
                                   reason=Reason.INVALID_ADAPTER) from None
        if not isinstance(config, dict):
            raise InvalidPlanError(f"adapter {self.name!r}: its PEFT config is not an object",
                                   reason=Reason.INVALID_ADAPTER)
        r = config.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise InvalidPlanError(f"adapter {self.name!r}: PEFT config rank r={r!r}, not an "
                                   "integer >= 1", reason=Reason.INVALID_ADAPTER)
        targets = config.get("target_modules")
        if not targets or not isinstance(targets, (str, list)):
            raise InvalidPlanError(f"adapter {self.name!r}: PEFT config names no "
                                   "target_modules", reason=Reason.INVALID_ADAPTER)

    def plan_tensors_check(self, tensors: Sequence[TensorSpec]) -> None:
        """Every tensor of an adapter plan is a LoRA factor (PEFT's `lora_A` / `lora_B`
        names): an adapter epoch never carries base weights."""
        for s in tensors:
            if ".lora_A." not in s.name and ".lora_B." not in s.name:
                raise InvalidPlanError(
                    f"adapter {self.name!r}: tensor {s.name!r} is not a LoRA factor (PEFT "
                    "names them ...lora_A.weight / ...lora_B.weight); an adapter epoch carries "
                    "the adapter's tensors only", reason=Reason.INVALID_ADAPTER)


def _json_default(value: object) -> object:
    """PEFT configs hold sets (target_modules) and enums: written as JSON lists and values."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    inner = getattr(value, "value", None)
    if isinstance(inner, (str, int, float)):
        return inner
    return str(value)


@dataclass(frozen=True)
class RefitPlan:
    tensors: tuple[TensorSpec, ...]
    packing: Packing = Packing()
    # Set for an adapter epoch's plan (`AdapterSpec`); None for the model's own weights.
    adapter: AdapterSpec | None = None

    @classmethod
    def from_state_dict_info(cls, info: Mapping[str, tuple[Sequence[int], object]],
                             packing: Packing | None = None,
                             adapter: AdapterSpec | None = None) -> RefitPlan:
        """`{name: (shape, dtype)}` in iteration order, the `prepare()` input of NeMo RL's channel
        (`adapter`: an adapter epoch's plan).

        dtype may be a torch.dtype or its name (with or without the "torch." prefix).
        """
        if info is None:
            raise InvalidPlanError("state_dict_info is None", reason=Reason.EMPTY_PLAN)
        specs = []
        for name, (shape, dtype) in info.items():
            dt = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(str(dtype))
            specs.append(TensorSpec(name, tuple(int(d) for d in shape), dt))
        plan = cls(tuple(specs), packing or Packing(), adapter)
        plan.validate()
        return plan

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]],
                     packing: Packing | None = None) -> RefitPlan:
        plan = cls(tuple(TensorSpec.of(n, t) for n, t in named), packing or Packing())
        plan.validate()
        return plan

    def validate(self, max_total_bytes: int | None = None, max_tensors: int | None = None) -> None:
        """Raise InvalidPlanError (or PlanTooLargeError) naming the first bad field."""
        from refit_grpc.errors import PlanTooLargeError

        if not self.tensors:
            raise InvalidPlanError("plan has no tensors", reason=Reason.EMPTY_PLAN)
        if max_tensors is not None and len(self.tensors) > max_tensors:
            raise PlanTooLargeError(f"plan has {len(self.tensors)} tensors, limit {max_tensors}")
        self.packing.validate()
        seen: set[str] = set()
        for i, spec in enumerate(self.tensors):
            if not spec.name:
                raise InvalidPlanError(f"tensor {i} has an empty name", reason=Reason.EMPTY_NAME)
            if spec.name in seen:
                raise InvalidPlanError(f"duplicate tensor name {spec.name!r}",
                                       reason=Reason.DUPLICATE_NAME)
            seen.add(spec.name)
            if spec.dtype not in DTYPE_NAMES:
                raise InvalidPlanError(f"tensor {spec.name!r}: unsupported dtype {spec.dtype}",
                                       reason=Reason.UNSUPPORTED_DTYPE)
            if any(d < 0 for d in spec.shape):
                raise InvalidPlanError(f"tensor {spec.name!r}: negative dimension in {spec.shape}",
                                       reason=Reason.INVALID_SHAPE)
            if spec.numel == 0:
                # An empty tensor carries no bytes; vLLM's packer cannot view it either.
                raise InvalidPlanError(f"tensor {spec.name!r}: zero-size shape {spec.shape}",
                                       reason=Reason.INVALID_SHAPE)
        if max_total_bytes is not None and self.total_bytes > max_total_bytes:
            raise PlanTooLargeError(
                f"plan is {self.total_bytes} bytes, limit {max_total_bytes}")
        if self.adapter is not None:
            self.adapter.validate()
            self.adapter.plan_tensors_check(self.tensors)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse, before any byte moves, tensors that do not match the plan (every sender's
        first step)."""
        for s in self.tensors:
            t = tensors.get(s.name)
            if t is None:
                raise InvalidPlanError(f"tensor {s.name!r} of the plan is missing",
                                       reason=Reason.MISSING_TENSOR)
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise InvalidPlanError(
                    f"tensor {s.name!r} is {tuple(t.shape)} {t.dtype}, plan says {s.shape} {s.dtype}",
                    reason=Reason.TENSOR_MISMATCH)

    @cached_property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.tensors)

    @cached_property
    def buckets(self) -> tuple[Bucket, ...]:
        sizes = [s.nbytes for s in self.tensors]
        out = []
        for i, (a, b) in enumerate(bucket_boundaries(sizes, self.packing.buffer_size_bytes)):
            out.append(Bucket(i, a, b, sum(sizes[a:b])))
        return tuple(out)

    @cached_property
    def digest(self) -> str:
        """SHA-256 over a canonical encoding: same tensors, order and packing <=> same digest."""
        h = hashlib.sha256()
        h.update(f"packing:{self.packing.buffer_size_bytes}:{self.packing.num_buffers}\n".encode())
        for s in self.tensors:
            # Lengths are prefixed, so no name can be crafted to collide with another encoding.
            name = s.name.encode()
            h.update(f"{len(name)}:".encode() + name)
            h.update(f":{dtype_name(s.dtype)}:{','.join(map(str, s.shape))}\n".encode())
        if self.adapter is not None:  # absent for a model's plan: its digest is unchanged
            for field in (self.adapter.name, self.adapter.peft_config):
                raw = field.encode()
                h.update(f"adapter:{len(raw)}:".encode() + raw + b"\n")
        return h.hexdigest()

    def state_dict_info(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {s.name: (s.shape, dtype_name(s.dtype)) for s in self.tensors}


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def raw_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (no numpy dependency)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr()))


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes of tensors in the given order.

    Trainer and reference engine compute it the same way, so equal digests mean byte-equal weights.
    """
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().contiguous().cpu()
        h.update(f"{len(name)}:{name}:{dtype_name(t.dtype)}:{tuple(t.shape)}\n".encode())
        h.update(raw_bytes(t))
    return h.hexdigest()
