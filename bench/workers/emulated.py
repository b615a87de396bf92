"""Layer-parallel training with emulated layers (a worker of bench/scaling_measured.py, run under
mpiexec; prints JSON lines).

    emulated.py STEP_MS VJP_MS STATE_FLOATS REPEATS CONFIG [CONFIG ...]

CONFIG is ``N:levels:cfactor[:M:B]``.  Each step layer spends STEP_MS milliseconds asleep in its
forward and VJP_MS in each VJP, with or without the parameter's gradient (using no CPU, like a
layer running on an accelerator), and computes ``w * x`` on a state of STATE_FLOATS float32
numbers, so that the messages have a real size.  With M and B the state is a batch of B rows
(STATE_FLOATS / B each) in M microbatches (``microbatches=M``: levels 1 is the exact path's
GPipe pipeline, more levels MGRIT in microbatches), and a layer sleeps its share of the time,
rows / B, as a layer whose cost is linear in its batch.
Everything else is the real training path: LayerParallelModule's forward and adjoint MGRIT
solves (2 forward / 1 adjoint iteration, F-relaxation on the fine level and FCF below, first
down-cycle skipped), the output broadcast and ``loss.backward()``.  Per config: the seconds of
each of REPEATS forward+backward passes (the slowest rank's) after a traced one, the warm-up,
which gives the steps and VJPs each rank ran (from the core's trace), and the CPU seconds each
rank spent in its fastest pass (what the ranks ask of the machine's cores; and how many of
them it spent waiting for other ranks, in layerbraid's polls) with the seconds its sleeps in that pass took
beyond their nominal time and their number (how late this machine wakes a sleeping rank).  On a
1-rank job, also the emulated serial network (plain PyTorch autograd over the same sleeping
layers).  Last, the hand-off of bench/workers/hand_off.py on the job's ranks (a row with
kind "hand_off").
"""
import sys
import time


# [seconds asleep beyond the nominal time, sleeps]: how late this rank's sleeps woke up
LATE = [0.0, 0]


def nap(seconds):
    t0 = time.perf_counter()
    time.sleep(seconds)
    LATE[0] += time.perf_counter() - t0 - seconds
    LATE[1] += 1


def build(comm, steps, levels, cfactor, step_s, vjp_s, floats, microbatches=1, rows=1):
    import torch
    from torch import nn

    import layerbraid

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            nap(step_s * x.shape[0] / rows)
            ctx.save_for_backward(x, w)
            return w * x

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            nap(vjp_s * x.shape[0] / rows)
            return g * w, (g * x).sum().reshape(w.shape)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.full((1,), -0.5))

        def forward(self, x):
            return Sleep.apply(x, self.w)

    class Emulated(layerbraid.LayerParallelModule):
        def step_layer(self, index):
            return Layer()

    nrelax = tuple([0] + [1] * (levels - 2)) if levels > 2 else 0
    fwd = layerbraid.MGRITOptions(max_levels=levels, cfactor=cfactor, max_iters=2, tol=0.0,
                                  nrelax=nrelax, skip_first_downcycle=True)
    bwd = layerbraid.MGRITOptions(**{**fwd.__dict__, "max_iters": 1})
    if levels == 1:
        fwd = bwd = layerbraid.MGRITOptions(max_levels=1)
    model = Emulated(num_steps=steps, comm=comm, forward_options=fwd, backward_options=bwd,
                     check_inputs=False, check_finite=False, microbatches=microbatches)
    x = torch.ones(rows, floats // rows)
    return model, x


def main():
    import json

    import torch
    from mpi4py import MPI

    from bench.workers import hand_off
    from bench.workers.resnet import traced_work
    from layerbraid.plan import wait_cpu_seconds

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    step_s, vjp_s = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
    floats, repeats = int(sys.argv[3]), int(sys.argv[4])
    for config in sys.argv[5:]:
        steps, levels, cfactor, *batching = map(int, config.split(":"))
        microbatches, rows = batching if batching else (1, 1)
        model, x = build(comm, steps, levels, cfactor, step_s, vjp_s, floats, microbatches,
                         rows)
        # the warm-up: the steps and VJPs from the core's trace of one solve, untimed (a traced
        # solve runs in the core; one rank with one level runs as plain autograd otherwise, as
        # timed)
        comm.Barrier()
        work = traced_work(model, lambda xx: model(xx).sum().backward(), x)
        times, cpu, waiting, late = [], [], [], []
        for _ in range(repeats):
            comm.Barrier()
            LATE[:] = [0.0, 0]
            t0, c0, w0 = time.perf_counter(), time.process_time(), wait_cpu_seconds()
            model(x).sum().backward()
            c1, w1 = time.process_time() - c0, wait_cpu_seconds() - w0
            times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            cpu.append(c1)
            waiting.append(w1)
            late.append(tuple(LATE))
        fastest = min(range(repeats), key=lambda k: cpu[k])
        counts = comm.gather(work + (cpu[fastest], late[fastest], waiting[fastest]), root=0)
        serial = None
        if comm.size == 1:  # the layers are warm: the model's passes ran them
            net = model.to_serial()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                net(x).sum().backward()
                ts.append(time.perf_counter() - t0)
            serial = min(ts)
        model.free()
        if comm.rank == 0:
            print(json.dumps(dict(ranks=comm.size, steps=steps, levels=levels, cfactor=cfactor,
                                  microbatches=microbatches, rows=rows,
                                  seconds=times, fwd_steps=[c[0] for c in counts],
                                  bwd_vjps=[c[1] for c in counts],
                                  cpu_seconds=[c[2] for c in counts],
                                  wait_cpu_seconds=[c[4] for c in counts],
                                  sleep_late=[c[3] for c in counts], serial_seconds=serial)),
                  flush=True)
    # the hand-off in the same job: its processes start once per rank count
    out = hand_off.row(comm, floats, step_s)
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
