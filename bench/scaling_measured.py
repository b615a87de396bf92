"""Scaling measured with emulated layers at 1-64 ranks, against layerbraid.plan's prediction.

    python -m bench.scaling_measured            (docs/scaling_measured.json, the "Measured"
                                                 section of docs/scaling.md and its plots)
    python -m bench.scaling_measured --report   (rewrites the section and plots from the last run's raw data)

A 2-core machine cannot compute 64 ranks' layers, but it can run everything else of 64 ranks:
bench/workers/emulated.py trains through the real path (LayerParallelModule's forward and adjoint
MGRIT solves, messages of a real state's size, the output broadcast) with step layers that sleep
instead of computing (STEP_MS per step, VJP_MS per VJP), as a layer on an accelerator leaves its
CPU idle. With more ranks than cores the core's waits sleep between tests (Note [polled waits] in
cbridge/src/comm.c), and MPICH's own waits yield (MPIR_CVAR_ENABLE_HEAVY_YIELD=1). What stays real
is the schedule, the messages, the waiting, the sequential coarse solve, and layerbraid's own CPU
work (callbacks, vector sums, norms, packing, Python around each solve), which 64 ranks on 2 cores
must share: that is the part of the measurement a cluster would not see. The model of this machine
is therefore layerbraid.plan's schedule run on 2 shared cores (plan.SharedCores): a step
action needs a core for its CPU part only (the parts run in turn, at most one per core), waiting
ranks poll, and a rank that napped in a wait sees its message as late as a state handed from rank
to rank showed on this machine. Settings: 2 forward / 1 adjoint iteration, F-relaxation on the fine
level, FCF below, first down-cycle skipped. Speedup = the emulated serial network's time (plain
PyTorch autograd over the same sleeping layers) / time.
"""
import os
import statistics

from bench.harness import DOCS, generate, launch, pick, provenance, write_section
from layerbraid import MGRITOptions, plan

WORKER = "emulated"  # bench/workers/emulated.py, which runs bench/workers/hand_off.py too
# 2 ms a step and 4 a VJP (3 and 6 until the run after commit 411805d): what matters is
# their size beside layerbraid's own CPU time per step, about 0.3 ms here
STEP_MS, VJP_MS, FLOATS, REPEATS = pick(2.0, 0.3), pick(4.0, 0.6), 6272, 2
CONFIGS = pick({256: [(2, 4), (3, 4), (2, 8)], 1024: [(3, 4), (4, 4)]}, {32: [(2, 4)]})
RANKS = pick([1, 2, 4, 8, 16, 32, 64], [1, 4])
# One rank runs the smallest N's hierarchies only: its points calibrate the model of this
# machine (`host`), and N=1024's would sleep 2 more minutes.  At commit 411805d, with one job
# per rank count for the layer and another for the hand-off, and N=1024's hierarchies on one
# rank, the whole run took 15 minutes; a 64-process job spends about a minute starting.
OUT = DOCS / "scaling_measured"


def options(levels, cfactor):
    nrelax = tuple([0] + [1] * (levels - 2)) if levels > 2 else 0
    fwd = MGRITOptions(max_levels=levels, cfactor=cfactor, max_iters=2, tol=0.0, nrelax=nrelax,
                       skip_first_downcycle=True)
    return fwd, MGRITOptions(**{**fwd.__dict__, "max_iters": 1})


def measure(args=None):
    os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    rows, hand_offs = [], []
    for ranks in RANKS:
        configs = [f"{n}:{lv}:{cf}" for n, cfgs in CONFIGS.items() for lv, cf in cfgs
                   if n >= ranks and (ranks > 1 or n == min(CONFIGS))]
        if ranks == 1:
            configs += [f"{n}:1:2" for n in CONFIGS]  # exact, on one rank
        print(f"--- {ranks} ranks", flush=True)
        out = launch(WORKER, ranks, STEP_MS, VJP_MS, FLOATS, REPEATS, *configs, timeout=7200)
        rows += [r for r in out if r.get("kind") != "hand_off"]
        hand_offs += [r for r in out if r.get("kind") == "hand_off"]
    return dict(provenance(), step_ms=STEP_MS, vjp_ms=VJP_MS, floats=FLOATS, repeats=REPEATS,
                rows=rows, hand_off=hand_offs)


