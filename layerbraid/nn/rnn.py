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
not); on a GPU both do, cuDNN's backward being one call where the loop launches a few kernels
per step.  The fused LSTM kernel returns only the h's: where the core keeps the states inside a run
(or the adjoint linearizes at them), the c's come from the same batched gates
(``c_t = f_t c_{t-1} + i_t g_t``).  The chain's output is the h's (taken in the final
relaxation, so the forward core keeps only what its cycles read again) and, for the LSTM, c_n
as one more row.  ``fused=False`` takes one cell call and one autograd VJP of a kept graph per
step (as Note [Euler graphs] in _engine/layer_steps.py): the reference the fused path is
tested equal to.

Note [cuDNN weights]: on a GPU the fused kernels run cuDNN, which wants each layer's weights as
views into one buffer in its own layout; otherwise it copies them into one on every call (and
warns that it does).  So whenever the module's tensors move or change type (``.to``, ``.cuda``,
``.double``: ``nn.Module._apply``) each layer's parameters become views into one such buffer,
as nn.GRU / nn.LSTM's ``flatten_parameters`` does.  The Parameter objects stay the same (an
optimizer made before keeps working) and in-place updates (an optimizer's step,
``load_state_dict``, the weights' broadcast) keep the views; on the CPU nothing changes.

The forward and adjoint solves are the engine's (``_engine/chain.py``), shared with
LayerParallelModule; a GRU or an LSTM is only a step provider: a cell subclass of ``_CellSteps``
(_cell_steps.py), whose cell math (the updates and closed-form VJPs) is in _cells.py.  This
file is the nn.Module surface.
"""

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from .._comm.world import resolve
from .._engine.chain import Run, _Chain, _ChainFn, _check_target, _gradient_estimate
from .._engine.handshake import agree_on_settings
from .._engine.parts import FreedOnExit, LayerParallelPart
from .._engine.torch_private import cudnn_flatten_rnn_weights
from ..grid import ProcessGrid
from ..launch import _enter
from ..options import MGRITOptions, check_int
from ..stats import SolveStats, sum_or_none
from ._cell_steps import _CellSteps, _GRUSteps, _LSTMSteps

__all__ = ["LayerParallelGRU", "LayerParallelLSTM"]


class _LayerParallelRNN(FreedOnExit, LayerParallelPart, nn.Module):
    _cell = _CellSteps

    def __init__(
        self,
        input_size,
        hidden_size,
        num_layers: int = 1,
        *,
        batch_first: bool = True,
        bias: bool = True,
        comm=None,
        forward_options=None,
        backward_options=None,
        coarse_rule: str = "cell",
        target_error=None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        _enter()

        if coarse_rule not in ("cell", "euler"):
            raise ValueError(f"coarse_rule must be 'cell' or 'euler', got {coarse_rule!r}")
        self.coarse_rule = coarse_rule
        if not batch_first:
            raise ValueError(
                "layer-parallel RNNs take batch_first=True inputs (batch, seq, features)"
            )
        for name, v in (
            ("input_size", input_size),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
        ):
            check_int(name, v)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        comm = resolve(comm)
        self.comm = comm.layer_comm if isinstance(comm, ProcessGrid) else comm
        self.target_error = _check_target(target_error)
        self.forward_options = _fc(forward_options)
        self.backward_options = _fc(backward_options)
        ref = self._cell.reference(input_size, hidden_size, num_layers, bias=bias, batch_first=True)
        # The same parameter names as nn.GRU / nn.LSTM, so that state_dicts load either way.
        for name, p in ref.named_parameters():
            self.register_parameter(name, nn.Parameter(p.detach().clone()))
        self.bias = bias
        self.comm.bcast_into(self.parameters())  # every rank holds rank 0's weights
        self._steps = self._cell(self.comm, bias, coarse_rule, fused)
        self._chains: dict[int, Any] = {}  # sequence length -> its chain
        self.forward_stats: list[Optional[SolveStats]] = []
        self.backward_stats: list[Optional[SolveStats]] = []
        self._init_part()
        self._calibration = 1.0

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._flatten_for_cudnn()
        return out

    def _flatten_for_cudnn(self) -> None:
        """Each layer's parameters as views into one buffer in cuDNN's layout, where cuDNN
        runs the kernels (Note [cuDNN weights]); otherwise nothing."""
        params = list(self.parameters())
        if (
            not params
            or not all(p.is_cuda and p.dtype == params[0].dtype for p in params)
            or not all(torch.backends.cudnn.is_acceptable(p) for p in params)
            or len({p.data_ptr() for p in params}) != len(params)
        ):
            return
        kind = self._cell.reference.__name__.upper()
        layers = [self._layer_params(k) for k in range(self.num_layers)]
        with torch.cuda.device_of(params[0]), torch.no_grad():
            # in place: the Parameters become views into one new buffer per layer
            cudnn_flatten_rnn_weights(layers, kind, self.input_size, self.hidden_size)

    def free(self) -> None:
        """Frees the communicators and MGRIT cores made for each sequence length (also done
        when the module is garbage collected, and at the end of a ``with`` block)."""
        for chain in self._chains.values():
            chain.free()
        self._chains.clear()

    def _counted_parameters(self) -> list[nn.Parameter]:
        """Shared weights: their gradients are summed over the layer group, so every rank holds
        the same; the first rank counts them (for clip_grad_norm_)."""
        return list(self.parameters()) if self.comm.Get_rank() == 0 else []

    def _layer_params(self, k: float) -> list[nn.Parameter]:
        names = [f"weight_ih_l{k}", f"weight_hh_l{k}"]
        if self.bias:
            names += [f"bias_ih_l{k}", f"bias_hh_l{k}"]
        return [getattr(self, n) for n in names]

    def _chain_for(self, seq: int) -> Any:
        if seq not in self._chains:
            size = self.comm.Get_size()
            if seq < size:
                raise ValueError(
                    f"the sequence has {seq} steps, fewer than the {size} ranks: "
                    "every rank needs a time step"
                )
            self._chains[seq] = _Chain(
                self.comm,
                seq,
                float(seq),
                self.forward_options,
                self.backward_options,
                target_error=self.target_error,
                store_all=False,
            )
            self._chains[seq].calibration = self._calibration
        return self._solving(self._chains[seq])

    def gradient_error_estimate(self) -> Optional[float]:
        """An estimate of the last backward's relative parameter-gradient error: the sum over
        the layers of what ``LayerParallelModule.gradient_error_estimate`` gives for one
        chain; None before a backward.  Calibrated by the audits run so far
        (``layerbraid.accuracy.audit_gradients``)."""
        return self._estimate("error_estimate")

    def _raw_gradient_error_estimate(self) -> Optional[float]:
        return self._estimate("raw_error_estimate")

    def _estimate(self, field: str) -> Optional[float]:
        if not self.forward_stats or len(self.backward_stats) != len(self.forward_stats):
            return None
        return sum_or_none(
            _gradient_estimate(f, b, field) for f, b in zip(self.forward_stats, self.backward_stats)
        )

    def _save_stats(self) -> Any:
        return self.forward_stats, self.backward_stats

    def _restore_stats(self, saved: Any) -> None:
        self.forward_stats, self.backward_stats = saved

    def _set_calibration(self, k: float) -> None:
        self._calibration = k
        for chain in self._chains.values():
            chain.calibration = k

    def _solved(self, counts: Sequence[Any]) -> Any:
        return self._save_stats()  # no warm starts: the statistics are all

    def _adopt(self, solved: Any, calibrate: Any) -> None:
        k = self._calibration
        self._restore_stats(tuple([calibrate(s, k) for s in stats] for stats in solved))

    def _settings(self, x: Any) -> dict[str, Any]:
        """What every rank must agree on for a forward and its backward."""
        return {
            "the input's shape and dtype": (tuple(x.shape), str(x.dtype)),
            "target_error": self.target_error,
            "the calibration of the error estimate": self._calibration,
            "the solve mode (audit_gradients, probe_gradients, IterationTuner)": self.solve_mode,
        }

    def forward(self, x: Any, hx: Optional[Any] = None) -> Any:
        """x: (batch, seq, input_size), the whole sequence, on every rank of the communicator.
        hx: initial state (num_layers, batch, hidden) (LSTM: a tuple (h0, c0)), or None.

        Returns (output, h_n) (LSTM: (output, (h_n, c_n))), the same on every rank; output is
        (batch, seq, hidden_size)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(
                f"{type(self).__name__} expects input of shape (batch, seq, "
                f"{self.input_size}), got {tuple(getattr(x, 'shape', ()))}"
            )
        batch, seq = x.shape[0], x.shape[1]
        h0_all = self._steps.initial_states(hx, (self.num_layers, batch, self.hidden_size), x)
        agree_on_settings(
            self.comm,
            self._settings(x),
            "the forward of a layer-parallel RNN",
            "the settings of a layer-parallel RNN's forward",
        )
        chain = self._chain_for(seq)  # after the check: a new length builds solvers (collective)
        self.forward_stats, self.backward_stats = [], []
        inp = x
        finals = []
        for k in range(self.num_layers):
            params = self._layer_params(k)
            record = torch.is_grad_enabled() and any(
                t.requires_grad for t in [inp, h0_all] + params
            )
            run = Run(
                self._steps,
                h0_all[k].shape,
                h0_all.dtype,
                x.device,
                record,
                on_backward=self.backward_stats.append,
            )
            out = _ChainFn.apply(chain, run, None, inp, h0_all[k], *params)
            self.forward_stats.append(run.forward_stats)
            inp, final = self._steps.split(out)  # (batch, seq, hidden), the final state
            finals.append(final)
        return self._steps.result(inp, finals)


def _fc(o: Any) -> Any:
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
