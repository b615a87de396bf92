"""layerbraid against pipeline parallelism (torch.distributed.pipelining), side by side.

    python -m bench.vs_pipelining      (writes docs/vs_pipelining.md and .json)

One job per launcher and batch, 2 processes, every system of bench/workers/vs_pipelining.py in
it, interleaved round by round: under torchrun (torch.distributed, gloo), plain PyTorch,
torch.distributed.pipelining's GPipe and 1F1B schedules and layerbraid; under mpiexec (MPI),
plain PyTorch and layerbraid (pipelining needs torch.distributed).  The network: 64 steps
``x + dt * relu(conv2(relu(conv1 x)))`` of 8 channels at 28x28 between a 3x3 convolution in and
a linear layer out, float32, MSE loss, SGD, one thread per process.

Then more ranks than this machine has cores: bench/workers/emulated.py trains 64 emulated layers
(each sleeps its share of 20 ms per step and 40 ms per VJP for a batch of 10, as a layer on an
accelerator leaves its CPU idle) on 2-16 ranks under mpiexec, layerbraid's exact path (GPipe's
schedule: a sleeping layer is a custom autograd Function, whose VJP is never split) and MGRIT (2 levels, cfactor 4, 2 forward / 1 adjoint iterations) each in 1, 2, 5
and 10 microbatches, beside the planner's prediction of each (layerbraid.plan.predict_pipeline,
layerbraid.plan.predict with microbatches).  1F1B's schedule has GPipe's bubble, so the exact
rows stand for pipelining there: where MGRIT's fastest row beats the exact path's fastest is
where MGRIT overtakes pipelining.
"""
import os
import statistics
import time
from dataclasses import replace

from bench.harness import (DOCS, SAME_LEGEND, generate, launch, load_raw, parser, pick,
                           provenance, speedup)
from bench.workers.vs_pipelining import CHAIN_STEPS
from bench.workers.vs_pipelining import planner_costs
from layerbraid import MGRITOptions, plan

OUT = DOCS / "vs_pipelining.md"
WORKER = "vs_pipelining"  # bench/workers/vs_pipelining.py

LABELS = {
    "plain": "plain PyTorch, 1 process",
    "gpipe": "pipelining, GPipe, {m} microbatches",
    "1f1b": "pipelining, 1F1B, {m} microbatches",
    "lp": "layerbraid exact, {m} microbatch(es)",
    "lp-mgrit": "layerbraid, 2 MGRIT levels, 1/1 iterations, {m} microbatch(es)",
}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=pick(20, 2), help="interleaved rounds per job")
    p.add_argument("--batches", type=int, nargs="+", default=pick([50, 10], [10]))
    p.add_argument("--microbatches", type=int, nargs="+", default=pick([2, 5, 10], [2]))
    only = p.add_mutually_exclusive_group()
    only.add_argument("--emulated-only", action="store_true",
                      help="measure the emulated section again, keeping the last run's "
                           "2-process jobs (its raw data)")
    only.add_argument("--processes-only", action="store_true",
                      help="measure the 2-process jobs again, keeping the last run's emulated "
                           "section (with the commit it measured)")
    generate(OUT, measure, report, p, argv)


def measure(a):
    if a.emulated_only:
        data = load_raw(OUT)
        data["emulated"] = measure_emulated()
        return data
    if a.processes_only:
        emulated = load_raw(OUT)["emulated"]
        return {**measure_processes(a), "emulated": emulated}
    return {**measure_processes(a), "emulated": measure_emulated()}


def measure_processes(a):
    """The 2-process jobs: each batch under torchrun, then under mpiexec."""
    t0 = time.time()
    jobs = []
    for batch in a.batches:
        for torchrun in (True, False):  # torch.distributed (gloo), then MPI
            args = ["--batch", batch, "--rounds", a.rounds, "--steps", pick(64, 16),
                    "--microbatches", *a.microbatches]
            kind = {"launcher": "torchrun"} if torchrun else {}
            if not torchrun:  # pipelining needs torch.distributed
                args += ["--systems", "plain", "lp", "lp-mgrit"]
            jobs.append(launch(WORKER, 2, *args, cores_per_rank=1, **kind)[-1])
    return {**provenance(), "rounds": a.rounds, "seconds": time.time() - t0, "jobs": jobs}


