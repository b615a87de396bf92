"""Time per training batch of one network, every system of docs/vs_pipelining.md side by side in
one job (a worker of bench/vs_pipelining.py; prints one JSON line on rank 0).

    torchrun --standalone --nproc-per-node 2 -m bench.workers.vs_pipelining --batch 50
    mpiexec -n 2 python -m bench.workers.vs_pipelining --batch 50

The network: a 3x3 convolution from 1 to 8 channels, 64 steps ``x + dt * relu(conv2(relu(conv1
x)))`` of 8 channels at 28x28, a linear layer to 10 outputs; float32, MSE loss, one thread per
process, SGD.  Systems (each its own copy of the same initial weights):

- ``plain``: the serial network on rank 0, the whole batch (the other ranks wait in a barrier);
- ``gpipe-M``, ``1f1b-M``: torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B with M
  microbatches, the network cut into as many stages as processes at the step boundaries
  layerbraid uses (the first stage holds the first layer, the last the last); torchrun only;
- ``lp-M``: layerbraid exact (one level) with ``microbatches=M``;
- ``lp-mgrit-M``: layerbraid, 2 MGRIT levels, cfactor 4, 1 forward and 1 adjoint iteration,
  with ``microbatches=M`` (every phase of the solve microbatch after microbatch, so that the
  coarsest level's sequential solve is a pipeline too).

Each round runs one training batch of every system, in an order that rotates from round to
round; a system's time is the slowest rank's.  Beside each system: its gradient's relative
error against the serial network's at the initial weights, and the peak bytes its autograd
graph held for the backward on each rank (what ``saved_tensors_hooks`` saw live at once: the
activation memory, which is what microbatching schedules trade; measured in the untimed
warm-up rounds, as its hooks cost time per tensor).  The planner's costs (a
step's forward and VJP at each microbatch size, a message through the job's transport, and
the times of two short chains that layerbraid's own costs are fitted on) are measured in every
round too, in the same rotation, so that each round's prediction has the machine in the state
its timings had.
"""

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import layerbraid
from bench.harness import bind_self, steady_allocator
from layerbraid.nn import ConvBlock

CHANNELS, SIZE, CLASSES = 8, 28, 10
COSTS = "costs"  # the planner's cost measurement, a pseudo-system of every round
COST_REPEATS = 5  # runs of each measured part a round (their median)
CHAIN_STEPS = 16  # the short chain that layerbraid's own costs are fitted on (and twice)
STATE_BYTES = 4 * CHANNELS * SIZE * SIZE  # one sample's state, float32
PING_TAG = 7499  # the timed messages' tag


class Euler(nn.Module):
    """``x <- x + dt * f(x)`` over ``blocks``, after ``open`` and before ``close`` (either may
    be None): the serial network, or one pipeline stage of it."""

    def __init__(self, blocks, dt, open=None, close=None):
        super().__init__()
        self.open, self.blocks, self.close, self.dt = open, nn.ModuleList(blocks), close, dt

    def forward(self, x):
        if self.open is not None:
            x = self.open(x)
        for f in self.blocks:
            x = x + self.dt * f(x)
        return self.close(x) if self.close is not None else x


def serial_network(steps: int) -> Euler:
    torch.manual_seed(0)
    open_ = nn.Conv2d(1, CHANNELS, 3, padding=1)
    blocks = [ConvBlock(CHANNELS) for _ in range(steps)]
    close = nn.Sequential(nn.Flatten(), nn.Linear(CHANNELS * SIZE * SIZE, CLASSES))
    return Euler(blocks, 1.0 / steps, open_, close)


