"""Moving between depths (layerbraid.depth): step weights and optimizer state, interpolated and
restricted on 1-3 ranks, equal to the same transfer done serially on the gathered networks."""
import time

import pytest
import torch
import torch.nn.functional as F

import layerbraid
from layerbraid import depth
from nets import ODEResNet, batch
from transports import WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def pair(n, cf, seed=0):
    torch.manual_seed(seed)
    coarse = ODEResNet(WORLD, num_steps=n)
    torch.manual_seed(seed + 1)
    fine = ODEResNet(WORLD, num_steps=n * cf)
    return coarse, fine


def serial_steps(model):
    """[state_dict of every step], in order, on every rank (collective)."""
    return [{k: v.clone() for k, v in layer.state_dict().items()}
            for layer in model.to_serial().layers]


def expected(steps, sources):
    return {k: sum(w * steps[i][k] for i, w in sources) for k in steps[sources[0][0]]}


def interp_sources(j, cf, n, rule):
    k, s = divmod(j, cf)
    if rule == "injection" or s == 0 or k + 1 >= n:
        return [(k, 1.0)]
    return [(k, 1.0 - s / cf), (k + 1, s / cf)]


def train(model, opt, steps=2):
    for k in range(steps):
        x, y = batch(seed=k)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def gathered_slots(model, opt, names):
    """{step: [{slot: tensor} per parameter]} of the whole network, on every rank."""
    mine = {i: [{n: opt.state[p][n].clone() for n in names} for p in layer.parameters()]
            for i, layer in model.owned_steps()}
    out = {}
    for part in WORLD.allgather_obj(mine, "the optimizer's slots"):
        out.update(part)
    return out


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("rule", ["injection", "linear"])
def test_interpolated_weights_equal_the_serial_interpolation(rule):
    # 5 -> 10 and 5 -> 15 steps: uneven blocks, and blocks that move between ranks with depth
    for n, cf in ((5, 2), (5, 3), (4, 2)):
        coarse, fine = pair(n, cf)
        steps = serial_steps(coarse)
        depth.interpolate(coarse, fine, rule)
        got = serial_steps(fine)
        for j in range(n * cf):
            want = expected(steps, interp_sources(j, cf, n, rule))
            for k, v in want.items():
                torch.testing.assert_close(got[j][k], v, rtol=1e-15, atol=0,
                                           msg=lambda m: f"{rule} {n}x{cf} step {j} {k}: {m}")


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
def test_restriction_inverts_injection_and_averages_as_serial():
    n, cf = 5, 3
    coarse, fine = pair(n, cf)
    depth.interpolate(coarse, fine, "linear")
    back = ODEResNet(WORLD, num_steps=n)
    depth.restrict(fine, back, "injection")
    for a, b in zip(serial_steps(coarse), serial_steps(back)):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    torch.manual_seed(5)
    fine2 = ODEResNet(WORLD, num_steps=n * cf)
    steps = serial_steps(fine2)
    depth.restrict(fine2, back, "average")
    got = serial_steps(back)
    for c in range(n):
        want = expected(steps, [(c * cf + s, 1.0 / cf) for s in range(cf)])
        for k, v in want.items():
            torch.testing.assert_close(got[c][k], v, rtol=1e-14, atol=1e-16)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("make, names", [
    (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), ["momentum_buffer"]),
    (lambda p: torch.optim.Adam(p, lr=1e-3), ["step", "exp_avg", "exp_avg_sq"]),
])
def test_optimizer_state_moves_with_the_weights(make, names):
    """After training the coarse network, its optimizer's slots interpolate onto a fresh
    optimizer of the fine one as the weights do; then both train on."""
    n, cf, rule = 5, 2, "linear"
    coarse, fine = pair(n, cf)
    opt_c, opt_f = make(coarse.parameters()), make(fine.parameters())
    train(coarse, opt_c)
    slots = gathered_slots(coarse, opt_c, names)
    depth.interpolate(coarse, fine, rule, optimizers=(opt_c, opt_f))
    for j, layer in fine.owned_steps():
        src = interp_sources(j, cf, n, rule)
        for q, p in enumerate(layer.parameters()):
            for name in names:
                want = sum(w * slots[i][q][name] for i, w in src)
                torch.testing.assert_close(opt_f.state[p][name].to(torch.float64),
                                           want.to(torch.float64), rtol=1e-15, atol=0)
    train(fine, opt_f, steps=1)  # the moved state is usable as it is


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
def test_adams_step_count_stays_whole_through_an_average():
    """Adam's step count is a count: restricted by averages of three (weights 1/3, whose sum
    of 7s is 6.999999999999999 in floating point) it is still 7."""
    coarse, fine = pair(2, 3)
    opt_f = torch.optim.Adam(fine.parameters(), lr=1e-3)
    train(fine, opt_f, steps=7)
    opt_c = torch.optim.Adam(coarse.parameters(), lr=1e-3)
    depth.restrict(fine, coarse, "average", optimizers=(opt_f, opt_c))
    for _, layer in coarse.owned_steps():
        for p in layer.parameters():
            assert float(opt_c.state[p]["step"]) == 7.0


