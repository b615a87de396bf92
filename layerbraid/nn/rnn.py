"""Layer-parallel GRU and LSTM: the recurrence over sequence time is the ODE that MGRIT solves.

Each step is the cell update written as an ODE step, ``h <- h + theta(dt) * (cell(x_t, h) - h)``
with ``theta(1) = 1``: on the fine level (``dt = 1``) the step is exactly the cell (to round-off),
so one MGRIT level reproduces ``nn.GRU`` / ``nn.LSTM``.  A coarse step spans ``dt = m`` fine steps
and reads the input at its start.  ``coarse_rule="cell"`` (default) takes ``theta = 1``: one
cell update per coarse step, a GRU reading every m-th input, which is stable for any m.
``coarse_rule="euler"`` takes ``theta = dt``, forward Euler on ``h' = cell - h``, whose
amplification ``|1 - dt|`` exceeds 1 beyond ``dt = 2`` (coarse levels then diverge).  The
sequence is split over the ranks of the communicator; every rank holds the same weights (shared
over time), and their gradients are summed over the ranks.

Note [rnn adjoint]: the loss depends on every output h_t, so the adjoint equation has a source:
``lambda_t = J_{t+1}^T lambda_{t+1} + dL/dh_t``.  The adjoint MGRIT step adds that source after
the VJP (coarse steps add the one at their end point, an approximation that convergence
removes).  A coarse adjoint step over forward step s linearizes the cell at the fine state h_s.

Note [fused cells]: with ``fused=True`` (the default) a run of steps between two C-points (the
core's step_interval, Note [fused intervals] in cbridge/src/relax.c), and in exact mode a rank's
whole block, goes through torch's own multi-step kernel (``torch._VF.gru`` / ``lstm``, what
nn.GRU / nn.LSTM call), and the adjoint keeps no autograd graph per step: once the forward is
solved, the cell's gates at every owned step come from two batched matrix products over the
block, at the states where the final relaxation took each step (a C-point's value before the
C-sweep updated it, as a kept graph would hold), and each adjoint step is the cell's closed-form
VJP (a few elementwise products and one product with W_hh), with the weights' and inputs'
gradients formed at the end by batched products over the block (as cuDNN's backward does).  In
exact mode the LSTM instead keeps the kernel's graph of each rank's block and runs torch's own
backward on it, one oneDNN call on CPU, faster there than the closed-form loop (the GRU's is
not).  The fused LSTM kernel returns only the h's: where the core keeps the states inside a run
(or the adjoint linearizes at them), the c's come from the same batched gates
(``c_t = f_t c_{t-1} + i_t g_t``).  The chain's output is the h's (taken in the final
relaxation, so the forward core keeps only what its cycles read again) and, for the LSTM, c_n
as one more row.  ``fused=False`` takes one cell call and one autograd VJP of a kept graph per
step (as Note [Euler graphs] in _layer_steps.py): the reference the fused path is tested equal
to.

The forward and adjoint solves are the engine's (``_chain.py``), shared with LayerParallelModule;
a GRU or an LSTM is only a step provider: a cell subclass of ``_CellSteps``.
"""
import torch
from torch import nn

from .._chain import Run, Steps, _Chain, _ChainFn, _Graph, _check_target, _gradient_estimate
from .._parts import FreedOnExit
from .._comm import allgather_obj, check_same_settings, world
from .._transport import allgather_rows, allreduce_sum, bcast_into, bcast_tensor
from ..launch import _enter
from ..options import MGRITOptions, check_int

__all__ = ["LayerParallelGRU", "LayerParallelLSTM"]


