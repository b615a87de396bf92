"""Spatial coarsening on 3D volumes: time per batch and accuracy with and without it.

    python -m bench.spatial             (docs/bench_spatial.md and .json; about 10 minutes on
                                         2 cores: timing, convergence, training runs of
                                         examples/volumes3d.py, errors on the trained network)
    python -m bench.spatial --report    (rewrites the .md from the last run's raw data, runs/reports/)

ODE-ResNet of 3D ConvBlocks (4 channels), batch 2, float32, one thread per rank; 3 MGRIT levels,
cfactor 4, FCF, 2 forward / 1 backward iterations, first down-cycle skipped.  Spatial coarsening on
levels 1 and 2, in mode "branch" (states stay fine, coarse steps run the layer on the coarse grid)
and mode "state" (coarse levels store coarse states).  Plain PyTorch's forward+backward (rank 0,
same weights; on 2 ranks the other rank waits in an MPI reduction meanwhile) is timed in the same
job, interleaved with the three modes round after round (3 rounds at 32^3 with 32 steps, 2 at
32^3 with 128 steps and at 64^3 with 32 steps, those on 2 ranks only: a run that also timed one
rank at both, 64^3 with 128 steps and longer training took 45 minutes instead of 13, training on twice the volumes 13 instead of 10), and is the reference of the errors: relative 2-norm errors of the
output, the input gradient and all parameter gradients.  Times are the median [min-max] over the
rounds and the speedup is over the rounds' pairs, after a warm-up on an 8^3 input.  The timing
jobs and the training runs bind each rank to a core of its own.
"""
import json
import statistics
import sys
from pathlib import Path

from bench.harness import (DOCS, QUICK, ROOT, SAME_LEGEND, generate, launch, mpiexec, pick,
                           provenance, speedup, spread)

WORKER = "spatial_timing"  # bench/workers/spatial_timing.py


CONVERGENCE = "spatial_convergence"  # bench/workers/spatial_convergence.py


def _times(row):
    """A timing row's seconds per round (a single best time in data measured before rounds)."""
    return row["seconds"] if isinstance(row["seconds"], list) else [row["seconds"]]


def _plain(row):
    return row["serial_seconds"] if isinstance(row["serial_seconds"], list) \
        else [row["serial_seconds"]]


def finding(data):
    """What the measurements show, each sentence computed from them."""
    def span(values, fmt=".1e"):
        values = [v for v in values if v == v]
        return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "(not measured)"

    modes = [m for m in ("none", "branch", "state") if any(r["mode"] == m
                                                           for r in data["timing"])]
    out = ["## What this shows", ""]
    for m in modes:
        rows = [r for r in data["timing"] if r["mode"] == m]
        two = [speedup(_plain(r), _times(r))[0] for r in rows if r["ranks"] == 2]
        conv = [r for r in data["convergence"] if r["mode"] == m]
        factors = [(r["residuals"][-1] / r["residuals"][0]) ** (1 / (len(r["residuals"]) - 1))
                   for r in conv if r["residuals"][0] > 0 and len(r["residuals"]) > 1]
        out.append(f"- Spatial coarsening {m!r}: output error {span([r['err_output'] for r in rows])}"
                   f", parameter-gradient error {span([r['err_param_grad'] for r in rows])} at "
                   f"2 forward / 1 adjoint iterations; speedup over plain PyTorch on 2 ranks "
                   f"{span(two, '.2f')} (medians of the configurations); the forward residual shrinks by a factor "
                   f"{span(factors, '.2f')} per iteration (float64, one rank).")
    if "none" in modes:
        base = {(r["size"], r["steps"], r["ranks"]): r for r in data["timing"]
                if r["mode"] == "none"}
        for m in (m for m in modes if m != "none"):
            ratios = [r["err_param_grad"] / base[k]["err_param_grad"] for r in data["timing"]
                      if r["mode"] == m and (k := (r["size"], r["steps"], r["ranks"])) in base
                      and base[k]["err_param_grad"] > 0]
            if ratios:
                out.append(f"- {m!r} against no spatial coarsening, same configuration: "
                           f"parameter-gradient error {span(ratios, '.2f')} times as large.")
    plain = {}
    for r in data["timing"]:
        if r["mode"] == "none":
            plain.setdefault((r["size"], r["steps"]), []).append(statistics.median(_plain(r)))
    jobs = [max(v) / min(v) for v in plain.values() if len(v) > 1 and min(v) > 0]
    if jobs:
        out.append(f"- Plain PyTorch's median time for the same configuration differs by up to "
                   f"{max(jobs):.2f}x between the 1- and 2-rank jobs: compare times within a "
                   "job.")
    rounds = [max(_plain(r)) / min(_plain(r)) for r in data["timing"]
              if r["mode"] == "none" and min(_plain(r)) > 0]
    if rounds:
        out.append(f"- Within a job, plain PyTorch's time varies by up to {max(rounds):.2f}x "
                   "from round to round.")
    if data.get("trained"):
        for w in sorted({r["weights"] for r in data["trained"]}):
            rows = [r for r in data["trained"] if r["weights"] == w and r["iters"] == 2]
            if rows:
                out.append(f"- {w.capitalize()} weights, 2 iterations: output error " + ", ".join(
                    f"{r['mode']} {r['err_output']:.1e}" for r in rows) + ".")
    return "\n".join(out)