@pytest.mark.parallel([1])
def test_bad_depths_and_rules_are_clear_errors():
    from mpi4py import MPI

    coarse = ODEResNet(MPI.COMM_SELF, num_steps=3)
    fine = ODEResNet(MPI.COMM_SELF, num_steps=7)
    with pytest.raises(ValueError, match="7 steps are not a multiple of the coarse network's 3"):
        depth.interpolate(coarse, fine)
    fine = ODEResNet(MPI.COMM_SELF, num_steps=6)
    with pytest.raises(ValueError, match="rule must be one of .*'cubic'"):
        depth.interpolate(coarse, fine, "cubic")
    with pytest.raises(ValueError, match="rule must be one of .*'linear'"):
        depth.restrict(fine, coarse, "linear")
    with pytest.raises(TypeError, match="RMSprop"):
        depth.interpolate(coarse, fine, optimizers=(torch.optim.RMSprop(coarse.parameters()),
                                                    torch.optim.RMSprop(fine.parameters())))


@pytest.mark.parallel([2])
def test_a_rank_that_never_transfers_is_reported(short_timeout):
    """Rank 1 never calls interpolate: rank 0 raises StallError naming the transfer after the
    timeout instead of waiting forever."""
    layerbraid.set_timeout(120)
    coarse, fine = pair(4, 2)
    layerbraid.set_timeout(short_timeout)
    if WORLD.rank == 0:
        with pytest.raises(layerbraid.StallError, match="the steps of interpolate"):
            depth.interpolate(coarse, fine)
    else:  # still running when rank 0 gives up (an exit would be reported as such instead)
        time.sleep(short_timeout + 3)


def built(comm, n, seed=None):
    """The ODEResNet of ``n`` steps with the same weights on any communicator: made whole on
    every rank, then distributed (each rank keeps its blocks)."""
    from mpi4py import MPI

    torch.manual_seed(n if seed is None else seed)
    whole = ODEResNet(MPI.COMM_SELF, num_steps=n).to_serial()
    return layerbraid.from_serial(whole, comm=comm)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3])
def test_refine_copies_the_ends_and_their_optimizer_state():
    coarse, fine = built(WORLD, 3, seed=1), built(WORLD, 6, seed=2)
    opt_c = torch.optim.Adam(coarse.parameters(), lr=1e-3)
    opt_f = torch.optim.Adam(fine.parameters(), lr=1e-3)
    train(coarse, opt_c)
    steps = serial_steps(coarse)
    depth.refine(coarse, fine, "linear", (opt_c, opt_f))
    got = serial_steps(fine)
    for j in range(6):
        for k, v in expected(steps, interp_sources(j, 2, 3, "linear")).items():
            torch.testing.assert_close(got[j][k], v, rtol=1e-15, atol=0)
    for name in ("open", "close"):
        a, b = getattr(coarse, name), getattr(fine, name)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), name
            if p in opt_c.state:  # on the rank that trains this end
                for slot, t in opt_c.state[p].items():
                    assert torch.equal(opt_f.state[q][slot], t), (name, slot)
    train(fine, opt_f, steps=1)