class _CellSteps(Steps):
    """One layer of a layer-parallel RNN on the engine: the step from point t reads input t and
    is ``h <- h + theta(dt) * (cell(x_t, h) - h)``.  Subclasses supply the cell, its parameters'
    reference module and how their state sits in the output sequence."""

    reference = None  # nn.GRU or nn.LSTM: the parameters' names and initialization

    def __init__(self, comm, bias, coarse_rule, fused=True):
        self.comm, self.bias, self.coarse_rule = comm, bias, coarse_rule
        self.fused = bool(fused)

    # ------------------------------------------------------------------ what a cell defines
    def cell(self, x, s, params):
        """The cell's next state from the state s and the input x."""
        raise NotImplementedError

    def cell_minus_h(self, x, s, params):
        return self.cell(x, s, params) - s

    def initial_states(self, hx, state_shape, like):
        """The user's hx (None: zeros) as one tensor ``(num_layers, *state)``."""
        raise NotImplementedError

    def h_of(self, s):
        """The hidden part of a state (the state itself unless stacked)."""
        return s

    def last_rows(self, s):
        """Rows the chain's output carries after the h's, from the last point's state (the
        LSTM's c_n)."""
        return []

    def as_state(self, g, p, seq):
        """The gradient of the state at point p from the output's gradient g (batch, rows,
        hidden), whose row p - 1 is h_p's."""
        return g[:, p - 1]

    def split(self, out):
        """(the h sequence, the final state) of one layer from the chain's output."""
        return out, out[:, -1]

    def result(self, out, finals):
        """forward's return value from the last layer's output and each layer's final state."""
        return out, torch.stack(finals)

    # Note [fused cells]: whether exact mode differentiates a rank's block by torch's backward
    # of the kernel (its graph kept from the forward) instead of the closed-form VJPs
    block_graphs = False

    def kernel(self, xs, s, params, keep):
        """Note [fused cells]: the states after the cell steps over xs (batch, n, input) from s,
        by torch's multi-step kernel, as a list of n states (without keep, only the last is
        needed and the others may be None), and the kernel's own outputs, the h sequence
        (batch, n, hidden) first."""
        raise NotImplementedError

    def cotangents(self, raw, src, w):
        """The gradients of the kernel's outputs ``raw`` from the sources of the points inside
        its block (``src``, the output sequence's gradient there) and the adjoint w at its end."""
        raise NotImplementedError

    def linearize(self, xs, sp, params):
        """The cell's Jacobian factors at the steps from states sp (n, *state) with inputs xs
        (n, batch, input), batched: what ``vjp`` reads."""
        raise NotImplementedError

    def vjp(self, jac, k, w, params, out=None, src=None):
        """``J_k^T w`` at step k of ``jac``, plus ``src`` (the source's hidden part, added in the
        last product) when given; with ``out = (dgi, dgh)`` also the gradients of the gates'
        input and hidden pre-activations, written there."""
        raise NotImplementedError

    def gate_buffers(self, n, like):
        """Where n steps' ``(dgi, dgh)`` go (batch, gates each)."""
        raise NotImplementedError

    def run_inputs(self, u, out, raw):
        """The states the steps of a kernel run started from, (n, *state)."""
        return torch.stack([u] + out[:-1])

    def previous_h(self, sp):
        """The hidden states that multiply W_hh, from states sp (n, *state)."""
        return sp

    # ------------------------------------------------------------------ boundary
    def begin(self, run, inputs):
        x, h0, params = inputs[0], inputs[1], inputs[2:]
        run.x, run.h0, run.params = x.detach(), h0.detach(), params
        # fused: first step of a run of the final relaxation -> its steps' input states, where
        # the adjoint linearizes (n, *state)
        run.inputs = {}
        run.blocks = {}  # fused, exact mode: first step -> (steps, state leaf, input leaf, outputs)
        run.final_h = {}  # first point of a run -> its h's from the final relaxation (batch, n, H)
        run.x_requires_grad = x.requires_grad

    def initial(self, run):
        return run.h0

    def output(self, run, states):
        # The h's at points 1..seq, taken in the final relaxation (the core keeps only what its
        # cycles read again), then what last_rows adds: (batch, rows, hidden) on every rank.
        # The owned points are one block per rank, in rank order (buffers, not pickles).
        seq = run.x.shape[1]
        mine = torch.cat([run.final_h[p] for p in sorted(run.final_h)], 1).transpose(0, 1)
        assert mine.shape[0] == len(run.owned), "the final relaxation missed an owned point"
        if seq in states:
            mine = torch.cat([mine] + [r.unsqueeze(0) for r in self.last_rows(states[seq])])
        rows = allgather_rows(self.comm, mine) if self.comm.Get_size() > 1 else mine
        return rows.to(run.x.device).transpose(0, 1)

    def begin_adjoint(self, run, grad):
        run.g = grad.detach()
        run.jac = None
        run.final_steps = set()  # steps whose (dgi, dgh) the adjoint's final relaxation wrote
        run.block_gx = {}  # first step of a block -> the input gradient of its steps

    def _linearize(self, run):
        """Note [fused cells]: the cell's gates at every owned step (once per backward),
        linearized where the forward's final relaxation took the step (a C-point's value before
        the C-sweep updated it), as a kept graph would be."""
        if run.jac is None:
            lo, hi = run.owned[0], run.owned[-1]
            run.jac_lo = lo
            run.sp = torch.cat([run.inputs[s] for s in sorted(run.inputs)])
            assert run.sp.shape[0] == len(run.owned), "the final relaxation missed an owned step"
            run.xs = run.x[:, lo:hi + 1].transpose(0, 1)
            run.jac = self.linearize(run.xs, run.sp, run.params)
            run.dgi, run.dgh = self.gate_buffers(len(run.owned), run.sp[0])
        return run.jac

    def adjoint_initial(self, run):
        # adjoint point 0 is forward point seq: dL/dh_seq
        seq = run.x.shape[1]
        return self.as_state(run.g, seq, seq).clone()

    def input_grads(self, run, states):
        comm = self.comm
        run.backward_log.append(run.backward_stats)
        # gradient for h0: the adjoint at forward point 0, on rank 0
        gh0 = states.get(run.x.shape[1]) if comm.Get_rank() == 0 else None
        if comm.Get_size() > 1:
            gh0 = bcast_tensor(comm, gh0, tuple(run.h0.shape), run.h0.dtype, run.h0.device, 0)
        if self.fused:
            gx, gp = self._fused_grads(run)
        else:
            gx = None
            if run.x_requires_grad:
                gx = torch.zeros_like(run.x)
                for key, g in run.grads.items():
                    if isinstance(key, tuple):  # ("x", step): the input slice of an owned step
                        gx[:, key[1]] = g
            gp = [run.grads.get(id(p), torch.zeros_like(p)) for p in run.params]
        gp = [g if p.requires_grad else None for p, g in zip(run.params, gp)]
        # shared weights: sum over the ranks; input slices: disjoint, so a sum assembles them
        flat = [t for t in gp if t is not None] + ([gx] if gx is not None else [])
        if comm.Get_size() > 1 and flat:
            flat = _allreduce_sum(comm, flat)
        it = iter(flat)
        gp = [next(it) if t is not None else None for t in gp]
        gx = next(it) if gx is not None else None
        return (gx, gh0, *gp)

    def _fused_grads(self, run):
        """The input's and the weights' gradients from the gates' gradients of every owned step
        (Note [fused cells]): batched products over the block."""
        steps = sorted(run.final_steps)
        blocks = sorted(run.blocks.items())
        covered = sorted(steps + [s for first, (n, *_) in blocks for s in range(first, first + n)])
        assert covered == list(run.owned), "the final relaxation did not run every owned step once"
        gp = [run.grads.get(id(p), torch.zeros_like(p)) for p in run.params]  # from blocks
        gx = torch.zeros_like(run.x) if run.x_requires_grad else None
        for first, g in run.block_gx.items():
            gx[:, first:first + g.shape[1]] = g
        if steps:
            k = [s - run.jac_lo for s in steps]
            if len(k) == len(run.owned):  # (n, batch, gates) and the steps' inputs
                dgi, dgh, xs, hp = run.dgi, run.dgh, run.xs, self.previous_h(run.sp)
            else:
                dgi, dgh, xs, hp = run.dgi[k], run.dgh[k], run.xs[k], self.previous_h(run.sp)[k]
            gp[0] = gp[0] + _flat(dgi).t() @ _flat(xs)
            gp[1] = gp[1] + _flat(dgh).t() @ _flat(hp)
            if self.bias:
                gp[2], gp[3] = gp[2] + dgi.sum((0, 1)), gp[3] + dgh.sum((0, 1))
            if gx is not None:
                gx[:, steps] = (dgi @ run.params[0]).transpose(0, 1)
        if not run.retain:
            run.blocks, run.jac = {}, None
        return gx, gp

    # ------------------------------------------------------------------ steps
    def scale(self, dt):
        return dt if self.coarse_rule == "euler" else 1.0

    def step(self, run, s, dt, level, index):
        theta = self.scale(dt)
        if theta == 1.0 and self.fused:  # the cell itself, as the kernel steps
            return self.cell(run.x[:, index], s, run.params)
        return s + theta * self.cell_minus_h(run.x[:, index], s, run.params)

    def step_interval(self, run, u, dts, level, index, stride, final, keep):
        # Note [fused cells]: a run of cell steps (theta = 1) is the kernel over every
        # stride-th input
        if not self.fused or any(self.scale(dt) != 1.0 for dt in dts):
            return None
        xs = run.x[:, index:index + len(dts) * stride:stride]
        if final and run.record and self.block_graphs and run.adjoint_levels == 1:
            return self._record_block(run, u, xs, index)
        linearize = final and run.record  # the adjoint linearizes at every step's input
        out, raw = self.kernel(xs, u, run.params, keep or linearize)
        if final:
            run.final_h[index + 1] = raw[0]
        if linearize:
            run.inputs[index] = self.run_inputs(u, out, raw)
        return out

    def _record_block(self, run, u, xs, index):
        """Exact mode (Note [fused cells]): the kernel's graph of a rank's block, which the
        one-level adjoint takes back in one piece (_block_vjp)."""
        ug = u.detach().requires_grad_(True)
        xg = xs.detach().requires_grad_(run.x_requires_grad)
        with torch.enable_grad():
            out, raw = self.kernel(xg, ug, run.params, False)
        run.blocks[index] = (len(out), ug, xg, raw)
        run.final_h[index + 1] = raw[0].detach()
        return [None] * (len(out) - 1) + [out[-1].detach()]

    def _block_vjp(self, run, first, n, w):
        """The adjoint at the start of the block of ``n`` steps from ``first`` from the adjoint w
        at its end, by torch's backward of the kernel; the sources of the points inside enter as
        the cotangents of the kernel's outputs there."""
        _, ug, xg, raw = run.blocks[first]
        cot = self.cotangents(raw, run.g[:, first:first + n - 1], w)
        params = [p for p in run.params if p.requires_grad]
        leaves = [ug] + ([xg] if xg.requires_grad else []) + params
        grads = list(torch.autograd.grad(raw, leaves, cot, allow_unused=True,
                                         retain_graph=run.retain))
        w0 = grads.pop(0)
        if xg.requires_grad:
            run.block_gx[first] = grads.pop(0)
        for p, g in zip(params, grads):
            if g is not None:
                run.grads[id(p)] = g if id(p) not in run.grads else run.grads[id(p)] + g
        w0 = torch.zeros_like(w) if w0 is None else w0
        src = self._source(run, first)
        return w0 if src is None else w0 + src

    def adjoint_step(self, run, w, dt, level, s, final):
        # fused: the source is added here (``source`` is None for the engine), inside the VJP's
        # last product when the step is the cell itself
        if not self.fused:
            return None  # the VJP of the kept graph
        jac = self._linearize(run)
        k = s - run.jac_lo
        theta = self.scale(dt)
        src = run.g[:, s - 1] if s >= 1 and theta == 1.0 else None
        dh = self.vjp(jac, k, w, run.params, (run.dgi[k], run.dgh[k]) if final else None, src)
        if final:
            run.final_steps.add(s)
        if theta == 1.0:
            return dh
        dh = w + theta * (dh - w)
        src = self._source(run, s)
        return dh if src is None else dh + src

    def adjoint_interval(self, run, w, dts, level, ss, final, keep):
        if not self.fused:
            return None
        first, n = ss[-1], len(ss)
        if final and not keep and run.blocks.get(first, (0,))[0] == n:
            return [None] * (n - 1) + [self._block_vjp(run, first, n, w)]
        out = []
        for k, (dt, s) in enumerate(zip(dts, ss)):
            w = self.adjoint_step(run, w, dt, level, s, final)  # its source included
            out.append(w if keep or k == len(ss) - 1 else None)
        return out

    def record(self, run, s, dt, index):
        graph = None
        if self.fused or not run.record:  # fused: the adjoint linearizes at the input kept here
            run.inputs[index] = s.unsqueeze(0)
            y = self.step(run, s, dt, 0, index)
        else:
            sg = s.detach().requires_grad_(True)
            xg = run.x[:, index].detach().requires_grad_(run.x_requires_grad)
            with torch.enable_grad():
                f = self.cell_minus_h(xg, sg, run.params)
            leaves = [(("x", index), xg)] + [(id(p), p) for p in run.params]
            y, graph = s + self.scale(dt) * f.detach(), _Graph(sg, f, leaves, increment=True)
        run.final_h[index + 1] = self.h_of(y).unsqueeze(1)
        return y, graph

    def source(self, run, s):
        # the fused adjoint steps add it themselves
        return None if self.fused else self._source(run, s)

    def _source(self, run, s):
        # dL/dh at forward point s, i.e. output s - 1 (Note [rnn adjoint])
        return self.as_state(run.g, s, run.x.shape[1]) if s >= 1 else None


