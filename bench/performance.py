"""When is layer-parallel training faster than plain PyTorch, and what does layerbraid add on
top of the layers' own work?  Writes docs/performance.md and its raw data, performance.json.

    python -m bench.performance                  # the whole report (about 10 minutes here)
    python -m bench.performance --rounds 6       # tighter spreads (about 30 minutes)
    python -m bench.performance --report         # rewrite the .md from the last run's raw data (runs/reports/)

One run measures, round after round (interleaved, so that drift of the machine hits every row
alike):

1. The demo network (examples/mnist.py) in training: plain PyTorch (1 and 2 threads), data
   parallel on 2 ranks (torch DDP; layerbraid's ProcessGrid), and layer parallel at 1 level
   (exact; the demo's settings) on 1 and 2 ranks and at 2 levels.  Each job is
   bench/workers/performance.py; each job pairs its batches with plain PyTorch's in the same
   process (the 2-thread row is timed against the plain PyTorch job of the same round).
2. The benchmark conv layer alone (bench/workers/resnet.py): each job alternates a
   layer-parallel forward+backward with plain PyTorch's on rank 0 (the other ranks wait in a
   barrier, so the reference runs with the machine as busy as in a 1-rank job), and after each
   pair measures one step's and one VJP's cost; each pair's work bound is layerbraid.plan's
   prediction from its round's costs with no overhead and free messages.  On several ranks
   the costs are measured a second time with every rank measuring at once (the busy bound:
   the ranks of a solve share the cache and memory bandwidth, plain PyTorch does not).
3. Memory: the growth of each rank's peak resident set over one forward+backward, against
   plain PyTorch's (separate processes).
4. The planner's projection to 4-4096 ranks from step costs measured here.
5. The transports: the benchmark layer's 2-rank N=64 rows (1 and 2 levels) under torchrun
   (torch.distributed, gloo) too, in the same rounds, beside the MPI rows of 2.

Every job binds each rank to cores of its own (bench.harness.binding): one per thread.

The unit everywhere: speedup = plain PyTorch's time / time (> 1 is faster).
"""
import statistics
import time
from pathlib import Path

from bench.harness import (DOCS, SAME_LEGEND, generate, launch, parser, pick, provenance,
                           speedup, spread)

OUT = DOCS / "performance.md"

# The demo network: (label, ranks, worker arguments)
ROWS = [
    ("plain PyTorch, 1 thread", 1, ["plain", "--threads", "1"]),
    ("plain PyTorch, 2 threads", 1, ["plain", "--threads", "2"]),
    ("data parallel, 2 ranks (torch DDP, gloo)", 2, ["ddp"]),
    ("data parallel, 2 ranks (layerbraid ProcessGrid)", 2, ["dp", "--levels", "1"]),
    ("layer parallel, 1 rank, 1 level (exact)", 1, ["lp", "--levels", "1"]),
    ("layer parallel, 2 ranks, 1 level (exact)", 2, ["lp", "--levels", "1"]),
    ("layer parallel, 2 ranks, 1 level (exact), 2 microbatches", 2,
     ["lp", "--levels", "1", "--microbatches", "2"]),
    ("layer parallel, 2 ranks, 2 levels, 2/1 iterations", 2, ["lp", "--iters", "2", "1"]),
    ("layer parallel, 2 ranks, 2 levels, 1/1 iterations", 2, ["lp", "--iters", "1", "1"]),
    ("layer parallel, 2 ranks, 2 levels, 1/1 iterations, first down-cycle relaxed", 2,
     ["lp", "--iters", "1", "1", "--relax-first"]),
]
REFERENCE = ROWS[0][0]
DEMO_TARGETS = {  # label -> (least speedup, what it stands for)
    ROWS[4][0]: (1 / 1.03, "at most 1.03x plain PyTorch's time"),
    ROWS[5][0]: (1 / 1.10, "at most 1.10x plain's time: plain plus a message each way"),
    ROWS[6][0]: (1.0, "faster than plain PyTorch: the demo's pipelined exact path"),
}

# The benchmark conv layer: (ranks, N, levels, forward iterations, adjoint iterations, least
# speedup, what that target stands for).  The 2-level targets are 0.8x TorchBraid's time on
# the same configuration, as a multiple of plain PyTorch's (the figure in the text); TorchBraid
# cannot be built here without its sources, so this script does not measure it.
LAYER_ROWS = [
    (1, 32, 1, 1, 1, 1 / 1.03, "<= 1.03x plain's time"),
    (1, 64, 1, 1, 1, 1 / 1.03, "<= 1.03x plain's time"),
    (2, 64, 1, 1, 1, 1 / 1.10, "<= 1.10x plain's time (pipeline bound)"),
    (2, 64, 2, 2, 1, 1 / 1.00, "0.8x TorchBraid's 1.24-1.27x plain's time"),
    (2, 64, 2, 1, 1, 1 / 0.72, "0.8x TorchBraid's 0.87-0.94x"),
    (2, 16, 2, 2, 1, 1 / 1.07, "0.8x TorchBraid's 1.32-1.35x"),
    (2, 16, 2, 1, 1, 1 / 0.83, "0.8x TorchBraid's 1.03-1.05x"),
]
# The transports: the benchmark layer's 2-rank N=64 rows under torchrun (torch.distributed,
# gloo) as well, in the same rounds; the MPI rows are LAYER_ROWS' own.
TRANSPORT_ROWS = [(2, 64, 1, 1, 1), (2, 64, 2, 2, 1)]