# The emulated section: N layers, a batch of ROWS rows of FLOATS float32 numbers in all, each
# layer sleeping STEP_MS per step and VJP_MS per VJP for the whole batch (its share for a
# microbatch); MGRIT as bench/workers/emulated.py sets it (2 levels, cfactor 4).
EMU_STEPS, EMU_ROWS, EMU_FLOATS = 64, 10, 6270
EMU_STEP_MS, EMU_VJP_MS, EMU_REPEATS = pick(20.0, 2.0), pick(40.0, 4.0), 2
EMU_RANKS = pick([2, 4, 8, 16], [4])
EMU_MICROBATCHES = pick([1, 2, 5, 10], [1, 5])
EMU_LATENCY, EMU_BANDWIDTH = 20e-6, 2e9  # one node's processes (docs/scaling.md's model)


def measure_emulated():
    rows = []
    for ranks in EMU_RANKS:
        configs = [f"{EMU_STEPS}:{levels}:{cf}:{m}:{EMU_ROWS}"
                   for levels, cf in ((1, 2), (2, 4)) for m in EMU_MICROBATCHES]
        print(f"--- emulated, {ranks} ranks", flush=True)
        # waits sleep on every rank count (by default they spin where every rank has a core
        # of its own), so that a rank's CPU seconds are layerbraid's work, not its waiting
        out = launch("emulated", ranks, EMU_STEP_MS, EMU_VJP_MS, EMU_FLOATS, EMU_REPEATS,
                     *configs, timeout=3600,
                     env={**os.environ, "LAYERBRAID_WAIT_SLEEP": "1e-4"})
        rows += [r for r in out if r.get("kind") != "hand_off"]
    return {**provenance(), "steps": EMU_STEPS, "rows_per_batch": EMU_ROWS,
            "floats": EMU_FLOATS, "step_ms": EMU_STEP_MS, "vjp_ms": EMU_VJP_MS,
            "repeats": EMU_REPEATS, "wait_sleep": 1e-4, "runs": rows}


