"""States as the MGRIT core's callbacks see them, and their byte format on the wire.

A state is a numpy array or a torch tensor of any shape and dtype.  Note [state bytes]: a
message is a header (kind: numpy or torch; a dtype code; the shape), padded to 8 bytes, then the
raw bytes of the state: float64 stays float64, bfloat16 and bool travel as their bytes, and a
CUDA tensor is staged through host memory and unpacked onto the receiving core's device.  This
module needs neither the compiled core nor torch (torch is used only when the program has
imported it), so the format is tested on its own.
"""

import struct
import sys
from typing import Any

import numpy as np

__all__ = []

_NP_DTYPES = [
    np.dtype(t)
    for t in (
        "float64",
        "float32",
        "float16",
        "complex128",
        "complex64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
]
_TORCH_DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
]


def _torch() -> Any:
    """torch if the program imported it (a state can only be a tensor then), else None.  Keeps
    numpy-only users from paying for torch's import."""
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _as_state(x: Any) -> Any:
    """numpy scalars and Python numbers become 0-d arrays; arrays and tensors pass."""
    if _is_torch(x) or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (np.generic, int, float, complex)):
        return np.asarray(x)
    raise TypeError(
        f"an MGRIT state must be a numpy array or a torch tensor, got {type(x).__name__}"
    )


# Note [norms in the state's precision]: a float32 norm reads the state once; converting it to
# float64 first (the obvious exact way) costs a copy and about 8x the time at 300k elements.  The
# float32 result is trusted where squares can neither overflow nor underflow to matter: between
# 1e-10 and float32's largest value, the lost squares (each below 1e-38) add up to less than
# 1e-29 even over 1e9 elements, against a sum of squares above 1e-20; the summation's rounding
# is about 1e-5 relative at 1M elements, far below what a residual norm is compared with.
# Outside that range, and for half precision, the norm is taken in float64.
_FAST_NORM_RANGE = (1e-10, 3e38)


def _norm(x: Any) -> float:
    if _is_torch(x):
        torch = _torch()
        flat = x.detach().reshape(-1)
        if flat.dtype in (torch.float32, torch.complex64):
            n = float(torch.linalg.vector_norm(flat))
            if _FAST_NORM_RANGE[0] < n < _FAST_NORM_RANGE[1]:
                return n
        if flat.is_floating_point():
            return float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        if flat.is_complex():
            return float(torch.linalg.vector_norm(flat.to(torch.complex128)))
        return float(torch.linalg.vector_norm(flat.double()))
    return float(
        np.linalg.norm(
            np.asarray(x, dtype=np.complex128 if np.iscomplexobj(x) else np.float64).reshape(-1)
        )
    )


def _sum(alpha: float, x: Any, beta: float, y: Any) -> Any:
    """A new state ``alpha * x + beta * y``, in one pass where the dtypes allow."""
    if _is_torch(y):
        if beta == 1.0 and x.dtype == y.dtype and (y.is_floating_point() or y.is_complex()):
            return _torch().add(y, x, alpha=alpha)
    elif beta == 1.0 and alpha in (1.0, -1.0) and x.dtype == y.dtype:
        return y + x if alpha == 1.0 else y - x
    if alpha == 1.0 and beta == 1.0:
        return x + y
    if beta == 1.0:
        return y + alpha * x
    return alpha * x + beta * y


def _sum_into(alpha: float, x: Any, beta: float, y: Any) -> bool:
    """``y <- alpha * x + beta * y`` in place, where y can hold the result exactly as `_sum`
    would give it (same dtype, floating or complex, no gradient tracking); returns whether it
    did.  Only for a state that nothing else refers to (Note [private states] in _bridge)."""
    if _is_torch(y):
        torch = _torch()
        if not (
            _is_torch(x)
            and x.dtype == y.dtype
            and x.device == y.device
            and x.shape == y.shape
            and (y.is_floating_point() or y.is_complex())
            and not y.requires_grad
        ):
            return False
        with torch.no_grad():
            if beta != 1.0:
                y.mul_(beta)
            y.add_(x, alpha=alpha)
        return True
    if not (
        isinstance(x, np.ndarray)
        and isinstance(y, np.ndarray)
        and x.dtype == y.dtype
        and x.shape == y.shape
        and y.dtype.kind in "fc"
        and y.flags.writeable
    ):
        return False
    if beta != 1.0:
        y *= beta
    if alpha == 1.0:
        y += x
    elif alpha == -1.0:
        y -= x
    else:
        y += alpha * x
    return True


def _header(x: Any) -> bytes:
    """kind, dtype code and shape, padded to a multiple of 8 bytes."""
    if _is_torch(x):
        kind, code = 1, _TORCH_DTYPE_NAMES.index(str(x.dtype).replace("torch.", ""))
    else:
        kind, code = 0, _NP_DTYPES.index(x.dtype)
    head = struct.pack(f"<BBH{x.ndim}q", kind, code, x.ndim, *x.shape)
    return head + b"\0" * (-len(head) % 8)


def _raw_bytes(x: Any) -> Any:
    """The state's bytes as a uint8 numpy array (CUDA tensors are staged through host memory)."""
    if _is_torch(x):
        torch = _torch()
        flat = x.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        return flat.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _from_bytes(buf: Any, device: Any) -> Any:
    kind, code, ndim = struct.unpack_from("<BBH", buf, 0)
    shape = struct.unpack_from(f"<{ndim}q", buf, 4)
    off = 4 + 8 * ndim
    off += -off % 8
    payload = np.frombuffer(buf, dtype=np.uint8, offset=off).copy()
    if kind == 0:
        return payload.view(_NP_DTYPES[code]).reshape(shape)
    import torch

    dtype = getattr(torch, _TORCH_DTYPE_NAMES[code])
    if payload.size == 0:  # an empty state: nothing to reinterpret
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.from_numpy(payload)
        t = t.to(torch.bool) if dtype == torch.bool else t.view(dtype)
        t = t.reshape(shape)
    return t.to(device) if device is not None and device.type != "cpu" else t


def _payload(x: Any) -> Any:
    """The state's bytes as a flat uint8 torch tensor, on the state's device (a numpy state's
    on the CPU): what a torch.distributed transport sends (Note [device-resident messages] in
    _comm/dist.py)."""
    import torch

    if not _is_torch(x):
        return torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    flat = x.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.contiguous().view(torch.uint8)


def _from_parts(head: Any, payload: Any, device: Any) -> Any:
    """A state from its header bytes and its payload (a flat uint8 torch tensor, on any
    device), on ``device`` (None: where the payload is)."""
    kind, code, ndim = struct.unpack_from("<BBH", head, 0)
    shape = struct.unpack_from(f"<{ndim}q", head, 4)
    if kind == 0:
        return payload.cpu().numpy().copy().view(_NP_DTYPES[code]).reshape(shape)
    import torch

    dtype = getattr(torch, _TORCH_DTYPE_NAMES[code])
    if payload.numel() == 0:
        t = torch.empty(shape, dtype=dtype, device=payload.device)
    elif dtype == torch.bool:
        t = payload.to(torch.bool).reshape(shape)
    else:
        t = payload.view(dtype).reshape(shape)
    return t if device is None else t.to(device)