class Peak:
    """The peak of the bytes that autograd graphs recorded under it hold for their backward
    (``saved_tensors_hooks``: each saved tensor counted while its graph keeps it)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def hooks(self) -> Any:
        peak = self

        class Held:
            def __init__(self, t: torch.Tensor) -> None:
                self.t, self.n = t, t.numel() * t.element_size()
                peak.live += self.n
                peak.peak = max(peak.peak, peak.live)

            def __del__(self) -> None:
                peak.live -= self.n

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t)


def stage_bounds(steps: int, comm) -> tuple[int, int]:
    """The steps of this rank's pipeline stage: those layerbraid gives this rank."""
    probe = _from_serial(serial_network(steps), comm)
    owned = [i for i, _ in probe.owned_steps()]
    probe.free()
    return owned[0], owned[-1] + 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 5, 10])
    p.add_argument("--systems", nargs="+",
                   default=["plain", "gpipe", "1f1b", "lp", "lp-mgrit"],
                   help="families to run: plain gpipe 1f1b lp lp-mgrit")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the networks run: cuda puts rank r on GPU r %% count (every "
                        "rank on the one GPU of a one-GPU machine); default cpu")
    a = p.parse_args()
    if a.warmup < 1:
        p.error(f"--warmup must be at least 1 (the peaks are measured there), got {a.warmup}")
    bind_self()
    steady_allocator()
    torch.set_num_threads(1)
    comm = layerbraid.launch.world()
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    rank, size = comm.Get_rank(), comm.Get_size()
    device = torch.device("cpu")
    if a.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.batch, 1, SIZE, SIZE, generator=g).to(device)
    y = torch.randn(a.batch, CLASSES, generator=g).to(device)

    systems: dict[str, Callable[[], None]] = {}
    errors: dict[str, float] = {}
    failed: dict[str, str] = {}  # systems that could not run here, and why
    serial = serial_network(a.steps).to(device)
    reference = _serial_grads(serial, x, y)
    if "plain" in a.systems:
        systems["plain"] = _plain(serial_network(a.steps).to(device), x, y, rank)
        errors["plain"] = 0.0
    lo, hi = stage_bounds(a.steps, comm)
    for family in ("gpipe", "1f1b"):
        if family in a.systems and torchrun and size > 1:
            for m in a.microbatches:
                name = f"{family}-{m}"
                try:
                    systems[name], errors[name] = _pipelining(family, m, a.steps, lo, hi, x, y,
                                                              reference, comm, device)
                except Exception as exc:  # e.g. no transport for its device here: say so
                    failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if "lp" in a.systems:
        for m in [1, *a.microbatches]:
            systems[f"lp-{m}"], errors[f"lp-{m}"] = _layerbraid(a.steps, x, y, reference, comm,
                                                                 device, microbatches=m)
    if "lp-mgrit" in a.systems:
        opts = layerbraid.MGRITOptions(max_levels=2, cfactor=4, max_iters=1)
        for m in [1, *a.microbatches]:
            systems[f"lp-mgrit-{m}"], errors[f"lp-mgrit-{m}"] = _layerbraid(
                a.steps, x, y, reference, comm, device, forward_options=opts,
                backward_options=opts, microbatches=m)

    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = {}
    counts = [1, *a.microbatches]
    # the planner's costs, measured in every round among the systems, so that each round's
    # prediction and measurement see the same stretch of a noisy machine
    costs: list[dict[str, Any]] = []
    order = [*names, COSTS] if device.type == "cpu" else names
    chains = ([_Chains(f, a.batch, counts, comm) for f in ("lp", "lp-mgrit") if f in a.systems]
              if COSTS in order else [])
    for r in range(a.warmup + a.rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            if name == COSTS:
                measured = _costs(a.batch, counts, comm, chains)
                if r >= a.warmup:
                    costs.append(measured)
                continue
            if r < a.warmup:  # the peak, in the untimed rounds: its hooks cost time per tensor
                peak = Peak()
                with peak.hooks():
                    systems[name]()
                peaks[name] = max(peaks.get(name, 0), peak.peak)
                continue
            comm.barrier("the start of a timed batch")
            t0 = time.perf_counter()
            systems[name]()
            if device.type == "cuda":  # the batch's kernels, not only their launches
                torch.cuda.synchronize(device)
            comm.barrier("the end of a timed batch")
            times[name].append(time.perf_counter() - t0)
    per_rank = comm.gather_obj(peaks, 0, "every rank's peaks")
    if rank == 0:
        assert per_rank is not None
        print(json.dumps({
            "ranks": size, "batch": a.batch, "steps": a.steps,
            "transport": "torch.distributed (gloo)" if torchrun else "MPI",
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu"),
            "failed": failed,
            "times": times, "errors": errors,
            "peak_bytes": {n: [pr[n] for pr in per_rank] for n in names},
            "medians": {n: statistics.median(t) for n, t in times.items()},
            "costs": {"rounds": costs, "message_bytes": STATE_BYTES}
            if costs else None,
        }))


def _layer_and_input(n: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ConvBlock(CHANNELS), torch.randn(n, CHANNELS, SIZE, SIZE)


def _costs(batch: int, counts: list[int], comm, chains: "list[_Chains]" = (),
           repeats: int = COST_REPEATS) -> dict[str, Any]:
    """One round's costs for the planner (layerbraid.plan.predict_pipeline and predict): a
    step's seconds, forward, VJP and VJP with parameter gradients, and the two parts of the
    split VJP (layerbraid.plan.measure_split), at each microbatch count's largest microbatch,
    measured on every rank at once (the ranks of a pipeline step side by side and share the
    node), and at the whole batch on rank 0 alone (plain PyTorch has the node to itself); a
    message's seconds, one float's and a microbatch's state's at each count (the transport's
    latency and bandwidth as the job sees them); and the times of ``chains``' short chains
    (:class:`_Chains`), from which the report fits layerbraid's own costs."""
    from layerbraid.plan import measure_split, measure_step

    busy, split = {}, {}
    for m in counts:
        comm.barrier("the start of a cost measurement")
        busy[m] = measure_step(*_layer_and_input(-(-batch // m)), repeats=repeats)
        split[m] = measure_split(*_layer_and_input(-(-batch // m)), repeats=repeats)
    alone = None
    comm.barrier("the start of the serial cost measurement")
    if comm.Get_rank() == 0:
        alone = measure_step(*_layer_and_input(batch), repeats=repeats)
    comm.barrier("the end of the serial cost measurement")
    out = {"busy": busy, "split": split, "alone": alone, "latency": _one_way(comm, 1),
           "message": {m: _one_way(comm, -(-batch // m) * CHANNELS * SIZE * SIZE)
                       for m in counts}}
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        # torch.distributed.pipelining's messages: its own isend/irecv and waits
        out["torch_latency"] = _one_way(comm, 1, through_torch=True)
        out["torch_message"] = {m: _one_way(comm, -(-batch // m) * CHANNELS * SIZE * SIZE,
                                            through_torch=True) for m in counts}
    if chains:
        out["chains"] = {c.family: c.timed() for c in chains}
    return out


def _one_way(comm, floats: int, repeats: int = COST_REPEATS, through_torch: bool = False
             ) -> float:
    """Seconds of one message of ``floats`` float32 numbers between ranks 0 and 1 through the
    job's transport as layerbraid's exact path sends them (its waits, with their deadline),
    or, ``through_torch``, through torch.distributed's own isend, irecv and wait, as
    torch.distributed.pipelining sends them: the median of ``repeats`` round trips, halved (0
    on one rank)."""
    rank, t = comm.Get_rank(), torch.zeros(floats)
    if comm.Get_size() < 2 or rank > 1:
        comm.barrier("the message timing")
        return 0.0
    import torch.distributed as dist

    peer, took = 1 - rank, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for send in ((True, False) if rank == 0 else (False, True)):
            if through_torch:
                (dist.isend if send else dist.irecv)(t, peer, tag=PING_TAG).wait()
            elif send:
                comm.start_send(t, peer, PING_TAG, "a timed message").wait()
            else:
                comm.start_recv((floats,), torch.float32, t.device, peer, PING_TAG,
                                "a timed message").wait()
        took.append(time.perf_counter() - t0)
    comm.barrier("the message timing")
    return statistics.median(took) / 2


def planner_costs(measured: dict[Any, Any], m: Any, batch: int, message_bytes: float,
                  through_torch: bool = False) -> "layerbraid.plan.Costs":
    """The planner's costs of a row in ``m`` microbatches from one round's measurement
    (:func:`_costs`; ``m`` a key of its dicts): a step's forward, VJP and VJP with the
    parameters' gradients and the split VJP's parts at the microbatch's size, and the
    transport's latency and bandwidth from its timed messages: layerbraid's, or, with
    ``through_torch`` where they were timed, torch.distributed's own (pipelining's rows).
    ``message_bytes``: one sample's state."""
    from layerbraid import plan

    step, vjp, vjp_param = measured["busy"][m]
    part_x, part_w = measured["split"][m]
    state_bytes = message_bytes * batch / int(m)
    prefix = "torch_" if through_torch and "torch_latency" in measured else ""
    latency = measured[prefix + "latency"]
    bandwidth = state_bytes / max(measured[prefix + "message"][m] - latency, 1e-7)
    return plan.Costs(step, vjp, vjp_param, message_bytes=state_bytes, latency=latency,
                      bandwidth=bandwidth, split_input_seconds=part_x,
                      split_weights_seconds=part_w)


class _Chains:
    """Two short chains of the network, CHAIN_STEPS conv steps and twice as many, trained by
    the job's ranks as ``family``'s rows train (exact, "lp", or MGRIT, "lp-mgrit") at each
    microbatch count: how much longer the longer takes, and its time, are what the report fits
    layerbraid's own costs on that the step costs leave out (bench/vs_pipelining.py:
    own_costs).  Short chains, so that the rows (64 steps) are predicted rather than
    fitted."""

    def __init__(self, family: str, batch: int, counts: list[int], comm) -> None:
        self.comm, self.family = comm, family
        levels = 2 if family == "lp-mgrit" else 1
        opts = layerbraid.MGRITOptions(max_levels=levels, cfactor=4, max_iters=1)
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(batch, 1, SIZE, SIZE, generator=g)
        self.y = torch.randn(batch, CLASSES, generator=g)
        self.models = {}
        for m in counts:
            for n in (CHAIN_STEPS, 2 * CHAIN_STEPS):
                self.models[m, n] = _from_serial(serial_network(n), comm, forward_options=opts,
                                                 backward_options=opts, microbatches=m)
                self._batch(m, n)  # warm

    def _batch(self, m: int, n: int) -> float:
        model = self.models[m, n]
        self.comm.barrier("the start of a chain's batch")
        t0 = time.perf_counter()
        F.mse_loss(model(self.x), self.y).backward()
        self.comm.barrier("the end of a chain's batch")
        took = time.perf_counter() - t0
        model.zero_grad()
        return took

    def timed(self, pairs: int = 3) -> dict[int, list[tuple[float, float]]]:
        """{m: [(the short chain's seconds per batch, the long one's), ...]}, ``pairs`` pairs
        each run back to back."""
        short, long = CHAIN_STEPS, 2 * CHAIN_STEPS
        return {m: [(self._batch(m, short), self._batch(m, long)) for _ in range(pairs)]
                for m in sorted({m for m, _ in self.models})}


def _serial_grads(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    net.zero_grad()
    F.mse_loss(net(x), y).backward()
    return {n: q.grad.detach().clone() for n, q in net.named_parameters()}


def _relative(pairs: list[tuple[torch.Tensor, torch.Tensor]], comm) -> float:
    """The relative error of the gradients in ``pairs`` (mine, the serial one) over every rank."""
    diff = sum(float((a - b).double().square().sum()) for a, b in pairs)
    norm = sum(float(b.double().square().sum()) for _, b in pairs)
    diff, norm = comm.allreduce_floats([diff, norm], "sum", "the gradient errors")
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def _plain(net: nn.Module, x, y, rank: int) -> Callable[[], None]:
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)

    def batch() -> None:
        if rank == 0:
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
    return batch


def _pipelining(family, m, steps, lo, hi, x, y, reference, comm, device):
    """A pipeline stage of this rank's steps under torch.distributed.pipelining."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    full = serial_network(steps).to(device)
    rank, size = comm.Get_rank(), comm.Get_size()
    stage = Euler(list(full.blocks[lo:hi]), full.dt, full.open if rank == 0 else None,
                  full.close if rank == size - 1 else None)
    names = {id(q): n for n, q in full.named_parameters()}
    pipe = PipelineStage(stage, rank, size, device, group=dist.group.WORLD)
    kind = ScheduleGPipe if family == "gpipe" else Schedule1F1B
    schedule = kind(pipe, m, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)

    def run() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == size - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    run()  # the gradients at the initial weights
    error = _relative([(q.grad, reference[names[id(q)]]) for q in stage.parameters()], comm)

    def batch() -> None:
        opt.zero_grad()
        run()
        opt.step()
    return batch, error


def _from_serial(full: Euler, comm, **options) -> layerbraid.LayerParallelModule:
    return layerbraid.from_serial(open=full.open, steps=full.blocks, close=full.close,
                                  dt=full.dt, comm=comm, **options)


def _layerbraid(steps, x, y, reference, comm, device, **options):
    model = _from_serial(serial_network(steps).to(device), comm, **options)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    F.mse_loss(model(x), y).backward()
    pairs = []
    for i, layer in model.owned_steps():
        for (n, q) in layer.named_parameters():
            pairs.append((q.grad, reference[f"blocks.{i}.{n}"]))
    if comm.Get_rank() == 0:
        pairs += [(q.grad, reference[f"open.{n}"]) for n, q in model.open.named_parameters()]
    if comm.Get_rank() == comm.Get_size() - 1:
        pairs += [(q.grad, reference[f"close.{n}"]) for n, q in model.close.named_parameters()]
    error = _relative(pairs, comm)

    def batch() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return batch, error


if __name__ == "__main__":
    main()
