"""The work model: its schedule is the core's own, rank by rank."""
import pytest
import torch
from mpi4py import MPI

from layerbraid import MGRIT, MGRITOptions, plan
from layerbraid._engine.schedule import OPS
from layerbraid.tools import plan as plan_cli
from nets import ODEResNet, batch
from problems import nonlinear_init, nonlinear_step
from transports import WORLD

OPTION_SETS = [
    MGRITOptions(max_levels=2, cfactor=4, max_iters=2, nrelax=0, skip_first_downcycle=True),
    MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=(2, 3), max_iters=3,
                 nrelax=(0, 1)),
    MGRITOptions(skip_first_downcycle=False, max_levels=4, cfactor=2, max_iters=2, nrelax=1, cycle="F"),
    MGRITOptions(max_levels=1),
]


def as_tuples(entries):
    return [(e.level, e.op, e.index, e.peer, e.done) for e in entries]


def virtual_tuples(arr):
    return [(int(r["level"]), OPS[r["op"]], int(r["index"]), int(r["peer"]), bool(r["done"]))
            for r in arr]


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 2, 3, 4])
def test_planner_schedule_is_the_cores_trace_on_every_rank():
    for opts in OPTION_SETS:
        for n in (23, 64):
            o = MGRITOptions(**{**opts.__dict__, "tol": 0.0, "final_fc_relax": True})
            real = MGRIT(step=nonlinear_step, init=nonlinear_init, num_steps=n, options=o,
                         comm=WORLD, trace=True).solve()
            virtual = plan.schedule(n, WORLD.size, opts)[WORLD.rank]
            assert virtual_tuples(virtual) == as_tuples(real.trace), (opts, n)
            counts = plan.step_counts(plan.schedule(n, WORLD.size, opts))[WORLD.rank]
            mine = {}
            for e in real.trace:
                if e.op.endswith("step"):
                    mine[e.level] = mine.get(e.level, 0) + 1
            assert counts == mine


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_planner_adjoint_schedule_is_the_training_backward_trace(float64, microbatches):
    # fixed iteration counts, as the planner plans them (no stopping test: no allreduce between
    # the iterations, Note [deferred status] in cycle.c); in microbatches, every action once
    # per microbatch in the core's order (Note [parts] in cycle.c)
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=2, max_iters=2,
                        nrelax=0, tol=0.0)
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=7, forward_options=opts, backward_options=opts,
                      microbatches=microbatches)
    model.set_trace(True)
    x, y = batch()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    fwd_trace, bwd_trace = model.trace()
    fwd = plan.schedule(7, WORLD.size, opts, microbatches=microbatches)[WORLD.rank]
    assert virtual_tuples(fwd) == as_tuples(fwd_trace)
    adj_rank = WORLD.size - 1 - WORLD.rank  # the adjoint runs on the reversed communicator
    bwd = plan.schedule(7, WORLD.size, opts, adjoint=True, microbatches=microbatches)[adj_rank]
    assert virtual_tuples(bwd) == as_tuples(bwd_trace)
    # each action once per microbatch
    assert len(fwd) == microbatches * len(plan.schedule(7, WORLD.size, opts)[WORLD.rank])


@pytest.mark.parametrize("adjoint", [False, True])
def test_a_pair_of_ranks_can_receive_out_of_send_order(adjoint):
    """Why the torch.distributed transport sends the core's states as one ordered stream per
    pair with the tag inside (Note [state streams] in layerbraid/_comm/dist.py): NCCL matches a
    pair's messages in posting order, and the core receives out of send order in some
    schedules, while every (level, point) a rank sends to another is received there, once."""
    send, recv = OPS.index("send"), OPS.index("recv")
    out_of_order = 0
    for opts in OPTION_SETS:
        for size in (2, 3, 5):
            for n in (size, 23, 64):
                ranks = plan.schedule(n, size, opts, adjoint=adjoint)
                for r in range(size):
                    for p in range(size):
                        sent = [(int(e["level"]), int(e["index"])) for e in ranks[r]
                                if e["op"] == send and e["peer"] == p]
                        got = [(int(e["level"]), int(e["index"])) for e in ranks[p]
                               if e["op"] == recv and e["peer"] == r]
                        assert sorted(sent) == sorted(got), (opts, size, n, r, p)
                        out_of_order += sent != got
    assert out_of_order > 0


