"""ProcessGrid: data parallel x layer parallel, and gradient averaging across data groups."""

from typing import Any, Optional

import torch

from ._comm.world import Comm, is_comm, resolve
from ._engine.parts import FreedOnExit
from .launch import _enter
from .options import check_int

__all__ = ["ProcessGrid"]


class ProcessGrid(FreedOnExit):
    """Splits ``comm``'s P ranks into ``data_parallel`` groups of P / data_parallel
    layer-parallel ranks.

    Ranks ``d*L .. d*L + L - 1`` form layer group ``d`` (L = P / D).  The ranks at the same place
    in every layer group own the same layers and form a data group, across which gradients are
    averaged.  Pass the grid wherever a communicator is accepted (``LayerParallelModule(...,
    comm=grid)``): the model runs on the layer group and averages over the data group.

    Attributes:
        world, layer_comm, data_comm: the communicators.
        layer_rank, layer_size: this rank's place in its layer group, and the group's size.
        data_rank, data_size: this rank's data group index (which shard it reads), and D.
    """

    def __init__(self, comm: Optional[Comm] = None, data_parallel: int = 1) -> None:
        _enter()

        comm = resolve(comm)
        if not is_comm(comm):
            raise TypeError(
                f"comm must be an mpi4py communicator or a torch.distributed ProcessGroup, "
                f"got {type(comm).__name__}"
            )
        size = comm.Get_size()
        check_int("data_parallel", data_parallel)
        if size % data_parallel:
            raise ValueError(
                f"data_parallel={data_parallel} does not divide the {size} ranks of "
                f"the communicator: each data group needs {size}/{data_parallel} "
                "ranks"
            )
        rank = comm.Get_rank()
        layers = size // data_parallel
        self.world = comm
        self.layer_size, self.data_size = layers, data_parallel
        self.layer_rank, self.data_rank = rank % layers, rank // layers
        what = "the construction of a ProcessGrid"
        self.layer_comm = comm.Split(self.data_rank, self.layer_rank, what)
        self.data_comm = comm.Split(self.layer_rank, self.data_rank, what)

    def free(self) -> None:
        """Frees the two communicators the grid made (also at the end of a ``with`` block)."""
        for c in (self.layer_comm, self.data_comm):
            c.Free()

    def __repr__(self) -> str:
        return (
            f"ProcessGrid(data_parallel={self.data_size}, layer_parallel={self.layer_size}, "
            f"data_rank={self.data_rank}, layer_rank={self.layer_rank})"
        )


def replicate(module: "torch.nn.Module", grid: Optional[ProcessGrid]) -> Optional["_GradAverager"]:
    """Under data parallelism (a grid of several data groups): every replica of ``module``
    starts from data rank 0's weights and buffers (as DDP does), and averages its gradients over
    the data group at the end of every backward (the returned averager); else nothing."""
    if grid is None or grid.data_size == 1:
        return None
    grid.data_comm.bcast_into(list(module.parameters()) + list(module.buffers()))
    return _GradAverager(module.parameters(), grid.data_comm)


class _GradAverager:
    """Averages the gradients of ``params`` over ``comm`` at the end of every backward, in flat
    buckets; a bucket's allreduce starts (non-blocking) as soon as all its gradients are
    accumulated, so that it overlaps with the rest of the backward pass.

    Note [bucket order]: allreduces are started in bucket order on every rank, whatever order the
    hooks fire in, so the collectives match across the data group.
    """

    def __init__(self, params, comm, bucket_bytes=8 << 20) -> None:
        self.comm, self.size = comm, comm.Get_size()
        params = [p for p in params if p.requires_grad]
        # Gradients appear roughly in reverse order of the parameters (close layer first).
        self.buckets, current, nbytes = [], [], 0
        for p in reversed(params):
            current.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= bucket_bytes:
                self.buckets.append(current)
                current, nbytes = [], 0
        if current:
            self.buckets.append(current)
        self.where = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.launched = 0
        self.pending: list[Any] = []
        self.queued = False

    def _hook(self, p) -> None:
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.queued = True
        k = self.where[id(p)]
        self.ready[k] += 1
        while self.launched < len(self.buckets) and self.ready[self.launched] == len(
            self.buckets[self.launched]
        ):
            self._launch(self.launched)
            self.launched += 1

    def _launch(self, k) -> None:
        params = [p for p in self.buckets[k] if p.grad is not None]
        if not params:
            self.pending.append((None, [], None))
            return
        grads = [p.grad.detach() for p in params]
        dtypes = {g.dtype for g in grads}
        dtype = (
            dtypes.pop()
            if len(dtypes) == 1 and grads[0].dtype in (torch.float32, torch.float64)
            else torch.float64
        )
        # summed on the transport's device: the host under MPI (Note [staging] in
        # _comm/mpi.py), the GPU under NCCL (Note [device-resident messages] in _comm/dist.py)
        flat = torch.cat([g.reshape(-1).to(self.comm.device, dtype) for g in grads])
        req = self.comm.start_allreduce_sum(flat)
        self.pending.append((req, params, flat))

    def _finish(self) -> None:
        while self.launched < len(self.buckets):  # buckets some of whose params got no grad
            self._launch(self.launched)
            self.launched += 1
        self.comm.wait(
            [r for r, _, _ in self.pending if r is not None],
            "every data group's gradients (the data-parallel average after backward)",
        )
        for _req, params, flat in self.pending:
            off = 0
            for p in params:
                n = p.grad.numel()
                avg = (flat[off : off + n] / self.size).view(p.grad.shape)
                p.grad.copy_(avg.to(p.grad.device, p.grad.dtype))
                off += n
        self._reset()
