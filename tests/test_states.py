"""The byte format of states (Note [state bytes]): every dtype and shape round-trips exactly,
without the compiled core."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from layerbraid._engine.states import _NP_DTYPES, _TORCH_DTYPE_NAMES, _from_bytes, _header, _raw_bytes


def round_trip(x):
    wire = _header(x) + _raw_bytes(x).tobytes()
    assert len(_header(x)) % 8 == 0
    return _from_bytes(bytearray(wire), None)


@pytest.mark.parametrize("dtype", _NP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (3,), (2, 0, 4), (2, 3, 5)])
def test_numpy_states_round_trip_exactly(dtype, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 100).astype(dtype) if dtype.kind != "c" else \
        (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    y = round_trip(x)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape
    assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("name", _TORCH_DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(), (3,), (2, 0, 4), (2, 3, 5)])
def test_torch_states_round_trip_exactly(name, shape):
    dtype = getattr(torch, name)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 100)
    x = x.to(dtype) if not dtype.is_complex else torch.complex(x, -x).to(dtype)
    x = x[..., ::2] if x.dim() and x.shape[-1] > 1 else x  # not contiguous
    y = round_trip(x)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y.view(-1).view(torch.uint8) if dtype != torch.bool else y,
                       x.contiguous().view(-1).view(torch.uint8) if dtype != torch.bool else x)


def test_the_format_needs_no_compiled_core():
    code = ("import sys, layerbraid._engine.states; "
            "assert 'layerbraid._mgrit_core' not in sys.modules and 'cffi' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