# Memory: (label, ranks, worker arguments)
MEMORY = [
    ("plain PyTorch", 1, ["--memory", "serial", "--steps", 64]),
    ("layer parallel, 1 rank, 1 level", 1, ["--memory", "lp", "--steps", 64]),
    ("layer parallel, 2 ranks, 1 level", 2, ["--memory", "lp", "--steps", 64]),
    ("layer parallel, 2 ranks, 2 levels", 2, ["--memory", "lp", "--steps", 64, "--levels", 2]),
]
BOUND_TARGET = 1.1  # 2 levels at 2/1 iterations: at most this multiple of the work bound
MEMORY_TARGET = 1.1  # the kept graphs of a rank's steps against the serial graph of as many

# Interconnects the projection assumes: (name, seconds per message, bytes per second).
NETWORKS = [("InfiniBand-class", 5e-6, 10e9), ("10 GbE-class", 30e-6, 1e9)]


def _layer_label(ranks, steps, levels, fwd, bwd):
    what = "1 level (exact)" if levels == 1 else f"{levels} levels, {fwd}/{bwd} iterations"
    return f"N={steps}, {ranks} rank{'s' if ranks > 1 else ''}, {what}"


def _layer_options(levels, fwd, bwd):
    """bench/workers/resnet.py's options: F-relaxation on the fine level, FCF on coarse ones,
    first down-cycle skipped, cfactor 4."""
    from layerbraid import MGRITOptions

    if levels == 1:
        return MGRITOptions(max_levels=1), MGRITOptions(max_levels=1)
    nrelax = tuple([0] + [1] * (levels - 2)) if levels > 2 else 0
    return tuple(MGRITOptions(max_levels=levels, cfactor=4, max_iters=it, nrelax=nrelax,
                              tol=0.0, skip_first_downcycle=True) for it in (fwd, bwd))


def work_bound(steps, ranks, levels, fwd, bwd, step, vjp, vjp_param):
    """Seconds the layer-parallel forward+backward would take with these step and VJP costs,
    no other work and free messages (layerbraid.plan's model of the core's schedule)."""
    from layerbraid.plan import Costs, predict

    costs = Costs(step, vjp, vjp_param, 0.0, 0.0, 1e30)
    return predict(steps, ranks, *_layer_options(levels, fwd, bwd), costs).seconds


def pair_costs(run, busy=False):
    """(step, VJP, VJP with parameter gradients) seconds for each timed pair of a benchmark-layer
    job: measured in the pair's own round, or, in a job that measured them once, that one
    measurement for every pair.  With ``busy``, the costs measured on every rank at once (the
    mean over the ranks), or None where the job did not measure them (one rank, older runs)."""
    pre = "busy_" if busy else ""
    if pre + "step_times" in run:
        return list(zip(run[pre + "step_times"], run[pre + "vjp_times"],
                        run[pre + "vjp_param_times"]))
    if busy:
        return None
    return [(run["step_seconds"], run["vjp_seconds"], run["vjp_param_seconds"])] * \
        len(run["lp_times"])


def rank_work(steps, ranks, levels, fwd, bwd, step, vjp, vjp_param):
    """Each rank's seconds of steps and VJPs in one forward+backward at these costs: the
    schedule's work without its waits (the final relaxation's steps at ``step`` and its VJPs at
    ``vjp_param``, with the parameter gradients; every other VJP at ``vjp``)."""
    import numpy as np

    from layerbraid.plan import OPS, STEP_OPS, schedule

    codes = [OPS.index(op) for op in STEP_OPS]
    fo, bo = _layer_options(levels, fwd, bwd)
    work = [0.0] * ranks
    for opts, adjoint, cost, done_cost in ((fo, False, step, step), (bo, True, vjp, vjp_param)):
        for r, trace in enumerate(schedule(steps, ranks, opts, adjoint=adjoint)):
            mask = np.isin(trace["op"], codes)
            done = int(np.count_nonzero(trace["done"][mask]))
            work[r] += done * done_cost + (int(np.count_nonzero(mask)) - done) * cost
    return work


# ---------------------------------------------------------------- measuring
def _projection():
    """Planner rows: (network, ranks, speedup at 2 levels, cfactor 4, 2/1 iterations,
    recommended speedup, settings)."""
    import torch

    from layerbraid import MGRITOptions
    from layerbraid.nn import ConvBlock
    from layerbraid.plan import Costs, measure_step, predict, recommend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 8, 14, 14)
    step, vjp, vjp_p = measure_step(ConvBlock(8), x, repeats=pick(30, 2))
    n = pick(4096, 64)
    demo = MGRITOptions(max_levels=2, cfactor=4, max_iters=2, skip_first_downcycle=True)
    demo_b = MGRITOptions(max_levels=2, cfactor=4, max_iters=1, skip_first_downcycle=True)
    rows = []
    for name, latency, bandwidth in NETWORKS:
        costs = Costs(step, vjp, vjp_p, x.numel() * 4, latency, bandwidth)
        for p in pick([4, 16, 64, 256, 1024, 4096], [4, 16]):
            d = predict(n, p, demo, demo_b, costs)
            best, bf, _ = recommend(n, p, costs, levels=(2, 3, 4, 5, 6), cfactors=(2, 4, 8, 16))
            rows.append((name, p, d.speedup, best.speedup,
                         f"{bf.max_levels} levels, cfactor {bf.cfactor}"))
    return {"step_seconds": step, "vjp_seconds": vjp, "vjp_param_seconds": vjp_p, "steps": n,
            "state_bytes": x.numel() * 4, "rows": rows}


