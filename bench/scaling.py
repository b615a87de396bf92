"""The scaling report: predicted speedup and efficiency at up to 4096 ranks.

    python -m bench.scaling       (writes docs/scaling.md and docs/scaling_*.png)

Costs: one step and one VJP of the benchmark layer of docs/bench_resnet.md (x + dt relu(conv2(relu(conv1 x))), 8 channels,
28x28, batch 50, float32) measured on this machine with layerbraid.plan.measure_step; a message
is one state (1.25 MB). Network, assumed (not measured here): 2 us latency, 25 GB/s (an
InfiniBand HDR-class fabric). Every number comes from layerbraid.plan, which simulates the C
core's exact schedule; docs/plan_validation.md holds that model against measurements.

Iterations: every table but the last assumes 2 forward / 1 adjoint MGRIT iterations per batch with
the first down-cycle skipped, the examples' defaults (layerbraid.cli).  Whether they give
serial-quality gradients depends on the network (docs/accuracy.md); the last table shows what the
iteration counts that other modes use cost at scale.
"""
import time
from dataclasses import replace

import torch

from bench.harness import DOCS, pick, write_section
from layerbraid import MGRITOptions, plan
from layerbraid.nn import ConvBlock

SETTINGS = [(2, 4), (3, 4), (4, 4), (3, 8)]  # (levels, cfactor); 2 forward / 1 backward iters
# (forward, adjoint iterations, skip the first down-cycle, label) for the iterations table; a warm
# start never skips (Note [warm start] in layerbraid/_engine/chain.py)
ITERATIONS = [(1, 1, True, "1 / 1"), (2, 1, True, "2 / 1 (the defaults)"),
              (2, 1, False, "2 / 1 without the skip (a warm start)"),
              (3, 2, True, "3 / 2"), (5, 4, True, "5 / 4"), (10, 10, True, "10 / 10")]
ITER_SETTINGS = [(3, 4), (4, 4)]
ITER_RANKS = pick((16, 64, 256), (4,))
RANKS = pick([2 ** k for k in range(13)], [1, 2, 4])
SIZES = pick((256, 1024, 4096), (16, 32, 64))  # N


