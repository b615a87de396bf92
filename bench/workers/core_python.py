"""The general solver through Python (numpy states); args: size steps levels [interval] (a
worker of bench/core.py, run under mpiexec; prints JSON lines).  With interval 1 the
solver gets a step_interval that takes each run of steps in one call from the core (the same
step function in a Python loop), so the difference is the core's per-step crossings."""


def main():
    import json, sys, time
    import numpy as np
    from mpi4py import MPI
    import layerbraid
    size, n, levels = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    interval = len(sys.argv) > 4 and sys.argv[4] == "1"
    comm = MPI.COMM_WORLD
    x0 = np.linspace(0, 1, size) if size > 1 else np.array(1.0)
    def step(u, t0, t1, level):
        return u / (1.0 + (t1 - t0))
    def init(t):
        return x0.copy() if t == 0.0 else np.zeros_like(x0)
    opts = layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=3, tol=0.0, nrelax=1)
    def runs(step_fn):
        """A step_interval over step_fn (None without interval)."""
        if not interval:
            return None
        def step_interval(u, times, level, keep):
            out = []
            for t0, t1 in zip(times[:-1], times[1:]):
                u = step_fn(u, t0, t1, level)
                out.append(u)
            return out
        return step_interval
    solver = layerbraid.MGRIT(step=step, init=init, num_steps=n, t_start=0.0, t_stop=0.5 * n,
                              options=opts, comm=comm, step_interval=runs(step))
    calls = {"n": 0, "t": 0.0}
    def timed_step(u, t0, t1, level):
        s = time.perf_counter(); out = step(u, t0, t1, level); calls["t"] += time.perf_counter() - s
        calls["n"] += 1; return out
    solver_t = layerbraid.MGRIT(step=timed_step, init=init, num_steps=n, t_start=0.0, t_stop=0.5 * n,
                                options=opts, comm=comm, step_interval=runs(timed_step))
    times = []
    for r in range(5):
        comm.Barrier(); t0 = time.perf_counter(); solver.solve()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    calls["n"] = 0; calls["t"] = 0.0
    comm.Barrier(); t0 = time.perf_counter(); solver_t.solve(); total = time.perf_counter() - t0
    seq = []
    if comm.rank == 0:
        for r in range(5):
            t0 = time.perf_counter(); u = init(0.0)
            for i in range(n):
                u = step(u, i * 0.5, (i + 1) * 0.5, 0)
            seq.append(time.perf_counter() - t0)
    out = dict(ranks=comm.size, state_size=size, steps=n, levels=levels, interval=interval,
               seconds=times, sequential_seconds=seq, steps_run=calls["n"],
               us_per_step_outside_user_step=1e6 * (total - calls["t"]) / max(calls["n"], 1))
    out = comm.gather(out, root=0)
    if comm.rank == 0:
        worst = max(out, key=lambda o: o["us_per_step_outside_user_step"])
        res = dict(out[0]); res["us_per_step_outside_user_step"] = worst["us_per_step_outside_user_step"]
        print(json.dumps(res))


if __name__ == "__main__":
    main()
