"""Layer-parallel GRU and LSTM: the recurrence over sequence time is the ODE that MGRIT solves.

Each step is the cell update written as an ODE step, ``h <- h + theta(dt) * (cell(x_t, h) - h)``
with ``theta(1) = 1``: on the fine level (``dt = 1``) the step is exactly the cell (to round-off),
so one MGRIT level reproduces ``nn.GRU`` / ``nn.LSTM``.  A coarse step spans ``dt = m`` fine steps
and reads the input at its start.  ``coarse_rule="cell"`` (default) takes ``theta = 1``: one
cell update per coarse step, a GRU reading every m-th input, which is stable for any m.
``coarse_rule="euler"`` takes ``theta = dt``, forward Euler on ``h' = cell - h``, whose
amplification ``|1 - dt|`` exceeds 1 beyond ``dt = 2`` (coarse levels then diverge).  The sequence is split over the ranks of the communicator; every rank holds
the same weights (shared over time), and their gradients are summed over the ranks.

Note [rnn adjoint]: the loss depends on every output h_t, so the adjoint equation has a source:
``lambda_t = J_{t+1}^T lambda_{t+1} + dL/dh_t``.  The adjoint MGRIT step adds that source after
the VJP (coarse steps add the one at their end point, an approximation that convergence
removes).  VJPs reuse the graph of ``cell(x_t, h) - h`` kept from the forward's final relaxation
(as Note [Euler graphs] in _layer_steps.py).

The forward and adjoint solves are the engine's (``_chain.py``), shared with LayerParallelModule;
a GRU or an LSTM is only a step provider: a cell subclass of ``_CellSteps``.
"""
import torch
from torch import nn

from .._chain import Run, Steps, _Chain, _ChainFn, _Graph
from .._transport import allgather_rows, bcast_into, bcast_tensor
from ..launch import FreedOnExit, arrive
from ..options import MGRITOptions

__all__ = ["LayerParallelGRU", "LayerParallelLSTM"]


class _CellSteps(Steps):
    """One layer of a layer-parallel RNN on the engine: the step from point t reads input t and
    is ``h <- h + theta(dt) * (cell(x_t, h) - h)``.  Subclasses supply the cell, its parameters'
    reference module and how their state sits in the output sequence."""

    reference = None  # nn.GRU or nn.LSTM: the parameters' names and initialization

    def __init__(self, comm, bias, coarse_rule):
        self.comm, self.bias, self.coarse_rule = comm, bias, coarse_rule

    # ------------------------------------------------------------------ what a cell defines
    def cell_minus_h(self, x, s, params):
        """cell(x, h) - h on the state s."""
        raise NotImplementedError

    def initial_states(self, hx, state_shape, like):
        """The user's hx (None: zeros) as one tensor ``(num_layers, *state)``."""
        raise NotImplementedError

    def to_seq(self, s):
        """A state as it sits in the output sequence (identity unless the state is stacked)."""
        return s

    def from_seq(self, g):
        return g

    def hidden(self, states):
        """The next layer's input from a layer's sequence of states."""
        return states

    def result(self, out, finals):
        """forward's return value from the last layer's output and each layer's final state."""
        return out, torch.stack(finals)

    # ------------------------------------------------------------------ boundary
    def begin(self, run, inputs):
        x, h0, params = inputs[0], inputs[1], inputs[2:]
        run.x, run.h0, run.params = x.detach(), h0.detach(), params
        run.x_requires_grad = x.requires_grad

    def initial(self, run):
        return run.h0

    def output(self, run, states):
        # every rank gets the whole sequence of states (points 1..seq); the owned points are
        # one block per rank, in rank order (buffers, not pickles)
        seq = run.x.shape[1]
        mine = torch.stack([states[i].detach() for i in sorted(states) if i >= 1])
        rows = allgather_rows(self.comm, mine) if self.comm.Get_size() > 1 else mine
        return torch.stack([self.to_seq(rows[i]) for i in range(seq)], dim=1).to(run.x.device)

    def begin_adjoint(self, run, grad):
        run.g = grad.detach()

    def adjoint_initial(self, run):
        # adjoint point 0 is forward point seq: dL/dh_seq
        return self.from_seq(run.g[:, -1]).clone()

    def input_grads(self, run, states):
        comm = self.comm
        run.backward_log.append(run.backward_stats)
        # gradient for h0: the adjoint at forward point 0, on rank 0
        gh0 = states.get(run.x.shape[1]) if comm.Get_rank() == 0 else None
        if comm.Get_size() > 1:
            gh0 = bcast_tensor(comm, gh0, tuple(run.h0.shape), run.h0.dtype, run.h0.device, 0)
        gx = None
        if run.x_requires_grad:
            gx = torch.zeros_like(run.x)
            for key, g in run.grads.items():
                if isinstance(key, tuple):  # ("x", step): the input slice of an owned step
                    gx[:, key[1]] = g
        gp = [run.grads.get(id(p), torch.zeros_like(p)) if p.requires_grad else None
              for p in run.params]
        # shared weights: sum over the ranks; input slices: disjoint, so a sum assembles them
        flat = [t for t in gp if t is not None] + ([gx] if gx is not None else [])
        if comm.Get_size() > 1 and flat:
            flat = _allreduce_sum(comm, flat)
        it = iter(flat)
        gp = [next(it) if t is not None else None for t in gp]
        gx = next(it) if gx is not None else None
        return (gx, gh0, *gp)

    # ------------------------------------------------------------------ steps
    def scale(self, dt):
        return dt if self.coarse_rule == "euler" else 1.0

    def step(self, run, s, dt, level, index):
        return s + self.scale(dt) * self.cell_minus_h(run.x[:, index], s, run.params)

    def record(self, run, s, dt, index):
        sg = s.detach().requires_grad_(True)
        xg = run.x[:, index].detach().requires_grad_(run.x_requires_grad)
        with torch.enable_grad():
            f = self.cell_minus_h(xg, sg, run.params)
        leaves = [(("x", index), xg)] + [(id(p), p) for p in run.params]
        return s + self.scale(dt) * f.detach(), _Graph(sg, f, leaves, increment=True)

    def source(self, run, s):
        # dL/dh at forward point s, i.e. output s - 1 (Note [rnn adjoint])
        return self.from_seq(run.g[:, s - 1]) if s >= 1 else None


