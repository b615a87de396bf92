"""LayerParallelModule against the serial PyTorch network it represents, on 1 to 4 ranks."""
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import LayerParallelModule, MGRITOptions
from nets import ConvBlock, ODEResNet, batch, compare_with_serial
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD, user_comm

RANKS = [1, 2, 3, 4]


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel(RANKS)
def test_one_level_equals_serial_pytorch_to_roundoff():
    for n in (4, 9):  # 9: steps that do not divide evenly over the ranks
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=n)
        compare_with_serial(model, *batch(), tol=ROUNDOFF, world=WORLD)
        assert model.forward_stats.iterations == 0 and model.backward_stats.iterations == 0


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_the_communicator_a_user_passes_equals_serial():
    """comm=dist.group.WORLD under torchrun (mpi4py's COMM_WORLD under mpiexec): one level
    equal to plain PyTorch to round-off, three converged levels to CONVERGED, float64."""
    torch.manual_seed(0)
    compare_with_serial(ODEResNet(user_comm(), num_steps=9), *batch(), tol=ROUNDOFF, world=WORLD)
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=40,
                        tol=1e-13, nrelax=1)
    model = ODEResNet(user_comm(), num_steps=12, forward_options=opts, backward_options=opts)
    compare_with_serial(model, *batch(), tol=CONVERGED, world=WORLD)
    assert model.forward_stats.iterations > 1


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_three_levels_run_to_convergence_equal_serial():
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=40, tol=1e-13, nrelax=1)
    for fwd_cycle in ("V", "F"):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=12, forward_options=opts,
                          backward_options=MGRITOptions(skip_first_downcycle=False, max_levels=3,
                                                        cfactor=(2, 3), max_iters=40,
                                                        tol=1e-13, nrelax=(0, 1), cycle=fwd_cycle))
        compare_with_serial(model, *batch(), tol=CONVERGED, world=WORLD)
        assert model.forward_stats.residual_norms[-1] < 1e-13
        assert model.backward_stats.residual_norms[-1] < 1e-13


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_cheap_settings_are_approximate_and_warm_start_helps():
    """2 forward / 1 backward iteration: an approximation that warm starts make better."""
    cheap_f = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=4, max_iters=2, nrelax=0)
    cheap_b = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=4, max_iters=1, nrelax=0)
    x, y = batch()
    errors = {}
    for warm in (False, True):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=16, forward_options=cheap_f, backward_options=cheap_b,
                          warm_start=warm)
        serial = model.to_serial()
        ref = serial(x)
        for _ in range(3):  # the same batch again: warm starts converge over calls
            out = model(x)
        errors[warm] = (out - ref).abs().max().item()
    assert errors[True] < 0.1 * errors[False]
    assert errors[False] > 1e-6


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_training_follows_the_serial_loss_trajectory():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=8)
    serial = model.to_serial()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
    losses, losses_s = [], []
    x, y = batch()
    for k in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        opt_s.zero_grad()
        loss_s = F.cross_entropy(serial(x), y)
        loss_s.backward()
        opt_s.step()
        losses_s.append(loss_s.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_s), rtol=1e-10, atol=1e-10)
    assert losses[-1] < losses[0]
    # the same loss on every rank
    assert WORLD.allgather_obj(losses, "the losses") == [losses] * WORLD.size


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
def test_gradients_accumulate():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=4)
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    F.cross_entropy(model(x1), y1).backward()
    F.cross_entropy(model(x2), y2).backward()
    acc = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    F.cross_entropy(model(x1), y1).backward()
    g1 = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    F.cross_entropy(model(x2), y2).backward()
    assert acc and set(acc) == set(g1)
    for k, p in model.named_parameters():
        if k in acc:
            torch.testing.assert_close(acc[k], g1[k] + p.grad, rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_checkpoint_saved_on_four_ranks_resumes_on_two_and_one():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for k in range(2):
        opt.zero_grad()
        x, y = batch(seed=k)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    path = WORLD.bcast(os.path.join(tempfile.mkdtemp(), "ckpt.pt") if WORLD.rank == 0 else None)
    model.save_checkpoint(path, optimizer=opt, extra={"epoch": 3})
    # Continue two more steps on 4 ranks: the reference trajectory.
    ref_losses = []
    for k in (2, 3):
        opt.zero_grad()
        x, y = batch(seed=k)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for size in (2, 1):
        sub = MPI.COMM_WORLD.Split(0 if WORLD.rank < size else MPI.UNDEFINED, WORLD.rank)
        if sub != MPI.COMM_NULL:
            torch.manual_seed(123)  # different initial weights: everything must come from the file
            resumed = ODEResNet(sub, num_steps=8)
            opt2 = torch.optim.SGD(resumed.parameters(), lr=0.5, momentum=0.0)
            assert resumed.load_checkpoint(path, optimizer=opt2) == {"epoch": 3}
            assert opt2.param_groups[0]["lr"] == 0.05 and opt2.param_groups[0]["momentum"] == 0.9
            losses = []
            for k in (2, 3):
                opt2.zero_grad()
                x, y = batch(seed=k)
                loss = F.cross_entropy(resumed(x), y)
                loss.backward()
                opt2.step()
                losses.append(loss.item())
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                       rtol=1e-10, atol=1e-10)
            sub.Free()
        WORLD.Barrier()


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_serial_state_dict_loads_into_layer_parallel_model():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=6)
    serial = model.to_serial()
    with torch.no_grad():
        for p in serial.parameters():
            p.mul_(1.5)
    model.load_state_dict(serial.state_dict())
    x, _ = batch()
    torch.testing.assert_close(model(x), serial(x), rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_owned_steps_cover_the_network_once():
    model = ODEResNet(WORLD, num_steps=7)
    mine = [i for i, _ in model.owned_steps()]
    everyone = WORLD.allgather(mine)
    assert sorted(i for b in everyone for i in b) == list(range(7))
    assert all(b == list(range(b[0], b[-1] + 1)) for b in everyone)
    # The same global step gets the same initial weights whatever the rank count.
    torch.manual_seed(5)
    a = ODEResNet(WORLD, num_steps=7).to_serial()
    torch.manual_seed(5)
    b = ODEResNet(MPI.COMM_SELF, num_steps=7).to_serial()
    for p, q in zip(a.layers.parameters(), b.layers.parameters()):
        assert torch.equal(p, q)


def test_step_layers_exist_for_the_optimizer_right_away():
    model = ODEResNet(MPI.COMM_SELF, num_steps=3)
    names = [k for k, _ in model.named_parameters()]
    assert "layers.0.conv1.weight" in names and "layers.2.conv2.bias" in names


# ------------------------------------------------------------------------------ errors


@pytest.mark.parallel([2, 3])
def test_fewer_steps_than_ranks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_steps=1 is smaller than the number of"):
        ODEResNet(WORLD, num_steps=1)


@pytest.mark.parallel([2, 3])
def test_options_that_differ_between_ranks_are_a_clear_error():
    with pytest.raises(ValueError, match="cfactor ranges from 2 to"):
        ODEResNet(WORLD, num_steps=8,
                  forward_options=MGRITOptions(nrelax=1, skip_first_downcycle=False, max_levels=2, cfactor=2 + WORLD.rank))


@pytest.mark.parallel([1, 3])
def test_wrong_input_shape_is_a_clear_error_on_every_rank():
    model = ODEResNet(WORLD, num_steps=6)
    x = torch.randn(4, 3, 8, 8)  # 3 channels; the open conv takes 1
    with pytest.raises((RuntimeError, ValueError)) as info:
        model(x)
    if WORLD.rank > 0:  # told by the first rank, which ran the open layer
        assert "rank 0" in str(info.value) and "(4, 3, 8, 8)" in str(info.value), info.value
    else:  # torch's own error of the open conv
        assert "3 channels" in str(info.value), info.value
    # the model still works afterwards
    model(batch(n=4)[0])


class ShapeChanging(LayerParallelModule):
    def __init__(self, comm):
        super().__init__(num_steps=6, comm=comm)

    def step_layer(self, index):
        return nn.Linear(4, 5) if index == 4 else nn.Linear(4, 4)


@pytest.mark.parallel([1, 3])
def test_step_layer_that_changes_the_shape_is_a_clear_error_on_every_rank():
    model = ShapeChanging(WORLD)
    with pytest.raises((ValueError, layerbraid.RemoteRankError)) as info:
        model(torch.ones(2, 4))
    assert "step layer 4 returned shape (2, 5)" in str(info.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_steps"):
        ODEResNet(MPI.COMM_SELF, num_steps=0)
    with pytest.raises(ValueError, match="t_final"):
        LayerParallelModule.__init__(nn.Module.__new__(LayerParallelModule), 4, t_final=-1.0)
    with pytest.raises(TypeError, match="forward_options"):
        ODEResNet(MPI.COMM_SELF, num_steps=4, forward_options={"max_levels": 2})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_states_match_cpu():
    torch.manual_seed(0)
    model = ODEResNet(MPI.COMM_SELF, num_steps=6,
                      forward_options=MGRITOptions(nrelax=1, skip_first_downcycle=False, max_levels=2, cfactor=2, max_iters=20, tol=1e-13),
                      backward_options=MGRITOptions(nrelax=1, skip_first_downcycle=False, max_levels=2, cfactor=2, max_iters=20, tol=1e-13))
    serial = model.to_serial()
    model.cuda()
    x, y = batch()
    out = model(x.cuda())
    F.cross_entropy(out, y.cuda()).backward()
    torch.testing.assert_close(out.cpu(), serial(x), rtol=CONVERGED, atol=CONVERGED)


class Midpoint(ODEResNet):
    """A subclass with its own step rule (explicit midpoint): the general, non-Euler path."""

    def step_rule(self, layer, x, dt, index):
        return x + dt * layer(x + 0.5 * dt * layer(x))


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
def test_a_custom_step_rule_equals_serial():
    torch.manual_seed(0)
    model = Midpoint(WORLD, num_steps=6)
    compare_with_serial(model, *batch(), tol=ROUNDOFF, world=WORLD)
    torch.manual_seed(0)
    opts = MGRITOptions(nrelax=1, skip_first_downcycle=False, max_levels=2, cfactor=3, max_iters=30, tol=1e-13)
    model = Midpoint(WORLD, num_steps=6, forward_options=opts, backward_options=opts)
    compare_with_serial(model, *batch(), tol=CONVERGED, world=WORLD)


class Stage(LayerParallelModule):
    def __init__(self, comm, steps, channels, open_layer, close_layer, output):
        super().__init__(num_steps=steps, comm=comm, output=output)
        self.channels, self.open, self.close = channels, open_layer, close_layer

    def step_layer(self, index):
        return ConvBlock(self.channels)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_stages_that_change_shape_chain_like_serial():
    """Two layer-parallel stages joined by a strided transition: the first hands its output to
    the second's first rank (output="next"); outputs and all gradients equal serial PyTorch."""
    torch.manual_seed(0)
    s1 = Stage(WORLD, 4, 3, nn.Conv2d(1, 3, 3, padding=1), None, "next")
    s2 = Stage(WORLD, 5, 6, nn.Conv2d(3, 6, 3, stride=2, padding=1),
               nn.Sequential(nn.Flatten(), nn.Linear(6 * 4 * 4, 3)), "all")
    net = nn.Sequential(s1, s2)
    serial = nn.Sequential(s1.to_serial(), s2.to_serial())
    x, y = batch()
    xp = x.clone().requires_grad_(True)
    out = net(xp)
    F.cross_entropy(out, y).backward()
    xs = x.clone().requires_grad_(True)
    ref = serial(xs)
    F.cross_entropy(ref, y).backward()
    torch.testing.assert_close(out, ref, rtol=ROUNDOFF, atol=ROUNDOFF)
    if WORLD.rank == 0:
        torch.testing.assert_close(xp.grad, xs.grad, rtol=ROUNDOFF, atol=ROUNDOFF)
    for stage, ser in zip((s1, s2), serial):
        for i, layer in stage.owned_steps():
            for p, q in zip(layer.parameters(), ser.layers[i].parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=ROUNDOFF, atol=ROUNDOFF)
        if WORLD.rank == 0:
            for p, q in zip(stage.open.parameters(), ser.open.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=ROUNDOFF, atol=ROUNDOFF)


def _count_autograd_calls(monkeypatch):
    """[n]: n counts the calls of ``torch.autograd.grad`` from now on (reset it to 0 at will)."""
    calls = [0]
    grad = torch.autograd.grad

    def counted(*args, **kwargs):
        calls[0] += 1
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counted)
    return calls


class _Damped(ODEResNet):
    """A custom step rule (the graph is the new state, not an increment)."""

    def step_rule(self, layer, x, dt, index):
        return x + dt * torch.tanh(layer(x)) - 0.1 * dt * x


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_fused_runs_equal_the_step_by_step_path(monkeypatch):
    """fused=True (a run of steps of the final relaxation as one graph, one autograd call per
    run in the adjoint's final relaxation) against fused=False (one call per step): the output,
    input gradient and every parameter gradient agree to round-off in float64, with 1-3
    levels, spatial coarsening in both modes and a custom step rule, and fused makes fewer
    autograd calls."""
    calls = _count_autograd_calls(monkeypatch)
    x, _ = batch(n=2)
    cases = [(1, ODEResNet, None), (1, _Damped, None)] + [
        (levels, net, mode) for levels in (2, 3) for net in (ODEResNet, _Damped)
        for mode in (None, "state", "branch")]
    for levels, net, mode in cases:
        opts = MGRITOptions(max_levels=levels, cfactor=4, max_iters=2, min_coarse=1,
                            skip_first_downcycle=False, nrelax=1)
        got = []
        for fused in (False, True):
            torch.manual_seed(1)
            spatial = layerbraid.SpatialCoarsening([1], mode=mode) if mode else None
            model = net(WORLD, num_steps=16, forward_options=opts, backward_options=opts,
                        spatial=spatial, fused=fused)
            # one level on one rank runs as plain autograd unless traced (Note [serial path])
            model.set_trace(levels == 1)
            xx = x.clone().requires_grad_(True)
            calls[0] = 0
            model(xx).square().sum().backward()
            got.append((calls[0], xx.grad,
                        [p.grad for _, layer in model.owned_steps() for p in layer.parameters()]))
            model.free()
        (n_step, gx_step, gp_step), (n_fused, gx_fused, gp_fused) = got
        case = (levels, net.__name__, mode)
        if levels == 1:
            # one level: a rank's block is one run, stepped in one autograd call; but the first
            # rank, a second call for the parameters, off the pipeline's critical path (Note
            # [deferred parameter gradients])
            assert n_fused == (1 if WORLD.Get_rank() == 0 else 2), (case, n_fused)
        else:
            assert n_fused < n_step, case
        assert torch.allclose(gx_fused, gx_step, rtol=ROUNDOFF, atol=0), case
        for a, b in zip(gp_fused, gp_step):
            assert torch.allclose(a, b, rtol=ROUNDOFF, atol=ROUNDOFF * float(b.abs().max())), case


def _has_chain_node(t):
    """Whether ``t``'s autograd graph goes through a layer-parallel solve (_ChainFn)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "_ChainFnBackward":
            return True
        stack.extend(f for f, _ in fn.next_functions)
    return False


class _OddTime(ODEResNet):
    """T = 1.3: step sizes that are not the same to the bit (the core's t_{i+1} - t_i)."""

    def __init__(self, comm, num_steps):
        LayerParallelModule.__init__(self, num_steps=num_steps, t_final=1.3, comm=comm)
        self.channels = 4
        self.open = nn.Conv2d(1, 4, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))


@pytest.mark.parallel([1])
def test_one_rank_exact_runs_as_plain_autograd_and_equals_the_solver_path(monkeypatch):
    """Note [serial path]: one rank, one level: the steps run in the caller's graph with no
    solver and no nested autograd call, and give the solver path's output, input gradient and
    parameter gradients bit for bit (float64 and float32, step sizes that are not powers of 2,
    a custom step rule), the serial network's too; the solve statistics are an exact solve's;
    gradients accumulate over backwards as in PyTorch."""
    calls = _count_autograd_calls(monkeypatch)
    for net, dtype, steps in [(ODEResNet, torch.float64, 8), (_OddTime, torch.float32, 24),
                              (_OddTime, torch.float64, 7), (_Damped, torch.float64, 7)]:
        torch.manual_seed(2)
        model = net(MPI.COMM_SELF, num_steps=steps).to(dtype)
        x, y = batch(dtype=dtype)
        got = []
        for traced in (False, True):  # a trace needs the core: the solver path
            model.set_trace(traced)
            model.zero_grad()
            xx = x.clone().requires_grad_(True)
            calls[0] = 0
            out = model(xx)
            assert _has_chain_node(out) == traced, (net.__name__, traced)
            F.cross_entropy(out, y).backward()
            assert (calls[0] == 0) == (not traced), (net.__name__, traced, calls[0])
            got.append((out.detach(), xx.grad, [p.grad.clone() for p in model.parameters()]))
            for stats in (model.forward_stats, model.backward_stats):
                assert stats.iterations == 0 and stats.error_estimate == 0.0, stats
                assert stats.seconds > 0, stats
        (out_s, gx_s, gp_s), (out_c, gx_c, gp_c) = got
        case = (net.__name__, dtype, steps)
        assert torch.equal(out_s, out_c) and torch.equal(gx_s, gx_c), case
        assert all(torch.equal(a, b) for a, b in zip(gp_s, gp_c)), case
        assert model.gradient_error_estimate() == 0.0
        serial = model.to_serial()
        xs = x.clone().requires_grad_(True)
        F.cross_entropy(serial(xs), y).backward()
        torch.testing.assert_close(xs.grad, gx_s, rtol=ROUNDOFF, atol=0)
        # .grad accumulates: a second forward and backward on the serial path doubles it
        model.set_trace(False)
        F.cross_entropy(model(x), y).backward()
        for a, p in zip(gp_c, model.parameters()):
            torch.testing.assert_close(p.grad, 2 * a, rtol=ROUNDOFF, atol=0)
        model.free()


def _chain_runs(t):
    """The layer-parallel runs in ``t``'s autograd graph (their nodes keep the run)."""
    seen, stack, runs = set(), [t.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "run"):
            runs.append(fn.run)
        stack.extend(f for f, _ in fn.next_functions)
    return runs


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_a_multilevel_forward_keeps_no_state_beyond_its_graphs():
    """Between a 2-level forward and its backward the only states alive are the kept graphs'
    (Note [unchained outputs]): the cores hold none after a solve, and a step's output that no
    step takes as its input (a C-point's new value) is kept as a gradient edge, not a tensor;
    the gradients are still the step-by-step path's."""
    x, _ = batch(n=2)
    opts = MGRITOptions(max_levels=2, cfactor=4, max_iters=2, min_coarse=1)
    grads = []
    for fused in (True, False):
        torch.manual_seed(1)
        model = ODEResNet(WORLD, num_steps=16, forward_options=opts, backward_options=opts,
                          fused=fused)
        out = model(x.clone())
        runs = _chain_runs(out)
        assert len(runs) == 1
        assert not model._chain.fwd._table, "the forward core kept states after its solve"
        if fused:
            graphs = list(runs[0].graphs.values())
            xs = {id(g.x) for g in graphs}
            tensors = [g for g in graphs if isinstance(g.y, torch.Tensor)]
            assert all(id(g.y) in xs for g in tensors)
            assert len(tensors) < len(graphs)  # the C-points' new values went
        out.square().sum().backward()
        assert not model._chain.bwd._table, "the adjoint core kept states after its solve"
        grads.append([p.grad for _, layer in model.owned_steps() for p in layer.parameters()])
        model.free()
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=ROUNDOFF, atol=ROUNDOFF * float(b.abs().max()))
