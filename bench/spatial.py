"""Spatial coarsening on 3D volumes: time per batch and accuracy with and without it.

    python -m bench.spatial             (docs/bench_spatial.md and .json; ~30 minutes here)
    python -m bench.spatial --training  (adds training runs of examples/volumes3d.py and the
                                               errors on the trained network; ~25 minutes)
    python -m bench.spatial --report    (rewrites the .md from the .json)

ODE-ResNet of 3D ConvBlocks (4 channels), batch 2, float32, one thread per rank; 3 MGRIT levels,
cfactor 4, FCF, 2 forward / 1 backward iterations, first down-cycle skipped.  Spatial coarsening
on levels 1 and 2, in mode "branch" (states stay fine, coarse steps run the layer on the coarse
grid) and mode "state" (coarse levels store coarse states).  Plain PyTorch's forward+backward
(rank 0, same weights) is timed in the same job and is the reference of the errors: relative
2-norm errors of the output, the input gradient and all parameter gradients.  Times are the best
of 2 runs at 32^3 and of 1 run at 64^3 (minutes per batch on this 2-core machine), after a
warm-up on an 8^3 input.
"""
import json
import sys
from pathlib import Path

from bench.harness import ROOT, launch, mpiexec

WORKER = "spatial_timing"  # bench/workers/spatial_timing.py


CONVERGENCE = "spatial_convergence"  # bench/workers/spatial_convergence.py


FINDING = """## What this shows

- Mode "state" (coarse levels store coarse states) is the cheapest per batch but unusable with
  few iterations on these networks: about 100% error in the output and the gradients, and its
  residual falls by ~1% per iteration. The states of a random-weight network on random input
  are dominated by fine-scale content that a half-size grid cannot hold, so the coarse levels
  correct almost none of the error, and P R != I also loses FCF's exact propagation: the solve
  becomes exact only as the fine-level relaxation sweeps it through, about one C-interval per
  iteration (32^3, N = 32: exact after 8 iterations; N = 128: still 98% off).
- Mode "branch" (default: states stay fine, coarse steps compute their increment on the coarse
  grid) is as accurate as MGRIT without spatial coarsening, here even slightly more so (output
  error 1e-3 vs 2e-3, gradient errors 2-3x smaller at 2/1 iterations; residual reduction ~100x
  per iteration in both), and takes most of "state"'s time saving: on 2 ranks at 64^3 and 128
  steps, a speedup of {branch} over plain PyTorch against {none} without spatial coarsening
  ({state} for "state").
- The saving is modest at this depth of the hierarchy: with 3 levels and cfactor 4 the coarse
  levels are a small part of a cycle, and a branch coarse step still restricts and interpolates
  fine-grid states, which on a CPU costs about as much as the 4-16 channel layer on the coarse
  grid (measured scales 0.37-0.55 of a fine step instead of the ideal 1/8 and 1/64). The work
  model below projects the gap at many ranks, where the coarse levels dominate.
- Training (below): all four runs reduce the loss alike over 6 epochs, "state" included, on
  this small, noisy task; each run trains its own layer-parallel model. The errors on a trained
  network show why few-iteration settings need care whatever the spatial mode: after exact
  training the chain amplifies its state far more (see the growth there), and 2 iterations leave
  56% output error with or without spatial coarsening (63% with "state"); at the initial weights
  the same settings give 1e-4 ("state": 7e-4 and 15% in the parameter gradients).
- Times in one job are comparable; across jobs they are noisy (e.g. plain PyTorch at 64^3 and
  128 steps: {serial1:.0f} s in the 1-rank job, {serial2:.0f} s in the 2-rank job)."""


def finding(data):
    """FINDING with the numbers it quotes taken from this run's measurements."""
    rows = {(r["size"], r["steps"], r["ranks"], r["mode"]): r for r in data["timing"]}

    def speedup(mode):
        r = rows.get((64, 128, 2, mode))
        return f"{r['serial_seconds'] / r['seconds']:.2f}" if r else "(not measured)"

    serial = [rows.get((64, 128, k, "none"), {}).get("serial_seconds", float("nan"))
              for k in (1, 2)]
    return FINDING.format(branch=speedup("branch"), none=speedup("none"), state=speedup("state"),
                          serial1=serial[0], serial2=serial[1])


def measure_costs(channels, batch):
    """Seconds of a fine step and of mode "branch"'s coarse steps (forward and adjoint, as the
    module runs them) at 64^3, here."""
    import statistics
    import time

    import torch

    from layerbraid import SpatialCoarsening, plan
    from layerbraid.nn import ConvBlock

    torch.set_num_threads(1)
    layer, x = ConvBlock(channels, dims=3), torch.randn(batch, channels, 64, 64, 64)
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


CONFIGS = [(32, 32, 2), (32, 128, 2), (64, 32, 1), (64, 128, 1)]  # size, steps, repeats
CONVERGENCE_CONFIGS = [(32, 32, 8), (32, 128, 8)]  # size, steps, iterations
RESULTS = ROOT / "docs" / "bench_spatial.json"