def costs(data, overhead):
    """The emulated layer's costs as the serial network measured them (a sleep overshoots its
    nominal time a little), and layerbraid's overhead per step action."""
    late = slack(data)
    return plan.Costs(data["step_ms"] / 1e3 + late, data["vjp_ms"] / 1e3 + late,
                      data["vjp_ms"] / 1e3 + late, message_bytes=4 * data["floats"],
                      latency=LATENCY, bandwidth=BANDWIDTH, overhead_seconds=overhead)


def slack(data):
    """Seconds a step or VJP of the emulated serial network takes beyond its nominal sleep."""
    nominal = (data["step_ms"] + data["vjp_ms"]) / 1e3
    out = [(r["serial_seconds"] / r["steps"] - nominal) / 2 for r in data["rows"]
           if r["serial_seconds"] and r["levels"] == 1]
    return max(0.0, statistics.mean(out))


# One machine's shared-memory MPI (MPICH, measured with the worker's messages): assumed values.
LATENCY, BANDWIDTH = 20e-6, 2e9


def overhead_per_step(data):
    """layerbraid's own seconds per step action on one rank: the 1-rank exact run's time over
    the emulated serial network's, per step (both run every step once forward, once backward)."""
    out = {}
    for r in data["rows"]:
        if r["ranks"] == 1 and r["levels"] == 1:
            out[r["steps"]] = max(0.0, (min(r["seconds"]) - r["serial_seconds"]) / (2 * r["steps"]))
    return statistics.mean(out.values())


CORES = 2  # this machine's


def host(data):
    """What a rank asks of this machine's cores, from the one-rank and 4-rank runs alone:
    (CPU seconds per step action, the seconds of an action beyond its CPU part and its nominal
    sleep, the share of a core a waiting rank takes).

    CPU per action: the one-rank runs' CPU time over their actions (least squares through
    zero).  Beyond it: the one-rank exact runs' time per action, less the CPU part and the
    nominal sleep (a sleep overshoots).  Waiting: the 4-rank runs' CPU time beyond their
    actions' share, over the time their ranks spent waiting (their wall time less their
    actions')."""
    ones = [r for r in data["rows"] if r["ranks"] == 1]
    xs = [r["fwd_steps"][0] + r["bwd_vjps"][0] for r in ones]
    cpu = sum(x * min(r["cpu_seconds"]) for x, r in zip(xs, ones)) / sum(x * x for x in xs)
    nominal = (data["step_ms"] + data["vjp_ms"]) / 2e3
    late = statistics.mean(min(r["seconds"]) / (2 * r["steps"]) - cpu - nominal
                           for r in ones if r["levels"] == 1)
    excess = waited = 0.0
    for r in data["rows"]:
        if r["ranks"] != 4 or r["levels"] == 1:
            continue
        wall = min(r["seconds"])
        for f, v, c in zip(r["fwd_steps"], r["bwd_vjps"], r["cpu_seconds"]):
            busy = (f * (data["step_ms"] / 1e3 + late + cpu)
                    + v * (data["vjp_ms"] / 1e3 + late + cpu))
            excess += c - cpu * (f + v)
            waited += max(0.0, wall - busy)
    return cpu, late, max(0.0, excess / waited) if waited > 0 else 0.0


def sleep_late(row):
    """Seconds a sleep of the emulated layers took beyond its nominal time in this run, the
    mean over every rank's sleeps (None for runs recorded before the worker measured it)."""
    late = row.get("sleep_late")
    if not late:
        return None
    return sum(x[0] for x in late) / max(1, sum(x[1] for x in late))


def _action_costs(data, machine):
    """(message seconds, seconds of a step, of a VJP) of the emulated layer on this machine."""
    cpu, late, _ = machine
    return (LATENCY + 4 * data["floats"] / BANDWIDTH, data["step_ms"] / 1e3 + late + cpu,
            data["vjp_ms"] / 1e3 + late + cpu)


def on_this_machine(n, ranks, fwd, bwd, data, machine, cores=CORES, seen_late=0.0):
    """(seconds, CPU seconds) of one forward+backward, the ranks sharing `cores` cores."""
    cpu, _, wait_cpu = machine
    msg, step, vjp = _action_costs(data, machine)
    shared = plan.SharedCores(cores, cpu, wait_cpu, seen_late)
    out = [plan.simulate(plan.schedule(n, ranks, opts, adjoint=adj), cost, cost, msg, LATENCY,
                         shared=shared)
           for opts, adj, cost in ((fwd, False, step), (bwd, True, vjp))]
    return out[0][0] + out[1][0], out[0][1] + out[1][1]


