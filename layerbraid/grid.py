"""ProcessGrid: data parallel x layer parallel, and gradient averaging across data groups."""

import warnings
from typing import Any, Optional

import torch

from ._comm.world import Comm, is_comm, resolve
from ._engine.parts import FreedOnExit
from .errors import ReplicaMismatchError
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

    Every ``check_replicas_every``-th backward of a model on the grid (Note [replica check]),
    the data groups compare fingerprints of their copies of each layer rank's parameters; where
    they differ (replicas updated differently: an optimizer's settings or state that differ
    between data groups), every rank raises :class:`layerbraid.errors.ReplicaMismatchError`
    naming the groups, the first differing parameter and the backward, or, with
    ``on_replica_mismatch="broadcast"``, data group 0's copies replace the others (a warning
    says so).  0 turns the check off.

    Attributes:
        world, layer_comm, data_comm: the communicators.
        layer_rank, layer_size: this rank's place in its layer group, and the group's size.
        data_rank, data_size: this rank's data group index (which shard it reads), and D.
    """

    def __init__(
        self,
        comm: Optional[Comm] = None,
        data_parallel: int = 1,
        *,
        check_replicas_every: int = 50,
        on_replica_mismatch: str = "raise",
    ) -> None:
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
        self.check_replicas_every = check_int("check_replicas_every", check_replicas_every, 0, None)
        if on_replica_mismatch not in ("raise", "broadcast"):
            raise ValueError(
                f"on_replica_mismatch must be 'raise' or 'broadcast', got {on_replica_mismatch!r}"
            )
        self.on_replica_mismatch = on_replica_mismatch
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
    replicas = Replicas(module, grid)
    return _GradAverager(module.parameters(), grid.data_comm, replicas)


# Note [replica check]: data parallelism keeps one copy of each layer rank's parameters per data
# group, equal only while every group applies the same update.  Nothing else notices when they
# do not (a learning rate computed from the rank, an optimizer state loaded on one group): the
# groups train on, apart.  So every K-th backward each rank fingerprints its parameters (two
# int64 checksums per tensor of its elements' bit patterns, a plain and a position-weighted
# sum: integer sums wrap the same in any order, so equal copies give equal checksums on any
# device, and a copy that differs in any element, or has two swapped, almost surely does not),
# the data group gathers them, and the whole grid learns in one reduction whether any group
# differs, so that every rank raises at the same backward or none does.
class Replicas:
    """The replica check of ``module``'s parameters over ``grid``'s data groups."""

    def __init__(self, module: "torch.nn.Module", grid: ProcessGrid) -> None:
        self.grid, self.every = grid, grid.check_replicas_every
        self.named = [(n, p) for n, p in module.named_parameters()]
        self.buffers = list(module.buffers())
        self.backwards = 0

    def after_backward(self) -> None:
        """Counts a backward; checks on every ``every``-th."""
        self.backwards += 1
        if self.every and self.backwards % self.every == 0:
            self.check(f"backward {self.backwards}")

    def check(self, when: str) -> None:
        """Compares the data groups' copies now (collective over the grid's world)."""
        grid = self.grid
        mine = fingerprints([p for _, p in self.named]).reshape(1, -1)
        rows = grid.data_comm.allgather_rows(mine, "every data group's parameter fingerprints")
        differ = [d for d in range(1, grid.data_size) if not torch.equal(rows[d], rows[0])]
        error: Optional[Exception] = None
        if differ:
            columns = (rows[differ[0]] != rows[0]).nonzero()
            name = self.named[int(columns[0, 0]) // 2][0] if len(columns) else "?"
            if grid.on_replica_mismatch == "broadcast":
                grid.data_comm.bcast_into([p for _, p in self.named] + self.buffers)
                warnings.warn(
                    f"data group(s) {differ} held copies of {name} (layer rank "
                    f"{grid.layer_rank}) other than data group 0's at {when}: replaced by "
                    "data group 0's (on_replica_mismatch='broadcast')",
                    stacklevel=2,
                )
            else:
                error = ReplicaMismatchError(
                    f"the data-parallel replicas differ: data group(s) {differ} hold a copy "
                    f"of {name} (layer rank {grid.layer_rank}) other than data group 0's at "
                    f"{when}; the replicas were updated differently (an optimizer whose "
                    "settings or state differ between data groups?).  ProcessGrid(..., "
                    "on_replica_mismatch='broadcast') copies data group 0's instead, "
                    "check_replicas_every=0 turns the check off",
                    differ,
                    name,
                    self.backwards,
                )
        grid.world.raise_on_every_rank(error, "the replica check")


def fingerprints(params: "list[torch.Tensor]") -> torch.Tensor:
    """Two int64 checksums per tensor of its elements' bit patterns (Note [replica check])."""
    sums = []
    for p in params:
        flat = p.detach().reshape(-1)
        bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        sums.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(sums)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _GradAverager:
    """Averages the gradients of ``params`` over ``comm`` at the end of every backward, in flat
    buckets; a bucket's allreduce starts (non-blocking) as soon as all its gradients are
    accumulated, so that it overlaps with the rest of the backward pass.

    Note [bucket order]: allreduces are started in bucket order on every rank, whatever order the
    hooks fire in, so the collectives match across the data group.
    """

    def __init__(
        self,
        params: Any,
        comm: Any,
        replicas: Optional[Replicas] = None,
        bucket_bytes: int = 8 << 20,
    ) -> None:
        self.comm, self.size = comm, comm.Get_size()
        self.replicas = replicas
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
        if self.replicas is not None:
            self.replicas.after_backward()
