"""The generated protobuf modules and the enum <-> Python value maps, in one place."""

from __future__ import annotations

import torch

from refit_grpc.common import EpochMode, PauseMode
from refit_grpc.v1 import reference_engine_pb2 as ref_pb  # noqa: F401
from refit_grpc.v1 import reference_engine_pb2_grpc as ref_pb_grpc  # noqa: F401
from refit_grpc.v1 import refit_pb2 as pb
from refit_grpc.v1 import refit_pb2_grpc as pb_grpc  # noqa: F401

DTYPE_TO_PROTO: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.D_TYPE_FLOAT32,
    torch.float16: pb.D_TYPE_FLOAT16,
    torch.bfloat16: pb.D_TYPE_BFLOAT16,
    torch.float64: pb.D_TYPE_FLOAT64,
    torch.int8: pb.D_TYPE_INT8,
    torch.uint8: pb.D_TYPE_UINT8,
    torch.int16: pb.D_TYPE_INT16,
    torch.int32: pb.D_TYPE_INT32,
    torch.int64: pb.D_TYPE_INT64,
    torch.bool: pb.D_TYPE_BOOL,
    torch.float8_e4m3fn: pb.D_TYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: pb.D_TYPE_FLOAT8_E5M2,
}
DTYPE_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_PROTO.items()}

# Python -> proto maps fill request fields, typed with the generated enums (the .pyi stubs check
# them); proto -> Python maps take what arrives, any int (an unknown value is not a key).
BACKEND_FROM_NAME: dict[str, pb.Backend] = {"gloo": pb.BACKEND_GLOO, "nccl": pb.BACKEND_NCCL}
BACKEND_NAMES: dict[int, str] = {v: k for k, v in BACKEND_FROM_NAME.items()}

PAUSE_MODE_TO_PROTO: dict[PauseMode, pb.PauseMode] = {
    PauseMode.KEEP: pb.PAUSE_MODE_KEEP,
    PauseMode.WAIT: pb.PAUSE_MODE_WAIT,
    PauseMode.ABORT: pb.PAUSE_MODE_ABORT,
}
PAUSE_MODE_FROM_PROTO: dict[int, PauseMode] = {v: k for k, v in PAUSE_MODE_TO_PROTO.items()}
EPOCH_MODE_TO_PROTO: dict[EpochMode, pb.EpochMode] = {
    EpochMode.IN_PLACE: pb.EPOCH_MODE_IN_PLACE,
    EpochMode.STAGED: pb.EPOCH_MODE_STAGED,
}