def hand_off_model(data, machine, ranks, seen_late):
    """Seconds of the hand-off worker's solve on `ranks` ranks in the model of this machine."""
    one = next(r["seconds"] for r in data["hand_off"] if r["ranks"] == 1)
    msg = _action_costs(data, machine)[0]
    shared = plan.SharedCores(CORES, min(machine[0], one), machine[2], seen_late)
    return plan.simulate(plan.schedule(ranks, ranks, MGRITOptions(max_levels=1)), one, one, msg,
                         LATENCY, shared=shared)[0]


def seen_late(data, machine):
    """{ranks: seconds}: how much later than half a nap a napping rank sees a message on this
    machine, from the hand-off runs (bench/workers/hand_off.py): the value with which the model
    gives the measured time (bisection; 0 where the model is already as slow)."""
    out = {}
    for r in data.get("hand_off", []):
        p, lo, hi = r["ranks"], 0.0, 0.01
        if p <= CORES or hand_off_model(data, machine, p, 0.0) >= r["seconds"]:
            out[p] = 0.0
            continue
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if hand_off_model(data, machine, p, mid) < r["seconds"] else \
                (lo, mid)
        out[p] = lo
    return out


def check_shared_cores(n, ranks, fwd, bwd, data, machine):
    """With a core per rank the shared-cores model must be layerbraid.plan.simulate itself."""
    msg, step, vjp = _action_costs(data, machine)
    ref = sum(plan.simulate(plan.schedule(n, ranks, opts, adjoint=adj), cost, cost, msg, LATENCY)
              for opts, adj, cost in ((fwd, False, step), (bwd, True, vjp)))
    got = on_this_machine(n, ranks, fwd, bwd, data, machine, cores=ranks)[0]
    if abs(got - ref) > 1e-9 * ref:
        raise AssertionError(f"shared-cores model {got} != plan.simulate {ref} (N={n}, "
                             f"{ranks} ranks)")