def test_simulation_of_plain_sequential_stepping():
    costs = plan.Costs(step_seconds=2.0, vjp_seconds=1.0, vjp_param_seconds=1.5,
                       message_bytes=0.0, latency=0.0)
    one = MGRITOptions(max_levels=1)
    p1 = plan.predict(12, 1, one, one, costs)
    assert p1.seconds == pytest.approx(12 * (2.0 + 1.5)) and p1.speedup == pytest.approx(1.0)
    p3 = plan.predict(12, 3, one, one, costs)  # a pipeline: no faster, no slower
    assert p3.seconds == pytest.approx(p1.seconds)
    assert p3.steps_per_rank == [4, 4, 4]
    slow_net = plan.Costs(2.0, 1.0, 1.5, message_bytes=1e6, latency=0.5, bandwidth=1e6)
    assert plan.predict(12, 3, one, one, slow_net).seconds > p3.seconds + 4 * 1.5


def test_multilevel_beats_serial_on_many_ranks():
    costs = plan.Costs(step_seconds=1e-3, vjp_seconds=1e-3, message_bytes=1e5)
    o = MGRITOptions(max_levels=3, cfactor=4, max_iters=2, nrelax=0, skip_first_downcycle=True)
    preds = plan.sweep(1024, [1, 16, 64], o, o, costs)
    assert preds[0].speedup < 1 < preds[1].speedup < preds[2].speedup
    best, fwd, bwd = plan.recommend(1024, 64, costs)
    assert best.seconds <= preds[2].seconds and fwd.max_iters == 2 and bwd.max_iters == 1


def test_bad_arguments():
    o = MGRITOptions(cfactor=2, nrelax=1, skip_first_downcycle=False)
    with pytest.raises(ValueError, match="ranks=9 is more than num_steps=8"):
        plan.schedule(8, 9, o)
    with pytest.raises(ValueError, match="num_steps must be an int >= 1, got 0"):
        plan.schedule(0, 1, o)
    with pytest.raises(ValueError, match=r"Costs.step_seconds must be a finite number >= 0, got -1"):
        plan.Costs(step_seconds=-1, vjp_seconds=1)
    with pytest.raises(ValueError, match="Costs.bandwidth must be > 0, got 0"):
        plan.Costs(1, 1, bandwidth=0)
    with pytest.raises(ValueError, match="data_parallel must be an int >= 1, got 0"):
        plan.predict(8, 2, o, o, plan.Costs(1, 1), data_parallel=0)
    with pytest.raises(SystemExit):
        plan_cli.main(["--steps", "8"])  # no costs given


def test_command_line(capsys):
    plan_cli.main(["--steps", "64", "--ranks", "1", "4", "--step-seconds", "1e-3", "--vjp-seconds",
               "1e-3", "--levels", "2", "--recommend"])
    out = capsys.readouterr().out
    assert "speedup" in out and "best:" in out
    assert len([ln for ln in out.splitlines() if ln.strip().startswith(("1 ", "4 "))]) == 2


def test_spatial_coarsening_costs_less_in_the_model():
    assert plan.spatial_scale((1, 2), 3, num_levels=4) == (1.0, 1 / 8, 1 / 64, 1 / 64)
    o = MGRITOptions(max_levels=3, cfactor=4, max_iters=2, nrelax=0, skip_first_downcycle=True)
    base = plan.Costs(1e-3, 1e-3, message_bytes=1e6)
    sc = plan.Costs(1e-3, 1e-3, message_bytes=1e6, level_scale=plan.spatial_scale((1, 2), 3))
    a, b = plan.predict(256, 16, o, o, base), plan.predict(256, 16, o, o, sc)
    assert b.seconds < a.seconds and b.serial_seconds == a.serial_seconds
    # mode "branch": cheaper coarse steps, but coarse levels still send fine states
    br = plan.Costs(1e-3, 1e-3, message_bytes=1e6, level_scale=plan.spatial_scale((1, 2), 3),
                    message_scale=(1,))
    assert sc.message_scale == sc.level_scale and br.message_scale == (1.0,)
    assert b.seconds < plan.predict(256, 16, o, o, br).seconds < a.seconds
    with pytest.raises(ValueError, match="level_scale must be positive"):
        plan.Costs(1, 1, level_scale=(1, 0))
    with pytest.raises(ValueError, match=r"message_scale must be positive numbers, got \(-1,\)"):
        plan.Costs(1, 1, message_scale=(-1,))