def measure(a):
    rows = pick(ROWS, [ROWS[0], ROWS[4]])
    layer_rows = pick(LAYER_ROWS, [LAYER_ROWS[0], LAYER_ROWS[3]])  # quick: 1 and 2 ranks
    demo = {label: [] for label, _, _ in rows}
    layer = {_layer_label(*row[:5]): [] for row in layer_rows}
    transport = {_layer_label(*row): [] for row in pick(TRANSPORT_ROWS, TRANSPORT_ROWS[1:])}
    t0 = time.time()
    for r in range(a.rounds):
        for label, ranks, args in rows:
            paired = [] if args[0] == "plain" else ["--paired"]
            threads = int(args[args.index("--threads") + 1]) if "--threads" in args else 1
            demo[label].append(launch("performance", ranks, *args, *paired, "--batches",
                                      a.batches, timeout=900, echo=False,
                                      cores_per_rank=threads)[-1])
            print(f"round {r + 1}: {label}: {1e3 * demo[label][-1]['seconds']:.1f} ms/batch",
                  flush=True)
        for ranks, steps, levels, fwd, bwd, _, _ in layer_rows:
            label = _layer_label(ranks, steps, levels, fwd, bwd)
            layer[label].append(launch("resnet", ranks, "--steps", steps, "--levels", levels,
                                       "--fwd-iters", fwd, "--bwd-iters", bwd, "--serial",
                                       "--repeats", a.repeats, *pick([], ["--batch", 2]),
                                       timeout=900, echo=False, cores_per_rank=1)[-1])
            print(f"round {r + 1}: {label}: speedup "
                  f"{layer[label][-1]['speedup']:.2f}", flush=True)
        for ranks, steps, levels, fwd, bwd in pick(TRANSPORT_ROWS, TRANSPORT_ROWS[1:]):
            label = _layer_label(ranks, steps, levels, fwd, bwd)
            transport[label].append(launch("resnet", ranks, "--steps", steps, "--levels", levels,
                                           "--fwd-iters", fwd, "--bwd-iters", bwd, "--serial",
                                           "--repeats", a.repeats, *pick([], ["--batch", 2]),
                                           timeout=900, echo=False, cores_per_rank=1,
                                           launcher="torchrun")[-1])
            print(f"round {r + 1}: {label}, torchrun: speedup "
                  f"{transport[label][-1]['speedup']:.2f}", flush=True)
    memory = {label: launch("resnet", ranks, *args, *pick([], ["--batch", 2]), timeout=900,
                            echo=False, cores_per_rank=1)[-1]
              for label, ranks, args in pick(MEMORY, MEMORY[:2])}  # quick: 1-rank jobs only
    return {**provenance(), "rounds": a.rounds, "batches": a.batches, "repeats": a.repeats,
            "seconds": time.time() - t0, "demo": demo, "layer": layer, "transport": transport,
            "memory": memory,
            "projection": _projection()}


def main(argv=None):
    p = parser(__doc__)
    # 2 rounds of every job keep the report near 10 minutes (6 took 30); each row's spread is
    # over all its rounds' batches or pairs, and the report states the rounds it ran
    p.add_argument("--rounds", type=int, default=pick(2, 1), help="interleaved rounds")
    p.add_argument("--batches", type=int, default=pick(15, 2),
                   help="timed batches per demo job (median taken)")
    # 8 pairs per job, 48 per row: with 4 (24 per row) the rows' speedups spread from 0.58-0.91x
    # to 1.29-1.45x their medians, enough to move a median across its target between runs
    p.add_argument("--repeats", type=int, default=pick(8, 1),
                   help="timed forward+backward pairs per benchmark-layer job")
    p.add_argument("--out", type=Path, default=OUT)
    generate(OUT, measure, report, p, argv)


# ---------------------------------------------------------------- the report
def _busy_rows(layer):
    """For every benchmark-layer row whose jobs measured the busy costs (several ranks): (label,
    target, meaning, plain times, layerbraid times, idle costs, busy costs, busy bounds), pair
    by pair."""
    rows = []
    for ranks, steps, levels, fwd, bwd, target, meaning in LAYER_ROWS:
        label = _layer_label(ranks, steps, levels, fwd, bwd)
        runs = layer.get(label)
        if not runs or any(pair_costs(r, busy=True) is None for r in runs):
            continue
        busy = [c for r in runs for c in pair_costs(r, busy=True)]
        rows.append((label, target, meaning, [t for r in runs for t in r["serial_times"]],
                     [t for r in runs for t in r["lp_times"]],
                     [c for r in runs for c in pair_costs(r)], busy,
                     [work_bound(steps, ranks, levels, fwd, bwd, *c) for c in busy]))
    return rows


