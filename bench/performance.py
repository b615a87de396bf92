"""When is layer-parallel training faster than plain PyTorch?  Measured at the demo's settings
and projected to many ranks; writes docs/performance.md.

    python -m bench.performance                 # the whole report (about 3 minutes here)
    python -m bench.performance --batches 10    # shorter

One run measures, round after round (interleaved, so that drift of the machine hits every row
alike): plain PyTorch (1 and 2 threads), data parallel on 2 ranks, and layer parallel on 2 ranks
at the demo's MGRIT settings (2 levels, cfactor 4, 2 forward / 1 backward iterations), at 1 / 1
iterations and exact (1 level).  Each row gets the relative parameter-gradient error against
the serial network, at the initial weights and after the timed batches.  Then the planner
(layerbraid.plan) projects the time per batch to 4-4096 ranks from step costs measured here.

The unit everywhere: speedup = plain PyTorch's time / time (> 1 is faster).

Each row is a job of bench/workers/performance.py under mpiexec.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

from bench.harness import ROOT, launch

OUT = ROOT / "docs" / "performance.md"

# (label, ranks, worker arguments)
ROWS = [
    ("plain PyTorch, 1 thread", 1, ["plain", "--threads", "1"]),
    ("plain PyTorch, 2 threads", 1, ["plain", "--threads", "2"]),
    ("data parallel, 2 ranks (torch DDP, gloo)", 2, ["ddp"]),
    ("data parallel, 2 ranks (layerbraid ProcessGrid)", 2, ["dp", "--levels", "1"]),
    ("layer parallel, 2 ranks, 2 levels, 2/1 iterations (demo)", 2, ["lp", "--iters", "2", "1"]),
    ("layer parallel, 2 ranks, 2 levels, 1/1 iterations", 2, ["lp", "--iters", "1", "1"]),
    ("layer parallel, 2 ranks, 1 level (exact)", 2, ["lp", "--levels", "1"]),
]
REFERENCE = ROWS[0][0]

# Interconnects the projection assumes: (name, seconds per message, bytes per second).
NETWORKS = [("InfiniBand-class", 5e-6, 10e9), ("10 GbE-class", 30e-6, 1e9)]


# ---------------------------------------------------------------- the driver
def _run(ranks, args, batches):
    return launch("performance", ranks, *args, "--batches", batches, timeout=900,
                  echo=False)[-1]


def _projection():
    """Planner rows: (network, ranks, demo-settings speedup, recommended speedup, settings)."""
    import torch

    from layerbraid import MGRITOptions
    from layerbraid.nn import ConvBlock
    from layerbraid.plan import Costs, predict, recommend

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 8, 14, 14)
    layer = ConvBlock(8)
    from layerbraid.plan import measure_step

    step, vjp, vjp_p = measure_step(layer, x, repeats=30)
    n = 4096
    demo = MGRITOptions(max_levels=2, cfactor=4, max_iters=2, skip_first_downcycle=True)
    demo_b = MGRITOptions(max_levels=2, cfactor=4, max_iters=1, skip_first_downcycle=True)
    rows = []
    for name, latency, bandwidth in NETWORKS:
        costs = Costs(step, vjp, vjp_p, x.numel() * 4, latency, bandwidth)
        for p in [4, 16, 64, 256, 1024, 4096]:
            d = predict(n, p, demo, demo_b, costs)
            best, bf, _ = recommend(n, p, costs, levels=(2, 3, 4, 5, 6), cfactors=(2, 4, 8, 16))
            rows.append((name, p, d.speedup, best.speedup,
                         f"{bf.max_levels} levels, cfactor {bf.cfactor}"))
    return (step, vjp, vjp_p, n, x.numel() * 4), rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=20, help="timed batches per row and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median taken)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report", action="store_true",
                   help="rewrite the report from the raw numbers of the last run (its .json)")
    a = p.parse_args(argv)
    raw = a.out.with_suffix(".json")
    if a.report:
        report(json.loads(raw.read_text()), a.out)
        return
    results = {label: [] for label, _, _ in ROWS}
    t0 = time.time()
    for r in range(a.rounds):
        for label, ranks, args in ROWS:
            results[label].append(_run(ranks, args, a.batches))
            print(f"round {r + 1}: {label}: {1e3 * results[label][-1]['seconds']:.1f} ms/batch",
                  flush=True)
    (step, vjp, vjp_p, n, state_bytes), proj = _projection()
    data = {"rounds": a.rounds, "batches": a.batches, "seconds": time.time() - t0,
            "measured": results,
            "projection": {"step_seconds": step, "vjp_seconds": vjp, "vjp_param_seconds": vjp_p,
                           "steps": n, "state_bytes": state_bytes, "rows": proj}}
    raw.write_text(json.dumps(data, indent=1))
    report(data, a.out)


def report(data, out):
    """docs/performance.md from the raw numbers."""
    results = data["measured"]
    med = {label: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
           for label, runs in results.items()}
    pj = data["projection"]
    step, vjp, vjp_p, n = pj["step_seconds"], pj["vjp_seconds"], pj["vjp_param_seconds"], pj["steps"]
    proj = pj["rows"]
    ref = med[REFERENCE]["seconds"]
    lines = [
        "# When is layer-parallel training faster than plain PyTorch?",
        "",
        f"Generated by `python -m bench.performance` ({data['rounds']} interleaved rounds of "
        f"{data['batches']} timed batches per row, medians; {data['seconds']:.0f} s; raw "
        "numbers in docs/performance.json, `--report` rewrites this file from them).",
        "",
        "**Speedup = plain PyTorch's time / time** (> 1 is faster), against plain PyTorch on one",
        "thread, the reference row.  Gradient error = ||g - g_serial|| / ||g_serial|| over every",
        "parameter, on one batch of 64, at the initial weights and after the timed batches.",
        "",
        "## Measured: the demo network on this machine (2 cores)",
        "",
        "The MNIST network of `make demo` (examples/mnist.py): a strided conv to 8 channels at",
        "14x14, 8 residual steps `x + dt relu(conv(relu(conv x)))`, a linear classifier; batch",
        "64, float32, SGD; one thread per rank.  Data parallel: each rank half the batch, the",
        "gradients averaged, with torch's DistributedDataParallel (gloo, loopback) or with",
        "layerbraid's ProcessGrid (2 data groups of 1 layer rank, one MGRIT level).",
        "",
        "| configuration | ms / batch | speedup | grad error (init) | grad error (trained) |",
        "|---|---|---|---|---|",
    ]
    for label, _, _ in ROWS:
        m = med[label]
        lines.append(f"| {label} | {1e3 * m['seconds']:.1f} | {ref / m['seconds']:.2f} | "
                     f"{m['grad_error_init']:.1e} | {m['grad_error_trained']:.1e} |")
    speed = {label: ref / med[label]["seconds"] for label, _, _ in ROWS}
    lines += [
        "",
        "What it says, at the demo's size (8 layers) on 2 ranks: layer parallelism runs at "
        f"{speed[ROWS[4][0]]:.2f}x plain PyTorch's speed at the demo settings "
        f"({speed[ROWS[5][0]]:.2f}x at 1/1 iterations), data parallelism at "
        f"{speed[ROWS[2][0]]:.2f}x with torch DDP and {speed[ROWS[3][0]]:.2f}x with layerbraid's "
        f"ProcessGrid, and plain PyTorch on both cores at {speed[ROWS[1][0]]:.2f}x.  Eight layers "
        "are far too few for MGRIT: two iterations of a 2-level solve do more layer work than "
        "the 8 serial steps, and the coarse solve is sequential.  On 2 ranks, data parallelism "
        "(or torch's own threads) is the better use of the cores for this network; the demo "
        "shows that training works layer-parallel, not where layer parallelism pays.  "
        "layerbraid's exact path (1 level, and ProcessGrid data parallelism, which runs through "
        "it) also pays for running the backward step by step (one autograd call per layer) "
        "where plain PyTorch makes one backward pass.",
        "",
        "## Projected: many ranks (layerbraid.plan)",
        "",
        f"The same layer, made deep: N = {n} steps of the demo's ConvBlock on a 64x8x14x14 state",
        f"(step {1e3 * step:.3f} ms, VJP {1e3 * vjp:.3f} ms, VJP with parameter gradients "
        f"{1e3 * vjp_p:.3f} ms, measured here on one thread), one rank per device, each rank",
        f"as fast as this machine's core.  Messages are one state ({pj['state_bytes'] / 1e3:.0f} "
        "kB); the model charges",
        "latency + bytes / bandwidth per message and log2(P) latencies per allreduce, and walks",
        "the exact schedule the C core runs.  Not modelled: MGRIT's vector bookkeeping, the open",
        "and close layers, contention.  Speedup is over the model's serial time (N steps + N",
        "VJPs with parameter gradients), i.e. over plain PyTorch on one such rank.",
        "",
        "| network | ranks | speedup, demo settings (2 levels, cfactor 4, 2/1 it) | speedup, "
        "best settings (2/1 it) | best settings |",
        "|---|---|---|---|---|",
    ]
    for name, ranks, sd, sb, settings in proj:
        lines.append(f"| {name} | {ranks} | {sd:.2f} | {sb:.2f} | {settings} |")
    lines += [
        "",
        "Networks: " + "; ".join(f"{name}: {1e6 * lat:g} us per message, {bw / 1e9:g} GB/s"
                                 for name, lat, bw in NETWORKS) + ".",
        "",
        "Read it as: layer parallelism pays when the network is deep (hundreds of layers or",
        "more), the ranks are many, and the MGRIT hierarchy has enough levels that the",
        "sequential coarsest solve is short (the demo's 2 levels leave N/4 sequential coarse",
        "steps: the speedup of those settings saturates).  The planner picks the best settings",
        "for time alone: the gradient is approximate at 2/1 iterations (the error column above)",
        "and deeper hierarchies with larger coarsening factors are usually less accurate per",
        "iteration; check the error of the settings you pick on your own network.",
        "",
    ]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