@pytest.mark.parametrize("ranks", [1, 4, 16])
def test_critical_path_adds_up_to_the_simulated_time(ranks):
    opts = MGRITOptions(max_levels=3, cfactor=4, max_iters=2, nrelax=(0, 1), tol=0.0,
                        skip_first_downcycle=True)
    traces = plan.schedule(256, ranks, opts)
    t = plan.simulate(traces, 1e-3, 2e-3, 1e-4, 1e-5)
    t2, path = plan.simulate(traces, 1e-3, 2e-3, 1e-4, 1e-5, critical_path=True)
    assert t2 == pytest.approx(t, rel=1e-12)
    assert sum(path.values()) == pytest.approx(t, rel=1e-9)
    if ranks == 1:  # one rank: every step is on the path, no message
        counts = plan.step_counts(traces)[0]
        assert path.get("messages", 0.0) == 0.0
        assert path["final relaxation"] == pytest.approx(256 * 2e-3)
        assert path["level 2 steps"] == pytest.approx(counts[2] * 1e-3)
    else:  # the coarsest level's sequential solve crosses every rank
        assert path["messages"] > 0 and path["level 2 steps"] > 0


@pytest.mark.parametrize("ranks", [1, 4, 16])
def test_shared_cores_model_is_the_planner_with_a_core_per_rank(ranks):
    opts = MGRITOptions(max_levels=3, cfactor=4, max_iters=2, nrelax=(0, 1), tol=0.0,
                        skip_first_downcycle=True)
    for adjoint in (False, True):
        traces = plan.schedule(128, ranks, opts, adjoint=adjoint)
        ref = plan.simulate(traces, 1e-3, 2e-3, 1e-4, 1e-5)
        got, cpu = plan.simulate(traces, 1e-3, 2e-3, 1e-4, 1e-5,
                                 shared=plan.SharedCores(ranks, 3e-4, 0.5))
        assert got == pytest.approx(ref, rel=1e-12)
        assert cpu > 0


def _shared(traces, step, done, msg, latency, *, cores, cpu, wait_cpu, seen_late=0.0):
    return plan.simulate(traces, step, done, msg, latency,
                         shared=plan.SharedCores(cores, cpu, wait_cpu, seen_late))


def test_shared_cores_model_shares_the_cores():
    one = MGRITOptions(max_levels=1)
    # a pipeline is sequential: fewer cores than ranks cost only the naps of its 3 hand-offs
    traces = plan.schedule(12, 4, one)
    t, _ = _shared(traces, 1.0, 1.0, 0.0, 0.0, cores=4, cpu=1.0, wait_cpu=0.0)
    assert t == pytest.approx(12.0)
    for cores in (1, 2):
        t, _ = _shared(traces, 1.0, 1.0, 0.0, 0.0, cores=cores, cpu=1.0, wait_cpu=0.0)
        assert 12.0 < t <= 12.0 + 3 * plan.NAP_MAX / 2 + 1e-9
    # multilevel work that is all CPU takes at least the ranks' work over the cores
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=2, cfactor=4, max_iters=2, nrelax=0, tol=0.0)
    traces = plan.schedule(64, 8, opts)
    work = sum(sum(c.values()) for c in plan.step_counts(traces)) * 1e-3
    for cores in (1, 2, 4):
        t, _ = _shared(traces, 1e-3, 1e-3, 0.0, 0.0, cores=cores, cpu=1e-3, wait_cpu=0.0)
        assert t >= work / cores * (1 - 1e-9)
    # a rank that naps sees its message late: at most half the longest nap, plus seen_late
    traces = plan.schedule(4, 4, one)
    base, _ = _shared(traces, 5e-3, 5e-3, 0.0, 0.0, cores=4, cpu=1e-5, wait_cpu=0.0)
    napped, _ = _shared(traces, 5e-3, 5e-3, 0.0, 0.0, cores=2, cpu=1e-5, wait_cpu=0.0)
    late, _ = _shared(traces, 5e-3, 5e-3, 0.0, 0.0, cores=2, cpu=1e-5, wait_cpu=0.0,
                              seen_late=1e-3)
    assert base < napped <= base + 3 * plan.NAP_MAX / 2 + 1e-12
    assert late == pytest.approx(napped + 3e-3)


