"""The cell math of layer-parallel GRUs and LSTMs: updates, multi-step kernels, linearized gates
and their closed-form VJPs (Note [fused cells] in rnn.py).  Mixed into the step providers of
_cell_steps.py; they read only ``self.bias``."""

from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from .._engine.torch_private import gru_kernel, lstm_kernel

__all__ = []


_SHORT_RUN = 4  # runs of at most this many LSTM steps whose states are kept go cell by cell


def _gates(
    xs: torch.Tensor, hp: torch.Tensor, params: Sequence[torch.Tensor], bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates' input and hidden pre-activations at n steps at once: xs (n, batch, input),
    hp (n, batch, hidden).  Two 2D products with the bias added in them (addmm): faster than
    batched 3D products for long runs, with the same bits."""

    def product(v: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
        flat = v.reshape(-1, v.shape[-1])
        out = torch.addmm(b, flat, w.t()) if bias else flat @ w.t()
        return out.view(*v.shape[:-1], w.shape[0])

    return (
        product(xs, params[0], params[2] if bias else None),
        product(hp, params[1], params[3] if bias else None),
    )


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(n, batch, k) -> (n * batch, k): a sum over steps and samples as one product."""
    return t.reshape(-1, t.shape[-1])


def _train(xs: torch.Tensor) -> bool:
    """The kernels' ``train`` flag: on for a GPU input where autograd records, since cuDNN
    differentiates its RNN kernel only when it ran in training mode; off on the CPU, whose
    LSTM kernel then runs faster and differentiates all the same (no dropout: no number
    changes either way)."""
    return xs.is_cuda and torch.is_grad_enabled()


def _lstm_activations(gi: torch.Tensor, gh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    i, f, g, o = (gi + gh).chunk(4, -1)
    return torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)


class GRUMath:
    """The GRU cell: its update, torch's multi-step kernel, the linearized gates and the
    closed-form VJP (Note [fused cells] in rnn.py)."""

    reference: ClassVar[type[nn.RNNBase]] = nn.GRU
    bias: bool  # the steps provider's (the class this one is mixed into)

    def cell(
        self, x: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        return torch.gru_cell(x, s, params[0], params[1], b_ih, b_hh)

    def kernel(
        self, xs: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor], keep: bool
    ) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
        out = gru_kernel(xs, s, params, self.bias, _train(xs))
        return list(out.unbind(1)), (out,)

    def cotangents(
        self, raw: Sequence[torch.Tensor], src: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        return (torch.cat([src, w.unsqueeze(1)], 1),)

    def linearize(
        self, xs: torch.Tensor, sp: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
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

    def vjp(
        self,
        jac: Any,
        k: int,
        w: torch.Tensor,
        params: Sequence[torch.Tensor],
        out: Any = None,
        src: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        z, f_gi, f_gh = jac
        w3 = w.unsqueeze(-2)
        if out is None:
            dgh = (w3 * f_gh[k]).flatten(-2)
        else:
            torch.mul(w3, f_gi[k], out=out[0].view(f_gi[k].shape))
            dgh = torch.mul(w3, f_gh[k], out=out[1].view(f_gh[k].shape)).flatten(-2)
        return torch.addmm(w * z[k] if src is None else torch.addcmul(src, w, z[k]), dgh, params[1])

    def gate_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, like.shape[0], 3 * like.shape[-1])
        return like.new_empty(shape), like.new_empty(shape)

    def run_inputs(self, u: torch.Tensor, out: Any, raw: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([u.unsqueeze(0), raw[0].transpose(0, 1)[:-1]])

    def initial_states(
        self, hx: Any, state_shape: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor:
        if hx is None:
            return like.new_zeros(state_shape)
        if not isinstance(hx, torch.Tensor) or tuple(hx.shape) != state_shape:
            raise ValueError(
                f"LayerParallelGRU expects h0 of shape {state_shape}, got "
                f"{tuple(getattr(hx, 'shape', ()))}"
            )
        return hx


class LSTMMath:
    """The LSTM cell, the state (h, c) stacked: its update, torch's multi-step kernel, the
    linearized gates and the closed-form VJP (Note [fused cells] in rnn.py)."""

    """The state is (h, c) stacked: (2, batch, hidden).  The chain's output is the h sequence
    and then c_n: (batch, seq + 1, hidden); the c's inside the sequence reach no loss."""

    reference: ClassVar[type[nn.RNNBase]] = nn.LSTM
    # torch's LSTM backward on CPU is one oneDNN call, faster than the closed-form VJPs' Python
    # loop; its GRU backward is not, so the GRU keeps the closed-form VJPs (bench/rnn.py
    # times both paths)
    block_graphs = True

    bias: bool  # the steps provider's (the class this one is mixed into)

    def cell(
        self, x: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        b_ih, b_hh = (params[2], params[3]) if self.bias else (None, None)
        return torch.stack(torch.lstm_cell(x, (s[0], s[1]), params[0], params[1], b_ih, b_hh))

    def kernel(
        self, xs: torch.Tensor, s: torch.Tensor, params: Sequence[torch.Tensor], keep: bool
    ) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
        n = xs.shape[1]
        if keep and n <= _SHORT_RUN:
            # each state's c is wanted: the cells return it, the kernel does not (and, for so
            # few steps, costs about as much as the cells)
            states: list[Any] = []
            for k in range(n):
                s = self.cell(xs[:, k], s, params)
                states.append(s)
            return states, (torch.stack([t[0] for t in states], 1), s[0:1], s[1:2])
        out, h_n, c_n = lstm_kernel(xs, s[0:1], s[1:2], params, self.bias, _train(xs))
        states = [] if keep else [None] * (n - 1)
        if keep and n > 1:
            # the kernel returns the h's only: the c's from the same gates (Note [fused cells])
            with torch.no_grad():
                hs = out.detach().transpose(0, 1)  # (n, batch, hidden)
                hp = torch.cat([s[0:1].detach(), hs[: n - 2]])
                i, f, g, _ = _lstm_activations(
                    *_gates(xs[:, : n - 1].detach().transpose(0, 1), hp, params, self.bias)
                )
                c = s[1].detach()
                for k in range(n - 1):
                    c = torch.addcmul(i[k] * g[k], f[k], c)
                    states.append(torch.stack([hs[k], c]))
        states.append(torch.stack([h_n[0], c_n[0]]))
        return states, (out, h_n, c_n)

    def cotangents(
        self, raw: Sequence[torch.Tensor], src: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        # the sequence's c's reach the loss only at its end (h_n, c_n): inside, h's only
        out = raw[0]
        return (torch.cat([src, torch.zeros_like(out[:, :1])], 1), w[0:1], w[1:2])

    def linearize(
        self, xs: torch.Tensor, sp: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        # c' = f c + i g, h' = o tanh(c')
        i, f, g, o = _lstm_activations(*_gates(xs, sp[:, 0], params, self.bias))
        c = sp[:, 1]
        tc = torch.tanh(f * c + i * g)
        return (
            o * (1 - tc * tc),
            f,
            torch.cat([g * i * (1 - i), c * f * (1 - f), i * (1 - g * g), tc * o * (1 - o)], -1),
        )

    def vjp(
        self,
        jac: Any,
        k: int,
        w: torch.Tensor,
        params: Sequence[torch.Tensor],
        out: Any = None,
        src: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        d_c, f, f_gates = jac
        wh, wc = w[0], w[1]
        dct = torch.addcmul(wc, wh, d_c[k])
        dg = torch.mul(
            torch.cat([dct, dct, dct, wh], -1), f_gates[k], out=None if out is None else out[0]
        )
        return torch.stack(
            [dg @ params[1] if src is None else torch.addmm(src, dg, params[1]), dct * f[k]]
        )

    def gate_buffers(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dg = like.new_empty((n, like.shape[-2], 4 * like.shape[-1]))
        return dg, dg  # the input and hidden pre-activations' gradients are the same

    def previous_h(self, sp: torch.Tensor) -> torch.Tensor:
        return sp[:, 0]

    def initial_states(
        self, hx: Any, state_shape: Sequence[int], like: torch.Tensor
    ) -> torch.Tensor:
        if hx is None:
            z = like.new_zeros(state_shape)
            hx = (z, z)
        if (
            not isinstance(hx, tuple)
            or len(hx) != 2
            or any(tuple(t.shape) != state_shape for t in hx)
        ):
            raise ValueError(
                f"LayerParallelLSTM expects hx = (h0, c0), each of shape {state_shape}"
            )
        return torch.stack([hx[0], hx[1]], dim=1)  # (layers, 2, batch, hidden)

    def h_of(self, s: torch.Tensor) -> torch.Tensor:
        return s[0]

    def last_rows(self, s: torch.Tensor) -> list[torch.Tensor]:
        return [s[1]]

    def as_state(self, g: torch.Tensor, p: int, seq: int) -> torch.Tensor:
        return torch.stack([g[:, p - 1], g[:, seq] if p == seq else torch.zeros_like(g[:, 0])])

    def split(self, out: Any) -> tuple[torch.Tensor, Any]:
        return out[:, :-1], (out[:, -2], out[:, -1])

    def result(self, out: Any, finals: list[torch.Tensor]) -> Any:
        return out, (torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals]))