def measure_costs(channels, batch):
    """Seconds of a fine step and of mode "branch"'s coarse steps (forward and adjoint, as the
    module runs them) at 64^3, here."""
    import statistics
    import time

    import torch

    from layerbraid import SpatialCoarsening, plan
    from layerbraid.nn import ConvBlock

    torch.set_num_threads(1)
    side = pick(64, 16)
    layer, x = ConvBlock(channels, dims=3), torch.randn(batch, channels, side, side, side)
    step, vjp, vjp_p = plan.measure_step(layer, x, repeats=3)
    sp = SpatialCoarsening([1, 2], mode="branch")

    def euler(v):
        return v + 0.1 * layer(v)

    def median_seconds(fn, repeats=3):
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    branch = []
    for lv in (1, 2):
        with torch.no_grad():
            f = median_seconds(lambda: sp.branch_step(euler, x, lv))
        b = median_seconds(lambda: sp.branch_adjoint(euler, x, x, lv))
        branch.append([f, b])
    return dict(channels=channels, batch=batch, step=step, vjp=vjp, vjp_p=vjp_p, branch=branch)


def projection_lines(measured):
    """Markdown: the work model's projection to many ranks at the issue's sizes (64^3, 128
    steps), without spatial coarsening and with it in both modes, from measure_costs()."""
    from layerbraid import MGRITOptions, plan

    lines = ["", "## Projection to many ranks (layerbraid.plan)", "",
             "N = 128 steps of the 3D ConvBlock at 64^3, 3 levels, cfactor 4, FCF, 2 forward / "
             "1 backward iterations; step costs measured here (one thread). Mode \"branch\": "
             "the measured cost of its coarse steps (restrict, the layer on the coarse grid, "
             "interpolate; forward and adjoint as the module runs them) relative to a fine step, "
             "the larger of the forward and adjoint ratios per level; its messages stay fine. "
             "Mode \"state\": steps and messages 1/8 and 1/64 of the fine ones. Network "
             "assumed: 2 us, 25 GB/s. Work only; the accuracy of each mode is in the tables "
             "above: \"state\" is not usable at 2/1 iterations on these networks."]
    fwd = MGRITOptions(max_levels=3, cfactor=4, max_iters=2, nrelax=1,
                       skip_first_downcycle=True)
    bwd = MGRITOptions(max_levels=3, cfactor=4, max_iters=1, nrelax=1,
                       skip_first_downcycle=True)
    for m in measured:
        step, vjp, vjp_p, branch = m["step"], m["vjp"], m["vjp_p"], m["branch"]
        scale_b = (1.0,) + tuple(max(f / step, b / vjp) for f, b in branch)
        lines += ["", f"**{m['channels']} channels, batch {m['batch']}**: a fine step "
                  f"{step:.3f} s (VJP {vjp:.3f} s, with parameter gradients {vjp_p:.3f} s); "
                  "a branch coarse step "
                  + ", ".join(f"on level {lv}: {f:.3f} s (adjoint {b:.3f} s)"
                              for lv, (f, b) in zip((1, 2), branch))
                  + f"; scales {scale_b[1]:.2f} and {scale_b[2]:.2f}.", "",
                  "| ranks | no spatial coarsening | branch | state |", "|---|---|---|---|"]
        net = dict(message_bytes=m["batch"] * m["channels"] * 64 ** 3 * 4, latency=2e-6,
                   bandwidth=25e9)
        costs = [plan.Costs(step, vjp, vjp_p, **net),
                 plan.Costs(step, vjp, vjp_p, level_scale=scale_b, message_scale=(1.0,), **net),
                 plan.Costs(step, vjp, vjp_p, level_scale=plan.spatial_scale((1, 2), 3), **net)]
        for p in (1, 4, 16, 32, 64, 128):
            lines.append(f"| {p} | " + " | ".join(
                f"{plan.predict(128, p, fwd, bwd, c).speedup:.2f}x" for c in costs) + " |")
    return lines