def test_settings_table_compares_exact_with_the_fastest_multilevel_settings():
    """The guide's tuning table: one row per depth and rank count (2 ranks or more, at most one
    rank per layer); the exact solve is sequential across the ranks, so it is never faster than
    serial; the multilevel column is recommend()'s choice, and the choice the faster of the two."""
    costs = plan.Costs(1e-3, 1e-3, message_bytes=4e5)
    rows = plan.settings_table([8, 64], [1, 2, 16, 64], costs)
    assert [(r.num_steps, r.ranks) for r in rows] == [(8, 2), (64, 2), (64, 16), (64, 64)]
    for r in rows:
        assert 0.9 < r.exact_speedup <= 1.0 + 1e-9
        best, fwd, _ = plan.recommend(r.num_steps, r.ranks, costs)
        assert (r.levels, r.multilevel_speedup) == (fwd.max_levels, best.speedup)
        faster = r.multilevel_speedup > r.exact_speedup
        assert r.choice == (f"{r.levels} levels, cfactor {r.cfactor}" if faster
                            else "1 level (exact)")


@pytest.mark.parametrize("ranks, m", [(2, 1), (2, 5), (4, 8), (3, 2)])
def test_pipelines_in_microbatches_have_the_bubble_of_gpipe(ranks, m):
    """Equal stages (steps divisible by the ranks), free messages: GPipe and 1F1B both take
    (M + P - 1) stage times forward and as many backward, each stage its steps' costs (GPipe's
    forward ends before its backward begins; 1F1B's are interleaved)."""
    costs = plan.Costs(1.0, 1.0, 2.0, latency=0.0)
    steps = 12 * ranks
    stage = steps // ranks
    for schedule in ("gpipe", "1f1b"):
        p = plan.predict_pipeline(steps, ranks, m, costs, schedule)
        assert p.steps_per_rank == [stage] * ranks
        if schedule == "gpipe":
            assert p.forward_seconds == pytest.approx((m + ranks - 1) * stage * 1.0)
        assert p.seconds == pytest.approx((m + ranks - 1) * stage * 3.0)
        assert p.serial_seconds == pytest.approx(m * steps * 3.0)


def test_the_exact_path_defers_weight_gradients_past_the_first_rank():
    """Schedule "exact": GPipe's order, and past the first rank the input's gradient (a VJP
    without parameters) first, the parameters' (the rest of a VJP with them) in the waits and
    at the end.  By hand, one step a rank, step 1, VJP 1, with parameters 2, free messages:
    forwards end at 3; rank 1's first input gradient takes [3, 4], its fused second VJP
    [4, 6] and the deferred weights [6, 7], rank 0's VJPs [4, 6] and [6, 8]: 8 in all,
    against GPipe's 9 (splitting both: rank 1's parts [3, 4], [4, 5] and [5, 7], the same 8,
    with more work)."""
    costs = plan.Costs(1.0, 1.0, 2.0, latency=0.0)
    exact = plan.predict_pipeline(2, 2, 2, costs, "exact")
    assert exact.forward_seconds == pytest.approx(3.0)
    assert exact.seconds == pytest.approx(8.0)
    assert plan.predict_pipeline(2, 2, 2, costs, "exact", split_first=2).seconds == 8.0
    assert plan.predict_pipeline(2, 2, 2, costs, "gpipe").seconds == pytest.approx(9.0)
    assert plan.pipeline_orders(3, 2, "exact") == plan.pipeline_orders(3, 2, "gpipe")
    # a middle rank fills its waits: never slower than GPipe, one rank the same
    for ranks, m in [(3, 2), (4, 5), (1, 3)]:
        split = plan.predict_pipeline(4 * ranks, ranks, m, costs, "exact").seconds
        fused = plan.predict_pipeline(4 * ranks, ranks, m, costs, "gpipe").seconds
        assert split <= fused + 1e-12
        assert (split == pytest.approx(fused)) == (ranks == 1)


