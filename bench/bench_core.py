"""The MGRIT core's speed.

    python bench/bench_core.py          (uses mpicc and mpiexec on PATH; writes docs/bench_core.md)

1. Core time per step: bench/core_bench.c drives the core with C callbacks on scalar states, so
   the time per executed step is the core's own bookkeeping and messaging.
2. Seconds per solve through Python (numpy callbacks), scalar and 64k-element states, 1 and 2
   ranks, against plain sequential stepping of the same step function.
"""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PY_BENCH = r'''
import json, sys, time
import numpy as np
from mpi4py import MPI
import layerbraid
size, n, levels = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
x0 = np.linspace(0, 1, size) if size > 1 else np.array(1.0)
def step(u, t0, t1, level):
    return u / (1.0 + (t1 - t0))
def init(t):
    return x0.copy() if t == 0.0 else np.zeros_like(x0)
opts = layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=3, tol=0.0, nrelax=1)
solver = layerbraid.MGRIT(step=step, init=init, num_steps=n, t_start=0.0, t_stop=0.5 * n,
                          options=opts, comm=comm)
calls = {"n": 0, "t": 0.0}
def timed_step(u, t0, t1, level):
    s = time.perf_counter(); out = step(u, t0, t1, level); calls["t"] += time.perf_counter() - s
    calls["n"] += 1; return out
solver_t = layerbraid.MGRIT(step=timed_step, init=init, num_steps=n, t_start=0.0, t_stop=0.5 * n,
                            options=opts, comm=comm)
best = 1e300
for r in range(3):
    comm.Barrier(); t0 = time.perf_counter(); solver.solve()
    best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
calls["n"] = 0; calls["t"] = 0.0
comm.Barrier(); t0 = time.perf_counter(); solver_t.solve(); total = time.perf_counter() - t0
seq = 1e300
if comm.rank == 0:
    for r in range(3):
        t0 = time.perf_counter(); u = init(0.0)
        for i in range(n):
            u = step(u, i * 0.5, (i + 1) * 0.5, 0)
        seq = min(seq, time.perf_counter() - t0)
out = dict(ranks=comm.size, state_size=size, steps=n, levels=levels, seconds=best,
           sequential_seconds=seq, steps_run=calls["n"],
           us_per_step_outside_user_step=1e6 * (total - calls["t"]) / max(calls["n"], 1))
out = comm.gather(out, root=0)
if comm.rank == 0:
    worst = max(out, key=lambda o: o["us_per_step_outside_user_step"])
    res = dict(out[0]); res["us_per_step_outside_user_step"] = worst["us_per_step_outside_user_step"]
    print(json.dumps(res))
'''


def build_core_bench(workdir):
    exe = Path(workdir) / "core_bench"
    srcs = sorted(str(p) for p in (ROOT / "cbridge" / "src").glob("*.c"))
    subprocess.run(["mpicc", "-O2", "-std=c99", f"-I{ROOT / 'cbridge' / 'include'}",
                    f"-I{ROOT / 'cbridge' / 'src'}", str(ROOT / "bench" / "core_bench.c"), *srcs,
                    "-lm", "-o", str(exe)], check=True)
    return exe


def main():
    rows_c, rows_py = [], []
    with tempfile.TemporaryDirectory() as d:
        exe = build_core_bench(d)
        for ranks in (1, 2):
            for n, levels in ((4096, 3), (65536, 4)):
                out = subprocess.run(["mpiexec", "-n", str(ranks), str(exe), str(n), str(levels),
                                      "4", "5", "5"], check=True, capture_output=True, text=True)
                rows_c.append(json.loads(out.stdout))
                print(rows_c[-1], flush=True)
        script = Path(d) / "py_bench.py"
        script.write_text(PY_BENCH)
        for ranks in (1, 2):
            for size in (1, 65536):
                n = 256 if size > 1 else 1024
                out = subprocess.run(["mpiexec", "-n", str(ranks), sys.executable, str(script),
                                      str(size), str(n), "3"], check=True, capture_output=True,
                                     text=True, cwd=ROOT)
                rows_py.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(rows_py[-1], flush=True)
    lines = ["# The MGRIT core's speed", "",
             "Measured on this project's 2-core machine by `python bench/bench_core.py`.", "",
             "## Core time per step (C callbacks on scalar states)", "",
             "bench/core_bench.c runs the core with C callbacks whose step is one division, so the "
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
              "and norms, packing, MPI), on the busiest rank.", "",
              "| ranks | state size | N | seconds per solve | sequential seconds | speedup | "
              "us/step outside step |", "|---|---|---|---|---|---|---|"]
    for r in rows_py:
        lines.append(f"| {r['ranks']} | {r['state_size']} | {r['steps']} | {r['seconds']:.4f} | "
                     f"{r['sequential_seconds']:.4f} | {r['sequential_seconds'] / r['seconds']:.2f}"
                     f" | {r['us_per_step_outside_user_step']:.1f} |")
    (ROOT / "docs" / "bench_core.md").write_text("\n".join(lines) + "\n")
    print("wrote docs/bench_core.md")


if __name__ == "__main__":
    main()
