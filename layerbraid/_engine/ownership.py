"""Who holds which step layer: seeding, the owned layers, and the copies coarse steps need.

Each step layer is built from its own seed, drawn once on every rank and combined with the
step's global index, so the same step gets the same initial weights whatever the number of
ranks.  A coarse forward step injects the fine layer at its start, which can belong to a rank
on the left: those layers are built here as frozen copies and refreshed from their owners once
per forward (a static plan made at construction, from the ranges every rank reports).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._comm.base import Transport
from ..errors import RemoteRankError

__all__ = []

Tensors = list[torch.Tensor]

_WEIGHT_TAG = 7301


def seeded_layer(
    factory: Callable[[int], nn.Module], index: int, base: int, device: Any = None
) -> nn.Module:
    """``factory(index)`` under the seed of step ``index`` (an nn.Module, else TypeError)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((base + 1000003 * index) % (2**63 - 1))
        layer = factory(index)
    if not isinstance(layer, nn.Module):
        raise TypeError(f"step_layer({index}) must return an nn.Module, got {type(layer).__name__}")
    return layer.to(device) if device is not None else layer


def draw_seed() -> int:
    """One draw from torch's generator: the base of every step's seed (the same draw on every
    rank when the ranks seed torch alike, as for any model)."""
    return int(torch.randint(0, 2**62, ()).item())


class _StepLayers:
    """Builds the owned layers into ``layers`` (a ModuleDict keyed by step index) and the
    copies of the layers the coarse steps inject (collective over ``comm``).

    Args:
        comm: the layer group's communicator.
        levels: ``[(first point, last point, stride)]`` per level of this rank's forward core.
        owned: the steps this rank owns.
        factory, base, device: see seeded_layer.
        layers: the ModuleDict to fill.
    Raises on every rank when building a layer failed on any rank.
    """

    def __init__(
        self,
        comm: Any,
        levels: Any,
        owned: Sequence[int],
        factory: Callable[[int], nn.Module],
        base: int,
        device: Any,
        layers: Any,
    ) -> None:
        self.comm, self.layers = comm, layers
        rank = comm.Get_rank()
        error = None
        try:
            for i in owned:
                layers[str(i)] = seeded_layer(factory, i, base, device)
        except Exception as exc:  # every rank learns of it in the allgather below
            error = exc
        needed = sorted(
            {(i - 1) * m for (lo, hi, m) in levels[1:] for i in range(max(lo, 1), hi + 1)}
            - set(owned)
        )
        report = None if error is None else f"{type(error).__name__}: {error}"
        mine = (owned[0], owned[-1]) if owned else None
        layout = None if error is not None else [_layout(layers[str(i)]) for i in owned]
        everyone = comm.allgather_obj(
            (needed, report, mine, layout), "the step layers' construction"
        )
        failed = [(r, msg) for r, (_, msg, _, _) in enumerate(everyone) if msg is not None]
        if failed:
            if error is not None:
                raise error
            r, msg = failed[0]
            raise RemoteRankError(f"building the step layers failed on rank {r}: {msg}", r)
        ranges = [rng for _, _, rng, _ in everyone]
        layouts = {
            i: lay
            for (_, _, rng, lays) in everyone
            if rng is not None
            for i, lay in zip(range(rng[0], rng[1] + 1), lays)
        }
        self.plan = _plan(rank, [(_owned_of(rng), idx) for idx, _, rng, _ in everyone])
        mismatch = self._build_copies(needed, ranges, layouts, factory, base, device)
        self._check_layouts(comm, mismatch)

    def _build_copies(
        self,
        needed: Sequence[int],
        ranges: Any,
        layouts: Any,
        factory: Callable[[int], nn.Module],
        base: int,
        device: Any,
    ) -> Any:
        """The copies of the layers this rank's coarse steps inject, and from which rank each
        is received; the first copy whose layout differs from its owner's layer (or None)."""
        self.copies = {}
        mismatch = None
        for i in needed:
            layer = seeded_layer(factory, i, base, device)
            for p in layer.parameters():
                p.requires_grad_(False)
            self.copies[i] = layer
            owner = next(
                r for r, rng in enumerate(ranges) if rng is not None and rng[0] <= i <= rng[1]
            )
            if mismatch is None and _layout(layer) != layouts[i]:
                mismatch = (i, owner, _layout(layer), layouts[i])
        return mismatch

    @staticmethod
    def _check_layouts(comm: Any, mismatch: Optional[str]) -> None:
        # The copies are filled with the owners' bytes: every copy must have its owner's
        # parameter and buffer layout, decided here, the same on every rank.
        bad = comm.allgather_obj(mismatch, "the step layers' layouts")
        wrong = [(r, m) for r, m in enumerate(bad) if m is not None]
        if wrong:
            r, (i, owner, here, there) = wrong[0]
            raise ValueError(
                f"step_layer({i}) built a different layer on rank {r} than on rank {owner}, "
                f"which owns step {i}: {_describe(here, there)}.  step_layer(index) must build "
                "the same parameters and buffers for a given index on every rank"
            )

    def layer(self, index: int) -> nn.Module:
        """The layer of step ``index``: the owned one, else the copy."""
        key = str(index)
        return self.layers[key] if key in self.layers else self.copies[index]

    def exchange(self) -> None:
        """Refreshes the copies from their owners (weights and buffers)."""
        if not self.plan.sends and not self.plan.recvs:
            return
        ref = next((p for m in self.layers.values() for p in m.parameters()), None)
        if ref is not None:  # follow model.to(...) / .double() on the owned layers
            for copy in self.copies.values():
                copy.to(device=ref.device, dtype=ref.dtype)
        got = fetch(
            self.comm,
            self.plan,
            lambda i: list(self.layers[str(i)].state_dict().values()),
            lambda i: list(self.copies[i].state_dict().values()),
            _WEIGHT_TAG,
            "the weights of the step layers that coarse steps copy",
        )
        with torch.no_grad():
            for i, values in got.items():
                for t, v in zip(self.copies[i].state_dict().values(), values):
                    t.copy_(v)