class _GRUSteps(_CellSteps):
    reference = nn.GRU

    def cell(self, x, s, params):
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        return torch.gru_cell(x, s, params[0], params[1], b_ih, b_hh)

    def kernel(self, xs, s, params, keep):
        out, _ = torch._VF.gru(xs.contiguous(), s.unsqueeze(0), list(params), self.bias, 1, 0.0,
                               False, False, True)
        return list(out.unbind(1)), (out,)

    def cotangents(self, raw, src, w):
        return (torch.cat([src, w.unsqueeze(1)], 1),)

    def linearize(self, xs, sp, params):
        # h' = (1 - z) n + z h with r, z = sigmoid(gi_rz + gh_rz), n = tanh(gi_n + r gh_n)
        gi, gh = _gates(xs, sp, params, self.bias)
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = gh.chunk(3, -1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        d_n = (1 - z) * (1 - n * n)
        d_z = (sp - n) * z * (1 - z)
        d_r = d_n * h_n * r * (1 - r)
        # (n, batch, 3, hidden): the factors of the r, z, n pre-activations' gradients
        return z, torch.stack([d_r, d_z, d_n], -2), torch.stack([d_r, d_z, d_n * r], -2)

    def vjp(self, jac, k, w, params, out=None, src=None):
        z, f_gi, f_gh = jac
        w3 = w.unsqueeze(-2)
        if out is None:
            dgh = (w3 * f_gh[k]).flatten(-2)
        else:
            torch.mul(w3, f_gi[k], out=out[0].view(f_gi[k].shape))
            dgh = torch.mul(w3, f_gh[k], out=out[1].view(f_gh[k].shape)).flatten(-2)
        return torch.addmm(w * z[k] if src is None else torch.addcmul(src, w, z[k]), dgh,
                           params[1])

    def gate_buffers(self, n, like):
        shape = (n, like.shape[0], 3 * like.shape[-1])
        return like.new_empty(shape), like.new_empty(shape)

    def run_inputs(self, u, out, raw):
        return torch.cat([u.unsqueeze(0), raw[0].transpose(0, 1)[:-1]])

    def initial_states(self, hx, state_shape, like):
        if hx is None:
            return like.new_zeros(state_shape)
        if not isinstance(hx, torch.Tensor) or tuple(hx.shape) != state_shape:
            raise ValueError(f"LayerParallelGRU expects h0 of shape {state_shape}, got "
                             f"{tuple(getattr(hx, 'shape', ()))}")
        return hx


class _LSTMSteps(_CellSteps):
    """The state is (h, c) stacked: (2, batch, hidden).  The chain's output is the h sequence
    and then c_n: (batch, seq + 1, hidden); the c's inside the sequence reach no loss."""

    reference = nn.LSTM
    # torch's LSTM backward on CPU is one oneDNN call, faster than the closed-form VJPs' Python
    # loop; its GRU backward is not, so the GRU keeps the closed-form VJPs (bench/bench_rnn.py
    # times both paths)
    block_graphs = True

    def cell(self, x, s, params):
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        return torch.stack(torch.lstm_cell(x, (s[0], s[1]), params[0], params[1], b_ih, b_hh))

    def kernel(self, xs, s, params, keep):
        n = xs.shape[1]
        if keep and n <= _SHORT_RUN:
            # each state's c is wanted: the cells return it, the kernel does not (and, for so
            # few steps, costs about as much as the cells)
            states = []
            for k in range(n):
                s = self.cell(xs[:, k], s, params)
                states.append(s)
            return states, (torch.stack([t[0] for t in states], 1), s[0:1], s[1:2])
        out, h_n, c_n = torch._VF.lstm(xs.contiguous(), (s[0:1], s[1:2]), list(params),
                                       self.bias, 1, 0.0, False, False, True)
        states = [] if keep else [None] * (n - 1)
        if keep and n > 1:
            # the kernel returns the h's only: the c's from the same gates (Note [fused cells])
            with torch.no_grad():
                hs = out.detach().transpose(0, 1)  # (n, batch, hidden)
                hp = torch.cat([s[0:1].detach(), hs[:n - 2]])
                i, f, g, _ = _lstm_activations(*_gates(xs[:, :n - 1].detach().transpose(0, 1),
                                                       hp, params, self.bias))
                c = s[1].detach()
                for k in range(n - 1):
                    c = torch.addcmul(i[k] * g[k], f[k], c)
                    states.append(torch.stack([hs[k], c]))
        states.append(torch.stack([h_n[0], c_n[0]]))
        return states, (out, h_n, c_n)

    def cotangents(self, raw, src, w):
        # the sequence's c's reach the loss only at its end (h_n, c_n): inside, h's only
        out = raw[0]
        return (torch.cat([src, torch.zeros_like(out[:, :1])], 1), w[0:1], w[1:2])

    def linearize(self, xs, sp, params):
        # c' = f c + i g, h' = o tanh(c')
        i, f, g, o = _lstm_activations(*_gates(xs, sp[:, 0], params, self.bias))
        c = sp[:, 1]
        tc = torch.tanh(f * c + i * g)
        return (o * (1 - tc * tc), f,
                torch.cat([g * i * (1 - i), c * f * (1 - f), i * (1 - g * g), tc * o * (1 - o)],
                          -1))

    def vjp(self, jac, k, w, params, out=None, src=None):
        d_c, f, f_gates = jac
        wh, wc = w[0], w[1]
        dct = torch.addcmul(wc, wh, d_c[k])
        dg = torch.mul(torch.cat([dct, dct, dct, wh], -1), f_gates[k],
                       out=None if out is None else out[0])
        return torch.stack([dg @ params[1] if src is None else torch.addmm(src, dg, params[1]),
                            dct * f[k]])

    def gate_buffers(self, n, like):
        dg = like.new_empty((n, like.shape[-2], 4 * like.shape[-1]))
        return dg, dg  # the input and hidden pre-activations' gradients are the same

    def previous_h(self, sp):
        return sp[:, 0]

    def initial_states(self, hx, state_shape, like):
        if hx is None:
            z = like.new_zeros(state_shape)
            hx = (z, z)
        if not isinstance(hx, tuple) or len(hx) != 2 or any(
                tuple(t.shape) != state_shape for t in hx):
            raise ValueError(f"LayerParallelLSTM expects hx = (h0, c0), each of shape "
                             f"{state_shape}")
        return torch.stack([hx[0], hx[1]], dim=1)  # (layers, 2, batch, hidden)

    def h_of(self, s):
        return s[0]

    def last_rows(self, s):
        return [s[1]]

    def as_state(self, g, p, seq):
        return torch.stack([g[:, p - 1], g[:, seq] if p == seq else torch.zeros_like(g[:, 0])])

    def split(self, out):
        return out[:, :-1], (out[:, -2], out[:, -1])

    def result(self, out, finals):
        return out, (torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals]))