def report(data):
    overhead = overhead_per_step(data)
    c = costs(data, overhead)
    machine = host(data)
    late_seen = seen_late(data, machine)
    serial = {r["steps"]: r["serial_seconds"] for r in data["rows"] if r["serial_seconds"]}
    table = []
    for r in data["rows"]:
        if r["levels"] == 1:
            continue
        fwd, bwd = options(r["levels"], r["cfactor"])
        check_shared_cores(r["steps"], r["ranks"], fwd, bwd, data, machine)
        cluster = plan.predict(r["steps"], r["ranks"], fwd, bwd, c)
        pred, pred_cpu = on_this_machine(r["steps"], r["ranks"], fwd, bwd, data, machine,
                                         seen_late=late_seen.get(r["ranks"], 0.0))
        bwd_counts = [sum(x.values()) for x in
                      plan.step_counts(plan.schedule(r["steps"], r["ranks"], bwd, adjoint=True))]
        same = (cluster.steps_per_rank == r["fwd_steps"]
                and sorted(bwd_counts) == sorted(r["bwd_vjps"]))
        meas = min(r["seconds"])
        late, woke = sleep_late(r), None
        if late is not None:  # the same model, each sleep as late as this run's were
            woke = on_this_machine(r["steps"], r["ranks"], fwd, bwd, data,
                                   (machine[0], late, machine[2]),
                                   seen_late=late_seen.get(r["ranks"], 0.0))[0]
        table.append(dict(r, measured=meas, predicted=pred, same_counts=same,
                          sleep_late=late, predicted_woke=woke,
                          busy=sum(r["cpu_seconds"]) / CORES / meas,
                          predicted_busy=pred_cpu / CORES / pred,
                          speedup=serial[r["steps"]] / meas,
                          predicted_speedup=serial[r["steps"]] / pred,
                          cluster_speedup=serial[r["steps"]] / cluster.seconds))
    cpu, late, wait_cpu = machine
    lines = ["", f"## Measured with emulated layers, {min(RANKS)}-{max(t['ranks'] for t in table)} ranks", "",
             __doc__.split("\n\n", 2)[2].replace("\n", " ").strip(), "",
             f"Emulated layer: {data['step_ms']:g} ms per step, {data['vjp_ms']:g} ms per VJP, a "
             f"state of {data['floats']} float32 ({4 * data['floats'] / 1e3:.0f} kB); "
             f"{_passes(data)} per point after a traced one (the warm-up), and in the "
             f"table the fastest, with the slowest in brackets; {_one_rank(data)}.  Model of this machine (`host` and "
             f"`on_this_machine` in the script): the core's schedule, {LATENCY * 1e6:g} us "
             f"latency, {BANDWIDTH / 1e9:g} GB/s, on {CORES} shared cores; a step action takes "
             f"{cpu * 1e3:.2f} ms of CPU (the one-rank runs' CPU time per action) and its sleep "
             f"plus {late * 1e3:.2f} ms (the one-rank exact runs' time beyond CPU and sleep); a "
             f"waiting rank takes {100 * wait_cpu:.1f}% of a core (the 4-rank runs' CPU time "
             "beyond their actions, over their waiting time); a rank that napped sees a "
             "message later by what the hand-off runs below measured at that rank count.  "
             "Nothing is fitted to the training runs from 8 ranks on: those points are "
             "predictions.  With a core per rank the same model is "
             "layerbraid.plan.simulate (checked on every configuration); the last column is "
             "layerbraid.plan.predict: what a cluster with a core per rank would see.  The "
             "two columns after it: how late the run's sleeps woke up (the mean over every "
             "rank's sleeps, measured by the worker), and the same model with each action's "
             "sleep that late instead of the one-rank value.", ""]
    worst = max(abs(t["predicted"] / t["measured"] - 1) for t in table)
    lines += [f"Largest prediction error: {100 * worst:.0f}%; step and VJP counts equal in "
              f"{sum(t['same_counts'] for t in table)} of {len(table)} runs.", ""]
    for n in CONFIGS:
        lines += [f"![N={n}: measured points on predicted lines]({OUT.name}_{n}.png)", ""]
    lines += ["| N | levels | cfactor | ranks | measured s (slowest) | predicted s | predicted / measured "
              "| cores busy, measured | cores busy, predicted | speedup measured | speedup "
              "predicted | counts equal | speedup predicted, a core per rank | a sleep woke "
              "late, measured ms | predicted with sleeps as late / measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in sorted(table, key=lambda t: (t["steps"], t["levels"], t["cfactor"], t["ranks"])):
        lines.append(f"| {t['steps']} | {t['levels']} | {t['cfactor']} | {t['ranks']} | "
                     f"{t['measured']:.3f} ({max(t['seconds']):.3f}) | {t['predicted']:.3f} | "
                     f"{t['predicted'] / t['measured']:.2f} | {100 * t['busy']:.0f}% | "
                     f"{100 * t['predicted_busy']:.0f}% | {t['speedup']:.2f} | "
                     f"{t['predicted_speedup']:.2f} | {'yes' if t['same_counts'] else 'NO'} | "
                     f"{t['cluster_speedup']:.2f} | " + (
                         f"{t['sleep_late'] * 1e3:.2f} | {t['predicted_woke'] / t['measured']:.2f} |"
                         if t["sleep_late"] is not None else "- | - |"))
    top = max(RANKS)
    lines += ["", f"### Where {top} ranks lose: the critical path", "",
              f"The chain of actions that sets the finishing time of one forward+backward at {top} "
              "ranks on a cluster (a core per rank; layerbraid.plan.simulate with "
              "critical_path=True), in seconds and share:", "",
              "| N | levels | cfactor | total s | " + " | ".join(PARTS) + " |",
              "|---|---|---|---|" + "---|" * len(PARTS)]
    for n, cfgs in CONFIGS.items():
        for lv, cf in cfgs:
            total, parts = critical_path(n, top, lv, cf, c)
            lines.append(f"| {n} | {lv} | {cf} | {total:.3f} | " + " | ".join(
                f"{parts.get(p, 0.0):.3f} ({100 * parts.get(p, 0.0) / total:.0f}%)"
                for p in PARTS) + " |")
    lines += hand_off_section(data, machine, late_seen)
    lines += ["", "### Reading it", ""] + findings(table, data) + [""]
    _plot(table)
    write_section(DOCS / "scaling.md", "measured", lines)


PARTS = ["level 0 steps", "level 1 steps", "level 2 steps", "level 3 steps", "final relaxation",
         "messages", "allreduces"]
def findings(table, data):
    """Sentences computed from the measured rows."""
    def worst(rows):
        return max((abs(t["predicted"] / t["measured"] - 1) for t in rows), default=0.0)
    counts = sorted({t["ranks"] for t in table})
    small = [t for t in table if t["ranks"] <= 8]
    out = [f"- Up to 8 ranks the prediction is within {100 * worst(small):.0f}% of every "
           "measurement, and every step and VJP count equals the core's own."]
    for p in counts:
        if p > 8:
            out.append(f"- {p} ranks: within {100 * worst([t for t in table if t['ranks'] == p]):.0f}%.")
    many = [t for t in table if t["ranks"] >= 16]
    if many:
        below = [t for t in many if t["predicted"] < t["measured"]]
        top = [t for t in table if t["ranks"] == max(counts)]
        out.append(f"- From 16 ranks on, 2 cores run 8-32 processes each.  The model is below "
                   f"the measurement at {len(below)} of these {len(many)} points.  At "
                   f"{max(counts)} ranks the cores are busy "
                   f"{100 * min(t['busy'] for t in top):.0f}-"
                   f"{100 * max(t['busy'] for t in top):.0f}% of the measured time (the ranks' "
                   "CPU time over the cores) and "
                   f"{100 * min(t['predicted_busy'] for t in top):.0f}-"
                   f"{100 * max(t['predicted_busy'] for t in top):.0f}% of the predicted time, "
                   "yet the measurement takes "
                   f"{min(t['measured'] / t['predicted'] for t in top):.1f}-"
                   f"{max(t['measured'] / t['predicted'] for t in top):.1f}x the prediction: "
                   "the ranks' CPU time leaves the cores idle part of the time, yet ranks "
                   "whose sleep has ended wait to run (next item).  These points measure "
                   "the emulation on this machine, not the schedule on a cluster (the last "
                   "column).")
    woke = [t for t in table if t["sleep_late"] is not None]
    if woke:
        per = {p: [t["sleep_late"] for t in woke if t["ranks"] == p] for p in counts}
        out.append("- How late this machine wakes a sleeping layer (the mean over every rank's "
                   "sleeps in the run): " + ", ".join(
                       f"{1e3 * min(v):.2f}-{1e3 * max(v):.2f} ms at {p}"
                       for p, v in per.items() if v) + " ranks, where the model takes "
                   f"{1e3 * host(data)[1]:.2f} ms (the one-rank runs).  With every sleep as late "
                   "as its run measured (the layer's cost as this machine gave it), the model "
                   "gives " + ", ".join(
                       f"{min(r):.2f}-{max(r):.2f} at {p}" for p in counts for r in
                       [[t["predicted_woke"] / t["measured"] for t in woke if t["ranks"] == p]]
                       if r) + " ranks (predicted / measured).  A mean over every sleep does "
                   "not say which sleeps lie on the critical path: where the lateness is "
                   "largest (64 ranks) the model then errs both ways.")
    if max(RANKS) not in counts:
        out.append(f"- {max(RANKS)} ranks: no measurement (the job did not finish; see the script's "
                   "RANKS).")
    def seconds(key, lv, p):
        return next((t[key] for t in table if t["steps"] == 1024 and t["levels"] == lv
                     and t["cfactor"] == 4 and t["ranks"] == p), None)
    wins = {key: [p for p in counts if seconds(key, 4, p) is not None and
                  seconds(key, 3, p) is not None and seconds(key, 4, p) < seconds(key, 3, p)]
            for key in ("measured", "predicted")}
    out.append("- The critical path at 64 ranks is the coarsest level's sequential solve, "
               "passed from rank to rank: one more level moves it to a level with a quarter of "
               "the steps.  At N = 1024, 4 levels beat 3 at "
               f"{wins['measured'] or 'no'} ranks measured, {wins['predicted'] or 'no'} "
               "predicted.  `python -m layerbraid.tools.plan --recommend` picks the fastest settings "
               "for given costs.")
    return out


def _passes(data):
    """How many timed passes each point had (one before the worker ran a traced warm-up)."""
    n = data.get("repeats", 1)
    return "one timed pass" if n == 1 else f"{n} timed passes"


def _one_rank(data):
    """Which hierarchies the run timed on one rank."""
    ns = sorted({r["steps"] for r in data["rows"] if r["ranks"] == 1 and r["levels"] > 1})
    return "one rank ran the hierarchies of N = " + ", ".join(map(str, ns))


def hand_off_section(data, machine, late_seen):
    """The hand-off table: a state passed from rank to rank (bench/workers/hand_off.py),
    measured, in the model with naps alone, and what the model takes from it."""
    rows = sorted(data.get("hand_off", []), key=lambda r: r["ranks"])
    one = next((r["seconds"] for r in rows if r["ranks"] == 1), None)
    if one is None:
        return []
    lines = ["", "### A state handed from rank to rank", "",
             f"One-level MGRIT with one step per rank ({data['step_ms']:g} ms asleep), as the "
             "coarsest level's sequential solve passes its state (bench/workers/hand_off.py): "
             "the time beyond the ranks' steps, per hand-off (it includes the status allreduce "
             "that ends the solve).  A cluster's hand-off is its message latency; here the "
             "waiting rank naps between tests, and the machine adds more than half a nap "
             "(waking up among many processes): the last column, which the model of this "
             "machine adds to every message a napping rank receives at that rank count.  "
             "Seconds: the best of the solves after a warm-up, with the slowest in brackets "
             "(the rest of the table uses the best).", "",
             "| ranks | seconds (slowest) | per hand-off, measured ms | per hand-off, model with naps "
             "alone ms | added per message ms |",
             "|---|---|---|---|---|"]
    for r in rows:
        p = r["ranks"]
        if p == 1:
            continue
        model = hand_off_model(data, machine, p, 0.0)
        slowest = f" ({max(r['solves']):.4f})" if r.get("solves") else ""
        lines.append(f"| {p} | {r['seconds']:.4f}{slowest} | {(r['seconds'] - p * one) / (p - 1) * 1e3:.2f} "
                     f"| {(model - p * one) / (p - 1) * 1e3:.2f} | "
                     f"{late_seen.get(p, 0.0) * 1e3:.2f} |")
    return lines


def critical_path(n, ranks, levels, cfactor, c):
    """(seconds, {part: seconds}) of forward + adjoint on the critical path."""
    fwd, bwd = options(levels, cfactor)
    msg = c.latency + c.message_bytes / c.bandwidth
    total, parts = 0.0, {}
    for opts, adjoint, step, done in ((fwd, False, c.step_seconds, c.step_seconds),
                                      (bwd, True, c.vjp_seconds, c.vjp_param_seconds)):
        t, p = plan.simulate(plan.schedule(n, ranks, opts, adjoint=adjoint),
                             step + c.overhead_seconds, done + c.overhead_seconds, msg,
                             c.latency, critical_path=True)
        total += t
        for k, v in p.items():
            parts[k] = parts.get(k, 0.0) + v
    return total, parts


def _plot(table):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for n in CONFIGS:
        fig, ax = plt.subplots(figsize=(6, 4))
        for k, (lv, cf) in enumerate(CONFIGS[n]):
            pts = sorted((t for t in table if t["steps"] == n and t["levels"] == lv
                          and t["cfactor"] == cf), key=lambda t: t["ranks"])
            ranks = [t["ranks"] for t in pts]
            ax.plot(ranks, [t["predicted_speedup"] for t in pts], "-", color=f"C{k}",
                    label=f"{lv} levels, cfactor {cf}: predicted on {CORES} cores")
            ax.plot(ranks, [t["speedup"] for t in pts], "o", color=f"C{k}", label="measured")
            ax.plot(ranks, [t["cluster_speedup"] for t in pts], ":", color=f"C{k}",
                    label="predicted, a core per rank")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("layer-parallel ranks")
        ax.set_ylabel("speedup over the emulated serial network")
        ax.set_title(f"N = {n}, emulated layers")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{OUT}_{n}.png", dpi=72)  # under 100 kB a figure
        plt.close(fig)


if __name__ == "__main__":
    generate(OUT, measure, report, doc=__doc__)
