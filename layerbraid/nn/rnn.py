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
(as Note [Euler graphs] in module.py).
"""
import time

import torch
from torch import nn

from .._transport import allgather_rows, bcast_into, bcast_tensor
from ..launch import FreedOnExit, arrive
from ..stats import SolveStats

from ..options import MGRITOptions

__all__ = ["LayerParallelGRU", "LayerParallelLSTM"]


class _Run:
    pass


class _RNNLayerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rnn, k, x, h0, *params):
        run = rnn._forward_layer(k, x, h0, params)
        ctx.rnn, ctx.run, ctx.k = rnn, run, k
        return run.states

    @staticmethod
    def backward(ctx, grad_states):
        gx, gh0, gparams = ctx.rnn._backward_layer(ctx.k, ctx.run, grad_states)
        ctx.run = None
        return (None, None, gx, gh0, *gparams)


class _LayerParallelRNN(FreedOnExit, nn.Module):
    _gates = 0
    _lstm = False

    def __init__(self, input_size, hidden_size, num_layers=1, *, batch_first=True, bias=True,
                 comm=None, forward_options=None, backward_options=None, coarse_rule="cell"):
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
        self.forward_options = _fc(forward_options)
        self.backward_options = _fc(backward_options)
        ref = (nn.LSTM if self._lstm else nn.GRU)(input_size, hidden_size, num_layers,
                                                  bias=bias, batch_first=True)
        # The same parameter names as nn.GRU / nn.LSTM, so that state_dicts load either way.
        for name, p in ref.named_parameters():
            self.register_parameter(name, nn.Parameter(p.detach().clone()))
        self.bias = bias
        bcast_into(self.comm, self.parameters())  # every rank holds rank 0's weights
        self._cores = {}
        self.forward_stats = []
        self.backward_stats = []

    def free(self):
        """Frees the communicators and MGRIT cores made for each sequence length (also done
        when the module is garbage collected, and at the end of a ``with`` block)."""
        for fwd, bwd, _, _ in self._cores.values():
            fwd.close()
            bwd.close()
        self._cores.clear()

    def _counted_parameters(self):
        """Shared weights: their gradients are summed over the layer group, so every rank holds
        the same; the first rank counts them (for clip_grad_norm_)."""
        return list(self.parameters()) if self.comm.Get_rank() == 0 else []

    # ------------------------------------------------------------------ helpers
    def _to_seq(self, s):
        """A state as it sits in the output sequence: LSTM (2, batch, hidden) -> (batch, 2, hidden)."""
        return s.transpose(0, 1) if self._lstm else s

    def _from_seq(self, g):
        return g.transpose(0, 1) if self._lstm else g

    def _layer_params(self, k):
        names = [f"weight_ih_l{k}", f"weight_hh_l{k}"]
        if self.bias:
            names += [f"bias_ih_l{k}", f"bias_hh_l{k}"]
        return [getattr(self, n) for n in names]

    def _cell_minus_h(self, x, s, params):
        """cell(x, h) - h on the (stacked) state s."""
        w_ih, w_hh = params[0], params[1]
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        if self._lstm:
            h, c = s[0], s[1]
            h2, c2 = torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)
            return torch.stack([h2, c2]) - s
        return torch.gru_cell(x, s, w_ih, w_hh, b_ih, b_hh) - s

    def _cores_for(self, seq):
        if seq not in self._cores:
            from .._bridge import _Core

            comm = self.comm
            size, rank = comm.Get_size(), comm.Get_rank()
            if seq < size:
                raise ValueError(f"the sequence has {seq} steps, fewer than the {size} ranks: "
                                 "every rank needs a time step")
            rev = comm.Split(0, size - 1 - rank)
            fwd = _Core(comm, seq, 0.0, float(seq), self.forward_options,
                        init=self._fwd_init, step=self._fwd_step)
            bwd = _Core(rev, seq, 0.0, float(seq), self.backward_options,
                        init=self._bwd_init, step=self._bwd_step, mirror=True,
                        real_ranks=list(range(size))[::-1], owns_comm=True)
            fwd.setup()
            bwd.setup()
            lo, hi, _ = fwd.level_info()[0]
            owned = list(range(max(lo, 1) - 1, hi))
            strides = [m for (_, _, m) in bwd.level_info()]
            self._cores[seq] = (fwd, bwd, owned, strides)
        return self._cores[seq]

    # ------------------------------------------------------------------ forward
    def forward(self, x, hx=None):
        """x: (batch, seq, input_size), the whole sequence, on every rank of the communicator.
        hx: initial state (num_layers, batch, hidden) (LSTM: a tuple (h0, c0)), or None.

        Returns (output, h_n) (LSTM: (output, (h_n, c_n))), the same on every rank; output is
        (batch, seq, hidden_size)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"{type(self).__name__} expects input of shape (batch, seq, "
                             f"{self.input_size}), got {tuple(getattr(x, 'shape', ()))}")
        batch, seq = x.shape[0], x.shape[1]
        state_shape = (self.num_layers, batch, self.hidden_size)
        if hx is None:
            z = x.new_zeros(state_shape)
            hx = (z, z) if self._lstm else z
        if self._lstm:
            if not isinstance(hx, tuple) or len(hx) != 2 or any(
                    tuple(t.shape) != state_shape for t in hx):
                raise ValueError(f"LayerParallelLSTM expects hx = (h0, c0), each of shape "
                                 f"{state_shape}")
            h0_all = torch.stack([hx[0], hx[1]], dim=1)  # (layers, 2, batch, hidden)
        else:
            if tuple(hx.shape) != state_shape:
                raise ValueError(f"LayerParallelGRU expects h0 of shape {state_shape}, got "
                                 f"{tuple(hx.shape)}")
            h0_all = hx
        self._cores_for(seq)
        arrive(self.comm, "the forward of a layer-parallel RNN")
        self.forward_stats, self.backward_stats = [], []
        inp = x
        finals = []
        for k in range(self.num_layers):
            states = _RNNLayerFn.apply(self, k, inp, h0_all[k], *self._layer_params(k))
            inp = states[:, :, 0] if self._lstm else states  # (batch, seq, hidden)
            finals.append(states[:, -1])
        out = inp
        if self._lstm:
            return out, (torch.stack([f[:, 0] for f in finals]), torch.stack([f[:, 1] for f in finals]))
        return out, torch.stack(finals)

    def _forward_layer(self, k, x, h0, params):
        seq = x.shape[1]
        fwd, _, owned, _ = self._cores_for(seq)
        run = _Run()
        run.x, run.h0, run.params, run.graphs = x.detach(), h0.detach(), params, {}
        run.record = torch.is_grad_enabled() or any(p.requires_grad for p in params)
        run.x_requires_grad = x.requires_grad
        self._run = run
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                it, norms = fwd.solve()
            states = fwd.states()
        finally:
            self._run = None
        self.forward_stats.append(SolveStats(it, norms, time.perf_counter() - t0,
                                             fwd.step_seconds, fwd.comm_seconds()))
        # every rank gets the whole sequence of states (points 1..seq)
        # the owned points are one block per rank, in rank order (buffers, not pickles)
        mine = torch.stack([states[i].detach() for i in sorted(states) if i >= 1])
        rows = allgather_rows(self.comm, mine) if self.comm.Get_size() > 1 else mine
        seq_states = torch.stack([self._to_seq(rows[i]) for i in range(seq)], dim=1)
        run.states = seq_states.to(x.device)
        run.owned = owned
        return run

    def _fwd_init(self, t, index):
        run = self._run
        return run.h0 if index == 0 else torch.zeros_like(run.h0)

    def _fwd_step(self, s, t0, t1, level, index, done):
        run = self._run
        xs = run.x[:, index]
        if done and level == 0:
            sg = s.detach().requires_grad_(True)
            xg = xs.detach().requires_grad_(run.x_requires_grad)
            with torch.enable_grad():
                f = self._cell_minus_h(xg, sg, run.params)
            run.graphs[index] = (sg, xg, f)
            return s + self._theta(t1 - t0) * f.detach()
        return s + self._theta(t1 - t0) * self._cell_minus_h(xs, s, run.params)

    def _theta(self, dt):
        return dt if self.coarse_rule == "euler" else 1.0

    # ------------------------------------------------------------------ backward
    def _backward_layer(self, k, run, grad_states):
        seq = grad_states.shape[1]
        _, bwd, owned, strides = self._cores_for(seq)
        run.g = grad_states.detach()
        run.strides = strides
        run.gx = torch.zeros_like(run.x) if run.x_requires_grad else None
        run.gp = [torch.zeros_like(p) if p.requires_grad else None for p in run.params]
        self._run = run
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                it, norms = bwd.solve()
            states = bwd.states()
        finally:
            self._run = None
            run.graphs = {}
        self.backward_stats.append(SolveStats(it, norms, time.perf_counter() - t0,
                                              bwd.step_seconds, bwd.comm_seconds()))
        comm = self.comm
        # gradient for h0: the adjoint at forward point 0, on rank 0
        gh0 = states.get(seq) if comm.Get_rank() == 0 else None
        if comm.Get_size() > 1:
            gh0 = bcast_tensor(comm, gh0, tuple(run.h0.shape), run.h0.dtype, run.h0.device, 0)
        # shared weights: sum over the ranks; input slices: disjoint, so a sum assembles them
        flat = [t for t in run.gp if t is not None] + ([run.gx] if run.gx is not None else [])
        if comm.Get_size() > 1 and flat:
            flat = _allreduce_sum(comm, flat)
        it_flat = iter(flat)
        gp = [next(it_flat) if t is not None else None for t in run.gp]
        gx = next(it_flat) if run.gx is not None else None
        return gx, gh0, gp

    def _bwd_init(self, t, index):
        run = self._run
        # adjoint point 0 is forward point seq: dL/dh_seq
        return self._from_seq(run.g[:, -1]).clone() if index == 0 else torch.zeros_like(run.h0)

    def _bwd_step(self, w, t0, t1, level, index, done):
        run = self._run
        seq = run.g.shape[1]
        s = seq - index - run.strides[level]  # forward step (owned, Note [rnn adjoint])
        sg, xg, f = run.graphs[s]
        dtw = self._theta(t1 - t0) * w
        if level == 0 and done:
            wants = [sg] + ([xg] if xg.requires_grad else []) + \
                [p for p in run.params if p.requires_grad]
            grads = torch.autograd.grad(f, wants, dtw, allow_unused=True)
            gs = grads[0]
            rest = list(grads[1:])
            if xg.requires_grad:
                gxs = rest.pop(0)
                if gxs is not None:
                    run.gx[:, s] += gxs
            j = 0
            for t, p in zip(run.gp, run.params):
                if p.requires_grad:
                    if rest[j] is not None:
                        t += rest[j]
                    j += 1
        else:
            gs, = torch.autograd.grad(f, sg, dtw, retain_graph=True, allow_unused=True)
        out = w + gs if gs is not None else w.clone()
        if s >= 1:  # the source: dL/dh at forward point s, i.e. output s - 1
            out = out + self._from_seq(run.g[:, s - 1])
        return out


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
    """


class LayerParallelLSTM(_LayerParallelRNN):
    """``nn.LSTM`` (batch_first) solved in sequence time by MGRIT; the state is (h, c) stacked.
    Same arguments as LayerParallelGRU; returns ``(output, (h_n, c_n))``."""

    _lstm = True