class _LayerParallelRNN(FreedOnExit, nn.Module):
    _cell = _CellSteps

    def __init__(self, input_size, hidden_size, num_layers=1, *, batch_first=True, bias=True,
                 comm=None, forward_options=None, backward_options=None, coarse_rule="cell",
                 target_error=None, fused=True):
        super().__init__()
        _enter()

        if coarse_rule not in ("cell", "euler"):
            raise ValueError(f"coarse_rule must be 'cell' or 'euler', got {coarse_rule!r}")
        self.coarse_rule = coarse_rule
        if not batch_first:
            raise ValueError("layer-parallel RNNs take batch_first=True inputs "
                             "(batch, seq, features)")
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):
            check_int(name, v)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        comm = world() if comm is None else comm
        self.comm = getattr(comm, "layer_comm", comm)
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
        self._steps = self._cell(self.comm, bias, coarse_rule, fused)
        self._chains = {}
        self.forward_stats = []
        self.backward_stats = []
        self._solve_exactly = False  # set by audit_gradients
        self._audit_ratios = []
        self._calibration = 1.0

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
                                       self.backward_options, target_error=self.target_error,
                                       store_all=False)
            self._chains[seq].calibration = self._calibration
        chain = self._chains[seq]
        return chain.exact() if self._solve_exactly else chain

    def gradient_error_estimate(self):
        """An estimate of the last backward's relative parameter-gradient error: the sum over
        the layers of what ``LayerParallelModule.gradient_error_estimate`` gives for one
        chain; None before a backward.  Calibrated by the audits run so far
        (``layerbraid.audit_gradients``)."""
        return self._estimate("error_estimate")

    def _raw_gradient_error_estimate(self):
        return self._estimate("raw_error_estimate")

    def _estimate(self, field):
        if not self.forward_stats or len(self.backward_stats) != len(self.forward_stats):
            return None
        values = [_gradient_estimate(f, b, field)
                  for f, b in zip(self.forward_stats, self.backward_stats)]
        return None if any(v is None for v in values) else sum(values)

    def _save_stats(self):
        return self.forward_stats, self.backward_stats

    def _restore_stats(self, saved):
        self.forward_stats, self.backward_stats = saved

    def _set_calibration(self, k):
        self._calibration = k
        for chain in self._chains.values():
            chain.calibration = k

    def _settings(self, x):
        """What every rank must agree on for a forward and its backward."""
        return {"the input's shape and dtype": (tuple(x.shape), str(x.dtype)),
                "target_error": self.target_error,
                "the calibration of the error estimate": self._calibration,
                "an exact solve (audit_gradients)": self._solve_exactly}

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
        if self.comm.Get_size() > 1:  # also the barrier that names a rank that never comes
            check_same_settings(allgather_obj(self.comm, self._settings(x),
                                              "the settings of a layer-parallel RNN's forward"))
        chain = self._chain_for(seq)  # after the check: a new length builds solvers (collective)
        self.forward_stats, self.backward_stats = [], []
        inp = x
        finals = []
        for k in range(self.num_layers):
            params = self._layer_params(k)
            record = torch.is_grad_enabled() and any(
                t.requires_grad for t in [inp, h0_all] + params)
            run = Run(self._steps, h0_all[k].shape, h0_all.dtype, x.device, record)
            run.backward_log = self.backward_stats
            out = _ChainFn.apply(chain, run, None, inp, h0_all[k], *params)
            self.forward_stats.append(run.forward_stats)
            inp, final = self._steps.split(out)  # (batch, seq, hidden), the final state
            finals.append(final)
        return self._steps.result(inp, finals)