def report(data):
    """docs/bench_spatial.md from the measurements."""
    lines = ["# Spatial coarsening on 3D volumes", "", (__doc__ or "").split("\n\n", 1)[1].strip(),
             "", "Generated by `python -m bench.spatial` (raw numbers: "
             "docs/bench_spatial.json; `--report` rewrites this file from them).", "",
             "## Time per batch and accuracy (2 forward / 1 backward iterations)", "",
             "Speedup = plain PyTorch's time / time (> 1 is faster).", "",
             "| size | N | ranks | spatial coarsening | s/batch | PyTorch s/batch | speedup | "
             "fwd residual | output err | input-grad err | param-grad err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["timing"]:
        res = r["fwd_residuals"][-1] if r["fwd_residuals"] else float("nan")
        lines.append(f"| {r['size']}^3 | {r['steps']} | {r['ranks']} | {r['mode']} | "
                     f"{r['seconds']:.2f} | {r['serial_seconds']:.2f} | "
                     f"{r['serial_seconds'] / r['seconds']:.2f} | {res:.1e} | "
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
        hist = " ".join(f"{v / res[0]:.0e}" for v in res[1:])
        factor = (res[-1] / res[0]) ** (1 / (len(res) - 1)) if res[-1] > 0 else 0.0
        lines.append(f"| {r['size']}^3 | {r['steps']} | {r['mode']} | {hist} | {factor:.2f} | "
                     f"{r['err_output']:.1e} |")
    if data.get("training"):
        lines += ["", "## Training (examples/volumes3d.py)", "",
                  "`mpiexec -n 2 python examples/volumes3d.py " + " ".join(TRAINING) + " ...`: "
                  "synthetic 3D shapes (4 classes, 512 training and 256 test volumes), Adam; "
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
                  "of 16, at its initial weights and after 6 epochs of exact training "
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
    (ROOT / "docs" / "bench_spatial.md").write_text("\n".join(lines) + "\n")
    print("wrote docs/bench_spatial.md")


TRAINING = ["--size", "16", "--steps", "16", "--channels", "4", "--epochs", "6", "--train-size",
            "512", "--lp-levels", "3", "--lp-cfactor", "4", "--lp-relax", "FCF",
            "--log-interval", "1000"]


TRAINED = "spatial_trained"  # bench/workers/spatial_trained.py


def trained_errors(tmp):
    """MGRIT's errors at 2-4 iterations (forward and backward alike) on the volumes3d network at
    its initial weights and after 6 epochs of exact (serial-equivalent) training."""
    ckpt = Path(tmp) / "trained.pt"
    mpiexec(1, [sys.executable, ROOT / "examples" / "volumes3d.py",
                *TRAINING[:TRAINING.index("--lp-levels")], "--lp-levels", "1", "--lp-sc-levels",
                "--log-interval", "1000", "--checkpoint", ckpt, "--out-dir", Path(tmp) / "exact"])
    return launch(TRAINED, 2, ckpt, TRAINING[TRAINING.index("--steps") + 1],
                   TRAINING[TRAINING.index("--size") + 1])


def training(tmp):
    """examples/volumes3d.py on 2 ranks without / with spatial coarsening (both modes), and as
    plain PyTorch: test accuracy and loss per epoch."""
    runs = [("plain PyTorch", ["--serial"], 1), ("none", ["--lp-sc-levels"], 2),
            ("branch", ["--lp-sc-mode", "branch"], 2), ("state", ["--lp-sc-mode", "state"], 2)]
    out = []
    for name, flags, ranks in runs:
        d = Path(tmp) / name.replace(" ", "_")
        mpiexec(ranks, [sys.executable, ROOT / "examples" / "volumes3d.py", *TRAINING, *flags,
                        "--out-dir", d])
        hist = json.loads((d / "metrics.json").read_text())["history"]
        out.append(dict(mode=name, ranks=ranks, test_accuracy=[h["test_accuracy"] for h in hist],
                        train_loss=[h["train_loss"] for h in hist],
                        seconds_per_batch=[h["seconds_per_batch"] for h in hist]))
        print(json.dumps(out[-1]), flush=True)
    return out


def main():
    data = {"timing": [], "convergence": []}
    for size, steps, repeats in CONFIGS:
        for ranks in (1, 2):
            data["timing"] += launch(WORKER, ranks, size, steps, repeats)
    for size, steps, iters in CONVERGENCE_CONFIGS:
        data["convergence"] += launch(CONVERGENCE, 1, size, steps, iters)
    data["costs"] = [measure_costs(4, 4), measure_costs(16, 2)]
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    report(data)


if __name__ == "__main__":
    if sys.argv[1:] == ["--report"]:
        report(json.loads(RESULTS.read_text()))
    elif sys.argv[1:] == ["--costs"]:  # measure the step costs of the projection again
        data = json.loads(RESULTS.read_text())
        data["costs"] = [measure_costs(4, 4), measure_costs(16, 2)]
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        report(data)
    elif sys.argv[1:] == ["--training"]:  # add the training runs to the measurements
        import tempfile

        data = json.loads(RESULTS.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            data["training"] = training(tmp)
            data["trained"] = trained_errors(tmp)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        report(data)
    else:
        main()