@pytest.mark.parallel([1])
def test_depths_are_checked():
    assert depth.depths(16, 3) == [4, 8, 16]
    assert depth.depths(12, 2, factor=3, ranks=4) == [4, 12]
    assert depth.depths(8, 1) == [8]
    with pytest.raises(ValueError, match="6 steps are not a multiple of 4"):
        depth.depths(24, 3, factor=4)
    with pytest.raises(ValueError, match="coarsest network would have 1 step.*fewer than the 2"):
        depth.depths(4, 3, ranks=2)
    with pytest.raises(ValueError, match="levels >= 1, got 0"):
        depth.depths(4, 0)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_nested_iteration_equals_the_one_rank_run():
    """3 -> 6 -> 12 steps, SGD with momentum carried over: on 2 and 3 ranks (blocks move
    between ranks with each refinement) the trained network equals the same nested iteration
    run on one rank from the same weights."""
    from mpi4py import MPI

    levels_seen = []

    def run(comm):
        def fit(model, opt, level):
            levels_seen.append((level, model.num_steps))
            train(model, opt, steps=2)

        return depth.nested_iteration(
            lambda n: built(comm, n), [3, 6, 12],
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), fit)

    model, opt = run(WORLD)
    reference, _ = run(MPI.COMM_SELF)
    assert levels_seen == [(0, 3), (1, 6), (2, 12)] * 2
    got, want = model.to_serial().state_dict(), reference.to_serial().state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_frozen_inherited_steps_stay_as_refined_and_the_rest_learn():
    """3 -> 6 steps with freeze=True: training at 6 steps leaves the even steps (the 3-step
    network's, inherited) exactly as refined and moves the odd ones; the run equals the same
    run on one rank; afterwards every parameter is trainable again."""
    from mpi4py import MPI

    seen = {}

    def run(comm):
        def fit(model, opt, level):
            if level:
                seen[comm is WORLD] = serial_steps(model)
            train(model, opt, steps=2)

        return depth.nested_iteration(
            lambda n: built(comm, n), [3, 6],
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), fit,
            freeze=True)

    model, _ = run(WORLD)
    reference, _ = run(MPI.COMM_SELF)
    after, refined = serial_steps(model), seen[True]
    for j in range(6):
        for k, v in refined[j].items():
            same = torch.equal(after[j][k], v)
            assert same == (j % 2 == 0), (j, k)
    assert all(p.requires_grad for _, layer in model.owned_steps() for p in layer.parameters())
    got, want = model.to_serial().state_dict(), reference.to_serial().state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14, msg=k)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2])
def test_nested_hierarchy_keeps_every_depth_for_mg_opt():
    """nested_hierarchy returns every depth's trained network and optimizer, finest first: the
    finest equals nested_iteration's, the coarser ones still run, and MG/Opt trains on them."""
    from layerbraid.depth.mgopt import MGOpt

    def make(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def fit(model, opt, level):
        train(model, opt, steps=2)

    models, opts = depth.nested_hierarchy(lambda n: built(WORLD, n), [3, 6, 12], make, fit)
    single, _ = depth.nested_iteration(lambda n: built(WORLD, n), [3, 6, 12], make, fit)
    assert [m.num_steps for m in models] == [12, 6, 3] and len(opts) == 3
    got, want = models[0].to_serial().state_dict(), single.to_serial().state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    x, y = batch(seed=5)
    mg = MGOpt(models, opts, state="reset")
    first = mg.step(lambda m: F.cross_entropy(m(x), y))
    for _ in range(3):
        last = mg.step(lambda m: F.cross_entropy(m(x), y))
    assert last < first


@pytest.mark.parallel([1])
def test_freezing_needs_a_refinement_and_plain_steps():
    model = built(WORLD, 6)
    with pytest.raises(ValueError, match="factor must be an int >= 2, got 1"):
        depth.freeze_inherited(model, 1)
    with pytest.raises(ValueError, match="6 steps are not a refinement by 4"):
        depth.freeze_inherited(model, 4)
    frozen = depth.freeze_inherited(model, 3)
    assert {id(p) for p in frozen} == {
        id(p) for j, layer in model.owned_steps() if j % 3 == 0 for p in layer.parameters()}


@pytest.mark.parallel([1])
def test_full_weighting_is_the_quarter_half_quarter_stencil():
    sources = depth.restriction("full_weighting", 8, 4)
    assert sources(1) == [(1, 0.25), (2, 0.5), (3, 0.25)]
    assert sources(2) == [(3, 0.25), (4, 0.5), (5, 0.25)]
    for k in range(4):  # at the ends too, the weights of a coarse step sum to 1
        assert sum(w for _, w in sources(k)) == pytest.approx(1.0, abs=1e-15)
    assert [j for j, _ in sources(0)] == [0, 1]
