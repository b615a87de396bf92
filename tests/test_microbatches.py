"""The exact path in microbatches (``microbatches=M``): the batch pipelined through the ranks,
equal to the batched path and to serial PyTorch to round-off in float64."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layerbraid
from layerbraid import LayerParallelModule, MGRITOptions
from layerbraid.depth.spline import SplineModule
from layerbraid.nn import ConvBlock
from nets import ODEResNet, assert_gradients_match, batch, compare_with_serial, train
from tolerances import ROUNDOFF
from transports import WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def _compare(model, x, y):
    compare_with_serial(model, x, y, ROUNDOFF, WORLD)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("chosen", [None, 2, 3])
def test_ranks_past_the_first_split_their_first_vjps(monkeypatch, chosen):
    """Past the first rank, the first VJPs of a backward are split (the input's gradient sent
    first, the weights' computed later: zero-bubble's B/W split), the rest fused: one until
    the rank has timed a few passes, then as many as its planner chooses (here forced: 2, or
    all 3); with serial's gradients either way."""
    from layerbraid._engine import pipeline

    calls = []

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    real = pipeline.split_vjp
    monkeypatch.setattr(pipeline, "split_vjp", counted)
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=6, microbatches=3)
    if chosen is not None:
        monkeypatch.setattr(model._split_planner, "split_first", lambda ranks, m: chosen)
    _compare(model, *batch(n=6))
    assert calls == ([] if WORLD.rank == 0 else [True] * (chosen or 1))


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_a_rank_that_splits_vjps_looks_up_their_helpers_when_the_model_is_built(monkeypatch):
    """The split's torch helpers (importing torch.distributed.pipelining: most of a second on
    a busy node) are looked up when a microbatched model is built on a rank past the first,
    not in its first backward, where each rank's import in turn held up the ranks to its left
    (16 emulated ranks on 2 cores: a first batch of 8.9 s against 2.1)."""
    from layerbraid._engine import torch_private

    monkeypatch.setattr(torch_private, "_FOUND", torch_private._Found())
    ODEResNet(WORLD, num_steps=4, microbatches=2).free()
    looked_up = [p for p in torch_private._FOUND if p.startswith("torch.distributed.pipelining")]
    assert len(looked_up) == (2 if WORLD.rank > 0 else 0)
    ODEResNet(WORLD, num_steps=4).free()  # one microbatch: no split, no lookup
    monkeypatch.setattr(torch_private, "_FOUND", torch_private._Found())
    ODEResNet(WORLD, num_steps=4).free()
    assert not torch_private._FOUND


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3, 4])
def test_microbatches_equal_serial_to_roundoff():
    # 7 samples in 3 microbatches of 3, 2, 2; more microbatches than samples; 9 steps that do
    # not divide evenly over the ranks
    for m, n in ((3, 7), (2, 6), (10, 4)):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=9, microbatches=m)
        _compare(model, *batch(n=n))
        assert model.forward_stats.iterations == 0


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_training_in_microbatches_follows_serial_and_gradients_accumulate():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=6, microbatches=3)
    serial = model.to_serial()
    torch.testing.assert_close(
        torch.tensor(train(model, 4)), torch.tensor(train(serial, 4)), rtol=1e-10, atol=1e-10
    )
    # two backwards without zero_grad: the gradients add up, as in PyTorch
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    model.zero_grad()
    serial.zero_grad()
    for x, y in ((x1, y1), (x2, y2)):
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(serial(x), y).backward()
    assert_gradients_match(model, serial, ROUNDOFF, WORLD)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_microbatches_keep_the_step_rule_the_eval_mode_and_retained_graphs():
    class Midpoint(ODEResNet):
        def step_rule(self, layer, x, dt, index):
            return x + dt * layer(x + 0.5 * dt * layer(x))

    torch.manual_seed(0)
    model = Midpoint(WORLD, num_steps=4, microbatches=2)
    _compare(model, *batch())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batch()[0]), model.to_serial().eval()(batch()[0]),
                                   rtol=ROUNDOFF, atol=ROUNDOFF)
    model.train()
    model.retain_graphs = True
    model.zero_grad()
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    loss.backward()
    twice = [p.grad for p in model.parameters() if p.grad is not None]
    for a, b in zip(once, twice):
        torch.testing.assert_close(2 * a, b, rtol=ROUNDOFF, atol=ROUNDOFF)


