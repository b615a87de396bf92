"""MGRIT on u' = -u (backward Euler), the XBraid test problem, on any number of ranks.

    mpiexec -n 2 python examples/dahlquist.py --steps 64 --levels 2 --cfactor 2

Prints the residual history on rank 0; the last line compares with sequential stepping.
"""
import argparse

import numpy as np
from mpi4py import MPI

import layerbraid
from layerbraid import cli
from layerbraid.launch import world

import common  # examples/common.py, beside this script


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=cli.int_at_least(2), default=64,
                   help="time steps (default 64)")
    p.add_argument("--dt", type=cli.positive_float, default=0.5, help="step size (default 0.5)")
    p.add_argument("--levels", type=cli.positive_int, default=2, help="MGRIT levels (default 2)")
    p.add_argument("--cfactor", type=cli.int_at_least(2), default=2,
                   help="coarsening factor (default 2)")
    p.add_argument("--relax", choices=["F", "FCF"], default="FCF", help="relaxation (default FCF)")
    p.add_argument("--skip", action="store_true", help="skip the work of the first down-cycle")
    p.add_argument("--cycle", choices=["V", "F"], default="V")
    p.add_argument("--tol", type=cli.nonneg_float, default=1e-10,
                   help="absolute residual tolerance")
    p.add_argument("--max-iters", type=cli.positive_int, default=100)
    args = common.parse_args(p)

    comm = world()  # mpiexec's COMM_WORLD, or torchrun's process group
    if args.steps < comm.size:
        p.error(f"--steps {args.steps} is smaller than the number of ranks ({comm.size})")
    options = layerbraid.MGRITOptions(
        max_levels=args.levels, cfactor=args.cfactor, max_iters=args.max_iters, tol=args.tol,
        nrelax=1 if args.relax == "FCF" else 0, skip_first_downcycle=args.skip, cycle=args.cycle)
    solver = layerbraid.MGRIT(
        step=lambda u, t0, t1, level: u / (1.0 + (t1 - t0)),
        init=lambda t: np.array(1.0 if t == 0.0 else 0.456),
        num_steps=args.steps, t_start=0.0, t_stop=args.steps * args.dt,
        options=options, comm=comm)
    result = solver.solve()

    # Compare this rank's states with the exact sequential answer (1 + dt)^-i.
    err = max((abs(float(u) - (1.0 + args.dt) ** -i) for i, u in result.states.items()), default=0.0)
    err = comm.allreduce(err, op=MPI.MAX)
    if comm.rank == 0:
        print(f"MGRIT on {comm.size} rank(s): {args.steps} steps, {result.num_levels} levels, "
              f"cfactor {args.cfactor}, {args.relax}-relaxation, {args.cycle}-cycle")
        first = 1 if args.skip else 0
        for k, r in enumerate(result.residual_norms):
            print(f"  iteration {k + first:3d}   residual {r:.6e}")
        print(f"{result.iterations} iterations; max |u - sequential| = {err:.3e}")


if __name__ == "__main__":
    main()
