"""A state handed from rank to rank (a worker of bench/scaling_measured.py, run under mpiexec;
prints one JSON line).

    hand_off.py STATE_FLOATS STEP_MS

One-level MGRIT (the general solver) with one step per rank: each rank waits for its
predecessor's state, sleeps STEP_MS in its step, and sends the state on, as the coarsest level's
sequential solve does.  Waiting ranks wait the core's way (Note [polled waits] in
cbridge/src/comm.c).  The best of 5 solves after a warm-up, the slowest rank's; on P ranks its
time less P steps' is the P - 1 hand-offs and the status allreduce that ends the solve.
"""
import json
import sys
import time


def main():
    import numpy as np
    from mpi4py import MPI

    import layerbraid

    floats, step_s = int(sys.argv[1]), float(sys.argv[2]) / 1e3
    comm = MPI.COMM_WORLD
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
    for k in range(6):
        comm.Barrier()
        t0 = time.perf_counter()
        solver.solve()
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if k:
            times.append(t)
    if comm.rank == 0:
        print(json.dumps(dict(ranks=comm.size, seconds=min(times))), flush=True)


if __name__ == "__main__":
    main()
