"""Does training over depths pay?  Time to accuracy of nested iteration, MG/Opt and spline
steps against training the full-depth network from scratch, with plain PyTorch as a row.

    python -m bench.depth            (docs/depth.md and .json; about 13 minutes on 2 cores)
    python -m bench.depth --examples mnist32   (the 32-step network alone; the last run's
                                                other networks are kept, with their commits)
    python -m bench.depth --examples mnist volumes3d   (both networks; about 15 minutes)
    python -m bench.depth --report   (rewrites the .md from the last run's raw data, runs/reports/)

A network trained in every mode from the same seed on the same batches
(bench/workers/depth.py): examples/mnist.py's (8 steps of 8 channels, SGD with momentum at
0.05, batch 64), and when asked examples/volumes3d.py's (16 steps of 4 channels on 16^3
volumes, Adam at 0.01, batch 16; one epoch of it left every mode near chance, so the default
run leaves it out), and the same MNIST network at 32 steps (mnist32: the depths where the
literature reports MG/Opt and nested iteration paying).  Modes: serial (plain PyTorch at full depth on one rank), full
(layer-parallel on 2 ranks at full depth from scratch, one MGRIT level: the examples'
default), nested (half the depth for the first third of the segments, rounded down, then
refined by linear interpolation with the optimizer's state), mgopt (MG/Opt V-cycles over full and half depth: 1 /
1 optimizer steps around each coarse correction, 2 on the coarse network, whose optimizer
state starts afresh each batch, backtracking line search: the examples' defaults), spline (full depth, the step weights B-splines of degree 2 with half as many
coefficient sets as steps; on mnist32 also spline_uniform, the same with TorchBraid's uniform
knots, and nested_frozen, nested iteration with the inherited steps frozen after the
refinement).  Training runs in segments of batches; after each, the test
accuracy (not timed).  The target is full-depth training's lowest final accuracy over the
seeds less one point; a run's time to it is its training time up to the first segment that
reaches it, and its batches to it the batches up to there (work, which the machine's load
does not move).  Each mode runs once per seed, the modes one after another, so each mode is
compared with full depth seed by seed: the ratio of full depth's time (and batches) to the
target to the mode's, and the difference of final accuracies, against the test set's noise
(twice the standard error of a difference of two accuracies on the same test images counted
as independent: 2 sqrt(2 p (1 - p) / n)).  A mode "pays" only where it reached the target
sooner in every seed.  MG/Opt takes two fine optimizer steps per batch besides its coarse
work: it is also compared at equal fine optimizer steps and at equal training time.  Spreads
are over the seeds (median [min-max]) and over every batch (time per batch).
"""
import statistics
import time

from bench.harness import (DOCS, generate, launch, load_raw, parser, pick, provenance, raw_path,
                           spread, time_to)

OUT = DOCS / "depth.md"
WORKER = "depth"  # bench/workers/depth.py
MODES = ["serial", "full", "nested", "nested_frozen", "mgopt", "spline", "spline_uniform"]
SHALLOW = ["serial", "full", "nested", "mgopt", "spline"]
# example -> (segments, batches per segment, test images, modes)
# Repetitions: 2 seeds of 320 MNIST batches took about 5 minutes (480 and 32 volumes3d
# batches took 15); 5 seeds, 13.  volumes3d runs only when asked (--examples): one epoch of 32 batches per
# seed (8 more minutes) left every mode near chance at commit 411805d, so its times to target
# said little.
RUNS = pick({"mnist": (8, 40, 2000, SHALLOW), "mnist32": (8, 40, 2000, MODES),
             "volumes3d": (4, 8, 256, SHALLOW)},
            {"mnist": (2, 3, 200, SHALLOW), "mnist32": (2, 3, 200, MODES),
             "volumes3d": (2, 2, 32, ["serial", "full"])})
EXAMPLES = pick(["mnist"], ["mnist32", "volumes3d"])  # what a run measures by default
SEEDS = pick([0, 1, 2, 3, 4], [0])
REFERENCE, FROM_SCRATCH = "serial", "full"
LABELS = {"serial": "plain PyTorch (1 rank)", "full": "full depth from scratch",
          "nested": "nested iteration", "nested_frozen": "nested iteration, inherited frozen",
          "mgopt": "MG/Opt", "spline": "spline steps",
          "spline_uniform": "spline steps, uniform knots"}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--examples", nargs="+", choices=sorted(RUNS), default=EXAMPLES,
                   help=f"the networks to train (default: {' '.join(EXAMPLES)})")
    generate(OUT, measure, report, p, argv)