class _Normed(LayerParallelModule):
    def __init__(self, comm, **kw):
        super().__init__(num_steps=4, comm=comm, **kw)

    def step_layer(self, index):
        return nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.BatchNorm2d(1))


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_a_batch_norm_in_training_is_refused_with_microbatches_and_runs_in_eval():
    torch.manual_seed(0)
    x = batch()[0]
    mgrit = MGRITOptions(max_levels=2, cfactor=2, max_iters=1)
    with pytest.raises(ValueError, match="microbatches > 1 with a batch norm in training mode"):
        _Normed(WORLD, microbatches=2, forward_options=mgrit, backward_options=mgrit)(x)
    model = _Normed(WORLD, microbatches=2)
    with pytest.raises(ValueError, match="microbatches > 1 with a batch norm in training mode"):
        model(x)
    model.eval()  # running statistics: each sample alone
    serial = model.to_serial().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), serial(x), rtol=ROUNDOFF, atol=ROUNDOFF)


def _solved(m, opts, seed=0, **kw):
    """A fresh ODEResNet in ``m`` microbatches: its output, input gradient, parameter
    gradients and the two solves' residual norms on one batch of 7."""
    torch.manual_seed(seed)
    model = ODEResNet(WORLD, forward_options=opts, backward_options=opts, microbatches=m, **kw)
    x, y = batch(n=7)
    x.requires_grad_(True)
    out = model(x)
    F.cross_entropy(out, y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    measured = [
        [*st.residual_norms, st.final_residual, st.raw_error_estimate]
        for st in (model.forward_stats, model.backward_stats)
    ]
    return (out, x.grad, grads, *measured)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3, 4])
@pytest.mark.parametrize("levels, cfactor, cycle", [(2, 2, "V"), (3, 2, "F"), (2, 3, "V")])
def test_mgrit_in_microbatches_equals_the_batched_solve(levels, cfactor, cycle):
    """Note [parts] in cbridge/src/cycle.c: at fixed iteration counts MGRIT in microbatches is
    the batched solve to round-off: output, every gradient and the residual norms."""
    opts = MGRITOptions(max_levels=levels, cfactor=cfactor, max_iters=2, tol=0.0, cycle=cycle)
    ref = _solved(1, opts, num_steps=12)
    for m in (2, 3, 7):  # 7 samples: 4+3, 3+2+2, one each
        got = _solved(m, opts, num_steps=12)
        for a, b in zip(got[:2], ref[:2]):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=ROUNDOFF, atol=ROUNDOFF)
        assert len(got[2]) == len(ref[2])
        for a, b in zip(got[2], ref[2]):
            torch.testing.assert_close(a, b, rtol=ROUNDOFF, atol=ROUNDOFF)
        for a, b in zip(got[3:], ref[3:]):  # the residuals and the estimate: the batch's
            assert len(a) == len(b) > 2 and None not in a, (a, b)
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-9, atol=0)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_warm_started_mgrit_in_microbatches_equals_the_batched_solve():
    """Warm starts: each microbatch starts from its rows of the last solve's states."""
    opts = MGRITOptions(max_levels=2, cfactor=2, max_iters=1, tol=0.0)
    outs = []
    for m in (1, 3):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=8, forward_options=opts, backward_options=opts,
                          microbatches=m, warm_start=True)
        x, y = batch(n=7)
        runs = []
        for _ in range(3):
            out = model(x)
            F.cross_entropy(out, y).backward()
            runs.append(out.detach())
        outs.append(runs)
    assert not torch.equal(outs[0][0], outs[0][2])  # the warm start changed the solve
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=ROUNDOFF, atol=ROUNDOFF)


def test_more_microbatches_than_mgrit_takes_are_refused_naming_the_count():
    opts = MGRITOptions(max_levels=2, cfactor=2, max_iters=1)
    model = ODEResNet(WORLD, num_steps=4, forward_options=opts, backward_options=opts,
                      microbatches=300)
    with pytest.raises(ValueError, match="microbatches=300 with MGRIT solves: at most 254"):
        model(batch(n=300)[0])


_FAULT = {"where": None}  # what _Failing's step 5 does wrong (None: nothing)


def _raise(text):
    def hook(grad):
        raise RuntimeError(text)
    return hook


