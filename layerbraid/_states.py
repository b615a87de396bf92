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

import numpy as np

__all__ = []

_NP_DTYPES = [np.dtype(t) for t in ("float64", "float32", "float16", "complex128", "complex64",
                                    "int64", "int32", "int16", "int8", "uint8", "bool")]
_TORCH_DTYPE_NAMES = ["float64", "float32", "float16", "bfloat16", "complex128", "complex64",
                      "int64", "int32", "int16", "int8", "uint8", "bool"]


def _torch():
    """torch if the program imported it (a state can only be a tensor then), else None.  Keeps
    numpy-only users from paying for torch's import."""
    return sys.modules.get("torch")


def _is_torch(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _as_state(x):
    """numpy scalars and Python numbers become 0-d arrays; arrays and tensors pass."""
    if _is_torch(x) or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (np.generic, int, float, complex)):
        return np.asarray(x)
    raise TypeError(f"an MGRIT state must be a numpy array or a torch tensor, got {type(x).__name__}")


def _clone(x):
    return x.clone() if _is_torch(x) else x.copy()


def _norm(x):
    if _is_torch(x):
        torch = _torch()
        return float(torch.linalg.vector_norm(x.detach().reshape(-1), dtype=torch.float64)
                     if x.is_floating_point() else torch.linalg.vector_norm(x.double()))
    return float(np.linalg.norm(np.asarray(x, dtype=np.complex128 if np.iscomplexobj(x)
                                          else np.float64).reshape(-1)))


def _header(x):
    """kind, dtype code and shape, padded to a multiple of 8 bytes."""
    if _is_torch(x):
        kind, code = 1, _TORCH_DTYPE_NAMES.index(str(x.dtype).replace("torch.", ""))
    else:
        kind, code = 0, _NP_DTYPES.index(x.dtype)
    head = struct.pack(f"<BBH{x.ndim}q", kind, code, x.ndim, *x.shape)
    return head + b"\0" * (-len(head) % 8)


def _raw_bytes(x):
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


def _from_bytes(buf, device):
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