def options(levels, cf):
    nrelax = tuple([0] + [1] * (levels - 2)) if levels > 2 else 0
    fwd = MGRITOptions(max_levels=levels, cfactor=cf, nrelax=nrelax, max_iters=2,
                       skip_first_downcycle=True)
    return fwd, replace(fwd, max_iters=1)


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = ConvBlock(8)
    step, vjp, vjp_p = plan.measure_step(layer, torch.randn(50, 8, 28, 28))
    param_bytes = sum(p.numel() * 4 for p in layer.parameters())
    costs = plan.Costs(step, vjp, vjp_p, message_bytes=50 * 8 * 28 * 28 * 4, latency=2e-6,
                       bandwidth=25e9)
    t0 = time.time()
    results = {}
    for n in SIZES:
        for lv, cf in SETTINGS:
            fwd, bwd = options(lv, cf)
            results[(n, lv, cf)] = plan.sweep(n, RANKS, fwd, bwd, replace(
                costs, param_bytes=n * param_bytes))
            print(n, lv, cf, f"{time.time() - t0:.0f}s", flush=True)
    fig_s, axs = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    fig_e, axe = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for k, n in enumerate(SIZES):
        for lv, cf in SETTINGS:
            pr = results[(n, lv, cf)]
            label = f"{lv} levels, cf {cf}"
            axs[k].loglog([p.ranks for p in pr], [p.speedup for p in pr], "o-", label=label, ms=3)
            axe[k].semilogx([p.ranks for p in pr], [p.efficiency for p in pr], "o-", label=label,
                            ms=3)
        for ax, what in ((axs[k], "speedup over serial"), (axe[k], "parallel efficiency")):
            ax.set_title(f"N = {n} layers")
            ax.set_xlabel("layer-parallel ranks")
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
        axs[k].axhline(1.0, color="gray", lw=0.8)
    axs[0].legend()
    axe[0].legend()
    fig_s.suptitle("Predicted speedup, 2 forward / 1 backward MGRIT iterations")
    fig_e.suptitle("Predicted parallel efficiency")
    for fig, name in ((fig_s, "scaling_speedup.png"), (fig_e, "scaling_efficiency.png")):
        fig.tight_layout()
        fig.savefig(DOCS / name, dpi=72)  # under 100 kB a figure

    lines = ["# Scaling report: what layer-parallel training buys at scale", "",
             (__doc__ or "").split("\n\n", 1)[1].strip(), "",
             f"Measured here: step {1e3 * step:.2f} ms, VJP {1e3 * vjp:.2f} ms, VJP with parameter "
             f"gradients {1e3 * vjp_p:.2f} ms.", "",
             "![speedup](scaling_speedup.png)", "", "![efficiency](scaling_efficiency.png)", ""]
    for n in SIZES:
        lines += [f"## N = {n} layers", "",
                  "| ranks | " + " | ".join(f"{lv} lev, cf {cf}" for lv, cf in SETTINGS) + " |",
                  "|---|" + "---|" * len(SETTINGS)]
        for i, p in enumerate(RANKS):
            if p > n:
                continue
            cells = []
            for lv, cf in SETTINGS:
                pr = results[(n, lv, cf)][i]
                cells.append(f"{pr.speedup:.2f}x ({pr.efficiency:.0%})")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        best_p = max(RANKS[:len(results[(n, 3, 4)])], key=lambda p: results[(n, 3, 4)][RANKS.index(p)].speedup)
        rec, rf, _ = plan.recommend(n, best_p, costs)
        lines += ["", f"Recommended at {best_p} ranks (fastest predicted of levels 2-4, cfactor "
                  f"2/4/8): {rf.max_levels} levels, cfactor {rf.cfactor}: "
                  f"{rec.speedup:.2f}x.", ""]
    # data parallel x layer parallel at a fixed number of ranks, global batch 512
    big = replace(costs, step_seconds=step * 512 / 50, vjp_seconds=vjp * 512 / 50,
                  vjp_param_seconds=vjp_p * 512 / 50, message_bytes=512 * 8 * 28 * 28 * 4,
                  param_bytes=1024 * param_bytes)
    fwd, bwd = options(3, 4)
    lines += ["## Data parallel x layer parallel", "",
              "N = 1024 layers, global batch 512 (a layer's cost taken as linear in its batch), "
              "3 levels, cfactor 4; D data groups of ranks/D layer-parallel ranks each; the "
              "gradient average is a ring allreduce.", "",
              "| total ranks | D x L | predicted s/batch | speedup |", "|---|---|---|---|"]
    for total in pick((16, 64, 256), (4,)):
        for d in (1, 4, 16, 64):
            if d > total or d > 512:
                continue
            pr = plan.predict(pick(1024, 16), total // d, fwd, bwd, big, data_parallel=d)
            lines.append(f"| {total} | {d} x {total // d} | {pr.seconds:.3f} | {pr.speedup:.1f}x |")
    n_it = pick(1024, 16)
    lines += ["", "## Iterations", "",
              f"N = {n_it} layers, the costs above: predicted speedup by forward / adjoint "
              "iterations (each the most a solve runs; adaptive iterations stop earlier where "
              "they can).", "",
              "| iterations fwd / adjoint | "
              + " | ".join(f"{lv} lev, cf {cf}, {p} ranks" for lv, cf in ITER_SETTINGS
                           for p in ITER_RANKS) + " |",
              "|---|" + "---|" * (len(ITER_SETTINGS) * len(ITER_RANKS))]
    for fi, bi, skip, label in ITERATIONS:
        cells = []
        for lv, cf in ITER_SETTINGS:
            f0, _ = options(lv, cf)
            fwd = replace(f0, max_iters=fi, skip_first_downcycle=skip)
            bwd = replace(fwd, max_iters=bi)
            for p in ITER_RANKS:
                pr = plan.predict(n_it, p, fwd, bwd, replace(costs, param_bytes=n_it * param_bytes))
                cells.append(f"{pr.speedup:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Generated by `python -m bench.scaling`."]
    write_section(DOCS / "scaling.md", "planner", lines)


if __name__ == "__main__":
    main()