def test_the_split_count_is_the_fastest_from_one_up():
    """Splitting every VJP piles the last rank's weight gradients up at its end: on 2 ranks,
    step 1, VJP 2, split parts 1.4 and 1.4 (dearer than the fused VJP, as on a CPU), 5
    microbatches: forwards end at 6, the last rank's input gradients take [6, 7.4] ...
    [11.6, 13], then five weight parts to 20; splitting the first only, rank 0's VJPs run
    [7.4, 17.4] and rank 1's fused ones keep up (its end: 16.8).  On 3 ranks with a free split (1 + 1 against 2) and 2 microbatches,
    splitting both is faster: 10 against 11 (worked out in the Note [split count]'s terms:
    the middle rank would wait for a fused second VJP)."""
    from layerbraid._engine.pipeline_model import StageCosts, best_split_count, simulate

    dear = plan.Costs(1.0, 1.0, 2.0, latency=0.0, split_input_seconds=1.4,
                      split_weights_seconds=1.4)
    assert plan.predict_pipeline(2, 2, 5, dear, "exact", split_first=5).seconds == \
        pytest.approx(20.0)
    assert plan.predict_pipeline(2, 2, 5, dear, "exact").seconds == pytest.approx(17.4)
    free = StageCosts([1.0] * 3, [2.0] * 3, [1.0] * 3, [1.0] * 3)
    assert simulate(free, 2, "exact", 1)[1] == 11.0 and simulate(free, 2, "exact", 2)[1] == 10.0
    assert best_split_count(free, 2) == 2
    assert best_split_count(StageCosts(*[[1.0, 1.0]] * 2, [1.4] * 2, [1.4] * 2), 5) == 1


def test_the_split_planner_chooses_from_the_passes_it_timed():
    """The runtime's choice (Note [split count]): one split until it has timed a few passes
    (the first, cold, not counted), then the simulation's count at its averaged timings."""
    from layerbraid._engine.pipeline_model import SplitPlanner

    planner = SplitPlanner()
    timings = {"forward": [1.0], "vjp": [2.0], "split_input": [1.0], "split_weights": [1.0]}
    for passes in range(SplitPlanner.SAMPLES + 1):
        assert planner.split_first(3, 2) == 1
        for kind, seconds in timings.items():
            planner.note(kind, [100.0 * t for t in seconds] if passes == 0 else seconds)
        planner.finished_pass()
    assert planner.seconds == {k: v[0] for k, v in timings.items()}  # pass 0 left out
    assert planner.split_first(3, 2) == 2 and planner.split_first(2, 5) == 1


def test_the_split_costs_default_to_a_free_split_and_are_checked():
    c = plan.Costs(1.0, 0.5, 2.0)
    assert c.split() == (0.5, 1.5)
    # measured parts that cost more than the fused VJP (the split's own search and calls)
    # lengthen the exact path where they lie on its critical path: rank 1's input gradients
    # take 1.5 each ([3, 4.5], [4.5, 6]), rank 0's VJPs [4.5, 6.5] and [6.5, 8.5]
    dear = plan.Costs(1.0, 1.0, 2.0, latency=0.0, split_input_seconds=1.5,
                      split_weights_seconds=1.0)
    assert plan.predict_pipeline(2, 2, 2, dear, "exact").seconds == pytest.approx(8.5)
    for bad in (-1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"Costs.split_weights_seconds must be a finite"):
            plan.Costs(1.0, 1.0, split_weights_seconds=bad)


def test_measure_split_times_both_parts_and_fuses_a_custom_function():
    from torch import nn

    from layerbraid.nn import ConvBlock

    x = torch.randn(4, 3, 6, 6)
    part_x, part_w = plan.measure_split(ConvBlock(3), x, repeats=3)
    assert part_x > 0 and part_w > 0

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return 2 * x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return 2 * g * w, (2 * g * x).sum()

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return Twice.apply(x, self.w)

    fused, rest = plan.measure_split(Custom(), x, repeats=3)
    assert fused > 0 and rest == 0.0


