"""A state handed from rank to rank (a worker of bench/scaling_measured.py, run under mpiexec;
prints one JSON line).

    hand_off.py STATE_FLOATS STEP_MS

One-level MGRIT (the general solver) with one step per rank: each rank waits for its
predecessor's state, sleeps STEP_MS in its step, and sends the state on, as the coarsest level's
sequential solve does.  Waiting ranks wait the core's way (Note [polled waits] in
cbridge/src/comm.c).  5 solves after a warm-up, each the slowest rank's; on P ranks the best
one's time less P steps' is the P - 1 hand-offs and the status allreduce that ends the solve.
bench/workers/emulated.py runs it at the end of its job (``row``), so that the processes start
once per rank count.
"""
import json
import sys
import time


def solve_seconds(comm, floats, step_s, solves=5):
    """The seconds of ``solves`` solves after a warm-up, each the slowest rank's."""
    import numpy as np
    from mpi4py import MPI

    import layerbraid

    x0 = np.ones(floats, dtype=np.float32)

    def step(u, t0, t1, level):
        time.sleep(step_s)
        return u * np.float32(0.5)

    def init(t):
        return x0.copy() if t == 0.0 else np.zeros_like(x0)

    solver = layerbraid.MGRIT(step=step, init=init, num_steps=comm.size, t_start=0.0,
                              t_stop=float(comm.size),
                              options=layerbraid.MGRITOptions(max_levels=1), comm=comm)
    times = []
    for k in range(solves + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        solver.solve()
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if k:
            times.append(t)
    return times


def row(comm, floats, step_s):
    """The JSON row: the best solve's seconds, and every solve's."""
    times = solve_seconds(comm, floats, step_s)
    return dict(kind="hand_off", ranks=comm.size, seconds=min(times), solves=times)


def main():
    from mpi4py import MPI

    floats, step_s = int(sys.argv[1]), float(sys.argv[2]) / 1e3
    comm = MPI.COMM_WORLD
    out = row(comm, floats, step_s)
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
