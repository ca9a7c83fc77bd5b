"""The bytes of a bucket: vLLM's packed format, byte for byte.

A bucket is its tensors' bytes back to back in plan order (`RefitPlan.buckets`), whatever their
dtypes. The sender packs tensors into a bucket buffer (`pack_into`, through `copy_bytes`); the
receiver walks a received bucket (`unpack`) and views each tensor's bytes as the tensor
(`as_tensor`). `bucket_buffers` allocates the buffers both ends reuse epoch after epoch.

Its own module because it is pure tensor work, with no group and no network: the code inside
vLLM's workers (`refit_grpc.vllm_plugin`), the delta codec and the trainer's NCCL sender use it
without touching a group.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence

import torch

from refit_grpc.plan import TensorSpec


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (0-dim included)."""
    return t.reshape(-1).view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst` (a contiguous uint8 tensor) <- the bytes of the contiguous tensor `src`.

    Between CPU tensors this is one `memmove` on the calling thread, with the GIL released.
    torch's `copy_` would split a large copy over its intra-op threads, and on a host whose
    cores are busy pushing the same bytes through the network stack those threads spin-wait
    between copies and take the cores the broadcast needs: measured on 2 cores, 1 GiB to one
    receiver, the sender's CPU time 0.67 s -> 0.33 s and the raw data path 1.60x -> 1.28x the
    floor (docs/bench.md)."""
    n = src.nbytes
    if dst.numel() != n:
        raise ValueError(f"copy_bytes: {dst.numel()} bytes of room for {n}")
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(_byte_view(src.detach()))


def pack_into(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy tensors back to back into the uint8 buffer `out`; returns the used prefix."""
    offset = 0
    for t in tensors:
        n = t.nbytes
        dst = out[offset:offset + n]
        if t.is_contiguous():
            copy_bytes(dst, t)
        else:
            # Copy through a typed view of the destination when aligned: no temporary copy.
            if offset % t.element_size() == 0 and n:
                dst.view(t.dtype).view(t.shape).copy_(t.detach())
            else:
                dst.copy_(_byte_view(t.detach().contiguous()))
        offset += n
    return out[:offset]


def unpack(buf: torch.Tensor, specs: Sequence[TensorSpec]) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Yield (spec, uint8 slice) for each tensor of one bucket."""
    offset = 0
    for s in specs:
        yield s, buf[offset:offset + s.nbytes]
        offset += s.nbytes


def as_tensor(spec: TensorSpec, raw: torch.Tensor) -> torch.Tensor:
    """A typed tensor from its packed bytes (copies only when the offset is unaligned)."""
    if raw.storage_offset() % spec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(spec.dtype).view(spec.shape)


def bucket_buffers(nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """`count` uint8 buffers of `nbytes` each on `device`: what buckets are packed into and
    received into."""
    return [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(count)]