_SHORT_RUN = 4  # runs of at most this many LSTM steps whose states are kept go cell by cell


def _gates(xs, hp, params, bias):
    """The gates' input and hidden pre-activations at n steps at once: xs (n, batch, input),
    hp (n, batch, hidden).  Two 2D products with the bias added in them (addmm): faster than
    batched 3D products for long runs, with the same bits."""
    def product(v, w, b):
        flat = v.reshape(-1, v.shape[-1])
        out = torch.addmm(b, flat, w.t()) if bias else flat @ w.t()
        return out.view(*v.shape[:-1], w.shape[0])
    return (product(xs, params[0], params[2] if bias else None),
            product(hp, params[1], params[3] if bias else None))


def _flat(t):
    """(n, batch, k) -> (n * batch, k): a sum over steps and samples as one product."""
    return t.reshape(-1, t.shape[-1])


def _lstm_activations(gi, gh):
    i, f, g, o = (gi + gh).chunk(4, -1)
    return torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)


def _allreduce_sum(comm, tensors):
    """Sums a list of tensors over comm in one message."""
    return allreduce_sum(comm, tensors, "the gradients of the weights shared over sequence time")


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
        fused: runs of steps through torch's GRU kernel and the adjoint through the cell's
            closed-form VJP with batched weight gradients (default); False: one cell call and
            one autograd VJP per step (Note [fused cells]).
    """

    _cell = _GRUSteps


class LayerParallelLSTM(_LayerParallelRNN):
    """``nn.LSTM`` (batch_first) solved in sequence time by MGRIT; the state is (h, c) stacked.
    Same arguments as LayerParallelGRU; returns ``(output, (h_n, c_n))``."""

    _cell = _LSTMSteps
