"""LayerParallelGRU / LayerParallelLSTM against nn.GRU / nn.LSTM with the same weights."""
import pytest
import torch
from mpi4py import MPI

from layerbraid import MGRITOptions
from layerbraid.nn import LayerParallelGRU, LayerParallelLSTM
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD

PAIRS = [(LayerParallelGRU, torch.nn.GRU), (LayerParallelLSTM, torch.nn.LSTM)]


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def compare(cls, ref_cls, seq, tol, opts=None, layers=2, with_h0=False):
    torch.manual_seed(0)
    model = cls(3, 5, num_layers=layers, comm=WORLD, forward_options=opts,
                backward_options=opts)
    ref = ref_cls(3, 5, num_layers=layers, batch_first=True)
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, seq, 3, generator=g)
    hx = None
    if with_h0:
        h = torch.randn(layers, 4, 5, generator=g)
        hx = (h, torch.randn(layers, 4, 5, generator=g)) if cls is LayerParallelLSTM else h
    results = []
    for net in (model, ref):
        xx = x.clone().requires_grad_(True)
        hh = None
        if hx is not None:
            hh = tuple(t.clone().requires_grad_(True) for t in hx) if isinstance(hx, tuple) \
                else hx.clone().requires_grad_(True)
        out, hn = net(xx, hh)
        h_last = hn[0] if isinstance(hn, tuple) else hn
        loss = (out * torch.linspace(-1, 1, seq).view(1, seq, 1)).pow(2).sum() + h_last.sum()
        if isinstance(hn, tuple):
            loss = loss + hn[1].pow(2).sum()
        net.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in net.parameters()]
        hgrad = None
        if hh is not None:
            hgrad = [t.grad for t in hh] if isinstance(hh, tuple) else [hh.grad]
        results.append((out.detach(), xx.grad, grads, hgrad))
    (o1, gx1, gp1, gh1), (o2, gx2, gp2, gh2) = results
    torch.testing.assert_close(o1, o2, rtol=tol, atol=tol)
    torch.testing.assert_close(gx1, gx2, rtol=tol, atol=tol)
    for a, b in zip(gp1, gp2):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if gh1 is not None:
        for a, b in zip(gh1, gh2):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    return model


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_exact_mode_equals_torch_rnns():
    for cls, ref in PAIRS:
        for seq in (8, 13):  # 13: not divisible by the ranks
            compare(cls, ref, seq, ROUNDOFF, with_h0=seq == 13)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_multilevel_converges_to_torch_rnns():
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=40, tol=1e-13, nrelax=1)
    for cls, ref in PAIRS:
        model = compare(cls, ref, 16, CONVERGED, opts)
        assert all(s.residual_norms[-1] < 1e-13 for s in model.forward_stats)


@pytest.mark.parallel([1, 2])
def test_bad_shapes_are_clear_errors():
    gru = LayerParallelGRU(3, 5, comm=WORLD)
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, seq, 3\), got \(4, 6\)"):
        gru(torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, seq, 3\), got \(4, 6, 2\)"):
        gru(torch.randn(4, 6, 2))
    with pytest.raises(ValueError, match=r"h0 of shape \(1, 4, 5\)"):
        gru(torch.randn(4, 6, 3), torch.randn(1, 3, 5))
    lstm = LayerParallelLSTM(3, 5, comm=WORLD)
    with pytest.raises(ValueError, match=r"hx = \(h0, c0\)"):
        lstm(torch.randn(4, 6, 3), torch.randn(1, 4, 5))
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1, got 0"):
        LayerParallelGRU(3, 0, comm=WORLD)
    if WORLD.size > 1:
        with pytest.raises(ValueError, match="fewer than the 2 ranks"):
            gru(torch.randn(4, 1, 3))