def measure(a):
    t0 = time.time()
    runs: dict[str, list] = {}
    for seed in SEEDS:
        for example in a.examples:
            segments, batches, tests, modes = RUNS[example]
            for mode in modes:
                rows = launch(WORKER, 1 if mode == "serial" else 2, example, mode, segments,
                              batches, tests, seed, echo=False, cores_per_rank=1)
                runs.setdefault(f"{example}/{mode}", []).extend(rows)  # rows name their seed
                print(f"--- {example}/{mode} seed {seed}: {sum(r['seconds'] for r in rows):.1f} s,"
                      f" test accuracy {rows[-1]['test_accuracy']:.4f}", flush=True)
    now = {**provenance(), "seconds": time.time() - t0}
    data = {**now, "seeds": SEEDS, "runs": runs, "config": {e: list(RUNS[e][:3]) for e in a.examples},
            "measured": {e: now for e in a.examples}}
    return keep_others(data, a.examples)


def keep_others(data, measured):
    """``data`` with the last run's networks that this run did not measure, each with the
    commit and date it was measured at (a deeper network costs an hour; the others need not be
    measured again with it)."""
    if not raw_path(OUT).exists():
        print(f"{raw_path(OUT)}: no raw data of a last run here; the report holds only "
              f"{', '.join(measured)}", flush=True)
        return data
    old = load_raw(OUT)
    for example, config in old.get("config", {}).items():
        if example in measured:
            continue
        data["config"][example] = config
        data["measured"][example] = old.get("measured", {}).get(example) or {
            k: old[k] for k in ("commit", "date", "machine", "seconds")}
        data["runs"].update({k: v for k, v in old["runs"].items()
                             if k.startswith(example + "/")})
    data["config"] = {e: data["config"][e] for e in RUNS if e in data["config"]}
    return data


def example_rows(data, example):
    """{mode: [runs]} of one example, in MODES order, a run being one seed's rows.  The raw
    data keep each mode's rows in one list (each row names its seed), so that their summary
    (docs/depth.json) takes quartiles over them instead of every row."""
    return {m: by_seed(data["runs"][f"{example}/{m}"]) for m in MODES
            if f"{example}/{m}" in data["runs"]}


def by_seed(rows):
    """A mode's rows as one list per seed, in the order the seeds ran (rows already grouped,
    as older runs kept them, stay as they are)."""
    if rows and isinstance(rows[0], list):
        return rows
    out: dict[int, list] = {}
    for r in rows:
        out.setdefault(r["seed"], []).append(r)
    return list(out.values())


def target_of(by_mode):
    """The lowest final accuracy of full-depth training over the seeds, less a point: what
    training the full-depth network from scratch reaches whatever the seed."""
    return min(run[-1]["test_accuracy"] for run in by_mode[FROM_SCRATCH]) - 0.01