class _GRUSteps(_CellSteps):
    reference = nn.GRU

    def cell_minus_h(self, x, s, params):
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        return torch.gru_cell(x, s, params[0], params[1], b_ih, b_hh) - s

    def initial_states(self, hx, state_shape, like):
        if hx is None:
            return like.new_zeros(state_shape)
        if not isinstance(hx, torch.Tensor) or tuple(hx.shape) != state_shape:
            raise ValueError(f"LayerParallelGRU expects h0 of shape {state_shape}, got "
                             f"{tuple(getattr(hx, 'shape', ()))}")
        return hx


class _LSTMSteps(_CellSteps):
    """The state is (h, c) stacked: (2, batch, hidden); in the output sequence (batch, 2,
    hidden)."""

    reference = nn.LSTM

    def cell_minus_h(self, x, s, params):
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        h2, c2 = torch.lstm_cell(x, (s[0], s[1]), params[0], params[1], b_ih, b_hh)
        return torch.stack([h2, c2]) - s

    def initial_states(self, hx, state_shape, like):
        if hx is None:
            z = like.new_zeros(state_shape)
            hx = (z, z)
        if not isinstance(hx, tuple) or len(hx) != 2 or any(
                tuple(t.shape) != state_shape for t in hx):
            raise ValueError(f"LayerParallelLSTM expects hx = (h0, c0), each of shape "
                             f"{state_shape}")
        return torch.stack([hx[0], hx[1]], dim=1)  # (layers, 2, batch, hidden)

    def to_seq(self, s):
        return s.transpose(0, 1)

    def from_seq(self, g):
        return g.transpose(0, 1)

    def hidden(self, states):
        return states[:, :, 0]

    def result(self, out, finals):
        return out, (torch.stack([f[:, 0] for f in finals]),
                     torch.stack([f[:, 1] for f in finals]))