def test_pipeline_orders_and_messages():
    gpipe = plan.pipeline_orders(2, 3, "gpipe")
    assert gpipe[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    one = plan.pipeline_orders(2, 3, "1f1b")
    assert one[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one[0] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    # every message on the critical path: 2 (P - 1) forward and backward hand-offs of the first
    # and last microbatch
    free = plan.predict_pipeline(8, 2, 1, plan.Costs(1.0, 1.0, 1.0, latency=0.0))
    slow = plan.predict_pipeline(8, 2, 1, plan.Costs(1.0, 1.0, 1.0, latency=0.5))
    assert slow.seconds - free.seconds == pytest.approx(2 * 0.5)
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan.pipeline_orders(2, 2, "interleaved")
    with pytest.raises(ValueError, match="microbatches must be an int"):
        plan.predict_pipeline(8, 2, 0, plan.Costs(1.0, 1.0))


@pytest.mark.parametrize("microbatches", [1, 5])
def test_a_batch_cost_is_added_once_to_every_prediction(microbatches):
    """``Costs.batch_seconds`` (what a batch costs outside the chain) moves every prediction by
    itself, whatever the schedule and microbatch count, and is checked like the others."""
    from dataclasses import replace

    opts = MGRITOptions(max_levels=2, cfactor=4, max_iters=1)
    base = plan.Costs(1e-3, 2e-3, 3e-3, message_bytes=1e4, overhead_seconds=1e-5)
    more = replace(base, batch_seconds=0.25)
    a = plan.predict(32, 2, opts, opts, base, microbatches=microbatches)
    b = plan.predict(32, 2, opts, opts, more, microbatches=microbatches)
    assert b.seconds == pytest.approx(a.seconds + 0.25)
    assert (b.forward_seconds, b.backward_seconds) == (a.forward_seconds, a.backward_seconds)
    for schedule in plan.PIPELINE_SCHEDULES:
        a = plan.predict_pipeline(32, 2, microbatches, base, schedule)
        b = plan.predict_pipeline(32, 2, microbatches, more, schedule)
        assert b.seconds == pytest.approx(a.seconds + 0.25), schedule
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match=r"Costs.batch_seconds must be a finite"):
            plan.Costs(1.0, 1.0, batch_seconds=bad)


def test_mgrit_in_microbatches_is_a_pipeline_in_the_model():
    """On 8 ranks with a step's cost linear in its batch, the coarse solve in microbatches
    overlaps the ranks: faster than the batch at once, and the predicted steps per rank are the
    batch's times the microbatches."""
    opts = MGRITOptions(max_levels=2, cfactor=4, max_iters=1)
    batch_costs = plan.Costs(1e-3, 2e-3, 3e-3)
    serial = 64 * (1e-3 + 3e-3)
    one = plan.predict(64, 8, opts, opts, batch_costs, serial_seconds=serial)
    tenth = plan.Costs(1e-4, 2e-4, 3e-4)
    ten = plan.predict(64, 8, opts, opts, tenth, microbatches=10, serial_seconds=serial)
    assert ten.seconds < 0.8 * one.seconds, (ten.seconds, one.seconds)
    assert ten.steps_per_rank == [10 * n for n in one.steps_per_rank]
    assert one.speedup == pytest.approx(serial / one.seconds)


@pytest.mark.shared_job
@pytest.mark.parallel([2])
@pytest.mark.parametrize("levels", [1, 2])
def test_choose_microbatches_follows_the_cost_of_a_step(monkeypatch, levels):
    """A step whose cost is all per sample pipelines best in the most microbatches; one whose
    cost is fixed per call, in one.  Every rank gets the first rank's choice."""
    opts = MGRITOptions(max_levels=levels, cfactor=2, max_iters=1)
    model = ODEResNet(WORLD, num_steps=8, forward_options=opts, backward_options=opts)
    x = batch(n=8, dtype=torch.float32)[0]
    for per_sample, want in ((True, 8), (False, 1)):
        def fake(layer, xm, repeats=10, dt=0.1, per_sample=per_sample):
            t = 1e-2 * (xm.shape[0] / 8 if per_sample else 1.0)
            return t, 2 * t, 3 * t
        monkeypatch.setattr(plan, "measure_step", fake)
        choice = plan.choose_microbatches(model, x, (1, 2, 4, 8, 16), trials=0)
        assert set(choice.seconds) == {1, 2, 4, 8}  # at most one sample each
        assert choice.microbatches == want, choice.summary()
        assert WORLD.allgather(choice.microbatches) == [want] * WORLD.size
        assert "microbatches" in choice.summary()
    one = ODEResNet(WORLD, num_steps=8)
    single = plan.choose_microbatches(one, x[:1])  # one sample: nothing to pipeline
    assert single.microbatches == 1 and single.seconds == {}
    assert single.summary().startswith("microbatches 1 (nothing to pipeline")


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_choose_microbatches_times_the_candidates_near_the_best_prediction(monkeypatch):
    """The planner's ranking picks what is timed (within ``near`` of its best), and the fastest
    measured wins, where the planner preferred another; the line says which were timed."""
    model = ODEResNet(WORLD, num_steps=8)
    x = batch(n=8, dtype=torch.float32)[0]

    def fake(layer, xm, repeats=10, dt=0.1):  # all per sample: the most microbatches best
        t = 1e-2 * xm.shape[0] / 8
        return t, 2 * t, 3 * t

    timed = {1: 5e-3, 2: 4e-3, 4: 6e-3, 8: 7e-3}
    asked = []

    def passes(model, x, counts, trials):
        asked.append((list(counts), trials))
        return {m: timed[m] for m in counts}

    monkeypatch.setattr(plan, "measure_step", fake)
    monkeypatch.setattr(plan, "_time_passes", passes)
    untimed = plan.choose_microbatches(model, x, trials=0)
    assert untimed.microbatches == 8 and untimed.measured == {}
    best = min(untimed.seconds.values())
    near = sorted(m for m, t in untimed.seconds.items() if t <= 1.5 * best)
    assert 1 not in near and 8 in near, untimed.seconds  # the case tests a pruned candidate
    choice = plan.choose_microbatches(model, x, trials=2, near=1.5)
    assert asked == [(near, 2)]
    assert choice.measured == {m: timed[m] for m in near}
    assert choice.microbatches == min(near, key=lambda m: timed[m])
    assert WORLD.allgather(choice.microbatches) == [choice.microbatches] * WORLD.size
    line = choice.summary()
    assert "measured: " in line and "not timed, predicted slower: 1 (" in line, line


class _Noisy(ODEResNet):
    """Steps that draw from torch's generator (as dropout would), to no effect on the state."""

    def step_rule(self, layer, x, dt, index):
        return x + dt * layer(x) + 0.0 * torch.rand(())


@pytest.mark.shared_job
@pytest.mark.parallel([2])
@pytest.mark.parametrize("levels", [1, 2])
def test_timing_the_candidates_leaves_the_gradients_and_the_generators_alone(levels):
    """Real forwards and backwards of steps that draw random numbers: every ``.grad`` (set or
    not) and the generator are as before, the model keeps its microbatch count, every rank
    agrees."""
    opts = MGRITOptions(max_levels=levels, cfactor=2, max_iters=1)
    model = _Noisy(WORLD, num_steps=8, forward_options=opts, backward_options=opts)
    x = batch(n=8, dtype=torch.float32)[0]
    params = list(model.parameters())
    for k, p in enumerate(params[::2]):
        p.grad = torch.full_like(p, float(k))
    before = [None if p.grad is None else p.grad.clone() for p in params]
    state = torch.random.get_rng_state()
    choice = plan.choose_microbatches(model, x, (1, 2), trials=1, near=100.0)
    assert set(choice.measured) == {1, 2} and choice.microbatches in (1, 2)
    assert all(t > 0 for t in choice.measured.values())
    assert WORLD.allgather(choice.microbatches) == [choice.microbatches] * WORLD.size
    assert model.microbatches == 1
    assert torch.equal(torch.random.get_rng_state(), state)
    for p, b in zip(params, before):
        assert (p.grad is None) == (b is None) and (b is None or torch.equal(p.grad, b))


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_timing_the_candidates_runs_the_backward_where_every_weight_is_frozen():
    """Rank 0's weights all frozen (fine-tuning the later layers): its part of each timed
    backward still runs, so rank 1's is not left waiting for it."""
    import time

    model = ODEResNet(WORLD, num_steps=8)
    if WORLD.rank == 0:
        for p in model.parameters():
            p.requires_grad_(False)
    x = batch(n=8, dtype=torch.float32)[0]
    t0 = time.perf_counter()
    choice = plan.choose_microbatches(model, x, (1, 2), trials=1, near=100.0)
    assert set(choice.measured) == {1, 2} and time.perf_counter() - t0 < 30
    assert WORLD.allgather(choice.microbatches) == [choice.microbatches] * WORLD.size


@pytest.mark.parallel([2])
def test_a_rank_late_for_the_candidates_timing_is_named_within_the_timeout(
    monkeypatch, short_timeout
):
    """Rank 1 is late for the timing's reduction after a timed pass (its backward done): rank 0
    stops waiting within the deadline, naming the timing; rank 1 then finds rank 0 gone or
    stalls too, and nothing hangs (a job of its own: the stall leaves a collective behind)."""
    import time

    import layerbraid

    model = ODEResNet(WORLD, num_steps=8)
    x = batch(n=8, dtype=torch.float32)[0]
    # the planner's measurement, on rank 0 alone, must not outlast the short deadline itself
    monkeypatch.setattr(plan, "measure_step", lambda *args, **kwargs: (1e-3, 2e-3, 3e-3))
    monkeypatch.setattr(plan, "measure_split", lambda *args, **kwargs: (1e-3, 1e-3))
    comm = model.comm
    real = comm.allreduce_floats

    entered = []

    def late(values, op, what):
        if what == "the microbatch choice's timing":
            entered.append(time.perf_counter())
            if WORLD.rank == 1 and len(entered) == 1:  # well past the deadline, on a busy node too
                time.sleep(3 * short_timeout)
        return real(values, op, what)

    monkeypatch.setattr(comm, "allreduce_floats", late)
    with pytest.raises((layerbraid.StallError, layerbraid.RemoteRankError)) as info:
        plan.choose_microbatches(model, x, (1, 2), trials=1, near=100.0)
    if WORLD.rank == 0:  # waited at the first timing, for at most the deadline
        assert isinstance(info.value, layerbraid.StallError)
        assert "the microbatch choice's timing" in str(info.value)
        assert len(entered) == 1 and time.perf_counter() - entered[0] < 2 * short_timeout


def test_command_line_compares_pipelines_and_names_the_crossover(capsys):
    plan_cli.main(["--steps", "64", "--ranks", "2", "16", "--levels", "2", "--step-seconds",
                   "1e-3", "--vjp-seconds", "2e-3", "--microbatches", "2", "4"])
    out = capsys.readouterr().out
    assert "pipelining 1F1B, 4 microbatch(es)" in out and "layerbraid exact, 2" in out
    assert "layerbraid MGRIT, 2 levels, 4 microbatch(es)" in out and "fastest:" in out
    assert "MGRIT beats no pipeline" in out or "beats every pipeline from" in out


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_a_failed_microbatch_choice_raises_on_every_rank(monkeypatch):
    """The first rank's measurement fails: its error there, a RemoteRankError naming it on the
    other rank, and no rank waits for the deadline."""
    import layerbraid

    model = ODEResNet(WORLD, num_steps=8)
    x = batch(n=8, dtype=torch.float32)[0]

    def broken(*args, **kwargs):
        raise RuntimeError("the layer cannot run here")

    monkeypatch.setattr(plan, "measure_step", broken)
    with pytest.raises(Exception) as info:
        plan.choose_microbatches(model, x)
    if WORLD.rank == 0:
        assert type(info.value) is RuntimeError
    else:
        assert isinstance(info.value, layerbraid.RemoteRankError)
        assert "rank 0" in str(info.value) and "the layer cannot run here" in str(info.value)


@pytest.mark.parallel([2])
def test_a_stalled_microbatch_choice_ends_within_the_timeout(monkeypatch, short_timeout):
    """The first rank's measurement outlasts the deadline: the other rank stops waiting within
    it, naming what it waited for (a job of its own: the stall leaves collectives behind)."""
    import time

    import layerbraid

    model = ODEResNet(WORLD, num_steps=8)
    x = batch(n=8, dtype=torch.float32)[0]

    def slow(*args, **kwargs):
        time.sleep(1.5 * short_timeout)
        return 1e-3, 2e-3, 3e-3

    monkeypatch.setattr(plan, "measure_step", slow)
    t0 = time.perf_counter()
    if WORLD.rank == 1:
        with pytest.raises(layerbraid.StallError, match="the microbatch choice"):
            plan.choose_microbatches(model, x, (1, 2))
        assert time.perf_counter() - t0 < 1.5 * short_timeout
    else:  # its peer has gone: under MPI a root's broadcast may still complete, or time out
        try:
            plan.choose_microbatches(model, x, (1, 2))
        except layerbraid.StallError:
            pass
