"""Tensors between ranks as buffers: every dtype arrives bit-exact, in rank order."""
import pytest
import torch
from mpi4py import MPI

from layerbraid._comm.transport import allgather_rows, bcast_into, bcast_tensor, recv_tensor, \
    send_tensor

WORLD = MPI.COMM_WORLD
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.complex64, torch.int64,
          torch.uint8, torch.bool]


def make(dtype, shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    return (x * 50).to(dtype) if not dtype.is_complex else torch.complex(x, -x).to(dtype)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_buffers_carry_every_dtype_exactly():
    for dtype in DTYPES:
        check(dtype)


def check(dtype):
    rank, size = WORLD.rank, WORLD.size
    ref = make(dtype, (3, 4), 0)
    got = bcast_tensor(WORLD, ref if rank == 0 else None, (3, 4), dtype, "cpu", 0)
    assert got.dtype == dtype and torch.equal(got, ref)
    mine = [make(dtype, (2,), rank), make(dtype, (), rank + 10)]
    bcast_into(WORLD, mine)
    assert torch.equal(mine[0], make(dtype, (2,), 0)) and torch.equal(mine[1], make(dtype, (), 10))
    rows = allgather_rows(WORLD, make(dtype, (rank + 1, 2), rank))  # uneven blocks
    assert torch.equal(rows, torch.cat([make(dtype, (r + 1, 2), r) for r in range(size)]))
    if size > 1:
        if rank == 0:
            send_tensor(WORLD, ref[:, ::2], size - 1, 5)  # not contiguous
        if rank == size - 1:
            assert torch.equal(recv_tensor(WORLD, (3, 2), dtype, "cpu", 0, 5), ref[:, ::2])