class _LayerParallelRNN(FreedOnExit, nn.Module):
    _cell = _CellSteps

    def __init__(self, input_size, hidden_size, num_layers=1, *, batch_first=True, bias=True,
                 comm=None, forward_options=None, backward_options=None, coarse_rule="cell",
                 target_error=None):
        super().__init__()
        from mpi4py import MPI

        from ..launch import _enter

        _enter()

        if coarse_rule not in ("cell", "euler"):
            raise ValueError(f"coarse_rule must be 'cell' or 'euler', got {coarse_rule!r}")
        self.coarse_rule = coarse_rule
        if not batch_first:
            raise ValueError("layer-parallel RNNs take batch_first=True inputs "
                             "(batch, seq, features)")
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = getattr(comm, "layer_comm", comm)
        from ..module import _check_target

        self.target_error = _check_target(target_error)
        self.forward_options = _fc(forward_options)
        self.backward_options = _fc(backward_options)
        ref = self._cell.reference(input_size, hidden_size, num_layers, bias=bias,
                                   batch_first=True)
        # The same parameter names as nn.GRU / nn.LSTM, so that state_dicts load either way.
        for name, p in ref.named_parameters():
            self.register_parameter(name, nn.Parameter(p.detach().clone()))
        self.bias = bias
        bcast_into(self.comm, self.parameters())  # every rank holds rank 0's weights
        self._steps = self._cell(self.comm, bias, coarse_rule)
        self._chains = {}
        self.forward_stats = []
        self.backward_stats = []

    def free(self):
        """Frees the communicators and MGRIT cores made for each sequence length (also done
        when the module is garbage collected, and at the end of a ``with`` block)."""
        for chain in self._chains.values():
            chain.free()
        self._chains.clear()

    def _counted_parameters(self):
        """Shared weights: their gradients are summed over the layer group, so every rank holds
        the same; the first rank counts them (for clip_grad_norm_)."""
        return list(self.parameters()) if self.comm.Get_rank() == 0 else []

    def _layer_params(self, k):
        names = [f"weight_ih_l{k}", f"weight_hh_l{k}"]
        if self.bias:
            names += [f"bias_ih_l{k}", f"bias_hh_l{k}"]
        return [getattr(self, n) for n in names]

    def _chain_for(self, seq):
        if seq not in self._chains:
            size = self.comm.Get_size()
            if seq < size:
                raise ValueError(f"the sequence has {seq} steps, fewer than the {size} ranks: "
                                 "every rank needs a time step")
            self._chains[seq] = _Chain(self.comm, seq, float(seq), self.forward_options,
                                       self.backward_options, target_error=self.target_error)
        return self._chains[seq]

    def forward(self, x, hx=None):
        """x: (batch, seq, input_size), the whole sequence, on every rank of the communicator.
        hx: initial state (num_layers, batch, hidden) (LSTM: a tuple (h0, c0)), or None.

        Returns (output, h_n) (LSTM: (output, (h_n, c_n))), the same on every rank; output is
        (batch, seq, hidden_size)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"{type(self).__name__} expects input of shape (batch, seq, "
                             f"{self.input_size}), got {tuple(getattr(x, 'shape', ()))}")
        batch, seq = x.shape[0], x.shape[1]
        h0_all = self._steps.initial_states(hx, (self.num_layers, batch, self.hidden_size), x)
        chain = self._chain_for(seq)
        arrive(self.comm, "the forward of a layer-parallel RNN")
        self.forward_stats, self.backward_stats = [], []
        inp = x
        finals = []
        for k in range(self.num_layers):
            params = self._layer_params(k)
            record = torch.is_grad_enabled() and any(
                t.requires_grad for t in [inp, h0_all] + params)
            run = Run(self._steps, h0_all[k].shape, h0_all.dtype, x.device, record)
            run.backward_log = self.backward_stats
            states = _ChainFn.apply(chain, run, None, inp, h0_all[k], *params)
            self.forward_stats.append(run.forward_stats)
            inp = self._steps.hidden(states)  # (batch, seq, hidden)
            finals.append(states[:, -1])
        return self._steps.result(inp, finals)


def _allreduce_sum(comm, tensors):
    """Sums a list of tensors over comm in one message."""
    from mpi4py import MPI

    flat = torch.cat([t.reshape(-1).to("cpu", torch.float64) for t in tensors]).numpy()
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    out, off = [], 0
    for t in tensors:
        out.append(torch.from_numpy(flat[off:off + t.numel()]).view(t.shape).to(t.device, t.dtype))
        off += t.numel()
    return out


def _fc(o):
    from dataclasses import replace

    if o is not None and not isinstance(o, MGRITOptions):
        raise TypeError(f"options must be an MGRITOptions, got {type(o).__name__}")
    return replace(o or MGRITOptions(max_levels=1), final_fc_relax=True)


class LayerParallelGRU(_LayerParallelRNN):
    """``nn.GRU`` (batch_first) solved in sequence time by MGRIT over the ranks of ``comm``.

    Args:
        input_size, hidden_size, num_layers, bias: as nn.GRU (the parameters have nn.GRU's names).
        comm: mpi4py communicator or ProcessGrid (its layer group) (default COMM_WORLD).
        forward_options, backward_options: MGRITOptions (default one level: exact).
        coarse_rule: "cell" (default) or "euler": the coarse-level step (module docstring).
        target_error: adaptive iterations, as for LayerParallelModule.
    """

    _cell = _GRUSteps


class LayerParallelLSTM(_LayerParallelRNN):
    """``nn.LSTM`` (batch_first) solved in sequence time by MGRIT; the state is (h, c) stacked.
    Same arguments as LayerParallelGRU; returns ``(output, (h_n, c_n))``."""

    _cell = _LSTMSteps