def _busy_table(layer):
    rows = _busy_rows(layer)
    if not rows:
        return []
    lines = [
        "",
        "### The work bound with every rank stepping at once",
        "",
        "The costs above are measured on one rank while the others wait, as plain PyTorch runs:",
        "alone on the machine.  In a solve the ranks step side by side and share the cache and",
        "memory bandwidth.  So every job on several ranks measures the same costs again right",
        "after, with every rank measuring at once (each on a layer of its own; the mean over",
        "the ranks), and `busy bound` is the work bound at those costs.  `busy / alone` is the",
        "busy cost over the alone cost, pair by pair; `busy bound's speedup` is plain",
        "PyTorch's time over the busy bound: the most the schedule's work allows on this",
        "machine's cores when they all step, with no overhead.",
        "",
        "| configuration | step, busy / alone | VJP with parameter gradients, busy / alone "
        "| busy bound ms | busy bound's speedup | / busy bound | speedup | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, target, meaning, pl_t, lp_t, alone, busy, bounds in rows:
        lines.append(
            f"| {label} | {spread([b[0] / a[0] for a, b in zip(alone, busy)])} "
            f"| {spread([b[2] / a[2] for a, b in zip(alone, busy)])} "
            f"| {spread(bounds, '.0f', 1e3)} | {spread([p / b for p, b in zip(pl_t, bounds)])} "
            f"| {spread([t / b for t, b in zip(lp_t, bounds)])} | {speedup(pl_t, lp_t)[3]} "
            f"| >= {target:.2f} |")
    return lines


def _split_table(layer):
    """Each rank's time in a multi-rank row, split by the solves' statistics, beside the work
    its steps and VJPs would take at the alone and at the busy costs."""
    rows = [r for r in _busy_rows(layer) if all("split_per_rank" in run for run in layer[r[0]])]
    if not rows:
        return [], []
    lines = [
        "",
        "### Where each rank's time goes",
        "",
        "From the solves' own statistics (``SolveStats``), each rank's median over the pairs of",
        "each job and then the median over the jobs: `steps` is the time in the step and VJP",
        "callbacks (the layer's work and layerbraid's Python around it), beside the same steps",
        "and VJPs priced at the alone and at the busy costs (their counts from the schedule);",
        "`MPI` the time in the core's MPI calls (messages and the waits the schedule has);",
        "`bookkeeping` the rest of the solves (the core's sweeps, the callbacks' vector sums,",
        "norms, clones and packing); `outside` the rest of the forward+backward (the module's",
        "work around the solves, zero_grad, the loss).  The four add up to the rank's time.",
        "",
        "| configuration | rank | ms | steps ms | their work alone ms | their work busy ms "
        "| MPI ms | bookkeeping ms | outside ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    findings = []
    for label, target, meaning, pl_t, lp_t, alone, busy, bounds in rows:
        runs = layer[label]
        ranks, steps, levels, fwd, bwd = next(row[:5] for row in LAYER_ROWS
                                              if _layer_label(*row[:5]) == label)
        med = lambda v: statistics.median(v)  # noqa: E731
        w_alone = rank_work(steps, ranks, levels, fwd, bwd, *(med(c[i] for c in alone)
                                                               for i in range(3)))
        w_busy = rank_work(steps, ranks, levels, fwd, bwd, *(med(c[i] for c in busy)
                                                             for i in range(3)))
        parts = []
        for r in range(ranks):
            mpi, book, st, out = (med(run["split_per_rank"][r][i] for run in runs)
                                  for i in range(4))
            total = mpi + book + st + out
            parts.append((total, mpi, book, st, out))
            lines.append(f"| {label} | {r} | {1e3 * total:.0f} | {1e3 * st:.0f} | "
                         f"{1e3 * w_alone[r]:.0f} | {1e3 * w_busy[r]:.0f} | {1e3 * mpi:.0f} | "
                         f"{1e3 * book:.0f} | {1e3 * out:.0f} |")
        r = max(range(ranks), key=lambda k: parts[k][0])
        total, mpi, book, st, out = parts[r]
        findings.append(
            f"- {label}, rank {r}: its steps took {st / w_alone[r]:.2f}x their work at the "
            f"alone costs and {st / w_busy[r]:.2f}x at the busy costs; the solves' bookkeeping "
            f"and the work outside them, layerbraid's own time beside the steps' Python, are "
            f"{100 * (book + out) / total:.0f}% of the rank's time, MPI "
            f"{100 * mpi / total:.0f}%.")
    return lines, findings


def _busy_findings(layer):
    """For every row below its target that measured the busy costs: what the busy bound allows
    and what the target asks of the time against it."""
    lines = []
    for label, target, meaning, pl_t, lp_t, alone, busy, bounds in _busy_rows(layer):
        med = speedup(pl_t, lp_t)[0]
        if med >= target:
            continue
        allowed = statistics.median(p / b for p, b in zip(pl_t, bounds))
        over = statistics.median(t / b for t, b in zip(lp_t, bounds))
        need = allowed / target
        dearer = statistics.median(b[0] / a[0] for a, b in zip(alone, busy))
        lines.append(
            f"- {label}, at the busy costs (a step {100 * (dearer - 1):+.0f}% against alone): "
            f"its bound's speedup is {allowed:.2f}; the target asks for at most {need:.2f}x "
            f"the busy bound, against {over:.2f}x measured"
            + (": below that bound, so it needs steps cheaper than they are with every rank "
               "stepping, which only the stretches where a rank steps alone (the schedule's "
               "waits) give" if need < 1.0 else f": {100 * (1 - need / over):.0f}% off the time")
            + ".")
    return lines


def _verdict(med, lo, target):
    if lo >= target:
        return "met in every measurement"
    if med >= target:
        return "met by the median, not in every measurement"
    return "not met"


def _transport_table(layer, transport):
    """The benchmark layer on 2 ranks under both transports, from the same rounds: MPI
    (mpiexec) and torch.distributed with gloo (torchrun), each job paired with plain PyTorch."""
    rows = [r for r in TRANSPORT_ROWS if _layer_label(*r) in transport]
    if not rows:
        return []
    lines = [
        "",
        "## The transports: MPI and torch.distributed (gloo)",
        "",
        "The benchmark layer's 2-rank N=64 rows run once more per round under torchrun: the",
        "same worker (bench/workers/resnet.py) with the default process group, gloo on",
        "loopback, each process bound to a core of its own.  Each job pairs its",
        "forward+backward with plain PyTorch's, as above (so plain PyTorch is a row of each",
        "job).  `messages ms`: the time in the core's sends, receives and allreduces",
        "(waiting included), the most over the ranks, median over the rounds.",
        "",
        "| configuration | transport | ms | plain PyTorch ms | speedup | messages ms | "
        "err param grad |",
        "|---|---|---|---|---|---|---|",
    ]
    findings = []
    for row in rows:
        label = _layer_label(*row)
        times = {}
        for name, runs in (("MPI (mpiexec)", layer.get(label)), ("gloo (torchrun)",
                                                                  transport[label])):
            if not runs:
                continue
            lp_t = [t for r in runs for t in r["lp_times"]]
            pl_t = [t for r in runs for t in r["serial_times"]]
            times[name] = (lp_t, speedup(pl_t, lp_t))
            msgs = statistics.median(r["mpi_seconds"] for r in runs)
            lines.append(
                f"| {label} | {name} | {spread(lp_t, '.0f', 1e3)} | {spread(pl_t, '.0f', 1e3)} "
                f"| {times[name][1][3]} | {1e3 * msgs:.0f} | "
                f"{statistics.median(r['err_param_grad'] for r in runs):.1e} |")
        if len(times) == 2:
            (mpi_t, mpi_s), (gloo_t, gloo_s) = times["MPI (mpiexec)"], times["gloo (torchrun)"]
            ratio = statistics.median(gloo_t) / statistics.median(mpi_t)
            overlap = gloo_s[1] <= mpi_s[2] and mpi_s[1] <= gloo_s[2]
            findings.append(
                f"- {label}: under gloo {ratio:.2f}x MPI's time (medians); speedups "
                f"{gloo_s[0]:.2f} against {mpi_s[0]:.2f}, "
                + ("their spreads overlap." if overlap else "their spreads do not overlap."))
    if findings:
        lines += ["", "### What the transport rows show", "", *findings]
    return lines


def report(data):
    """docs/performance.md's lines from the raw numbers; every sentence of findings is computed
    from them."""
    demo, layer, memory, pj = data["demo"], data["layer"], data["memory"], data["projection"]
    ref = [run["seconds"] for run in demo[REFERENCE]]
    lines = [
        "# When is layer-parallel training faster than plain PyTorch?",
        "",
        f"Generated by `python -m bench.performance` on commit {data['commit']}, {data['date']}, "
        f"{data['machine']}: {data['rounds']} interleaved rounds, {data['seconds']:.0f} s; raw "
        "numbers in runs/reports/performance.json where it ran, their summary in docs/performance.json (`--report` rewrites this file from the raw numbers).",
        "",
        "**Speedup = plain PyTorch's time / time** (> 1 is faster).  Every timing is given as "
        "median [min-max] over the rounds (or the timed pairs); " + SAME_LEGEND,
        "",
        "## The demo network in training",
        "",
        "The MNIST network of `make demo` (examples/mnist.py): a strided conv to 8 channels at",
        "14x14, 8 residual steps `x + dt relu(conv(relu(conv x)))`, a linear classifier; batch",
        "64, float32, SGD; one thread per rank.  Each job times its batches (`ms / batch`: "
        f"median of {data['batches']}",
        "per job, the slowest rank's; spread over the rounds).  A 2-thread row's speedup in a",
        "round is the 1-thread plain PyTorch job's time of that round over the row's.  Every",
        "other job pairs each of its timed batches with one of plain PyTorch (a serial copy",
        "of the network with its own SGD, 1 thread, on rank 0 while the other ranks wait; the",
        "two in alternating order), and its speedup's spread is over every pair of every round:",
        "separate jobs see the machine in different states, a pair sees both timings under",
        "the same one.  Data parallel: each rank half the batch, the",
        "gradients averaged (torch's DistributedDataParallel over gloo on loopback, or",
        "layerbraid's ProcessGrid with 2 data groups of one layer rank).  Gradient error =",
        "||g - g_serial|| / ||g_serial|| over every parameter, on one batch of 64, at the",
        "initial weights and after the timed batches.",
        "",
        "| configuration | ms / batch | speedup | target | grad error (init) | "
        "grad error (trained) |",
        "|---|---|---|---|---|---|",
    ]
    demo_speed = {}
    for label, _, _ in ROWS:
        if label not in demo:  # a quick run measures only some rows
            continue
        runs = demo[label]
        times = [run["seconds"] for run in runs]
        if "plain_times" in runs[0]:  # paired with plain PyTorch batch by batch in its jobs
            demo_speed[label] = speedup([t for r in runs for t in r["plain_times"]],
                                        [t for r in runs for t in r["times"]])
        else:  # against the reference job of the same round
            demo_speed[label] = speedup(ref, times)
        target = DEMO_TARGETS.get(label)
        cell = "1 (the reference)" if label == REFERENCE else demo_speed[label][3]
        lines.append(
            f"| {label} | {spread(times, '.1f', 1e3)} | {cell} | "
            f"{f'>= {target[0]:.2f}' if target else ''} | "
            f"{statistics.median(r['grad_error_init'] for r in runs):.1e} | "
            f"{statistics.median(r['grad_error_trained'] for r in runs):.1e} |")
    lines += ["", "### What the demo rows show", ""]
    for label, (target, meaning) in DEMO_TARGETS.items():
        if label not in demo_speed:
            continue
        med, lo, hi, _ = demo_speed[label]
        lines.append(f"- {label}: speedup {med:.2f} [{lo:.2f}-{hi:.2f}] against the target "
                     f"{target:.2f} ({meaning}): {_verdict(med, lo, target)}.")
    if ROWS[3][0] in demo_speed and ROWS[2][0] in demo_speed:
        dp, ddp = demo_speed[ROWS[3][0]], demo_speed[ROWS[2][0]]
        if dp[1] > ddp[2]:
            cmp = "faster than torch DDP in every round"
        elif dp[2] < ddp[1]:
            cmp = "slower than torch DDP in every round"
        else:
            cmp = "within torch DDP's spread"
        lines.append(f"- Data parallelism: layerbraid's ProcessGrid {dp[0]:.2f} [{dp[1]:.2f}-"
                     f"{dp[2]:.2f}], torch DDP {ddp[0]:.2f} [{ddp[1]:.2f}-{ddp[2]:.2f}]: "
                     f"ProcessGrid is {cmp} (target: at least DDP's speedup).")
    others = [label for label in demo_speed if label != REFERENCE]
    lps = [label for label in demo_speed if label.startswith("layer parallel, 2")]
    if others:
        best = max(others, key=lambda label: demo_speed[label][0])
        lines.append(f"- The fastest use of this machine for this 8-step network is {best} "
                     f"({demo_speed[best][0]:.2f}).")
    if lps:
        lp = max(lps, key=lambda label: demo_speed[label][0])
        lines.append(f"- The fastest layer-parallel row on 2 ranks is {lp} "
                     f"({demo_speed[lp][0]:.2f}).")

    lines += [
        "",
        "## The benchmark conv layer: time against the work bound",
        "",
        "`x <- x + dt relu(conv2(relu(conv1(x))))`, 8 channels, 28x28, batch 50, float32, one",
        "thread per rank; no open or close layer.  cfactor 4, F-relaxation on the fine level,",
        "FCF on coarse ones, first down-cycle skipped.  Each job alternates a layer-parallel",
        f"forward+backward and plain PyTorch's ({data['repeats']} timed pairs per job, one job "
        "per round): the speedup's spread is over every pair.  `bound` is the work bound:",
        "layerbraid.plan's prediction of the core's schedule with the step and VJP costs",
        "measured right after the pair (medians of 3), no other work and free messages;",
        "`/ bound` is the time as a multiple of its pair's bound, for layerbraid and for plain",
        "PyTorch (whose bound is N steps + N VJPs), median [min-max] over the pairs.  The ranks",
        "are bound to a core each.  The costs are measured on one step alone, its input and",
        "output hot in cache; in a chain of steps every step reads the previous one's output,",
        "so `plain / bound` shows how far the isolated costs stand from a chain's.  `bound's",
        "speedup` is plain PyTorch's time over the bound, pair by pair: the most speedup the",
        "schedule's own work allows, with no overhead at all.  `/ chain bound` scales the",
        "bound by plain PyTorch's time over its own bound: the time as a multiple of the work",
        "at the cost a step has inside plain PyTorch's chain, which leaves layerbraid's",
        "overhead alone.  `target` is the least speedup the row is held to.  `MPI` and",
        "`bookkeeping` come from the solves' own statistics (``SolveStats``), forward and",
        "adjoint together, the most over the ranks (median over the pairs): the time in the",
        "core's MPI calls (messages and the waiting for them, which the schedule has too) and",
        "the time in neither the steps nor MPI (the core's sweeps and the callbacks' vector",
        "sums, norms, clones and packing: overhead the bound leaves out).",
        "",
        "| configuration | ms | plain PyTorch ms | speedup | target | bound ms | bound's speedup "
        "| / bound | plain / bound | / chain bound | MPI ms | bookkeeping ms | err param grad |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts, chain = [], []
    for ranks, steps, levels, fwd, bwd, target, meaning in LAYER_ROWS:
        label = _layer_label(ranks, steps, levels, fwd, bwd)
        if label not in layer:
            continue
        runs = layer[label]
        lp_t = [t for r in runs for t in r["lp_times"]]
        pl_t = [t for r in runs for t in r["serial_times"]]
        med, lo, hi, cell = speedup(pl_t, lp_t)
        costs = [c for r in runs for c in pair_costs(r)]
        bounds = [work_bound(steps, ranks, levels, fwd, bwd, *c) for c in costs]
        plain_bounds = [steps * (c[0] + c[2]) for c in costs]
        over_t = [t / b for t, b in zip(lp_t, bounds)]
        plain_over_t = [t / b for t, b in zip(pl_t, plain_bounds)]
        chain_t = [o / q for o, q in zip(over_t, plain_over_t)]
        over, over_chain = statistics.median(over_t), statistics.median(chain_t)
        allowed = [p / b for p, b in zip(pl_t, bounds)]  # the bound's speedup
        mpi, book = (statistics.median(r[key] for r in runs) if key in runs[0] else None
                     for key in ("mpi_seconds", "bookkeeping_seconds"))
        lines.append(
            f"| {label} | {spread(lp_t, '.0f', 1e3)} | {spread(pl_t, '.0f', 1e3)} | {cell} | "
            f">= {target:.2f} ({meaning}) | {spread(bounds, '.0f', 1e3)} | {spread(allowed)} "
            f"| {spread(over_t)} | "
            f"{spread(plain_over_t)} | {spread(chain_t)} "
            f"| {'' if mpi is None else f'{1e3 * mpi:.0f}'} "
            f"| {'' if book is None else f'{1e3 * book:.0f}'} "
            f"| {statistics.median(r['err_param_grad'] for r in runs):.1e} |")
        verdicts.append((label, med, lo, target, _verdict(med, lo, target),
                         statistics.median(allowed), over))
        if levels > 1 and (fwd, bwd) == (2, 1):
            chain.append((label, over, over_chain,
                          None if book is None else book / statistics.median(lp_t)))
    lines += _busy_table(layer)
    split_lines, split_findings = _split_table(layer)
    lines += split_lines
    lines += ["", "### What the benchmark-layer rows show", ""]
    met = [v for v in verdicts if v[4] != "not met"]
    lines.append(f"- {len(met)} of {len(verdicts)} rows meet their target by the median; "
                 f"{sum(v[4] == 'met in every measurement' for v in verdicts)} in every timed "
                 "pair.")
    for label, med, lo, target, verdict, allowed, over in verdicts:
        if verdict == "met in every measurement":
            continue
        line = f"- {label}: speedup {med:.2f} (lowest {lo:.2f}) against {target:.2f}: {verdict}."
        if verdict == "not met":
            # the time the target asks for, as a multiple of the work bound
            need = allowed / target
            line += (f"  At its work bound it would reach {allowed:.2f}; the target asks for "
                     f"at most {need:.2f}x the bound, against {over:.2f}x measured"
                     + (": below the bound itself, so no cut of overhead reaches it, only a "
                        "schedule with less work" if need < 1.0 else
                        f": {100 * (1 - need / over):.0f}% off the time") + ".")
        lines.append(line)
    lines += _busy_findings(layer) + split_findings
    for label, over, over_chain, book in chain:
        lines.append(f"- {label}, against the target of at most {BOUND_TARGET:.2f}x the work "
                     f"bound: {over:.2f}x the bound ({'met' if over <= BOUND_TARGET else 'not met'})"
                     f", {over_chain:.2f}x the chain bound "
                     f"({'met' if over_chain <= BOUND_TARGET else 'not met'})"
                     + ("" if book is None else
                        f"; the solves' bookkeeping is {100 * book:.0f}% of its time") + ".")

    lines += _transport_table(layer, data.get("transport", {}))
    lines += [
        "",
        "## Memory",
        "",
        "One forward+backward of the benchmark layer at N=64 on every rank (after a",
        "forward+backward of 2 samples, so that what the libraries allocate once is not",
        "counted): the growth of the bytes torch's allocator holds, at their peak (from the",
        "profiler's allocation events: every tensor, the kept graphs and layerbraid's states",
        "included; the same for every run of the same code), per step the rank owns; plain",
        "PyTorch's is its growth over 64 steps.  `graph` is the same growth when the forward",
        "has returned (the kept graph and the output), per owned step; `above the graph` is what",
        "the backward adds at its peak, in states (one state: the batch's activations after a",
        "step), beside the fine C-points the rank's adjoint solve owns (its MGRIT unknowns, from",
        "cfactor on: kept from its coarse solve through its final relaxation).  Beside them, the",
        "peak resident set's growth over another forward+backward, what the OS saw: it varies",
        "between runs of the same code with what the C allocator returns and reuses, so it is",
        "shown, not judged.  Separate processes.",
        "",
        "| configuration | allocated MB per rank | MB per owned step | / plain's per step "
        "| graph MB per owned step (/ plain's) | above the graph, states per rank | adjoint "
        "C-points per rank | resident set growth, MB per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def per_step(label, key="allocated_bytes"):
        return max(r[key] / r["owned_steps"] for r in memory[label]["per_rank"])

    def above(label, r):  # the backward's peak over the kept graph, in states
        return (r["allocated_bytes"] - r["after_forward_bytes"]) / memory[label]["state_bytes"]

    plain = MEMORY[0][0]
    plain_step = per_step(plain)
    graphs = "after_forward_bytes" in memory[plain]["per_rank"][0]
    ratios = {label: per_step(label) / plain_step for label in list(memory)[1:]}
    for label in memory:
        rows = memory[label]["per_rank"]
        ratio = f"{ratios[label]:.2f}" if label in ratios else "1 (the reference)"
        graph = (f"{per_step(label, 'after_forward_bytes') / 1e6:.3f} ("
                 f"{per_step(label, 'after_forward_bytes') / per_step(plain, 'after_forward_bytes'):.2f})"
                 if graphs else "")
        lines.append(f"| {label} | "
                     + ", ".join(f"{r['allocated_bytes'] / 1e6:.1f}" for r in rows)
                     + f" | {per_step(label) / 1e6:.3f} | {ratio} | {graph} | "
                     + (", ".join(f"{above(label, r):.1f}" for r in rows) if graphs else "") + " | "
                     + ", ".join(str(r.get("adjoint_c_points", "")) for r in rows) + " | "
                     + ", ".join(f"{r['growth_bytes'] / 1e6:.0f}" for r in rows) + " |")
    within = [label for label, r in ratios.items() if r <= MEMORY_TARGET]
    worst = max(ratios, key=ratios.get)
    lines += ["", f"Within {MEMORY_TARGET}x plain PyTorch's allocated memory per step: "
              f"{', '.join(within) if within else 'none'}; the most: {worst} "
              f"({ratios[worst]:.2f}x)."]
    if graphs:
        g = [per_step(label, "after_forward_bytes") / per_step(plain, "after_forward_bytes")
             for label in list(memory)[1:]]
        worst_rows = memory[worst]["per_rank"]
        r = max(worst_rows, key=lambda r: r["allocated_bytes"] / r["owned_steps"])
        c = r.get("adjoint_c_points", 0)
        without = ((r["allocated_bytes"] - c * memory[worst]["state_bytes"]) / r["owned_steps"]
                   / plain_step)
        span = f"{min(g):.2f}" if f"{min(g):.2f}" == f"{max(g):.2f}" else \
            f"{min(g):.2f}-{max(g):.2f}"
        lines += ["", f"The kept graph per owned step is {span}x plain "
                  f"PyTorch's in every layer-parallel row.  What differs is the backward's "
                  f"working memory above it: {above(plain, memory[plain]['per_rank'][0]):.1f} states "
                  f"for plain PyTorch's whole chain, {above(worst, r):.1f} on the busiest rank of "
                  f"{worst}"
                  + (f", of which its adjoint's {c} C-point values are MGRIT's own unknowns "
                     f"(without them: {without:.2f}x plain's per step)" if c else "") + "."]

    step, vjp, vjp_p, n = pj["step_seconds"], pj["vjp_seconds"], pj["vjp_param_seconds"], pj["steps"]
    lines += [
        "",
        "## Projected: many ranks (layerbraid.plan)",
        "",
        f"The demo's layer, made deep: N = {n} steps of its ConvBlock on a 64x8x14x14 state",
        f"(step {1e3 * step:.3f} ms, VJP {1e3 * vjp:.3f} ms, VJP with parameter gradients "
        f"{1e3 * vjp_p:.3f} ms, measured here on one thread), one rank per device, each rank",
        f"as fast as this machine's core.  Messages are one state ({pj['state_bytes'] / 1e3:.0f} "
        "kB); the model charges latency + bytes / bandwidth per message and log2(P)",
        "latencies per allreduce, and walks the exact schedule the C core runs, at 2 forward /",
        "1 adjoint iterations.  Not modelled: layerbraid's own time per step (measured above),",
        "the open and close layers, contention.  Speedup is over the model's serial time (N",
        "steps + N VJPs with parameter gradients), i.e. over plain PyTorch on one such rank.",
        "",
        "| network | ranks | speedup, 2 levels, cfactor 4, 2/1 it | speedup, "
        "best settings (2/1 it) | best settings |",
        "|---|---|---|---|---|",
    ]
    for name, ranks, sd, sb, settings in pj["rows"]:
        lines.append(f"| {name} | {ranks} | {sd:.2f} | {sb:.2f} | {settings} |")
    lines += ["", "Networks: " + "; ".join(f"{name}: {1e6 * lat:g} us per message, "
                                           f"{bw / 1e9:g} GB/s" for name, lat, bw in NETWORKS)
              + ".", ""]
    for name, _, _ in NETWORKS:
        rows = [r for r in pj["rows"] if r[0] == name]
        first = next((r[1] for r in rows if r[3] > 1.0), None)
        top = max(rows, key=lambda r: r[3])
        demo_top = max(rows, key=lambda r: r[2])
        lines.append(
            f"- {name}: the best settings first beat plain PyTorch at "
            f"{f'{first} ranks' if first else 'no rank count shown'}, and reach {top[3]:.1f}x at "
            f"{top[1]} ranks ({top[4]}); 2 levels, cfactor 4 reach at most {demo_top[2]:.1f}x "
            f"(at {demo_top[1]} ranks).")
    lines += ["", "The projection assumes 2/1 iterations give usable gradients; "
              "docs/accuracy.md measures what they give in training."]
    return lines


if __name__ == "__main__":
    main()