def table(by_mode, target):
    ref = [time_to(run, target) for run in by_mode[REFERENCE]]
    lines = ["| mode | steps | s/batch: median [quartiles] | training s, whole run (min-max) | "
             "final test accuracy (min-max) | time to target, s | batches to target "
             "| speedup to target (plain PyTorch's time / this) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, runs in by_mode.items():
        batch = sorted(t for run in runs for r in run for t in r["batch_seconds"])
        q = statistics.quantiles(batch, n=4) if len(batch) > 1 else batch * 3
        whole = [sum(r["seconds"] for r in run) for run in runs]
        final = [run[-1]["test_accuracy"] for run in runs]
        reach = [time_to(run, target) for run in runs]
        depths = " -> ".join(dict.fromkeys(str(r["steps"]) for r in runs[0]))
        work = [batches_to(run, target) for run in runs]
        if all(t is not None for t in reach):
            to = spread(reach, ".1f")
            work_to = spread(work, ".0f")
            speed = spread([a / b for a, b in zip(ref, reach)], ".2f") \
                if all(t is not None for t in ref) else "- (plain PyTorch did not reach it)"
        else:
            to = f"not reached in {sum(t is None for t in reach)} of {len(reach)} run(s)"
            speed = work_to = "-"
        lines.append(f"| {LABELS[mode]} | {depths} | {statistics.median(batch):.3f} "
                     f"[{q[0]:.3f}-{q[2]:.3f}] | {min(whole):.1f}-{max(whole):.1f} | "
                     f"{100 * min(final):.2f}-{100 * max(final):.2f}% | {to} | {work_to} | "
                     f"{speed} |")
    return lines


def batches_to(rows, goal):
    """Batches up to the first of ``rows`` whose test accuracy reaches ``goal``; None if none."""
    return next((r["batches"] for r in rows if r["test_accuracy"] >= goal), None)


def accuracy_within(rows, key, limit):
    """The test accuracy after the last of ``rows`` whose cumulative ``key`` ("seconds" or
    "full_depth_steps") is at most ``limit``; None if the first segment already exceeds it."""
    total, acc = 0.0, None
    for r in rows:
        total += r[key]
        if total > limit * (1 + 1e-9):
            break
        acc = r["test_accuracy"]
    return acc


def noise(p, n):
    """Twice the standard error of the difference of two accuracies near ``p`` on ``n``
    images each (counted as independent)."""
    return 2 * (2 * p * (1 - p) / n) ** 0.5


def _ratios(base, reach):
    return [b / r for b, r in zip(base, reach) if b is not None and r is not None and r > 0]


def _verdict(ratios, total, what):
    if len(ratios) < total:
        return f"did not reach the target in {total - len(ratios)} of {total} seed(s)"
    faster, slower = sum(x > 1 for x in ratios), sum(x < 1 for x in ratios)
    ratio = f"{what} ratio {spread(ratios)}"
    if faster == total:
        return f"sooner in every seed ({ratio})"
    if slower == total:
        return f"later in every seed ({ratio})"
    if faster == slower == 0:
        return f"as soon in every seed ({ratio})"
    return f"sooner in {faster}, later in {slower} of {total} seeds ({ratio})"


def _accuracy_sentence(mode_runs, base_runs, tests):
    diffs = [m[-1]["test_accuracy"] - b[-1]["test_accuracy"]
             for m, b in zip(mode_runs, base_runs)]
    p = statistics.median(b[-1]["test_accuracy"] for b in base_runs)
    band = noise(p, tests)
    mean = statistics.fmean(diffs)
    where = ("outside" if abs(mean) > band else "inside")
    return (f"final accuracy {'+' if mean >= 0 else ''}{100 * mean:.2f} points against full "
            f"depth's on average (per seed {', '.join(f'{100 * d:+.2f}' for d in diffs)}), "
            f"{where} the test set's noise of +-{100 * band:.2f} points")


def findings(by_mode, target, tests):
    """One paragraph per mode of training over depths, against full depth from scratch, seed
    by seed."""
    base = by_mode[FROM_SCRATCH]
    base_t = [time_to(run, target) for run in base]
    base_b = [batches_to(run, target) for run in base]
    out = []
    for mode in ("nested", "nested_frozen", "mgopt", "spline", "spline_uniform"):
        if mode not in by_mode:
            continue
        runs = by_mode[mode]
        t = _ratios(base_t, [time_to(run, target) for run in runs])
        # frozen steps make its full-depth batches less work than full depth's: not load
        load = _load(runs, base) if mode == "nested" else None
        if load is not None:  # the separate runs' speeds, taken out (see _load)
            t = [x * f for x, f in zip(t, load)]
        b = _ratios(base_b, [batches_to(run, target) for run in runs])
        text = (f"- {LABELS[mode]}: reached the target {_verdict(t, len(runs), 'time')}; in "
                f"batches, {_verdict(b, len(runs), 'batch')}; "
                f"{_accuracy_sentence(runs, base, tests)}.")
        reached = len(t) == len(b) == len(runs)
        if reached and all(x > 1 for x in t) and all(x >= 1 for x in b):
            text += " It pays here: sooner in every seed, in time, and no later in batches."
        elif not reached or all(x < 1 for x in t):
            text += " It does not pay here."
        else:
            text += " Not distinguishable from full depth here: the seeds disagree."
        if load is not None:
            text += (f" (Its time ratios are corrected for the runs' load: its full-depth "
                     f"batches took {spread(load)} times full depth's own, per seed.)")
        if mode.startswith("nested"):
            full_steps = max(r["steps"] for r in runs[0])
            half = sum(r["batches"] - (runs[0][k - 1]["batches"] if k else 0)
                       for k, r in enumerate(runs[0]) if r["steps"] < full_steps)
            text += (f" It trained {half} of its {runs[0][-1]['batches']} batches "
                     f"({100 * half / runs[0][-1]['batches']:.0f}%) at reduced depth.")
        if mode == "mgopt":
            text += " " + _equal_work(runs, base)
        out.append(text)
    if "spline" in by_mode and "spline_uniform" in by_mode:
        out.append(_knots(by_mode["spline"], by_mode["spline_uniform"], target, tests))
    return out


def _knots(clamped, uniform, target, tests):
    """Which spline knots to default to, from the two spline modes, seed by seed."""
    b = _ratios([batches_to(r, target) for r in clamped], [batches_to(r, target) for r in uniform])
    diffs = [u[-1]["test_accuracy"] - c[-1]["test_accuracy"] for c, u in zip(clamped, uniform)]
    band = noise(statistics.median(c[-1]["test_accuracy"] for c in clamped), tests)
    mean = statistics.fmean(diffs)
    text = (f"- Knots: uniform against clamped, per seed: final accuracy "
            f"{', '.join(f'{100 * d:+.2f}' for d in diffs)} points (mean {100 * mean:+.2f}, the "
            f"test set's noise +-{100 * band:.2f}); in batches to the target, uniform "
            f"{_verdict(b, len(clamped), 'batch')}.")
    if abs(mean) <= band:
        return text + " Not distinguishable here: the default stays clamped."
    better = "uniform" if mean > 0 else "clamped"
    return text + f" {better.capitalize()} knots are better here."


def _load(runs, base):
    """Per seed, the median time per batch of a mode's segments at full depth over full
    depth's own (the same work, in runs apart: a ratio away from 1 is the machine's load, not
    the method); None where the mode has no segment at full depth."""
    out = []
    for m, f in zip(runs, base):
        full_steps = max(r["steps"] for r in f)
        mine = [t for r in m if r["steps"] == full_steps for t in r["batch_seconds"]]
        theirs = [t for r in f for t in r["batch_seconds"]]
        if not mine or not theirs:
            return None
        out.append(statistics.median(mine) / statistics.median(theirs))
    return out


def _equal_work(runs, base):
    """MG/Opt against full depth at equal fine optimizer steps and at equal training time."""
    steps, wall = [], []
    for m, f in zip(runs, base):
        limit = sum(r["full_depth_steps"] for r in f)
        steps.append((accuracy_within(m, "full_depth_steps", limit), f[-1]["test_accuracy"]))
        limit = sum(r["seconds"] for r in f)
        wall.append((accuracy_within(m, "seconds", limit), f[-1]["test_accuracy"]))

    def say(pairs, what):
        got = [(a, b) for a, b in pairs if a is not None]
        if not got:
            return f"at equal {what} none of its segments fit in full depth's run"
        return (f"at equal {what} (full depth's whole run) it had "
                f"{', '.join(f'{100 * a:.2f}' for a, _ in got)}% against full depth's "
                f"{', '.join(f'{100 * b:.2f}' for _, b in got)}%"
                + (f" ({len(pairs) - len(got)} seed(s) had no segment that fit)"
                   if len(got) < len(pairs) else ""))

    return (f"Per seed, {say(steps, 'fine optimizer steps')}; {say(wall, 'training time')}.")


def report(data):
    lines = ["# Training over depths: does it pay?", "",
             (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             f"Generated by `python -m bench.depth` ({len(data['seeds'])} seed(s)); each "
             "network's section names the commit and date it was measured at.  Raw data in "
             "runs/reports/ where it ran, their summary in docs/depth.json.  Each job binds its "
             "ranks to cores of their own."]
    for example, (segments, batches, tests) in data["config"].items():
        by_mode = example_rows(data, example)
        target = target_of(by_mode)
        at = data.get("measured", {}).get(example) or data
        lines += ["", f"## {example} ({segments} segments of {batches} batches, {tests} test "
                  f"images; target {100 * target:.2f}%)", "",
                  f"Measured on commit {at['commit']}, {at['date']}, {at['machine']} "
                  f"({at['seconds']:.0f} s).", ""]
        lines += table(by_mode, target)
        lines += ["", f"### {example}: what the run shows", ""]
        lines += findings(by_mode, target, tests)
        mg = by_mode.get("mgopt")
        if mg:
            alphas = [a for run in mg for r in run for a in r["alphas"]]
            taken = sum(a > 0 for a in alphas)
            lines.append(f"- MG/Opt's line search took the coarse correction at {taken} of "
                         f"{len(alphas)} batches (mean step {statistics.fmean(alphas):.2f}).")
    return lines


if __name__ == "__main__":
    main()