CONFIGS = [(32, 32, 3, (1, 2)), (32, 128, 2, (2,)), (64, 32, 2, (2,))]  # size, steps, rounds, ranks
CONVERGENCE_CONFIGS = [(32, 32, 8), (32, 128, 8)]  # size, steps, iterations
RESULTS = DOCS / "bench_spatial.json"


def report(data):
    """docs/bench_spatial.md from the measurements."""
    lines = ["# Spatial coarsening on 3D volumes", "", (__doc__ or "").split("\n\n", 2)[2].strip(),
             "", "Generated by `python -m bench.spatial`"
             + (f" on commit {data['commit']}, {data['date']}, {data['machine']}"
                if "commit" in data else "")
             + " (raw numbers: runs/reports/bench_spatial.json where it ran, their summary docs/bench_spatial.json; `--report` rewrites this file from "
             "them).", "",
             "## Time per batch and accuracy (2 forward / 1 backward iterations)", "",
             "Speedup = plain PyTorch's time / time (> 1 is faster), per round, median "
             "[min-max] over the rounds; " + SAME_LEGEND, "",
             "| size | N | ranks | spatial coarsening | rounds | s/batch | PyTorch s/batch | "
             "speedup | fwd residual | output err | input-grad err | param-grad err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["timing"]:
        res = r["fwd_residuals"][-1] if r["fwd_residuals"] else float("nan")
        lines.append(f"| {r['size']}^3 | {r['steps']} | {r['ranks']} | {r['mode']} | "
                     f"{len(_times(r))} | {spread(_times(r))} | {spread(_plain(r))} | "
                     f"{speedup(_plain(r), _times(r))[3]} | {res:.1e} | "
                     f"{r['err_output']:.1e} | {r['err_input_grad']:.1e} | "
                     f"{r['err_param_grad']:.1e} |")
    lines += ["", "## MGRIT iterations", "",
              "Forward solves in float64 on one rank (batch 1, same network and settings, tol 0): "
              "the residual after each iteration relative to the first, the mean reduction per "
              "iteration, and the output error after the last.", "",
              "| size | N | spatial coarsening | residual / first, iterations 2..last | "
              "mean factor | output err |", "|---|---|---|---|---|---|"]
    for r in data["convergence"]:
        res = r["residuals"]
        hist = " ".join(f"{v / res[0]:.0e}" if res[0] > 0 else "-" for v in res[1:])
        factor = (res[-1] / res[0]) ** (1 / (len(res) - 1)) if res[-1] > 0 and res[0] > 0 \
            and len(res) > 1 else 0.0
        lines.append(f"| {r['size']}^3 | {r['steps']} | {r['mode']} | {hist} | {factor:.2f} | "
                     f"{r['err_output']:.1e} |")
    if data.get("training"):
        lines += ["", "## Training (examples/volumes3d.py)", "",
                  "`mpiexec -n 2 python examples/volumes3d.py " + " ".join(TRAINING) + " ...`: "
                  f"synthetic 3D shapes (4 classes, {_flag('--train-size')} training and 256 "
                  "test volumes), Adam; "
                  "2/1 iterations. With 16 steps and cfactor 4 the hierarchy stops at 2 levels "
                  "(level 1, coarse in space, has 4 points). Each run trains its own "
                  "layer-parallel model; test accuracy on 256 volumes is noisy from epoch to "
                  "epoch. Per epoch:", "",
                  "| run | ranks | train loss | test accuracy | s/batch |", "|---|---|---|---|---|"]
        for r in data["training"]:
            lines.append(f"| {r['mode']} | {r['ranks']} | "
                         + ", ".join(f"{v:.3f}" for v in r["train_loss"]) + " | "
                         + ", ".join(f"{100 * v:.1f}%" for v in r["test_accuracy"]) + " | "
                         + ", ".join(f"{v:.2f}" for v in r["seconds_per_batch"]) + " |")
    if data.get("trained"):
        lines += ["", "## Errors on a trained network", "",
                  "The volumes3d network (16^3, 16 steps, cfactor 4: 2 levels, FCF, the same "
                  "number of forward and backward iterations, 2 ranks, float32) on a test batch "
                  f"of 16, at its initial weights and after {_flag('--epochs')} epochs of exact "
                  "training "
                  "(`--lp-levels 1`, which reproduces plain PyTorch's losses).  Relative errors "
                  "against plain PyTorch with the same weights, output / step-parameter "
                  "gradients (with 4 coarse points, 3 iterations are exact for \"none\" and "
                  "\"branch\"):", "",
                  "| weights | iterations | none | branch | state |", "|---|---|---|---|---|"]
        rows = {(r["weights"], r["iters"], r["mode"]): r for r in data["trained"]}
        growth = {r["weights"]: r["state_growth"] for r in data["trained"]}
        lines[-4] += ("  The state's norm grows by " + " and ".join(
            f"{g:.1f}x ({w} weights)" for w, g in growth.items()) + " over the steps.")
        for w, it in sorted({(r["weights"], r["iters"]) for r in data["trained"]}):
            lines.append(f"| {w} | {it} | " + " | ".join(
                f"{rows[w, it, m]['err_output']:.1e} / {rows[w, it, m]['err_param_grad']:.1e}"
                for m in ("none", "branch", "state")) + " |")
    lines += ["", finding(data)] + projection_lines(data["costs"])
    return lines


# 3 epochs of 128 volumes (of 256 until commit 411805d: 4 more minutes in all)
TRAINING = ["--size", pick("16", "8"), "--steps", pick("16", "8"), "--channels", "4", "--epochs",
            pick("3", "1"), "--train-size", pick("128", "16")] + pick([], ["--test-limit", "16"]) \
    + ["--lp-levels", "3", "--lp-cfactor", "4", "--lp-relax", "FCF", "--log-interval", "1000"]


TRAINED = "spatial_trained"  # bench/workers/spatial_trained.py


def _flag(name):
    """The value TRAINING gives ``name``."""
    return TRAINING[TRAINING.index(name) + 1]


def trained_errors(tmp):
    """MGRIT's errors at 2-4 iterations (forward and backward alike) on the volumes3d network at
    its initial weights and after TRAINING's epochs of exact (serial-equivalent) training."""
    ckpt = Path(tmp) / "trained.pt"
    mpiexec(1, [sys.executable, ROOT / "examples" / "volumes3d.py",
                *TRAINING[:TRAINING.index("--lp-levels")], "--lp-levels", "1", "--lp-sc-levels",
                "--log-interval", "1000", "--checkpoint", ckpt, "--out-dir", Path(tmp) / "exact"])
    return launch(TRAINED, 2, ckpt, TRAINING[TRAINING.index("--steps") + 1],
                  TRAINING[TRAINING.index("--size") + 1], pick("2,3,4", "2"))


def training(tmp):
    """examples/volumes3d.py on 2 ranks without / with spatial coarsening (both modes), and as
    plain PyTorch: test accuracy and loss per epoch."""
    runs = [("plain PyTorch", ["--serial"], 1), ("none", ["--lp-sc-levels"], 2),
            ("branch", ["--lp-sc-mode", "branch"], 2), ("state", ["--lp-sc-mode", "state"], 2)]
    runs = pick(runs, runs[2:3])
    out = []
    for name, flags, ranks in runs:
        d = Path(tmp) / name.replace(" ", "_")
        mpiexec(ranks, [sys.executable, ROOT / "examples" / "volumes3d.py", *TRAINING, *flags,
                        "--out-dir", d], cores_per_rank=1)
        hist = json.loads((d / "metrics.json").read_text())["history"]
        out.append(dict(mode=name, ranks=ranks, test_accuracy=[h["test_accuracy"] for h in hist],
                        train_loss=[h["train_loss"] for h in hist],
                        seconds_per_batch=[h["seconds_per_batch"] for h in hist]))
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None):
    generate(RESULTS, measure, report, argv=argv, doc=__doc__)


def measure(args=None):
    """Timing, MGRIT's convergence, the step costs of the projection, and training: the
    volumes3d example without and with spatial coarsening, and MGRIT's errors on its trained
    network."""
    import tempfile

    data = {**provenance(), "timing": [], "convergence": []}
    for size, steps, rounds, ranks_list in pick(CONFIGS, [(8, 8, 1, (2,))]):
        for ranks in ranks_list:
            data["timing"] += launch(WORKER, ranks, size, steps, rounds, cores_per_rank=1)
    for size, steps, iters in pick(CONVERGENCE_CONFIGS, [(8, 8, 2)]):
        data["convergence"] += launch(CONVERGENCE, 1, size, steps, iters)
    data["costs"] = [measure_costs(2, 1)] * 2 if QUICK else \
        [measure_costs(4, 4), measure_costs(16, 2)]
    with tempfile.TemporaryDirectory() as tmp:
        data["training"] = training(tmp)
        data["trained"] = trained_errors(tmp)
    return data


if __name__ == "__main__":
    main()
