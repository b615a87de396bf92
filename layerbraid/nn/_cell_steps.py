"""The step providers of layer-parallel RNNs on the engine (``_engine/chain.py``): a cell's
steps, their runs through the fused kernels, the adjoint with its output-gradient sources
(Note [rnn adjoint] in rnn.py), and the weights' gradients summed over the ranks."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from .._engine.steps import Run, State, Steps, _Graph
from ._cells import GRUMath, LSTMMath, _flat

__all__ = []


@dataclass
class _CellRun:
    """What a cell provider keeps per run (``run.own``)."""

    x: Optional[torch.Tensor] = None  # the layer's input (batch, seq, input), detached
    x_requires_grad: bool = False
    h0: Optional[torch.Tensor] = None
    params: list = field(default_factory=list)
    # fused: first step of a run of the final relaxation -> its steps' input states, where the
    # adjoint linearizes (n, *state)
    inputs: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)  # fused, exact mode: first step -> (steps,
    #                                              state leaf, input leaf, outputs)
    final_h: dict = field(default_factory=dict)  # first point of a run -> its h's from the
    #                                              final relaxation (batch, n, H)
    g: Optional[torch.Tensor] = None  # the output's gradient
    jac: Any = None  # Note [fused cells]: the linearized gates
    jac_lo: int = 0
    sp: Optional[torch.Tensor] = None  # the owned steps' input states (n, *state)
    xs: Optional[torch.Tensor] = None  # the owned steps' inputs (n, batch, input)
    dgi: Optional[torch.Tensor] = None  # the owned steps' gate gradients
    dgh: Optional[torch.Tensor] = None
    final_steps: set = field(default_factory=set)  # steps whose (dgi, dgh) the adjoint's final
    #                                               relaxation wrote
    block_gx: dict = field(default_factory=dict)  # first step of a block -> its input gradient


class _CellSteps(Steps):
    """One layer of a layer-parallel RNN on the engine: the step from point t reads input t and
    is ``h <- h + theta(dt) * (cell(x_t, h) - h)``.  Subclasses supply the cell, its parameters'
    reference module and how their state sits in the output sequence."""

    # nn.GRU or nn.LSTM: the parameters' names and initialization
    reference: ClassVar[type[torch.nn.RNNBase]]

    def __init__(self, comm: Any, bias: bool, coarse_rule: Any, fused: bool = True) -> None:
        self.comm, self.bias, self.coarse_rule = comm, bias, coarse_rule
        self.fused = bool(fused)

    # ------------------------------------------------------------------ what a cell defines
    def cell(
        self, x: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The cell's next state from the state s and the input x."""
        raise NotImplementedError

    def cell_minus_h(
        self, x: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        return self.cell(x, s, params) - s

    def initial_states(
        self, hx: Any, state_shape: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor:
        """The user's hx (None: zeros) as one tensor ``(num_layers, *state)``."""
        raise NotImplementedError

    def h_of(self, s: torch.Tensor) -> torch.Tensor:
        """The hidden part of a state (the state itself unless stacked)."""
        return s

    def last_rows(self, s: torch.Tensor) -> list[torch.Tensor]:
        """Rows the chain's output carries after the h's, from the last point's state (the
        LSTM's c_n)."""
        return []

    def as_state(self, g: torch.Tensor, p: int, seq: int) -> torch.Tensor:
        """The gradient of the state at point p from the output's gradient g (batch, rows,
        hidden), whose row p - 1 is h_p's."""
        return g[:, p - 1]

    def split(self, out: Any) -> tuple[torch.Tensor, Any]:
        """(the h sequence, the final state) of one layer from the chain's output."""
        return out, out[:, -1]

    def result(self, out: Any, finals: list[torch.Tensor]) -> Any:
        """forward's return value from the last layer's output and each layer's final state."""
        return out, torch.stack(finals)

    # Note [fused cells]: whether exact mode differentiates a rank's block on the CPU by torch's
    # backward of the kernel (its graph kept from the forward) instead of the closed-form VJPs.
    # On a GPU it always does: cuDNN's backward is one call, where the closed-form VJPs launch a
    # few kernels per step (on an H200, exact mode on 1 rank, float32, batch 64: a forward and
    # backward of a GRU with hidden size 32 over 28 steps took 4.6-4.8 ms with the VJP loop and
    # 2.1-2.2 ms by the kernel's backward, nn.GRU's 0.9-1.2 ms; hidden 256 over 128 steps:
    # 15.0-16.2, 6.2-6.7 and 4.5-5.4 ms)
    block_graphs = False

    def _block_graph(self, xs: torch.Tensor) -> bool:
        return self.block_graphs or xs.is_cuda

    def kernel(
        self, xs: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor], keep: bool
    ) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
        """Note [fused cells]: the states after the cell steps over xs (batch, n, input) from s,
        by torch's multi-step kernel, as a list of n states (without keep, only the last is
        needed and the others may be None), and the kernel's own outputs, the h sequence
        (batch, n, hidden) first."""
        raise NotImplementedError

    def cotangents(
        self, raw: Sequence[torch.Tensor], src: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The gradients of the kernel's outputs ``raw`` from the sources of the points inside
        its block (``src``, the output sequence's gradient there) and the adjoint w at its end."""
        raise NotImplementedError

    def linearize(
        self, xs: torch.Tensor, sp: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """The cell's Jacobian factors at the steps from states sp (n, *state) with inputs xs
        (n, batch, input), batched: what ``vjp`` reads."""
        raise NotImplementedError

    def vjp(
        self,
        jac: Any,
        k: int,
        w: torch.Tensor,
        params: Sequence[torch.Tensor],
        out: Any = None,
        src: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``J_k^T w`` at step k of ``jac``, plus ``src`` (the source's hidden part, added in the
        last product) when given; with ``out = (dgi, dgh)`` also the gradients of the gates'
        input and hidden pre-activations, written there."""
        raise NotImplementedError

    def gate_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where n steps' ``(dgi, dgh)`` go (batch, gates each)."""
        raise NotImplementedError

    def run_inputs(self, u: torch.Tensor, out: Any, raw: Sequence[torch.Tensor]) -> torch.Tensor:
        """The states the steps of a kernel run started from, (n, *state)."""
        return torch.stack([u] + out[:-1])

    def previous_h(self, sp: torch.Tensor) -> torch.Tensor:
        """The hidden states that multiply W_hh, from states sp (n, *state)."""
        return sp

    # ------------------------------------------------------------------ boundary
    def new_run_state(self) -> Any:
        return _CellRun()

    def begin(self, run: Run, inputs: Sequence[torch.Tensor]) -> None:
        x, h0, params = inputs[0], inputs[1], inputs[2:]
        own = run.own
        own.x, own.h0, own.params = x.detach(), h0.detach(), params
        own.inputs, own.blocks, own.final_h = {}, {}, {}
        own.x_requires_grad = x.requires_grad

    def initial(self, run: Run) -> State:
        return run.own.h0

    def output(self, run: Run, states: Any) -> torch.Tensor:
        # The h's at points 1..seq, taken in the final relaxation (the core keeps only what its
        # cycles read again), then what last_rows adds: (batch, rows, hidden) on every rank.
        # The owned points are one block per rank, in rank order (buffers, not pickles).
        seq = run.own.x.shape[1]
        mine = torch.cat([run.own.final_h[p] for p in sorted(run.own.final_h)], 1).transpose(0, 1)
        assert mine.shape[0] == len(run.owned), "the final relaxation missed an owned point"
        if seq in states:
            mine = torch.cat([mine] + [r.unsqueeze(0) for r in self.last_rows(states[seq])])
        rows = self.comm.allgather_rows(mine) if self.comm.Get_size() > 1 else mine
        return rows.to(run.own.x.device).transpose(0, 1)

    def begin_adjoint(self, run: Run, grad: torch.Tensor) -> None:
        own = run.own
        own.g, own.jac, own.final_steps, own.block_gx = grad.detach(), None, set(), {}

    def _linearize(self, run: Run) -> Any:
        """Note [fused cells]: the cell's gates at every owned step (once per backward),
        linearized where the forward's final relaxation took the step (a C-point's value before
        the C-sweep updated it), as a kept graph would be."""
        if run.own.jac is None:
            lo, hi = run.owned[0], run.owned[-1]
            run.own.jac_lo = lo
            run.own.sp = torch.cat([run.own.inputs[s] for s in sorted(run.own.inputs)])
            assert run.own.sp.shape[0] == len(run.owned), (
                "the final relaxation missed an owned step"
            )
            run.own.xs = run.own.x[:, lo : hi + 1].transpose(0, 1)
            run.own.jac = self.linearize(run.own.xs, run.own.sp, run.own.params)
            run.own.dgi, run.own.dgh = self.gate_buffers(len(run.owned), run.own.sp[0])
        return run.own.jac

    def adjoint_initial(self, run: Run) -> State:
        # adjoint point 0 is forward point seq: dL/dh_seq
        seq = run.own.x.shape[1]
        return self.as_state(run.own.g, seq, seq).clone()

    def input_grads(self, run: Run, states: Any) -> tuple[torch.Tensor | None, ...]:
        comm = self.comm
        # gradient for h0: the adjoint at forward point 0, on rank 0
        gh0 = states.get(run.own.x.shape[1]) if comm.Get_rank() == 0 else None
        if comm.Get_size() > 1:
            gh0 = comm.bcast_tensor(
                gh0, tuple(run.own.h0.shape), run.own.h0.dtype, run.own.h0.device, 0
            )
        if self.fused:
            gx, gp = self._fused_grads(run)
        else:
            gx = None
            if run.own.x_requires_grad:
                gx = torch.zeros_like(run.own.x)
                for key, g in run.grads.items():
                    if isinstance(key, tuple):  # ("x", step): the input slice of an owned step
                        gx[:, key[1]] = g
            gp = [run.grads.get(id(p), torch.zeros_like(p)) for p in run.own.params]
        gp = [g if p.requires_grad else None for p, g in zip(run.own.params, gp)]
        # shared weights: sum over the ranks; input slices: disjoint, so a sum assembles them
        flat = [t for t in gp if t is not None] + ([gx] if gx is not None else [])
        if comm.Get_size() > 1 and flat:
            flat = _allreduce_sum(comm, flat)
        it = iter(flat)
        gp = [next(it) if t is not None else None for t in gp]
        gx = next(it) if gx is not None else None
        return (gx, gh0, *gp)

    def _fused_grads(self, run: Run) -> Any:
        """The input's and the weights' gradients from the gates' gradients of every owned step
        (Note [fused cells]): batched products over the block."""
        steps = sorted(run.own.final_steps)
        blocks = sorted(run.own.blocks.items())
        covered = sorted(steps + [s for first, (n, *_) in blocks for s in range(first, first + n)])
        assert covered == list(run.owned), "the final relaxation did not run every owned step once"
        gp = [run.grads.get(id(p), torch.zeros_like(p)) for p in run.own.params]  # from blocks
        gx = torch.zeros_like(run.own.x) if run.own.x_requires_grad else None
        for first, g in run.own.block_gx.items():
            assert gx is not None  # blocks keep an input gradient only where x needs one
            gx[:, first : first + g.shape[1]] = g
        if steps:
            k = [s - run.own.jac_lo for s in steps]
            if len(k) == len(run.owned):  # (n, batch, gates) and the steps' inputs
                dgi, dgh, xs, hp = run.own.dgi, run.own.dgh, run.own.xs, self.previous_h(run.own.sp)
            else:
                dgi, dgh, xs, hp = (
                    run.own.dgi[k],
                    run.own.dgh[k],
                    run.own.xs[k],
                    self.previous_h(run.own.sp)[k],
                )
            gp[0] = gp[0] + _flat(dgi).t() @ _flat(xs)
            gp[1] = gp[1] + _flat(dgh).t() @ _flat(hp)
            if self.bias:
                gp[2], gp[3] = gp[2] + dgi.sum((0, 1)), gp[3] + dgh.sum((0, 1))
            if gx is not None:
                gx[:, steps] = (dgi @ run.own.params[0]).transpose(0, 1)
        if not run.retain:
            run.own.blocks, run.own.jac = {}, None
        return gx, gp

    # ------------------------------------------------------------------ steps
    def scale(self, dt: float) -> float:
        return dt if self.coarse_rule == "euler" else 1.0

    def step(self, run: Run, s: torch.Tensor, dt: float, level: int, index: int) -> State:
        theta = self.scale(dt)
        if theta == 1.0 and self.fused:  # the cell itself, as the kernel steps
            return self.cell(run.own.x[:, index], s, run.own.params)
        return s + theta * self.cell_minus_h(run.own.x[:, index], s, run.own.params)

    def step_interval(
        self,
        run: Run,
        u: State,
        dts: Sequence[float],
        level: int,
        index: int,
        stride: int,
        final: bool,
        keep: bool,
    ) -> list[State | None] | None:
        # Note [fused cells]: a run of cell steps (theta = 1) is the kernel over every
        # stride-th input
        if not self.fused or any(self.scale(dt) != 1.0 for dt in dts):
            return None
        xs = run.own.x[:, index : index + len(dts) * stride : stride]
        if final and run.record and run.adjoint_levels == 1 and self._block_graph(xs):
            return self._record_block(run, u, xs, index)
        linearize = final and run.record  # the adjoint linearizes at every step's input
        out, raw = self.kernel(xs, u, run.own.params, keep or linearize)
        if final:
            run.own.final_h[index + 1] = raw[0]
        if linearize:
            run.own.inputs[index] = self.run_inputs(u, out, raw)
        return out

    def _record_block(self, run: Run, u: torch.Tensor, xs: torch.Tensor, index: int) -> Any:
        """Exact mode (Note [fused cells]): the kernel's graph of a rank's block, which the
        one-level adjoint takes back in one piece (_block_vjp)."""
        ug = u.detach().requires_grad_(True)
        xg = xs.detach().requires_grad_(run.own.x_requires_grad)
        with torch.enable_grad():
            out, raw = self.kernel(xg, ug, run.own.params, False)
        run.own.blocks[index] = (len(out), ug, xg, raw)
        run.own.final_h[index + 1] = raw[0].detach()
        return [None] * (len(out) - 1) + [out[-1].detach()]

    def _block_vjp(self, run: Run, first: int, n: int, w: torch.Tensor) -> torch.Tensor:
        """The adjoint at the start of the block of ``n`` steps from ``first`` from the adjoint w
        at its end, by torch's backward of the kernel; the sources of the points inside enter as
        the cotangents of the kernel's outputs there."""
        _, ug, xg, raw = run.own.blocks[first]
        cot = self.cotangents(raw, run.own.g[:, first : first + n - 1], w)
        params = [p for p in run.own.params if p.requires_grad]
        leaves = [ug] + ([xg] if xg.requires_grad else []) + params
        grads = list(
            torch.autograd.grad(raw, leaves, cot, allow_unused=True, retain_graph=run.retain)
        )
        w0 = grads.pop(0)
        if xg.requires_grad:
            run.own.block_gx[first] = grads.pop(0)
        for p, g in zip(params, grads):
            if g is not None:
                run.grads[id(p)] = g if id(p) not in run.grads else run.grads[id(p)] + g
        w0 = torch.zeros_like(w) if w0 is None else w0
        src = self._source(run, first)
        return w0 if src is None else w0 + src

    def adjoint_step(
        self, run: Run, w: State, dt: float, level: int, s: int, final: bool
    ) -> State | None:
        # fused: the source is added here (``source`` is None for the engine), inside the VJP's
        # last product when the step is the cell itself
        if not self.fused:
            return None  # the VJP of the kept graph
        jac = self._linearize(run)
        k = s - run.own.jac_lo
        theta = self.scale(dt)
        src = run.own.g[:, s - 1] if s >= 1 and theta == 1.0 else None
        dh = self.vjp(
            jac, k, w, run.own.params, (run.own.dgi[k], run.own.dgh[k]) if final else None, src
        )
        if final:
            run.own.final_steps.add(s)
        if theta == 1.0:
            return dh
        dh = w + theta * (dh - w)
        src = self._source(run, s)
        return dh if src is None else dh + src

    def adjoint_interval(
        self,
        run: Run,
        w: State,
        dts: Sequence[float],
        level: int,
        ss: Sequence[int],
        final: bool,
        keep: bool,
    ) -> list[State | None] | None:
        if not self.fused:
            return None
        first, n = ss[-1], len(ss)
        if final and not keep and run.own.blocks.get(first, (0,))[0] == n:
            return [None] * (n - 1) + [self._block_vjp(run, first, n, w)]
        out: list[State | None] = []
        for k, (dt, s) in enumerate(zip(dts, ss)):
            got = self.adjoint_step(run, w, dt, level, s, final)  # its source included
            assert got is not None  # fused (checked above)
            w = got
            out.append(w if keep or k == len(ss) - 1 else None)
        return out

    def record(
        self, run: Run, s: torch.Tensor, dt: float, index: int
    ) -> tuple[State, _Graph | None]:
        graph = None
        if self.fused or not run.record:  # fused: the adjoint linearizes at the input kept here
            run.own.inputs[index] = s.unsqueeze(0)
            y = self.step(run, s, dt, 0, index)
        else:
            sg = s.detach().requires_grad_(True)
            xg = run.own.x[:, index].detach().requires_grad_(run.own.x_requires_grad)
            with torch.enable_grad():
                f = self.cell_minus_h(xg, sg, run.own.params)
            leaves = [(("x", index), xg)] + [(id(p), p) for p in run.own.params]
            y, graph = s + self.scale(dt) * f.detach(), _Graph(sg, f, leaves, increment=True)
        run.own.final_h[index + 1] = self.h_of(y).unsqueeze(1)
        return y, graph

    def source(self, run: Run, s: int) -> State | None:
        # the fused adjoint steps add it themselves
        return None if self.fused else self._source(run, s)

    def _source(self, run: Run, s: int) -> Optional[torch.Tensor]:
        # dL/dh at forward point s, i.e. output s - 1 (Note [rnn adjoint])
        return self.as_state(run.own.g, s, run.own.x.shape[1]) if s >= 1 else None


def _allreduce_sum(comm: Any, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Sums a list of tensors over comm in one message."""
    return comm.allreduce_sum(tensors, "the gradients of the weights shared over sequence time")


class _GRUSteps(GRUMath, _CellSteps):
    """The GRU's steps."""


class _LSTMSteps(LSTMMath, _CellSteps):
    """The LSTM's steps."""
