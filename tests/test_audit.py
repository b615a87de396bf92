"""Gradient audits and the calibrated error estimate, against serial copies, in training."""
import math

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import MGRITOptions
from layerbraid.nn import ConvBlock, LayerParallelGRU, LPBatchNorm2d
from nets import ODEResNet, batch
from tolerances import CALIBRATED_FACTOR, ROUNDOFF
from transports import WORLD



@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def opts(iters, levels=2, cfactor=4):
    return MGRITOptions(max_levels=levels, cfactor=cfactor, max_iters=iters, nrelax=0, tol=0.0,
                        skip_first_downcycle=True)


def net(comm, steps=24, **kw):
    torch.manual_seed(0)
    kw.setdefault("forward_options", opts(2))
    kw.setdefault("backward_options", opts(1))
    return ODEResNet(comm, num_steps=steps, channels=4, size=8, classes=3, **kw)


def serial_error(model, x, y):
    """The true relative error of the model's parameter gradients against a serial copy with
    the same weights on the same batch (collective)."""
    from layerbraid._engine.parts import counted_parameters

    serial = model.to_serial()
    F.cross_entropy(serial(x), y).backward()
    ref = dict(serial.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    num = den = 0.0
    for p in counted_parameters(model)[1]:
        q = ref[names[id(p)]].grad
        g = p.grad if p.grad is not None else torch.zeros_like(q)
        num += float((g - q).pow(2).sum())
        den += float(q.pow(2).sum())
    return math.sqrt(WORLD.allreduce(num) / WORLD.allreduce(den))


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_audit_measures_the_serial_error_and_changes_nothing():
    assert WORLD.Get_size() in (1, 2, 3)
    model = net(WORLD)
    x, y = batch(n=8, seed=0)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fstats, bstats = model.forward_stats, model.backward_stats
    audit = layerbraid.accuracy.audit_gradients(model, lambda: F.cross_entropy(model(x), y))
    true = serial_error(model, x, y)
    assert 1e-4 < audit.error  # 2/1 iterations: a real error to measure
    assert audit.error == pytest.approx(true, rel=1e-9)
    assert audit.raw_estimate == pytest.approx(model.gradient_error_estimate(), rel=ROUNDOFF)
    assert audit.estimate == audit.raw_estimate  # no audit before: uncalibrated
    assert audit.calibration == pytest.approx(audit.error / audit.raw_estimate, rel=ROUNDOFF)
    assert audit.seconds > 0 and audit.ratio == pytest.approx(1 / audit.calibration)
    # the same everywhere, bit for bit
    assert WORLD.allgather((audit.error, audit.calibration)) == \
        [(audit.error, audit.calibration)] * WORLD.Get_size()
    # nothing the training loop sees has changed
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert after.keys() == grads.keys()
    assert all(torch.equal(after[n], grads[n]) for n in grads)
    assert model.forward_stats is fstats and model.backward_stats is bstats
    # the calibration applies from the next solve on
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    st = model.backward_stats
    assert st.error_estimate == pytest.approx(audit.calibration * st.raw_error_estimate,
                                              rel=ROUNDOFF)
    model.free()


class BNNet(layerbraid.LayerParallelModule):
    def __init__(self, comm, **kw):
        super().__init__(num_steps=8, comm=comm, **kw)
        self.open = nn.Conv2d(1, 3, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3))


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_audit_and_probe_leave_batch_norm_statistics_and_warm_starts_alone():
    assert WORLD.Get_size() in (1, 2)
    torch.manual_seed(0)
    o = opts(2, cfactor=2)
    model = BNNet(WORLD, forward_options=o, backward_options=o, warm_start=True)
    x, y = batch(n=8, seed=3)
    F.cross_entropy(model(x), y).backward()
    buffers = [b.clone() for b in model.buffers()]
    warm = dict(model._chain._warm_fwd), dict(model._chain._warm_bwd)
    audit = layerbraid.accuracy.audit_gradients(model, lambda: F.cross_entropy(model(x), y))
    assert audit.error == pytest.approx(serial_error(model, x, y), rel=1e-9)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert model._chain._warm_fwd.keys() == warm[0].keys()
    assert all(model._chain._warm_fwd[k] is v for k, v in warm[0].items())
    assert all(model._chain._warm_bwd[k] is v for k, v in warm[1].items())
    # a probe continues from the batch's own solution, in a solver of its own, and leaves
    # those states as they were
    values = [(v, v.clone()) for d in warm for v in d.values()]
    probe = layerbraid.accuracy.probe_gradients(model, lambda: F.cross_entropy(model(x), y))
    assert all(torch.equal(v, saved) for v, saved in values)
    assert probe.iterations == [(3, 3)]
    assert audit.error / CALIBRATED_FACTOR <= probe.change <= audit.error * CALIBRATED_FACTOR
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert all(model._chain._warm_fwd[k] is v for k, v in warm[0].items())
    assert all(model._chain._warm_bwd[k] is v for k, v in warm[1].items())
    model.free()


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_estimates_hold_on_a_trained_amplifying_network():
    """24 ReLU conv steps, 2/1 iterations, SGD with momentum: as training makes the steps
    amplify, the true gradient error grows several times over; audits every 8 batches keep
    the calibrated estimate, judged at the batches between them, within the factor of the
    truth, while the raw estimate alone drifts away from it.  The probe (one more iteration)
    is within the factor at every judged batch with no calibration at all, and leaves the
    gradients as they were."""
    assert WORLD.Get_size() in (1, 3)
    model = net(WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    judged, errors = [], []
    for b in range(41):
        x, y = batch(n=16, seed=b)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if b % 8 == 0:
            audit = layerbraid.accuracy.audit_gradients(model, lambda: F.cross_entropy(model(x), y))
            errors.append(audit.error)
        elif b % 4 == 0 and b > 8:
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            probe = layerbraid.accuracy.probe_gradients(model, lambda: F.cross_entropy(model(x), y))
            assert all(p.grad is g is None or torch.equal(p.grad, g)
                       for p, g in zip(model.parameters(), grads))
            assert probe.iterations == [(3, 2)]
            true = serial_error(model, x, y)
            judged.append((b, model.gradient_error_estimate(), true,
                           model._raw_gradient_error_estimate(), probe.change))
        opt.step()
    assert errors[-1] > 3 * errors[0], errors  # the network came to amplify errors
    for b, est, true, raw, change in judged:
        assert true / CALIBRATED_FACTOR <= est <= true * CALIBRATED_FACTOR, (b, est, true)
        assert true / CALIBRATED_FACTOR <= change <= true * CALIBRATED_FACTOR, (b, change, true)
    assert any(raw > true * CALIBRATED_FACTOR for _, _, true, raw, _ in judged), judged
    model.free()


def _relative_change(model, other):
    """|g_other - g_model| / |g_other| over the model's counted parameters (collective)."""
    from layerbraid._engine.parts import counted_parameters

    theirs = dict(other.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    num = den = 0.0
    for p in counted_parameters(model)[1]:
        q = theirs[names[id(p)]].grad
        num += float((p.grad - q).pow(2).sum())
        den += float(q.pow(2).sum())
    return math.sqrt(WORLD.allreduce(num) / WORLD.allreduce(den))


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_tuner_lowers_by_the_change_of_one_iteration_fewer():
    """At a loose target the tuner tries one iteration fewer in every solve, from the cold
    guess: its lower_change is the change of a copy run at those counts, to round-off; the
    counts go down, and the next batch runs them, with its gradients those of the copy."""
    assert WORLD.Get_size() in (1, 2)
    model = net(WORLD, steps=16, forward_options=opts(3), backward_options=opts(2))
    fewer = net(WORLD, steps=16)  # 2/1
    x, y = batch(n=8, seed=2)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(fewer(x), y).backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    tuner = layerbraid.accuracy.IterationTuner(model, 0.9, every=4)
    assert tuner.iterations == [None]
    t = tuner(lambda: F.cross_entropy(model(x), y), 0)
    assert all(p.grad is g is None or torch.equal(p.grad, g)
               for p, g in zip(model.parameters(), grads))
    assert t.ran == [(3, 2)] and t.iterations == [(2, 1)] == tuner.iterations
    assert tuner.aim == 0.45 and t.aim == 0.45  # the target over the default margin 2
    assert t.change <= 0.45 and 1e-4 < t.lower_change <= 0.45
    ref = _relative_change(fewer, model)  # |g_2/1 - g_3/2| / |g_3/2|
    assert t.lower_change == pytest.approx(ref, rel=1e-9)
    assert WORLD.allgather(t.lower_change) == [t.lower_change] * WORLD.Get_size()
    assert tuner(lambda: F.cross_entropy(model(x), y), 3) is None  # not due: nothing runs
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # at the tuned counts
    assert (model.forward_stats.iterations, model.backward_stats.iterations) == (2, 1)
    assert _relative_change(model, fewer) < ROUNDOFF
    # at a tight target the probe's change is above it: every count goes up by one, capped
    t = layerbraid.accuracy.IterationTuner(model, 1e-9, every=4, max_iterations=2)(
        lambda: F.cross_entropy(model(x), y), 0)
    assert t.ran == [(2, 1)] and t.iterations == [(2, 2)] and t.lower_change is None
    for m in (model, fewer):
        m.free()


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_tuner_climbs_within_the_batch_until_a_change_meets_the_aim():
    """Above the aim the tuner solves the batch again at one iteration more each time, until
    the change of one iteration meets the aim: the counts become the fewest that met it, and
    the batch trains on the climb's last solve, whose gradients (those of a copy solved at its
    counts, to round-off) and solve statistics become the model's, so that an audit of the
    batch judges the estimate of the gradients trained on.  A scheduled probe that meets the
    aim then tries one fewer; a climb that reaches max_iterations stops there."""
    assert WORLD.Get_size() in (1, 2)
    model = net(WORLD, steps=16, forward_options=opts(1), backward_options=opts(1))
    x, y = batch(n=8, seed=2)
    tuner = layerbraid.accuracy.IterationTuner(model, 1e-9, every=50)

    def step(b):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return tuner(lambda: F.cross_entropy(model(x), y), b)

    t = step(100)
    assert t.ran == [(1, 1)] and t.change > tuner.aim and t.lower_change is None
    k = 1 + len(t.climb)  # the counts the climb stopped at, verified by its last change
    assert len(t.climb) >= 2 and t.climb[-1] <= tuner.aim < min(t.climb[:-1]), t.climb
    assert t.iterations == [(k, k)] == tuner.iterations
    assert WORLD.allgather(t.climb) == [t.climb] * WORLD.Get_size()
    # the batch trains on the last solve, at k + 1: a copy's gradients, and its statistics
    more = net(WORLD, steps=16, forward_options=opts(k + 1), backward_options=opts(k + 1))
    F.cross_entropy(more(x), y).backward()
    assert _relative_change(model, more) < ROUNDOFF
    assert (model.forward_stats.iterations, model.backward_stats.iterations) == (k + 1, k + 1)
    assert model._raw_gradient_error_estimate() == \
        pytest.approx(more._raw_gradient_error_estimate(), rel=1e-9)
    audit = layerbraid.accuracy.audit_gradients(model, lambda: F.cross_entropy(model(x), y),
                                       calibrate=False)
    assert audit.raw_estimate == pytest.approx(more._raw_gradient_error_estimate(), rel=1e-9)
    assert audit.error == pytest.approx(serial_error(model, x, y), rel=1e-6, abs=1e-13)
    more.free()
    assert step(101) is None  # off the schedule: nothing runs
    assert (model.forward_stats.iterations, model.backward_stats.iterations) == (k, k)
    tuner.target = 0.9
    t = step(150)  # scheduled and met: one fewer is tried, and kept
    assert t.ran == [(k, k)] and t.climb == [] and t.lower_change <= tuner.aim
    assert t.iterations == [(k - 1, k - 1)]
    tuner.target, tuner.max_iterations = 1e-12, k
    t = step(200)  # a climb to the cap: nothing to compare the cap with, so it ends there
    assert t.ran == [(k - 1, k - 1)] and t.iterations == [(k, k)] and t.climb == []
    assert len(tuner.history) == 3
    model.free()


def test_a_climb_keeps_its_last_solves_warm_start_states():
    """With warm starts, the states the next batch starts from are those of the solve the
    batch trains on (the climb's last), not the batch's own: the same batch solved next at the
    tuned counts from them is as exact as that solve."""
    model = net(MPI.COMM_SELF, steps=16, forward_options=opts(1), backward_options=opts(1),
                warm_start=True)
    x, y = batch(n=8, seed=2)
    F.cross_entropy(model(x), y).backward()
    first = serial_error(model, x, y)
    t = layerbraid.accuracy.IterationTuner(model, 1e-9, every=50)(
        lambda: F.cross_entropy(model(x), y), 0)
    assert t.climb and t.climb[-1] <= 5e-10, t
    trained = serial_error(model, x, y)
    assert trained < 1e-8 < first, (trained, first)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # at the tuned counts, from the adopted states
    assert serial_error(model, x, y) < 1e-8
    model.free()


def test_the_tuner_holds_the_probe_to_the_target_over_its_margin():
    """A probe below the target but above target / margin (the aim) starts a climb; with margin 1 the same probe meets the
    target and nothing is raised.  The probe is the same deterministic solve both times."""
    x, y = batch(n=8, seed=2)
    changes = {}
    for margin in (2.0, 1.0):
        model = net(MPI.COMM_SELF, steps=16, forward_options=opts(1), backward_options=opts(1))
        F.cross_entropy(model(x), y).backward()
        p = layerbraid.accuracy.probe_gradients(model, lambda: F.cross_entropy(model(x), y)).change
        assert 1e-3 < p < 0.6, p
        tuner = layerbraid.accuracy.IterationTuner(model, 1.5 * p, every=4, margin=margin)
        t = tuner(lambda: F.cross_entropy(model(x), y), 0)
        changes[margin] = t.change
        assert t.change == pytest.approx(p, rel=1e-9) and t.change <= tuner.target
        assert t.aim == pytest.approx(1.5 * p / margin)
        if margin == 2.0:  # above the aim: a climb
            assert t.iterations[0] > (1, 1) and t.climb and t.lower_change is None
        else:  # meets the aim; at 1/1 there is nothing lower to try
            assert t.iterations == [(1, 1)] and not t.climb and t.lower_change is None
        model.free()
    assert changes[2.0] == pytest.approx(changes[1.0], rel=1e-9)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_tuned_iterations_meet_the_target_on_a_trained_amplifying_network():
    """24 ReLU conv steps trained with SGD with momentum, tuned to 1e-2 from 1/1 iterations:
    the counts go down one at a time and up as far as a climb within the batch finds needed,
    the batches probed are the schedule's, every later batch runs the counts, and the true error at the tuned counts (audited on the
    batches between the probes) is below the target at every audit after the first probes
    (the tuner aims at half of it), on any rank count."""
    assert WORLD.Get_size() in (1, 3)
    model = net(WORLD, forward_options=opts(1), backward_options=opts(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tuner = layerbraid.accuracy.IterationTuner(model, 1e-2, every=6)
    errors, tunings = [], []
    for b in range(37):
        x, y = batch(n=16, seed=b)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if tuner.iterations[0] is not None:  # every batch runs the tuned counts
            assert [(model.forward_stats.iterations, model.backward_stats.iterations)] == \
                tuner.iterations
        t = tuner(lambda: F.cross_entropy(model(x), y), b)
        assert (t is not None) == layerbraid.accuracy.audit_due(b, 6), b  # probed on the schedule
        if t is not None:
            tunings.append(t)
            if t.climb:  # up to the counts whose change met the aim (or to the cap)
                assert t.change > tuner.aim and t.iterations[0][0] == t.ran[0][0] + len(t.climb)
                assert t.climb[-1] <= tuner.aim or t.iterations[0][0] == tuner.max_iterations
            elif t.iterations != t.ran:  # down by one where the lower counts meet the aim
                assert t.lower_change <= tuner.aim
                assert all(a - c == 1 for a, c in zip(t.ran[0], t.iterations[0]))
        elif b > 12 and b % 3 == 0:
            errors.append((b, serial_error(model, x, y), tuner.iterations))
        opt.step()
    assert tunings[0].ran == [(1, 1)] and tunings[0].change > 1e-2  # 1/1 is not enough
    assert max(t.iterations[0][0] for t in tunings) >= 2
    for b, err, its in errors:  # the margin is room for the probe's factor and the drift
        assert err <= 1e-2, (b, err, its, errors)
    model.free()


def test_tuner_arguments_are_checked():
    model = net(MPI.COMM_SELF, steps=8)
    for bad, match in [(dict(target=None), "target"), (dict(target=0.0), "target_error"),
                       (dict(target=1.5), "target_error"), (dict(target=1e-2, every=0), "every"),
                       (dict(target=1e-2, max_iterations=True), "max_iterations"),
                       (dict(target=1e-2, margin=0.5), "margin"),
                       (dict(target=1e-2, margin=float("nan")), "margin"),
                       (dict(target=1e-2, margin="2"), "margin")]:
        with pytest.raises(ValueError, match=match):
            layerbraid.accuracy.IterationTuner(model, **bad)
    adaptive = net(MPI.COMM_SELF, steps=8, target_error=1e-2)
    with pytest.raises(ValueError, match="target_error=0.01"):
        layerbraid.accuracy.IterationTuner(adaptive, 1e-2)
    with pytest.raises(ValueError, match="layer-parallel"):
        layerbraid.accuracy.IterationTuner(nn.Linear(2, 2), 1e-2)
    for m in (model, adaptive):
        m.free()


def test_a_tuned_solve_is_the_chains_own():
    """What a tuned solve leaves (statistics, warm-start states) is its chain's, so that warm
    starts continue across the tuned batches; a change of the counts builds one new solver."""
    model = net(MPI.COMM_SELF, steps=16, warm_start=True)
    x, y = batch(n=8, seed=2)
    F.cross_entropy(model(x), y).backward()
    tuner = layerbraid.accuracy.IterationTuner(model, 1e-12, every=2, max_iterations=2)
    tuner(lambda: F.cross_entropy(model(x), y), 0)  # up to the cap, 2/2
    chain = model._chain
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert chain._tuned_key == (2, 2) and chain.forward_stats.iterations == 2
    assert chain._warm_fwd is chain._tuned._warm_fwd and chain._warm_fwd
    assert chain._warm_bwd is chain._tuned._warm_bwd and chain._warm_bwd
    old = chain._tuned
    tuner.max_iterations = 3
    x, y = batch(n=8, seed=3)  # a new batch, which the states do not solve
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    tuner(lambda: F.cross_entropy(model(x), y), 2)  # up to 3/3: a new solver, the old freed
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert chain._tuned is not old and old.freed and chain._tuned_key == (3, 3)
    model.free()
    assert chain._tuned is None


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_probe_is_the_change_of_one_more_iteration():
    """Without warm starts the probe re-solves from the same cold guess with one iteration
    more in each solve: its change is that of a copy run at 3/2 iterations, to round-off."""
    assert WORLD.Get_size() in (1, 2)
    model, more = net(WORLD, steps=16), net(WORLD, steps=16, forward_options=opts(3),
                                            backward_options=opts(2))
    x, y = batch(n=8, seed=2)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(more(x), y).backward()
    stats = model.forward_stats, model.backward_stats
    probe = layerbraid.accuracy.probe_gradients(model, lambda: F.cross_entropy(model(x), y))
    assert probe.change > 1e-4  # a real change to measure
    assert probe.change == pytest.approx(_relative_change(model, more), rel=1e-9)
    assert (model.forward_stats, model.backward_stats) == stats
    assert WORLD.allgather(probe.change) == [probe.change] * WORLD.Get_size()
    # exact: nothing to probe, and no probe solver is built
    exact = net(WORLD, steps=16, forward_options=opts(1, levels=1),
                backward_options=opts(1, levels=1))
    F.cross_entropy(exact(x), y).backward()
    probe = layerbraid.accuracy.probe_gradients(exact, lambda: F.cross_entropy(exact(x), y))
    assert probe.change == 0.0 and probe.iterations == [None] and not exact._chain._probes
    for m in (model, more, exact):
        m.free()


def test_a_chain_keeps_its_latest_probe_solvers_only():
    """Adaptive iterations probe at varying counts: the chain keeps the solvers of the last
    four pairs, the most recently used last, and frees the others."""
    from layerbraid._engine.chain import _PROBES_KEPT

    model = net(MPI.COMM_SELF, steps=8)
    chain = model._chain
    made = {k: chain.probe(k, 1) for k in range(1, 7)}
    assert list(chain._probes) == [(k, 1) for k in range(7 - _PROBES_KEPT, 7)]
    assert all(made[k].freed == (k < 7 - _PROBES_KEPT) for k in made)
    assert chain.probe(3, 1) is made[3]  # reused, and now the most recent
    assert list(chain._probes)[-1] == (3, 1)
    model.free()
    assert all(p.freed for p in made.values())


def test_probe_needs_a_backward_first():
    model = net(MPI.COMM_SELF, steps=8)
    x, y = batch(n=4, seed=0)
    with pytest.raises(ValueError, match="needs a backward first"):
        layerbraid.accuracy.probe_gradients(model, lambda: F.cross_entropy(model(x), y))
    with pytest.raises(ValueError, match="layer-parallel modules"):
        layerbraid.accuracy.probe_gradients(nn.Linear(2, 2), lambda: torch.zeros(()))
    model.free()


@pytest.mark.shared_job
@pytest.mark.parallel([2, 3, 4])
def test_estimate_does_not_depend_on_the_rank_count():
    """The same solve on every rank count gives the same estimates: the model on all ranks
    against a copy with the same weights on one rank (each rank runs one)."""
    size = WORLD.Get_size()
    assert size in (2, 3, 4)
    x, y = batch(n=8, seed=1)
    results, whole = [], None
    for comm in (WORLD, MPI.COMM_SELF):  # the layer-parallel model first, then its serial copy
        model = net(comm, steps=16)
        if comm is MPI.COMM_SELF:
            model.load_state_dict(whole)
        else:
            whole = model.to_serial().state_dict()
        F.cross_entropy(model(x), y).backward()
        results.append((model.forward_stats.error_estimate, model.backward_stats.error_estimate))
        model.free()
    (f_p, b_p), (f_1, b_1) = results
    assert f_p == pytest.approx(f_1, rel=1e-9) and b_p == pytest.approx(b_1, rel=1e-9)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_audit_and_probe_of_a_layer_parallel_gru():
    assert WORLD.Get_size() in (1, 2)
    torch.manual_seed(0)
    o = opts(1, cfactor=2)
    model = LayerParallelGRU(3, 5, num_layers=2, comm=WORLD, forward_options=o,
                             backward_options=o)
    ref = torch.nn.GRU(3, 5, num_layers=2, batch_first=True)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(1))

    def loss_of(m):
        return m(x)[0].pow(2).sum()

    loss_of(model).backward()
    loss_of(ref).backward()
    num = sum(float((p.grad - q.grad).pow(2).sum()) for p, q in
              zip(model.parameters(), ref.parameters()))
    den = sum(float(q.grad.pow(2).sum()) for q in ref.parameters())
    stats = model.forward_stats
    audit = layerbraid.accuracy.audit_gradients(model, lambda: loss_of(model))
    assert audit.error > 1e-6
    assert audit.error == pytest.approx(math.sqrt(num / den), rel=1e-9)
    assert model.forward_stats is stats
    assert audit.raw_estimate is not None and audit.calibration > 0
    # the probe: the change of a copy at one iteration more (2/2), to round-off
    more = LayerParallelGRU(3, 5, num_layers=2, comm=WORLD, forward_options=opts(2, cfactor=2),
                            backward_options=opts(2, cfactor=2))
    more.load_state_dict(model.state_dict())
    loss_of(more).backward()
    probe = layerbraid.accuracy.probe_gradients(model, lambda: loss_of(model))
    assert probe.iterations == [(2, 2)]
    assert probe.change == pytest.approx(_relative_change(model, more), rel=1e-9)
    assert model.forward_stats is stats
    more.free()
    model.free()


def test_audit_arguments_are_checked():
    model = net(MPI.COMM_SELF, steps=4)
    with pytest.raises(ValueError, match="history must be an int >= 1, got 0"):
        layerbraid.accuracy.audit_gradients(model, lambda: None, history=0)
    with pytest.raises(ValueError, match="layer-parallel"):
        layerbraid.accuracy.audit_gradients(nn.Linear(2, 2), lambda: None)
    x, y = batch(n=4, seed=0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(TypeError, match="the closure must return the loss"):
        layerbraid.accuracy.audit_gradients(model, lambda: model(x))
    assert model.solve_mode is None  # left as it was
    model.free()


def test_audit_schedule_is_dense_at_the_start_then_every_k():
    due = [b for b in range(320) if layerbraid.accuracy.audit_due(b, 50)]
    assert due == [0, 1, 2, 4, 8, 16, 32, 50, 100, 150, 200, 250, 300]
    assert [b for b in range(10) if layerbraid.accuracy.audit_due(b, 1)] == list(range(10))
    assert [b for b in range(10) if layerbraid.accuracy.audit_due(b, 3)] == [0, 1, 2, 3, 6, 9]
    assert not any(layerbraid.accuracy.audit_due(b, 0) for b in range(10))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"batch must be an int >= 0, got {bad!r}"):
            layerbraid.accuracy.audit_due(bad, 50)
        with pytest.raises(ValueError, match=f"every must be an int >= 0, got {bad!r}"):
            layerbraid.accuracy.audit_due(0, bad)


def test_an_audit_at_round_off_leaves_the_calibration_alone():
    """Float32: an error of 5 epsilons is round-off and leaves the calibration as it is; one of
    20 epsilons calibrates."""
    from layerbraid.accuracy.audit import ROUNDOFF_EPSILONS, _calibrate

    class Part:
        def __init__(self):
            self.audit_ratios, self.calibration = [], None

        def _set_calibration(self, c):
            self.calibration = c

    eps = torch.finfo(torch.float32).eps
    assert ROUNDOFF_EPSILONS == 10
    parts = [Part(), Part()]
    assert _calibrate(parts, 5 * eps, 1e-3, eps, 3) == 1.0 and parts[0].audit_ratios == []
    assert _calibrate(parts, 20 * eps, 1e-3, eps, 3) == pytest.approx(20 * eps / 1e-3)
    assert [p.calibration for p in parts] == [pytest.approx(20 * eps / 1e-3)] * 2


def _trained_once_without_the_short_timeout(short):
    """A model built and run once under a generous timeout (its solvers keep the timeout they
    were built with), then the short one for the reductions the stall tests aim at: a loaded
    machine can hold a rank back for more than 2 s in a first solve."""
    layerbraid.set_timeout(120)
    model = net(WORLD, steps=8)
    x, y = batch(n=4, seed=0)
    F.cross_entropy(model(x), y).backward()
    layerbraid.set_timeout(short)
    return model, x, y


@pytest.mark.parallel([2])
@pytest.mark.parametrize("name, what", [("audit_gradients", "a gradient audit"),
                                        ("probe_gradients", "a gradient probe")])
def test_a_rank_that_stops_before_the_reduction_is_reported(monkeypatch, short_timeout, name,
                                                            what):
    """Rank 1 never reaches the audit's (or the probe's) reduction: rank 0 raises StallError
    naming it after the timeout instead of waiting forever; rank 1 ends with its own error."""
    assert WORLD.Get_size() == 2
    model, x, y = _trained_once_without_the_short_timeout(short_timeout)
    measure = getattr(layerbraid.accuracy, name)
    if WORLD.rank == 1:
        real = model.comm.allreduce_floats

        def stop(values, op, reduction):  # the audit's (or the probe's) own reduction only
            if reduction == what:
                raise RuntimeError("rank 1 stops before the reduction")
            return real(values, op, reduction)
        monkeypatch.setattr(model.comm, "allreduce_floats", stop)
    if WORLD.rank == 0:
        with pytest.raises(layerbraid.StallError, match=f"every rank's part of {what}"):
            measure(model, lambda: F.cross_entropy(model(x), y))
    else:
        with pytest.raises(RuntimeError, match="rank 1 stops before the reduction"):
            measure(model, lambda: F.cross_entropy(model(x), y))


@pytest.mark.parallel([2])
@pytest.mark.parametrize("target", [0.9, 1e-12], ids=["lower re-solve", "climb"])
def test_a_rank_that_stops_before_the_tuners_reduction_is_reported(monkeypatch, short_timeout,
                                                                   target):
    """Rank 1 probes with rank 0 but never reaches the reduction of the tuner's next solve (at
    a loose target the lower re-solve, at a tight one the climb's first): rank 0 raises
    StallError naming it after the timeout; rank 1 ends with its own error."""
    assert WORLD.Get_size() == 2
    model, x, y = _trained_once_without_the_short_timeout(short_timeout)
    tuner = layerbraid.accuracy.IterationTuner(model, target)
    if WORLD.rank == 1:
        real = model.comm.allreduce_floats

        def stop(values, op, what):
            if what == "an iteration tuner":
                raise RuntimeError("rank 1 stops before the tuner's reduction")
            return real(values, op, what)
        monkeypatch.setattr(model.comm, "allreduce_floats", stop)
    if WORLD.rank == 0:
        with pytest.raises(layerbraid.StallError, match="every rank's part of an iteration tuner"):
            tuner(lambda: F.cross_entropy(model(x), y), 0)
    else:
        with pytest.raises(RuntimeError, match="rank 1 stops before the tuner's reduction"):
            tuner(lambda: F.cross_entropy(model(x), y), 0)
