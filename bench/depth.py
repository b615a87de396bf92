"""Does training over depths pay?  Time to accuracy of nested iteration, MG/Opt and spline
steps against training the full-depth network from scratch, with plain PyTorch as a row.

    python -m bench.depth            (docs/depth.md and .json; about 5 minutes on 2 cores)
    python -m bench.depth --examples mnist volumes3d   (both networks; about 15 minutes)
    python -m bench.depth --report   (rewrites the .md from the last run's raw data, runs/reports/)

A network trained in every mode from the same seed on the same batches
(bench/workers/depth.py): examples/mnist.py's (8 steps of 8 channels, SGD with momentum at
0.05, batch 64), and when asked examples/volumes3d.py's (16 steps of 4 channels on 16^3
volumes, Adam at 0.01, batch 16; one epoch of it left every mode near chance, so the default
run leaves it out).  Modes: serial (plain PyTorch at full depth on one rank), full
(layer-parallel on 2 ranks at full depth from scratch, one MGRIT level: the examples'
default), nested (half the depth for the first third of the batches, then refined by linear
interpolation with the optimizer's state), mgopt (MG/Opt V-cycles over full and half depth: 1 /
1 optimizer steps around each coarse correction, 2 on the coarse network, whose optimizer
state starts afresh each batch, backtracking line search: the examples' defaults), spline (full depth, the step weights B-splines of degree 2 with half as many
coefficient sets as steps).  Training runs in segments of batches; after each, the test
accuracy (not timed).  The target is full-depth training's lowest final accuracy over the
seeds less one point; a run's time to it is its training time up to the first segment that
reaches it.  Each mode runs once per seed, the modes one after another; spreads are over the
seeds (time to target, final accuracy) and over every batch (time per batch).
"""
import statistics
import time

from bench.harness import DOCS, generate, launch, parser, pick, provenance, spread, time_to

OUT = DOCS / "depth.md"
WORKER = "depth"  # bench/workers/depth.py
MODES = ["serial", "full", "nested", "mgopt", "spline"]
# example -> (segments, batches per segment, test images, modes)
# Repetitions: 2 seeds of 320 MNIST batches take about 5 minutes (480 and 32 volumes3d
# batches took 15).  volumes3d runs only when asked (--examples): one epoch of 32 batches per
# seed (8 more minutes) left every mode near chance at commit 411805d, so its times to target
# said little.
RUNS = pick({"mnist": (4, 80, 2000, MODES), "volumes3d": (4, 8, 256, MODES)},
            {"mnist": (2, 3, 200, MODES), "volumes3d": (2, 2, 32, ["serial", "full"])})
EXAMPLES = pick(["mnist"], ["mnist", "volumes3d"])  # what a run measures by default
SEEDS = pick([0, 1], [0])
REFERENCE, FROM_SCRATCH = "serial", "full"
LABELS = {"serial": "plain PyTorch (1 rank)", "full": "full depth from scratch",
          "nested": "nested iteration", "mgopt": "MG/Opt", "spline": "spline steps"}


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
                runs.setdefault(f"{example}/{mode}", []).append(rows)
                print(f"--- {example}/{mode} seed {seed}: {sum(r['seconds'] for r in rows):.1f} s,"
                      f" test accuracy {rows[-1]['test_accuracy']:.4f}", flush=True)
    return {**provenance(), "seeds": SEEDS, "runs": runs, "seconds": time.time() - t0,
            "config": {e: list(RUNS[e][:3]) for e in a.examples}}


def example_rows(data, example):
    """{mode: [runs]} of one example, in MODES order."""
    return {m: data["runs"][f"{example}/{m}"] for m in MODES if f"{example}/{m}" in data["runs"]}


def target_of(by_mode):
    """The lowest final accuracy of full-depth training over the seeds, less a point: what
    training the full-depth network from scratch reaches whatever the seed."""
    return min(run[-1]["test_accuracy"] for run in by_mode[FROM_SCRATCH]) - 0.01