def emulated_prediction(emu, run):
    """The planner's prediction for an emulated run: its layer's sleep at the microbatch's size
    (the largest microbatch), plus what the run measured per step action on its slowest rank:
    how late a sleep woke, and layerbraid's own CPU time (the pass's CPU seconds, less those
    its waits for other ranks polled away, over the steps and VJPs the rank ran: a sleeping
    layer uses none; the waiting is the simulation's, not a cost of every action)."""
    m, n = run["microbatches"], emu["steps"]
    share = -(-emu["rows_per_batch"] // m) / emu["rows_per_batch"]
    late = max(t / k for t, k in run["sleep_late"] if k)
    waiting = run.get("wait_cpu_seconds", [0.0] * len(run["cpu_seconds"]))  # older runs: none
    over = max((c - w) / (f + b) for c, w, f, b in zip(run["cpu_seconds"], waiting,
                                                        run["fwd_steps"], run["bwd_vjps"])
               if f + b)
    costs = plan.Costs(share * emu["step_ms"] / 1e3 + late, share * emu["vjp_ms"] / 1e3 + late,
                       share * emu["vjp_ms"] / 1e3 + late, message_bytes=4 * emu["floats"] * share,
                       latency=EMU_LATENCY, bandwidth=EMU_BANDWIDTH, overhead_seconds=over)
    serial = n * (emu["step_ms"] + emu["vjp_ms"]) / 1e3
    if run["levels"] == 1:  # a sleeping layer is a custom autograd Function: its VJP is
        # never split (the split would run it twice), so the exact path runs GPipe's schedule
        return plan.predict_pipeline(n, run["ranks"], m, costs, "gpipe", serial)
    fwd = MGRITOptions(max_levels=2, cfactor=4, max_iters=2, tol=0.0, nrelax=0,
                       skip_first_downcycle=True)
    bwd = MGRITOptions(**{**fwd.__dict__, "max_iters": 1})
    return plan.predict(n, run["ranks"], fwd, bwd, costs, microbatches=m, serial_seconds=serial)


def _label(name):
    family, _, m = name.rpartition("-") if name[-1].isdigit() else (name, "", "")
    return LABELS[family].format(m=m)


MGRIT_ROWS = MGRITOptions(max_levels=2, cfactor=4, max_iters=1)  # the worker's lp-mgrit-M


def predicted(job, name):
    """The planner's seconds per batch for a row in each round, from the step costs the job
    measured in that round at the row's microbatch size (a pipeline:
    layerbraid.plan.predict_pipeline; MGRIT in microbatches: layerbraid.plan.predict) and, for
    layerbraid's rows, its own costs (:func:`own_costs`), or None for plain PyTorch.  Runs that
    measured the costs once, after the rounds, give one prediction."""
    family, _, m = name.rpartition("-")
    if name == "plain" or family not in ("gpipe", "1f1b", "lp", "lp-mgrit"):
        return None
    c = job["costs"]
    out = []
    for r in c.get("rounds", [c]):
        costs = _costs_of(job, m, r, c["message_bytes"], family in ("gpipe", "1f1b"))
        if family in ("lp", "lp-mgrit"):
            over, per_batch = own_costs(job, family, m, costs)
            costs = replace(costs, overhead_seconds=over, batch_seconds=per_batch)
        out.append(_model(family, job["steps"], job["ranks"], int(m), costs,
                          job["steps"] * (r["alone"][0] + r["alone"][-1])))
    return out


def own_costs(job, family, m, costs):
    """layerbraid's own seconds per step action and per batch in ``family``'s rows in ``m``
    microbatches, which the step costs leave out (``Costs.overhead_seconds``: the step's call
    through layerbraid, the vector sums and norms around it, a message's handling beyond the
    latency its sender is charged; ``Costs.batch_seconds``: the layers around the chain, the
    loss, the microbatches' set-up), from the short chains the job timed in every round (the
    worker's _Chains) and one round's ``costs``: the overhead at which the planner predicts how
    much longer the longer chain takes (the median over every round's pairs: one round's few
    pairs extrapolated to 64 steps multiply their noise), and what the longer chain's time
    (the median) has beyond its prediction with it.  (0, 0) for runs that timed no chains;
    the values they fitted themselves where they did."""
    rounds = job["costs"].get("rounds", [job["costs"]])
    pairs = [p for r in rounds for p in r.get("chains", {}).get(family, {}).get(m, [])]
    if not pairs:
        prefix = "" if family == "lp-mgrit" else "lp-"
        return tuple(statistics.median(r.get(prefix + k, {}).get(m, 0.0) for r in rounds)
                     for k in ("overhead", "batch_seconds"))
    grown = statistics.median(b - a for a, b in pairs)
    took = statistics.median(b for _, b in pairs)
    short, long = CHAIN_STEPS, 2 * CHAIN_STEPS

    def chain(n, over):
        return _model(family, n, job["ranks"], int(m), replace(costs, overhead_seconds=over))

    def growth(over):
        return chain(long, over) - chain(short, over)

    lo, hi = 0.0, 1e-4
    if growth(lo) < grown:
        while growth(hi) < grown and hi < 1.0:
            hi *= 2
        for _ in range(30):  # bisection: the longer chain has more actions to pay it
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if growth(mid) < grown else (lo, mid)
    return lo, max(took - chain(long, lo), 0.0)


def _model(family, steps, ranks, m, costs, serial=None):
    """The planner's seconds per batch of ``family``'s schedule in ``m`` microbatches."""
    if family == "lp-mgrit":
        return plan.predict(steps, ranks, MGRIT_ROWS, MGRIT_ROWS, costs, microbatches=m,
                            serial_seconds=serial).seconds
    schedule = {"1f1b": "1f1b", "gpipe": "gpipe"}.get(family, "exact")
    return plan.predict_pipeline(steps, ranks, m, costs, schedule, serial).seconds


def _costs_of(job, m, measured, message_bytes, pipelining=False):
    """The planner's costs of a row (the worker's planner_costs; ``pipelining``: its messages
    timed through torch.distributed itself, where they were), also from the raw data of runs
    before every part of them was measured: the plain VJP (then 2/3 of the other), the split
    VJP and the timed messages (then 50 us and 1 GB/s)."""
    if "message" in measured and "split" in measured and len(measured["busy"][m]) == 3:
        return planner_costs(measured, m, job["batch"], message_bytes, pipelining)
    busy = measured["busy"][m]
    if len(busy) == 2:
        busy = (busy[0], busy[1] / 1.5, busy[1])
    part_x, part_w = measured.get("split", {}).get(m, (None, None))
    return plan.Costs(*busy, message_bytes=message_bytes * job["batch"] / int(m),
                      latency=50e-6, bandwidth=1e9, split_input_seconds=part_x,
                      split_weights_seconds=part_w)


def model_cells(times, guesses):
    """The predicted ms and measured / predicted cells of a row, and the ratio to judge it by:
    with a prediction per round, the median over the rounds of each round's ratio, with its
    spread; with one, the median's."""
    if len(guesses) == len(times) > 1:
        ratios = sorted(t / g for t, g in zip(times, guesses))
        med = statistics.median(ratios)
        return (f"{1e3 * statistics.median(guesses):.0f} | "
                f"{med:.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]", med)
    med = statistics.median(times) / guesses[0]
    return f"{1e3 * guesses[0]:.0f} | {med:.2f}", med


def report(data):
    lines = ["# layerbraid against pipeline parallelism", "",
             (__doc__ or "").split("\n\n", 1)[1].strip(), "",
             f"Measured on commit {data['commit']}, {data['date']}, {data['machine']} "
             f"({data['rounds']} rounds per job, {data['seconds']:.0f} s for the 2-process jobs).", "",
             "Speedup = plain PyTorch's time / the system's time of the same round (> 1 is "
             "faster), median [min-max] over the rounds; ms per batch likewise (the slowest "
             "process's).  Gradient error: relative, against the serial network's at the "
             "initial weights.  Peak saved MiB: the most bytes the autograd graphs held for the "
             "backward at once, per process (rank 0 / rank 1), seen in the untimed warm-up "
             "rounds (its hooks cost time per tensor).  Predicted: the planner's "
             "time (`layerbraid.plan.predict_pipeline`: the bubble model of GPipe and 1F1B "
             "schedules, and of layerbraid's exact path, GPipe's order with the first VJPs "
             "of each backward split past the first rank, as many as its simulation finds "
             "fastest) from a step's forward and VJP "
             "seconds measured at the row's microbatch size with both processes measuring at "
             "once, a message's seconds through the job's transport (as layerbraid sends "
             "it, with its deadline; for pipelining's rows as torch.distributed's own isend "
             "and irecv do), and for layerbraid's rows "
             "its own seconds per step action (the one at which the planner "
             "predicts how much longer a 32-step chain takes than a 16-step one, both "
             "trained by the job's processes as the row's family trains, exact or MGRIT, in "
             "the row's microbatches) and per batch (what the 32-step chain's time "
             "has beyond its prediction: the layers around the chain, the loss, the "
             "microbatches' set-up; the planner's `Costs.batch_seconds`), the two fitted "
             "together in each round; all measured in every "
             "round among the systems (the machine's quiet and busy stretches "
             "differ by more than the model's errors): predicted ms is the median of the "
             "rounds' predictions, measured / predicted the median [min-max] of each round's "
             "time over its own prediction.  " + SAME_LEGEND, ""]
    ratios = []
    best = {}
    for job in data["jobs"]:
        plain = job["times"]["plain"]
        lines += [f"## Batch {job['batch']}, {job['ranks']} processes, "
                  f"{job['transport']}", "",
                  "| system | ms per batch | speedup | gradient error | peak saved MiB "
                  "| predicted ms | measured / predicted |",
                  "|---|---|---|---|---|---|---|"]
        for name, times in job["times"].items():
            med = statistics.median(times)
            cell = speedup(plain, times)[3] if name != "plain" else "1.00"
            peaks = " / ".join(f"{b / 2**20:.0f}" for b in job["peak_bytes"][name])
            guesses = predicted(job, name)
            model = "- | -"
            if guesses is not None:
                model, ratio = model_cells(times, guesses)
                ratios.append(ratio)
            lines.append(f"| {_label(name)} | {spread(times)} | {cell} | "
                         f"{job['errors'][name]:.1e} | {peaks} | {model} |")
            exact = name.startswith("lp-") and not name.startswith("lp-mgrit")
            family = name.split("-")[0]
            kind = "pipelining" if family in ("gpipe", "1f1b") else "layerbraid" if exact else None
            if kind:
                key = (job["batch"], job["transport"], kind)
                if key not in best or med < best[key][1]:
                    best[key] = (name, med)
        lines.append("")
    emu_lines, emu_findings, emu_ratios = emulated_report(data.get("emulated"))
    lines += emu_lines
    lines += ["## Findings", ""]
    for job in data["jobs"]:
        key = (job["batch"], job["transport"])
        lp, pp = best.get((*key, "layerbraid")), best.get((*key, "pipelining"))
        if lp and pp:
            ratio = pp[1] / lp[1]
            lines.append(f"- Batch {key[0]}, {key[1]}: layerbraid's fastest exact row "
                         f"({_label(lp[0])}, {1e3 * lp[1]:.0f} ms) against the fastest "
                         f"pipelining row ({_label(pp[0])}, {1e3 * pp[1]:.0f} ms): "
                         f"{ratio:.2f}x its speed (> 1: layerbraid faster), medians.")
    if ratios:
        lines.append(f"- The planner's pipeline model on the 2-process rows: measured / "
                     f"predicted {min(ratios):.2f} to {max(ratios):.2f} over the {len(ratios)} "
                     f"modelled rows ({sum(abs(r - 1) <= 0.15 for r in ratios)} within 15%).")
    lines += emu_findings
    return lines


def _emu_label(run):
    kind = "exact (GPipe)" if run["levels"] == 1 else "MGRIT, 2 levels"
    return f"layerbraid {kind}, {run['microbatches']} microbatch(es)"


def emulated_report(emu):
    """The emulated section's lines, its findings, and the measured / predicted ratios."""
    if not emu or not emu.get("runs"):
        return [], [], []
    serial = emu["steps"] * (emu["step_ms"] + emu["vjp_ms"]) / 1e3
    when = (f"Measured on commit {emu['commit']}, {emu['date']}; waiting ranks sleep "
            f"{1e3 * emu['wait_sleep']:g} ms between tests.  " if "commit" in emu else "")
    lines = [f"## More ranks, emulated layers ({emu['steps']} layers, mpiexec)", "",
             when + f"Each layer sleeps its share of {emu['step_ms']:g} ms per step and "
             f"{emu['vjp_ms']:g} ms per VJP for the batch of {emu['rows_per_batch']} rows; the "
             f"serial network's time is {1e3 * serial:.0f} ms per batch (the sleeps alone).  "
             f"Seconds per batch: median [min-max] of {emu['repeats']} passes (the slowest "
             "rank's); predicted: the planner's, from the sleeps at the microbatch's size plus "
             "what the run measured per step action (how late a sleep woke, and layerbraid's "
             "own CPU time per step, less what its waits for other ranks polled away).  "
             "Speedup = the serial time / the median.", "",
             "| ranks | system | ms per batch | speedup | predicted ms | measured / predicted |",
             "|---|---|---|---|---|---|"]
    ratios, best = [], {}
    for run in sorted(emu["runs"], key=lambda r: (r["ranks"], r["levels"], r["microbatches"])):
        med = statistics.median(run["seconds"])
        guess = emulated_prediction(emu, run).seconds
        ratios.append(med / guess)
        lines.append(f"| {run['ranks']} | {_emu_label(run)} | {spread(run['seconds'])} | "
                     f"{serial / med:.2f} | {1e3 * guess:.0f} | {med / guess:.2f} |")
        key = (run["ranks"], run["levels"] > 1)
        for source, value in (("measured", med), ("predicted", guess)):
            k = (*key, source)
            if k not in best or value < best[k][1]:
                best[k] = (run, value)
    lines.append("")
    findings = [f"- Emulated rows: measured / predicted {min(ratios):.2f} to {max(ratios):.2f} "
                f"over {len(ratios)} rows ({sum(abs(r - 1) <= 0.15 for r in ratios)} within "
                "15%)."]
    for source in ("measured", "predicted"):
        ranks = sorted({r for r, _, s in best if s == source})
        over = [r for r in ranks if (r, True, source) in best and (r, False, source) in best
                and best[(r, True, source)][1] < best[(r, False, source)][1]]
        if over:
            r = over[0]
            mg, ex = best[(r, True, source)], best[(r, False, source)]
            findings.append(f"- MGRIT overtakes the pipeline ({source}) from {r} ranks on "
                            f"(of {ranks}): {_emu_label(mg[0])} {1e3 * mg[1]:.0f} ms against "
                            f"{_emu_label(ex[0])} {1e3 * ex[1]:.0f} ms.")
        else:
            findings.append(f"- MGRIT does not overtake the pipeline ({source}) on {ranks} "
                            "ranks.")
    return lines, findings, ratios


def spread(times):
    v = sorted(1e3 * t for t in times)
    return f"{statistics.median(v):.0f} [{v[0]:.0f}-{v[-1]:.0f}]"


if __name__ == "__main__":
    main()
