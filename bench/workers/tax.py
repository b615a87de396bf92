"""layerbraid's own time per step: a LayerParallelModule whose step layers cost almost nothing
(``f(x) = w * x``, one parameter), against the same chain in plain PyTorch (a worker of
bench/core.py, run under mpiexec; prints one JSON line on rank 0).

    mpiexec -n 1 python -m bench.workers.tax SIZE LEVELS [N [REPEATS]]

SIZE: elements of the state (float32); LEVELS: MGRIT levels (cfactor 4, 2 forward / 1 adjoint
iterations, first down-cycle skipped; 1 = exact).  The forward (recording the graph, as in
training) and the backward are timed separately, alternating with plain PyTorch's; the time
outside the layer per step is (layerbraid's time - the steps it ran x plain PyTorch's time per
step) / the steps it ran, on the busiest rank, for the forward's steps and the adjoint's VJPs;
and, from each solve's statistics, its time in MPI and its bookkeeping (neither the steps nor
MPI), per step the rank ran, the most over the ranks.
"""
import json
import statistics
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

import layerbraid
from bench.harness import steady_allocator
from bench.workers.resnet import traced_work


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w * x


class Chain(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, levels):
        opts = [layerbraid.MGRITOptions(max_levels=1)] * 2 if levels == 1 else [
            layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=it, tol=0.0,
                                    skip_first_downcycle=True) for it in (2, 1)]
        super().__init__(num_steps=steps, t_final=1.0, comm=comm, forward_options=opts[0],
                         backward_options=opts[1])

    def step_layer(self, index):
        return Scale()


def main():
    size, levels = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    steady_allocator()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    model = Chain(comm, steps, levels)
    serial = model.to_serial()
    x = torch.randn(size, generator=torch.Generator().manual_seed(0))  # the same on every rank
    times = {"lp_forward": [], "lp_backward": [], "plain_forward": [], "plain_backward": []}
    # this rank's solves, per timed iteration: (forward, adjoint) x (MPI seconds, seconds in
    # neither the steps nor MPI: the core's sweeps and the vector sums, norms and packing)
    split = []
    for k in range(repeats + 1):
        for name, m in (("lp", model), ("plain", serial)):
            if name == "plain" and comm.rank != 0:
                continue
            xx = x.clone().requires_grad_(True)
            m.zero_grad(set_to_none=True)
            if name == "lp":
                comm.Barrier()
            t0 = time.perf_counter()
            out = m(xx).sum()
            t1 = time.perf_counter()
            out.backward()
            t2 = time.perf_counter()
            if name == "lp":  # the busiest rank's times
                t1, t2 = t0 + comm.allreduce(t1 - t0, op=MPI.MAX), \
                    t0 + comm.allreduce(t2 - t0, op=MPI.MAX)
                t2 = max(t2, t1)
            if k > 0:
                times[f"{name}_forward"].append(t1 - t0)
                times[f"{name}_backward"].append(t2 - t1)
                if name == "lp":
                    split.append([v for st in (m.forward_stats, m.backward_stats)
                                  for v in (st.comm_seconds,
                                            st.seconds - st.step_seconds - st.comm_seconds)])
        comm.Barrier()
    # the steps and VJPs, from the core's trace of one more solve, untimed (a traced solve runs
    # in the core; one rank with one level runs as plain autograd otherwise, as timed)
    work = traced_work(model, lambda xx: model(xx).sum().backward(),
                       x.clone().requires_grad_(True))
    # per executed step on this rank, the median over the timed iterations
    medians = [statistics.median(v[j] for v in split) / max(work[j // 2], 1) for j in range(4)]
    gathered = comm.gather((work, medians), root=0)
    if comm.rank == 0:
        counts, splits = zip(*gathered)
        med = {k: statistics.median(v) for k, v in times.items()}
        fwd_steps, bwd_steps = max(c[0] for c in counts), max(c[1] for c in counts)
        print(json.dumps({
            "size": size, "levels": levels, "ranks": comm.size, "steps": steps, **times,
            "fwd_steps": fwd_steps, "bwd_steps": bwd_steps,
            "us_outside_per_forward_step": 1e6 * (med["lp_forward"] - fwd_steps *
                                                  med["plain_forward"] / steps) / fwd_steps,
            "us_outside_per_adjoint_step": 1e6 * (med["lp_backward"] - bwd_steps *
                                                  med["plain_backward"] / steps) / bwd_steps,
            # the most over the ranks, us per step the rank ran
            **{key: 1e6 * max(sp[j] for sp in splits) for j, key in enumerate((
                "us_mpi_per_forward_step", "us_bookkeeping_per_forward_step",
                "us_mpi_per_adjoint_step", "us_bookkeeping_per_adjoint_step"))}}))


if __name__ == "__main__":
    main()