def _run_both_paths(cls, opts, rule, seq=23):
    """Outputs and gradients of the fused and the per-step path (Note [fused cells]) of one
    model, same weights and inputs; also under no_grad."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = cls(3, 5, num_layers=2, comm=WORLD, forward_options=opts, backward_options=opts,
                    coarse_rule=rule, fused=fused)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(4, seq, 3, generator=g).requires_grad_(True)
        h = torch.randn(2, 4, 5, generator=g).requires_grad_(True)
        hx = (h, 2 * h) if cls is LayerParallelLSTM else h
        out, hn = model(x, hx)
        finals = hn if isinstance(hn, tuple) else (hn,)
        loss = (out * torch.linspace(-1, 1, seq).view(1, seq, 1)).pow(2).sum() + sum(
            f.pow(2).sum() for f in finals)
        loss.backward()
        with torch.no_grad():
            plain, _ = model(x)
        iters = [s.iterations for s in model.forward_stats + model.backward_stats]
        results.append(([out.detach(), plain, x.grad, h.grad] + [p.grad for p in
                                                                 model.parameters()], iters))
    return results


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_fused_path_equals_per_step_path():
    """Runs of steps through torch's kernels and closed-form adjoints (or, in exact mode, the
    LSTM kernel's own backward) give what one cell call and one autograd VJP per step give, in
    float64 to round-off, whatever the levels, relaxation and coarse rule."""
    configs = [None,
               MGRITOptions(max_levels=2, cfactor=4, max_iters=2, nrelax=0,
                            skip_first_downcycle=True),
               MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=1, nrelax=1),
               # F-intervals of 5 steps: the LSTM's kept runs through the kernel, not cells
               MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=6, max_iters=2, nrelax=1)]
    for cls in (LayerParallelGRU, LayerParallelLSTM):
        for opts in configs:
            for rule in ("cell", "euler"):
                (fused, it_f), (per_step, it_p) = (_run_both_paths(cls, opts, rule))
                assert it_f == it_p
                for a, b in zip(fused, per_step):
                    torch.testing.assert_close(a, b, rtol=ROUNDOFF, atol=ROUNDOFF)


def _gru_steps_of_each_call(monkeypatch, method, xs_at):
    """The list that every later call of the GRU's ``method`` appends its step count to: the
    length of its argument ``xs_at`` (the inputs of its steps, batch first)."""
    from layerbraid.nn import rnn

    calls = []
    original = getattr(rnn._GRUSteps, method)

    def counted(self, *args):
        calls.append(args[xs_at].shape[1])
        return original(self, *args)

    monkeypatch.setattr(rnn._GRUSteps, method, counted)
    return calls


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_gru_blocks_by_the_kernels_own_backward_equal_torch(monkeypatch):
    """On a GPU, exact mode differentiates the GRU's blocks by torch's backward of the kernel,
    as it does the LSTM's everywhere (Note [fused cells]): the same path forced on the CPU
    equals nn.GRU to round-off, one block per rank and layer."""
    from layerbraid.nn import rnn

    monkeypatch.setattr(rnn._GRUSteps, "block_graphs", True)
    blocks = _gru_steps_of_each_call(monkeypatch, "_record_block", 2)  # run, u, xs
    for seq in (8, 13):  # 13: not divisible by the ranks
        blocks.clear()
        compare(LayerParallelGRU, torch.nn.GRU, seq, ROUNDOFF, with_h0=seq == 13)
        assert len(blocks) == 2 and blocks[0] == blocks[1], blocks  # one per layer
        assert WORLD.allreduce(blocks[0]) == seq  # each rank's block: its steps


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_fused_path_runs_blocks_and_intervals_in_one_kernel_call(monkeypatch):
    """Exact mode: one kernel call per rank and layer; two levels with cfactor 4: the level-0
    F-intervals (3 steps) in one call each."""
    calls = _gru_steps_of_each_call(monkeypatch, "kernel", 0)  # xs, s, ...
    seq = 16
    gru = LayerParallelGRU(3, 5, num_layers=2, comm=WORLD)
    out, _ = gru(torch.randn(4, seq, 3))
    out.sum().backward()
    assert calls == [seq // WORLD.size] * 2
    calls.clear()
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=4, max_iters=1, nrelax=0)
    gru = LayerParallelGRU(3, 5, comm=WORLD, forward_options=opts)
    gru(torch.randn(4, seq, 3))
    assert calls and 3 in calls
