"""One wire for tensors: a list of tensors packed as one flat byte tensor on a given device, and
unpacked into templates.  Every transport sends tensors this way: nothing passes through numpy,
so a tensor on a GPU stays there when the transport moves device memory (NCCL, a CUDA-aware
MPI), and every dtype travels as its bytes (bool, complex and bfloat16 included, which not
every backend reduces or moves)."""

from collections.abc import Sequence

import torch

__all__ = ["nbytes", "pack", "unpack", "unpack_into"]


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of ``tensors``' elements, together."""
    return sum(t.numel() * t.element_size() for t in tensors)


def as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s bytes, flat and contiguous on ``device`` (``t``'s own memory when it is one)."""
    return t.detach().reshape(-1).to(device).contiguous().view(torch.uint8)


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors``' bytes, one after the other, as one flat uint8 tensor on ``device``."""
    parts = [as_bytes(t, device) for t in tensors]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def unpack(flat: torch.Tensor, templates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors packed in ``flat`` (a flat uint8 tensor) with ``templates``' shapes and dtypes,
    in order, on ``flat``'s device: views of ``flat`` where the bytes are aligned for the dtype,
    else copies."""
    if flat.numel() != nbytes(templates):
        raise ValueError(
            f"{flat.numel()} bytes do not hold the {nbytes(templates)} bytes of the templates"
        )
    out, off = [], 0
    for t in templates:
        n = t.numel() * t.element_size()
        piece = flat[off : off + n]
        if off % t.element_size():  # a view as a wider dtype needs an aligned offset
            piece = piece.clone()
        out.append(piece.view(t.dtype).view(t.shape))
        off += n
    return out


def unpack_into(flat: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Overwrites ``targets`` (on any device) with the tensors packed in ``flat``."""
    with torch.no_grad():
        for t, got in zip(targets, unpack(flat, targets)):
            t.copy_(got)