class _Failing(ODEResNet):
    """Step 5 raises in the forward, in its VJP, or only where its parameters' gradients are
    computed (past the first rank the exact path defers those: Note [deferred W]), as _FAULT
    says (the serial copy, which calls this rule with itself as ``self``, too)."""

    def step_rule(self, layer, x, dt, index):
        if index == 5 and _FAULT["where"] == "forward":
            raise RuntimeError("step 5 failed")
        y = x + dt * layer(x)
        if index == 5 and _FAULT["where"] == "backward":
            y.register_hook(_raise("step 5's VJP failed"))
        if index == 5 and _FAULT["where"] == "weights":
            q = next(layer.parameters()) * 1.0  # on the parameter's path alone
            q.register_hook(_raise("step 5's weight gradient failed"))
            y = y + 0.0 * q.sum()
        if index == 5 and _FAULT["where"] == "nan weights":
            q = next(layer.parameters()) * 1.0  # its gradient alone turns NaN
            q.register_hook(lambda grad: grad * float("nan"))
            y = y + 0.0 * q.sum()
        return y


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([3])
@pytest.mark.parametrize("where", ["forward", "backward", "weights"])
@pytest.mark.parametrize("levels", [1, 2])
def test_a_step_that_raises_in_a_microbatch_raises_on_every_rank(where, levels):
    """Step 5 of 9 runs on rank 1 of 3: rank 1 raises its own error, the ranks before and
    after it a RemoteRankError naming rank 1 and the message, none waits for the deadline;
    on the exact path (a failing weight gradient too, which rank 1 computes after it sent the
    input's gradient on) and in MGRIT's microbatched solves."""
    torch.manual_seed(0)
    opts = MGRITOptions(max_levels=levels, cfactor=3, max_iters=1)
    model = _Failing(WORLD, num_steps=9, microbatches=3, forward_options=opts,
                     backward_options=opts)
    _FAULT["where"] = where
    assert (5 in [i for i, _ in model.owned_steps()]) == (WORLD.rank == 1)
    x, y = batch()
    with pytest.raises(Exception) as info:
        F.cross_entropy(model(x), y).backward()
    if WORLD.rank == 1:
        assert type(info.value) is RuntimeError and "step 5" in str(info.value)
    else:
        assert isinstance(info.value, layerbraid.RemoteRankError), repr(info.value)
        assert "rank 1" in str(info.value) and "step 5" in str(info.value)
    # the layer group is still usable: the same model, without the fault
    _FAULT["where"] = None
    model.zero_grad()  # the close layer's backward ran before the failure
    if levels == 1:
        _compare(model, x, y)
    else:
        F.cross_entropy(model(x), y).backward()
        assert model.backward_stats.iterations == 1


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([3])
@pytest.mark.parametrize("levels", [1, 2])
def test_non_finite_gradients_on_one_rank_are_an_error_on_every_rank(levels):
    """Step 5's parameter gradient is NaN on rank 1 of 3 alone (its input's gradient is
    finite, so no other rank's is NaN): every rank raises the FloatingPointError naming rank 1,
    on the exact path in microbatches (where the finiteness check shares the error check's
    reduction) and in MGRIT's microbatched solves; the model trains on afterwards."""
    torch.manual_seed(0)
    opts = MGRITOptions(max_levels=levels, cfactor=3, max_iters=1)
    model = _Failing(WORLD, num_steps=9, microbatches=3, forward_options=opts,
                     backward_options=opts)
    x, y = batch()
    _FAULT["where"] = "nan weights"
    try:
        with pytest.raises(FloatingPointError, match=r"non-finite gradients \(NaN or Inf\) "
                                                      r"on rank 1:"):
            F.cross_entropy(model(x), y).backward()
    finally:
        _FAULT["where"] = None
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_microbatch_count_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"microbatches must be an int .*got {bad!r}"):
        ODEResNet(WORLD, num_steps=4, microbatches=bad)


def test_the_microbatch_sizes_are_tensor_splits():
    from layerbraid._engine.pipeline import microbatch_sizes

    for batch_size in range(1, 12):
        for m in range(1, 14):
            want = [len(c) for c in torch.arange(batch_size).tensor_split(min(m, batch_size))]
            assert microbatch_sizes(batch_size, m) == want


class _Spline(SplineModule):
    """Spline step weights: the chain's inputs are the evaluated weights, whose gradients go
    back to the coefficient sets through an autograd Function of their own."""

    def __init__(self, comm, **kw):
        super().__init__(num_steps=6, comm=comm, nsplines=3, degree=1, **kw)
        self.open = nn.Conv2d(1, 4, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

    def coefficient_layer(self, index):
        return ConvBlock(4)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_spline_weights_in_microbatches_equal_the_batched_solve():
    grads = []
    for m in (1, 3):
        torch.manual_seed(0)
        model = _Spline(WORLD, microbatches=m)
        x, y = batch()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=ROUNDOFF, atol=ROUNDOFF)