def table(by_mode, target):
    ref = [time_to(run, target) for run in by_mode[REFERENCE]]
    lines = ["| mode | steps | s/batch: median [quartiles] | training s, whole run (min-max) | "
             "final test accuracy (min-max) | time to target, s | speedup to target "
             "(plain PyTorch's time / this) |", "|---|---|---|---|---|---|---|"]
    for mode, runs in by_mode.items():
        batch = sorted(t for run in runs for r in run for t in r["batch_seconds"])
        q = statistics.quantiles(batch, n=4) if len(batch) > 1 else batch * 3
        whole = [sum(r["seconds"] for r in run) for run in runs]
        final = [run[-1]["test_accuracy"] for run in runs]
        reach = [time_to(run, target) for run in runs]
        depths = " -> ".join(dict.fromkeys(str(r["steps"]) for r in runs[0]))
        if all(t is not None for t in reach):
            to = spread(reach, ".1f")
            speed = spread([a / b for a, b in zip(ref, reach)], ".2f") \
                if all(t is not None for t in ref) else "- (plain PyTorch did not reach it)"
        else:
            to = f"not reached in {sum(t is None for t in reach)} of {len(reach)} run(s)"
            speed = "-"
        lines.append(f"| {LABELS[mode]} | {depths} | {statistics.median(batch):.3f} "
                     f"[{q[0]:.3f}-{q[2]:.3f}] | {min(whole):.1f}-{max(whole):.1f} | "
                     f"{100 * min(final):.2f}-{100 * max(final):.2f}% | {to} | {speed} |")
    return lines


def findings(by_mode, target):
    """One sentence per mode of training over depths, against full depth from scratch."""
    base = [time_to(run, target) for run in by_mode[FROM_SCRATCH]]
    base_final = statistics.median(run[-1]["test_accuracy"] for run in by_mode[FROM_SCRATCH])
    out = []
    for mode in ("nested", "mgopt", "spline"):
        if mode not in by_mode:
            continue
        reach = [time_to(run, target) for run in by_mode[mode]]
        final = statistics.median(run[-1]["test_accuracy"] for run in by_mode[mode])
        acc = (f"final accuracy {100 * final:.2f}% against {100 * base_final:.2f}% "
               f"({'at least' if final >= base_final else 'below'} full depth's)")
        if any(t is None for t in reach) or any(t is None for t in base):
            missed = sum(t is None for t in reach)
            out.append(f"- {LABELS[mode]}: does not pay here: {missed} of {len(reach)} run(s) "
                       f"did not reach the target {100 * target:.2f}%; {acc}.")
            continue
        ratio = statistics.median(base) / statistics.median(reach)
        if max(reach) < min(base):
            verdict = f"pays here: {ratio:.2f}x faster to the target"
        elif min(reach) > max(base):
            verdict = f"does not pay here: {1 / ratio:.2f}x slower to the target"
        else:
            verdict = f"indistinguishable here (the spreads overlap; median ratio {ratio:.2f})"
        out.append(f"- {LABELS[mode]}: {verdict}, {statistics.median(reach):.1f} s against "
                   f"{statistics.median(base):.1f} s for full depth from scratch; {acc}.")
    return out


def report(data):
    lines = ["# Training over depths: does it pay?", "",
             (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             f"Generated by `python -m bench.depth` on commit {data['commit']}, {data['date']}, "
             f"{data['machine']} ({len(data['seeds'])} seed(s), {data['seconds']:.0f} s); raw "
             "data in runs/reports/ where it ran, their summary in docs/depth.json.  Each job "
             "binds its ranks to cores of their own."]
    for example, (segments, batches, tests) in data["config"].items():
        by_mode = example_rows(data, example)
        target = target_of(by_mode)
        lines += ["", f"## {example} ({segments} segments of {batches} batches, {tests} test "
                  f"images; target {100 * target:.2f}%)", ""]
        lines += table(by_mode, target)
        lines += ["", f"### {example}: what the run shows", ""] + findings(by_mode, target)
        mg = by_mode.get("mgopt")
        if mg:
            alphas = [a for run in mg for r in run for a in r["alphas"]]
            taken = sum(a > 0 for a in alphas)
            lines.append(f"- MG/Opt's line search took the coarse correction at {taken} of "
                         f"{len(alphas)} batches (mean step {statistics.fmean(alphas):.2f}).")
    return lines


if __name__ == "__main__":
    main()