# ---------------------------------------------------------------- fetching steps from owners
@dataclass(frozen=True)
class FetchPlan:
    """Who sends which steps' tensors to whom: ``sends`` {rank: steps this rank sends it},
    ``recvs`` {rank: steps this rank receives from it}, in step order."""

    sends: Mapping[int, list[int]]
    recvs: Mapping[int, list[int]]


def _owned_of(rng: tuple[int, int]) -> list[int]:
    return [] if rng is None else list(range(rng[0], rng[1] + 1))


def _plan(rank: int, table: Sequence[tuple[Sequence[int], Sequence[int]]]) -> FetchPlan:
    """The plan from every rank's (owned steps, wanted steps), by rank."""
    owner = {i: r for r, (owned, _) in enumerate(table) for i in owned}
    mine = set(table[rank][0])
    sends = {
        r: sorted(i for i in set(wanted) if i in mine)
        for r, (_, wanted) in enumerate(table)
        if r != rank and any(i in mine for i in wanted)
    }
    recvs: dict[int, list[int]] = {}
    for i in sorted(set(table[rank][1]) - mine):
        recvs.setdefault(owner[i], []).append(i)
    return FetchPlan(sends, recvs)


def plan_fetch(
    comm: Transport, owned: Sequence[int], wanted: Sequence[int], what: str
) -> FetchPlan:
    """Collective: the plan by which every rank gets the steps it wants from their owners."""
    table = comm.allgather_obj((sorted(owned), sorted(set(wanted))), f"the steps of {what}")
    return _plan(comm.Get_rank(), table)


def fetch(
    comm: Transport,
    plan: FetchPlan,
    get: Callable[[int], Tensors],
    like: Callable[[int], Tensors],
    tag: int,
    what: str,
) -> dict[int, Tensors]:
    """Collective: sends ``get(i)`` for the steps the plan sends, and returns {step: tensors}
    for the steps it receives, shaped as ``like(i)`` and on its device.  One message per pair of
    ranks, on the transport's device (``Transport.exchange``: nothing through numpy)."""
    sends = {r: [t for i in idx for t in get(i)] for r, idx in plan.sends.items()}
    recvs = {r: [t for i in idx for t in like(i)] for r, idx in plan.recvs.items()}
    got = comm.exchange(sends, recvs, tag, what)
    out: dict[int, Tensors] = {}
    for r, idx in plan.recvs.items():
        values = iter(got[r])
        for i in idx:
            out[i] = [next(values).to(t.device) for t in like(i)]
    return out


def _layout(layer: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, shape, dtype)] of a layer's state: what its bytes mean."""
    return [(k, tuple(v.shape), str(v.dtype)) for k, v in layer.state_dict().items()]


def _describe(here: Any, there: Any) -> str:
    if [k for k, _, _ in here] != [k for k, _, _ in there]:
        return f"state names {[k for k, _, _ in here]} against {[k for k, _, _ in there]}"
    for (k, s1, d1), (_, s2, d2) in zip(here, there):
        if (s1, d1) != (s2, d2):
            return f"{k} has shape {s1} and dtype {d1} against shape {s2} and dtype {d2}"
    return "different layouts"
