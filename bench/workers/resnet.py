"""Forward+backward time of a layer-parallel ODE-ResNet vs plain PyTorch (one configuration).

    mpiexec -n 2 python -m bench.workers.resnet --steps 64 --levels 2 --json out.json

Network: x <- x + dt * relu(conv2(relu(conv1(x)))), 8 channels, 28x28, batch 50, float32, 1 thread
per rank.  Reports seconds per forward+backward (median of --repeats), the relative errors of the
output, input gradient and parameter gradients against the serial network at the initial weights
(a first solve: no warm guess yet), and the MGRIT work
model: the steps and VJPs each rank ran (from the core's trace), turned into a predicted time with
the serial cost of one step and one VJP, measured in every round beside the timed pair (with
--serial), so that the work bound sees the machine as the times do.  On several ranks the same
costs are measured again with every rank measuring at once (the busy costs): the ranks of a
solve step side by side and share the cache and memory bandwidth, which the first measurement,
like plain PyTorch, has to itself.

The weights stay at their initial values while timing (the cost of a step does not depend on
them), but with --warm: a warm start needs a network that changes between solves, so each round
then ends with a small SGD step on both copies of the weights.
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from mpi4py import MPI

import layerbraid
from layerbraid.launch import world
from bench.harness import bind_self, steady_allocator
from layerbraid.nn import ConvBlock


class Chain(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, channels, fwd, bwd, warm):
        super().__init__(num_steps=steps, t_final=1.0, comm=comm, forward_options=fwd,
                         backward_options=bwd, warm_start=warm)
        self.channels = channels

    def step_layer(self, index):
        return ConvBlock(self.channels)


def _sgd(model, serial, comm, lr):
    """One plain SGD step on the layer-parallel weights, mirrored onto the serial copy."""
    with torch.no_grad():
        for i, layer in model.owned_steps():
            for p in layer.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        state = model._gather_state()
        serial.load_state_dict(state)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, nargs="+", default=[64],
                   help="the network's steps; several: one network after another, a JSON line "
                        "each (one process start for all)")
    p.add_argument("--levels", type=int, default=1)
    p.add_argument("--cfactor", type=int, default=4)
    p.add_argument("--fwd-iters", type=int, default=2)
    p.add_argument("--bwd-iters", type=int, default=1)
    p.add_argument("--warm", action="store_true", help="warm-start each solve from the last")
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serial", action="store_true", help="also time plain PyTorch (rank 0)")
    p.add_argument("--json", help="write the results here (rank 0)")
    p.add_argument("--memory", choices=["lp", "serial"],
                   help="only measure the memory of one first forward+backward, of the "
                        "layer-parallel network or (1 rank) of its serial copy: the growth of "
                        "each rank's peak resident set over its resident set before it")
    args = p.parse_args()
    if args.memory and len(args.steps) > 1:
        p.error("--memory measures one network per process (a peak resident set is the "
                "process's)")
    steady_allocator()
    bind_self()
    torch.set_num_threads(1)
    comm = world()  # MPI's COMM_WORLD, or torchrun's process group (the transport rows)
    for steps in args.steps:
        run(args, steps, comm)


def run(args, steps, comm):
    """Builds the network of ``steps`` steps and measures it as ``args`` ask; rank 0 prints
    its JSON line."""
    # F-relaxation on the fine level, FCF on coarse levels, first down-cycle skipped.
    nrelax = tuple([0] + [1] * (args.levels - 2)) if args.levels > 2 else 0
    def opts(iters):
        if args.levels == 1:
            return layerbraid.MGRITOptions(max_levels=1)
        return layerbraid.MGRITOptions(max_levels=args.levels, cfactor=args.cfactor,
                                       max_iters=iters, nrelax=nrelax, tol=0.0,
                                       skip_first_downcycle=True)
    torch.manual_seed(0)
    model = Chain(comm, steps, args.channels, opts(args.fwd_iters), opts(args.bwd_iters),
                  args.warm)
    serial = model.to_serial()
    g = torch.Generator().manual_seed(1)
    if args.memory:
        return memory(model if args.memory == "lp" else serial, args, steps, comm)

    def lp_step(xx):
        model.zero_grad(set_to_none=True)
        out = model(xx)
        out.sum().backward()
        return out

    def serial_step(xx):
        serial.zero_grad(set_to_none=True)
        out = serial(xx)
        out.sum().backward()
        return out

    def errors(xb):
        """Relative errors of the output, input gradient and parameter gradients against the
        serial network with the same weights, on batch xb (collective)."""
        xp = xb.detach().clone().requires_grad_(True)
        out = lp_step(xp)
        xs = xb.detach().clone().requires_grad_(True)
        ref = serial_step(xs)
        num = den = 0.0
        for i, layer in model.owned_steps():
            for p_, q in zip(layer.parameters(), serial.layers[i].parameters()):
                num += float((p_.grad - q.grad).pow(2).sum())
                den += float(q.grad.pow(2).sum())
        num, den = comm.allreduce(num), comm.allreduce(den)
        err_in = comm.bcast(rel(xp.grad, xs.grad) if comm.rank == 0 else None, root=0)
        return rel(out.detach(), ref.detach()), err_in, (num / max(den, 1e-300)) ** 0.5

    # Accuracy at the initial weights, before the timed steps: with --warm, the SGD steps below
    # (sum loss) degenerate the network (biases driven negative, layers that output zeros),
    # which would make any configuration look accurate.  Errors on trained networks:
    # docs/accuracy.md.
    err_out, err_in, err_param = errors(
        torch.randn(args.batch, args.channels, 28, 28, generator=torch.Generator().manual_seed(7)))

    # A new batch each time; layer-parallel and serial runs alternate, and the step costs are
    # measured after each pair, so that machine noise hits all three alike.
    from layerbraid.plan import measure_step

    lp_times, serial_times, costs, busy_costs = [], [], [], []
    own = serial.layers[0] if comm.rank == 0 else next(iter(model.owned_steps()))[1]
    split = []  # this rank's split of each timed forward+backward (solve_split)
    h = torch.randn(args.batch, args.channels, 28, 28, generator=torch.Generator().manual_seed(5))

    for k in range(args.repeats + 1):
        xb = torch.randn(args.batch, args.channels, 28, 28, generator=g).requires_grad_(True)
        comm.Barrier()
        t0 = time.perf_counter()
        lp_step(xb)
        mine = time.perf_counter() - t0
        t = comm.allreduce(mine, op=MPI.MAX)
        if k > 0:
            lp_times.append(t)
            split.append(solve_split(model, mine))
        if args.serial and comm.rank == 0:
            xs = xb.detach().clone().requires_grad_(True)
            t0 = time.perf_counter()
            serial_step(xs)
            if k > 0:
                serial_times.append(time.perf_counter() - t0)
                # one step's and one VJP's cost, this round (medians of 3)
                costs.append(measure_step(serial.layers[0], h, repeats=3))
        comm.Barrier()
        if args.serial and comm.size > 1 and k > 0:
            # the same costs measured on every rank at once, each on a layer of its own: in a
            # solve the ranks step side by side and share the machine's cache and memory
            # bandwidth, which plain PyTorch, alone on the machine, does not
            comm.Barrier()
            every = comm.gather(measure_step(own, h, repeats=3), root=0)
            if comm.rank == 0:
                busy_costs.append(tuple(statistics.mean(c[i] for c in every) for i in range(3)))
        if args.warm and k < args.repeats:  # the same SGD step on both copies of the weights
            _sgd(model, serial, comm, lr=1e-3)
    lp_time = statistics.median(lp_times)
    splits = comm.gather([statistics.median(v) for v in zip(*split)], root=0)

    # work model: steps (forward) and VJPs (backward) this rank ran, from the core's trace of
    # one more solve, untimed (a traced solve always runs in the core: one rank with one level
    # runs as plain autograd otherwise, and that is what was timed)
    work = comm.gather(traced_work(model, lp_step, torch.randn(
        args.batch, args.channels, 28, 28, generator=g).requires_grad_(True)), root=0)

    result = None
    if comm.rank == 0:
        result = dict(ranks=comm.size, steps=steps, levels=args.levels, cfactor=args.cfactor,
                      fwd_iters=args.fwd_iters, bwd_iters=args.bwd_iters, warm=args.warm,
                      seconds=lp_time, err_output=err_out, err_input_grad=err_in,
                      err_param_grad=err_param, lp_times=lp_times, serial_times=serial_times,
                      fwd_steps_per_rank=[w[0] for w in work],
                      bwd_vjps_per_rank=[w[1] for w in work],
                      fwd_iterations=model.forward_stats.iterations,
                      bwd_iterations=model.backward_stats.iterations,
                      # the most over the ranks of each one's median
                      mpi_seconds=max(sp[0] for sp in splits),
                      bookkeeping_seconds=max(sp[1] for sp in splits),
                      # each rank's medians: (MPI, bookkeeping, steps, outside the solves)
                      split_per_rank=splits)
        if args.serial:
            result["serial_seconds"] = statistics.median(serial_times)
            result["speedup"] = result["serial_seconds"] / lp_time
            # serial cost of one step forward and one VJP, for the work model: each round's
            # (beside its timed pair), and their medians
            for i, key in enumerate(("step_seconds", "vjp_seconds", "vjp_param_seconds")):
                result[key.replace("seconds", "times")] = [c[i] for c in costs]
                result[key] = statistics.median(c[i] for c in costs)
                if busy_costs:  # the same, measured on every rank at once (their mean)
                    result["busy_" + key.replace("seconds", "times")] = [c[i] for c in busy_costs]
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


def solve_split(model, seconds):
    """(MPI, bookkeeping, steps, outside) seconds of this rank's last forward+backward, which
    took it ``seconds``, from the forward and adjoint solves' statistics: the time in the core's
    MPI calls (messages and the waiting for them); in neither the steps nor MPI (the core's
    sweeps and the callbacks' vector sums, norms, clones and packing); in the step and VJP
    callbacks (the layer's work and layerbraid's Python around it); and outside the two solves
    (the module's work around them, zero_grad, the loss)."""
    stats = (model.forward_stats, model.backward_stats)
    return (sum(st.comm_seconds for st in stats),
            sum(st.seconds - st.step_seconds - st.comm_seconds for st in stats),
            sum(st.step_seconds for st in stats),
            seconds - sum(st.seconds for st in stats))


def traced_work(model, step, x):
    """(steps, VJPs) this rank ran in ``step(x)``, one forward and backward of ``model``,
    from the core's trace of it; tracing is switched off again afterwards."""
    model.set_trace(True)
    try:
        step(x)
    finally:
        model.set_trace(False)
    return tuple(sum(1 for e in t if e.op.endswith("step")) for t in model.trace())


def allocator_profile(forward, backward):
    """(peak, after the forward): the growth of the bytes torch's CPU allocator holds while
    ``backward(forward())`` runs, at its peak and when ``forward()`` has returned (the kept
    graph and the output), from the profiler's allocation and free events (every tensor torch
    allocates, layerbraid's states included; not the OS's page cache or the allocator's reuse,
    which is what makes the resident set's growth vary between runs of the same code)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench.forward"):
            out = forward()
        backward(out)
    events = prof.profiler.kineto_results.events()
    forward_end = max(e.end_ns() for e in events if e.name() == "bench.forward")
    live = peak = after_forward = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
        if e.start_ns() <= forward_end:
            after_forward = live
    return peak, after_forward


def adjoint_c_points(model):
    """The fine C-points this rank owns in the adjoint solve, those from cfactor on (the
    adjoint's MGRIT unknowns, kept through its final relaxation); 0 with one level or for the
    serial network."""
    chain = getattr(model, "_chain", None)
    if chain is None or chain.bwd is None or chain.bwd.num_levels() < 2:
        return 0
    lo, hi, _ = chain.bwd.level_info()[1]
    return max(0, hi - max(lo, 1) + 1)


def memory(model, args, steps, comm):
    """Prints (rank 0), for every rank, the growth of torch's allocated bytes at their peak over
    one forward+backward (the measure the report judges), the peak resident set's growth over
    another (what the OS saw; it varies between runs of the same code with what the C allocator
    returns and reuses), and the steps the rank owns."""
    import gc
    import resource

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    # A forward+backward of 2 samples first, so that what the libraries allocate once (MPI's
    # buffers, torch's kernels, the core's tables) is not counted
    small = torch.randn(2, args.channels, 28, 28, requires_grad=True)
    model(small).sum().backward()
    model.zero_grad(set_to_none=True)

    def forward():
        x = torch.randn(args.batch, args.channels, 28, 28,
                        generator=torch.Generator().manual_seed(3))
        x.requires_grad_(True)
        return model(x).sum()

    def step():
        forward().backward()

    gc.collect()
    comm.Barrier()
    before = resident()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.zero_grad(set_to_none=True)
    gc.collect()
    comm.Barrier()
    allocated, after_forward = allocator_profile(forward, lambda loss: loss.backward())
    owned = len(list(model.owned_steps())) if hasattr(model, "owned_steps") else steps
    rows = comm.gather({"allocated_bytes": allocated, "after_forward_bytes": after_forward,
                        "growth_bytes": max(peak - before, 0), "owned_steps": owned,
                        "adjoint_c_points": adjoint_c_points(model)}, root=0)
    if comm.rank == 0:
        print(json.dumps({"memory": args.memory, "ranks": comm.size, "steps": steps,
                          "levels": args.levels, "per_rank": rows,
                          "state_bytes": args.channels * 28 * 28 * 4 * args.batch}))

if __name__ == "__main__":
    main()
