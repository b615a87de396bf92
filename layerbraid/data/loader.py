"""Batches that agree across a layer group: a DataLoader whose sampler every rank draws alike.

Note [who reads the batch]: in a layer-parallel forward the input is used on the first rank of
the layer group and the labels on the last (the loss's gradient enters the adjoint solve there).
Each rank must therefore be handed the same batch, and under data parallelism each data group its
own shard of the epoch.  A plain shuffled ``DataLoader`` draws a different order on every rank
and trains silently on mismatched inputs and labels.
"""

import itertools
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .._comm.world import is_comm, resolve, world
from .._engine.parts import LayerParallelPart
from ..grid import ProcessGrid
from ..launch import _enter
from ..options import check_int

__all__ = ["LayerParallelLoader", "GroupSampler"]


def _group_of(comm):
    """(world communicator, data_rank, data_size) for a ProcessGrid, a LayerParallelModule (or
    anything with a ``comm``), or an mpi4py communicator (one data group)."""
    if comm is None:
        return world(), 0, 1
    if isinstance(comm, LayerParallelPart):
        comm = comm._process_grid() or comm.comm
    if isinstance(comm, ProcessGrid):
        return comm.world, comm.data_rank, comm.data_size
    comm = resolve(comm)
    if not is_comm(comm):
        raise TypeError(
            f"comm must be an mpi4py communicator, a ProcessGrid or a layer-parallel "
            f"module, got {type(comm).__name__}"
        )
    return comm, 0, 1


def _agree_seed(world, seed):
    """One seed on every rank: rank 0 draws it when ``seed`` is None; a given seed must be the
    same everywhere (else every rank raises)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    if world.Get_size() == 1:
        return int(torch.empty((), dtype=torch.int64).random_().item()) if seed is None else seed
    seeds = world.allgather_obj(seed, "the loader's seed")
    if seed is None and all(s is None for s in seeds):
        drawn = (
            int(torch.empty((), dtype=torch.int64).random_().item())
            if world.Get_rank() == 0
            else None
        )
        return world.bcast_obj(drawn, 0, "the loader's drawn seed")
    if len(set(seeds)) != 1:
        raise ValueError(
            f"the ranks were given different loader seeds {seeds}: pass the same "
            "seed on every rank, or seed=None everywhere to draw one"
        )
    return seeds[0]


class GroupSampler(DistributedSampler):
    """``DistributedSampler`` across data groups: every rank of a layer group draws the same
    indices, and data group ``data_rank`` of ``data_size`` gets its shard of each epoch.

    Unlike ``DistributedSampler`` the epoch advances by itself each time an epoch's iteration
    starts (``set_epoch`` still sets it, e.g. on resume), so forgetting ``set_epoch`` does not
    repeat the first epoch's order.
    """

    def __init__(
        self,
        dataset: Dataset,
        data_rank: int = 0,
        data_size: int = 1,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=data_size,
            rank=data_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self._next_epoch = 0
        self.skip = 0  # samples of the next epoch already trained on (a resumed position)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.epoch = self._next_epoch
        self._next_epoch += 1
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class LayerParallelLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` that yields the same batches on every rank of a layer
    group and each data group its own shard (collective at construction: the ranks agree on the
    shuffling seed over MPI).

    Args:
        dataset: any map-style dataset (e.g. ``TensorDataset(x, y)``).
        batch_size: samples per batch of one data group (with ``ProcessGrid(data_parallel=D)``
            the global batch is ``D * batch_size``, as with DistributedDataParallel).
        comm: a ``ProcessGrid``, a layer-parallel module, or an mpi4py communicator (default
            ``COMM_WORLD``: one data group).
        shuffle: reshuffle every epoch (the same order on every rank of a layer group).
        seed: the shuffling seed; ``None`` draws one on rank 0 and shares it.
        drop_last: drop the tail that does not divide evenly over the data groups.
        **kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ``collate_fn``,
            ...); ``sampler``, ``batch_sampler`` and ``shuffle`` are this class's.

    Each ``iter(loader)`` starts the next epoch's order; ``loader.set_epoch(e)`` sets it.
    ``state_dict()`` is the position (the epoch and the batches of it handed out so far), which
    ``load_state_dict`` restores, so that a resumed run continues with the next batch
    (``layerbraid.checkpoint.resume`` does both around a checkpoint).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        *,
        comm: Any = None,
        shuffle: bool = True,
        seed: Optional[int] = None,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        for bad in ("sampler", "batch_sampler"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"LayerParallelLoader chooses its own sampler; got {bad}=")
        check_int("batch_size", batch_size)
        world, data_rank, data_size = _group_of(comm)
        _enter()
        seed = _agree_seed(world, seed)
        sampler = GroupSampler(
            dataset, data_rank, data_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs
        )
        self.seed = seed
        self._epoch, self._handed = 0, 0  # the epoch iterated, and its batches handed out

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next iteration yields."""
        sampler = self.sampler
        assert isinstance(sampler, GroupSampler)
        sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, GroupSampler)
        self._epoch, self._handed = sampler._next_epoch, sampler.skip // (self.batch_size or 1)
        for batch in super().__iter__():
            self._handed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "batches"}`` (of that epoch, handed out) and the seed."""
        return {"epoch": self._epoch, "batches": self._handed, "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues after :meth:`state_dict`'s position: the next iteration yields the rest of
        that epoch (or the next epoch where it was over).  The seed must be the one saved, else
        the order would differ (ValueError)."""
        if int(state["seed"]) != int(self.seed):
            raise ValueError(
                f"the position was saved with shuffling seed {state['seed']}; this loader has "
                f"seed {self.seed}: pass seed={state['seed']} to resume in the same order"
            )
        sampler = self.sampler
        assert isinstance(sampler, GroupSampler)
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):
            epoch, batches = epoch + 1, 0
        sampler.set_epoch(epoch)
        sampler.skip = batches * (self.batch_size or 1)
