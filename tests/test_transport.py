"""Tensors between ranks as buffers: every dtype arrives bit-exact, in rank order."""
import pytest
import torch
from mpi4py import MPI

from transports import WORLD

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.complex64, torch.int64,
          torch.uint8, torch.bool]


def make(dtype, shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    return (x * 50).to(dtype) if not dtype.is_complex else torch.complex(x, -x).to(dtype)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_buffers_carry_every_dtype_exactly():
    for dtype in DTYPES:
        check(dtype)


def check(dtype):
    rank, size = WORLD.rank, WORLD.size
    ref = make(dtype, (3, 4), 0)
    got = WORLD.bcast_tensor(ref if rank == 0 else None, (3, 4), dtype, "cpu", 0)
    assert got.dtype == dtype and torch.equal(got, ref)
    mine = [make(dtype, (2,), rank), make(dtype, (), rank + 10)]
    WORLD.bcast_into(mine)
    assert torch.equal(mine[0], make(dtype, (2,), 0)) and torch.equal(mine[1], make(dtype, (), 10))
    rows = WORLD.allgather_rows(make(dtype, (rank + 1, 2), rank))  # uneven blocks
    assert torch.equal(rows, torch.cat([make(dtype, (r + 1, 2), r) for r in range(size)]))
    if size > 1:
        if rank == 0:
            WORLD.send_tensor(ref[:, ::2], size - 1, 5)  # not contiguous
        if rank == size - 1:
            assert torch.equal(WORLD.recv_tensor((3, 2), dtype, "cpu", 0, 5), ref[:, ::2])


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
def test_the_core_over_cuda_aware_mpi_mode_equals_serial():
    """LAYERBRAID_CUDA_AWARE_MPI=1 routes the core's messages through the MPI transport
    (Note [CUDA-aware MPI] in layerbraid/_comm/mpi.py).  Here, with CPU states (MPI takes host
    buffers whatever it is), the tests of one level equal to serial and of converged MGRIT run
    through that path on 3 ranks; only the handing of device pointers to MPI is left to a
    machine with a CUDA-aware MPI."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI"))}
    env["LAYERBRAID_CUDA_AWARE_MPI"] = "1"
    cmd = ["mpiexec", "-n", "3", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-m", "both_transports and parallel[3]", "tests/test_module.py", "tests/test_rnn.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
