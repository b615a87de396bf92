"""The MGRIT core's speed.

    python -m bench.core          (uses mpicc and mpiexec on PATH; writes docs/bench_core.md)

1. Core time per step: bench/workers/core_bench.c drives the core with C callbacks on scalar states, so
   the time per executed step is the core's own bookkeeping and messaging.
2. Seconds per solve through Python (numpy callbacks), scalar and 64k-element states, 1 and 2
   ranks, against plain sequential stepping of the same step function.
"""
import json
import subprocess
import tempfile
from pathlib import Path

from bench.harness import ROOT, launch, mpiexec, write_report

PY_BENCH = "core_python"  # bench/workers/core_python.py


def build_core_bench(workdir):
    exe = Path(workdir) / "core_bench"
    srcs = sorted(str(p) for p in (ROOT / "cbridge" / "src").glob("*.c"))
    subprocess.run(["mpicc", "-O2", "-std=c99", f"-I{ROOT / 'cbridge' / 'include'}",
                    f"-I{ROOT / 'cbridge' / 'src'}", str(ROOT / "bench" / "workers" / "core_bench.c"), *srcs,
                    "-lm", "-o", str(exe)], check=True)
    return exe


def main():
    rows_c, rows_py = [], []
    with tempfile.TemporaryDirectory() as d:
        exe = build_core_bench(d)
        for ranks in (1, 2):
            for n, levels in ((4096, 3), (65536, 4)):
                out = mpiexec(ranks, [exe, n, levels, 4, 5, 5])
                rows_c.append(json.loads(out.stdout))
                print(rows_c[-1], flush=True)
        for ranks in (1, 2):
            for size in (1, 65536):
                for interval in (0, 1):
                    rows_py.append(launch(PY_BENCH, ranks, size, 256 if size > 1 else 1024, 3,
                                          interval)[-1])
    lines = ["# The MGRIT core's speed", "",
             "Measured on this project's 2-core machine by `python -m bench.core`.", "",
             "## Core time per step (C callbacks on scalar states)", "",
             "bench/workers/core_bench.c runs the core with C callbacks whose step is one division, so the "
             "time per executed step is the core's own work (sweeps, bookkeeping, messages). "
             "5 iterations of FCF V-cycles, cfactor 4; best of 5 solves.", "",
             "| ranks | N | levels | seconds per solve | steps run (busiest rank) | us per step |",
             "|---|---|---|---|---|---|"]
    for r in rows_c:
        lines.append(f"| {r['ranks']} | {r['steps']} | {r['levels']} | {r['seconds']:.4f} | "
                     f"{r['steps_run_max_rank']} | {r['us_per_step']:.3f} |")
    lines += ["", "## Through Python (numpy states, `layerbraid.MGRIT`)", "",
              "3 FCF V-cycles, 3 levels, cfactor 4; `sequential` is a plain Python loop of the "
              "same step function on one rank; speedup = sequential seconds / seconds per solve (> 1 is "
              "faster). `us/step outside step` is the time per step spent "
              "outside the user's step function (the cffi callbacks, the vector table, numpy sums "
              "and norms, packing, MPI), on the busiest rank.  `runs`: the solver also gets a "
              "`step_interval` that takes each run of steps between C-points (and each rank's "
              "block of the coarsest solve) in one call, looping over the same step function in "
              "Python: the difference is the core's crossing into Python per step.", "",
              "| ranks | state size | N | runs | seconds per solve | sequential seconds | speedup | "
              "us/step outside step |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_py:
        lines.append(f"| {r['ranks']} | {r['state_size']} | {r['steps']} | "
                     f"{'yes' if r['interval'] else 'no'} | {r['seconds']:.4f} | "
                     f"{r['sequential_seconds']:.4f} | {r['sequential_seconds'] / r['seconds']:.2f}"
                     f" | {r['us_per_step_outside_user_step']:.1f} |")
    write_report(ROOT / "docs" / "bench_core.md", lines)


if __name__ == "__main__":
    main()
