"""layerbraid.plan: predict the time per batch of layer-parallel training before booking the ranks.

    python -m layerbraid.plan --steps 1024 --ranks 1 2 4 8 16 64 256 1024 \\
        --levels 3 --cfactor 4 --fwd-iters 2 --bwd-iters 1 --step-seconds 6e-3 --vjp-seconds 6e-3

The prediction runs on the exact schedule the C core would run: each rank's ordered actions
(steps per level, sends and receives with their peers, the residual allreduces), recorded by
*virtual* ranks of the core (`mgrit_create_virtual`: the same code with no MPI and no-op states;
the schedule never depends on the data).  A discrete-event simulation then walks those actions:
a step costs the measured (or given) seconds of one layer step forward, one VJP backward (one
with parameter gradients in the final relaxation); a message costs latency + bytes / bandwidth;
a receive waits for its message; an allreduce waits for every rank, plus log2(P) latencies.
Forward and adjoint solves are simulated separately (the adjoint on the mirrored distribution)
and added.  A planned solve runs a fixed number of iterations, with no stopping test, as the
examples' solves do (``--lp-tol 0``): a solve with a residual tolerance also waits for every
rank in an allreduce after each iteration but its last.  MGRIT's own bookkeeping (vector sums)
is not modelled: it is small next to the layers (see docs/bench_grid.md).
"""

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union, overload

import numpy as np

from ._engine import pipeline_model
from ._engine.schedule import OPS, virtual_schedule
from .options import MGRITOptions, check_int

__all__ = [
    "OPS",
    "STEP_OPS",
    "Costs",
    "Prediction",
    "schedule",
    "step_counts",
    "simulate",
    "predict",
    "sweep",
    "recommend",
    "measure_step",
    "spatial_scale",
    "PIPELINE_SCHEDULES",
    "SharedCores",
    "pipeline_orders",
    "predict_pipeline",
    "measure_split",
    "MicrobatchChoice",
    "choose_microbatches",
    "wait_cpu_seconds",
]

# The trace's operation names (a schedule's "op" column indexes OPS), and those that run a step.
STEP_OPS = ("fstep", "cstep", "rstep", "gstep", "seqstep")


@dataclass(frozen=True)
class Costs:
    """Seconds of one step and one VJP of a layer on the hardware, and the network.

    Attributes:
        step_seconds: one layer step forward (any MGRIT level: coarse steps use the same layer).
        vjp_seconds: one vector-Jacobian product for the state (adjoint relaxation).
        vjp_param_seconds: the VJP of the final relaxation, with parameter gradients (default
            1.5 x vjp_seconds).
        message_bytes: bytes of one state (batch x channels x height x width x dtype size).
        latency: seconds per message; bandwidth: bytes per second.
        param_bytes: bytes of one rank's parameters (data parallelism averages them).
        level_scale: optional cost multipliers of a step (and message) on MGRIT level 0, 1, ...
            (the last repeated), e.g. ``(1, 1/8, 1/64)`` for 3D spatial coarsening on levels 1
            and 2 in mode "state" (see :func:`spatial_scale`).
        message_scale: optional multipliers of a message's bytes per level, where they differ
            from level_scale: ``(1,)`` for spatial coarsening in mode "branch", whose coarse
            levels send fine states (their step costs, transfers included, are best measured).
        overhead_seconds: layerbraid's own CPU time per step action (the callback, the vector
            sums and norms around it), added to every step and VJP: small next to real layers,
            but it is what remains of a step whose layer runs elsewhere (an accelerator, or the
            sleeping layers of bench/scaling_measured.py).
        split_input_seconds, split_weights_seconds: the two parts of a VJP with parameter
            gradients split as the exact path's microbatched backward splits it (Note
            [pipeline model]; :func:`measure_split`): the input's gradient, with the search for
            where the parameters join, and the parameters' gradients afterwards (defaults:
            ``vjp_seconds`` and ``vjp_param_seconds - vjp_seconds``, the split for free).
        batch_seconds: seconds of a batch that do not grow with the chain and that no rank's
            schedule holds (the layers before and after the chain, the loss, a solve's set-up
            of its microbatches), added once to a prediction; measured as what remains of a
            short chain's time after its prediction (own_costs in bench/vs_pipelining.py).
    """

    step_seconds: float
    vjp_seconds: float
    vjp_param_seconds: Optional[float] = None
    message_bytes: float = 0.0
    latency: float = 5e-6
    bandwidth: float = 10e9
    param_bytes: float = 0.0
    level_scale: Optional[tuple] = None
    message_scale: Optional[tuple] = None
    overhead_seconds: float = 0.0
    split_input_seconds: Optional[float] = None
    split_weights_seconds: Optional[float] = None
    batch_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("level_scale", "message_scale"):
            value = getattr(self, name)
            if value is not None:
                scale = tuple(float(v) for v in value)
                if not scale or any(not v > 0 for v in scale):
                    raise ValueError(f"Costs.{name} must be positive numbers, got {value!r}")
                object.__setattr__(self, name, scale)
        if self.message_scale is None:
            object.__setattr__(self, "message_scale", self.level_scale)
        for name in (
            "step_seconds",
            "vjp_seconds",
            "message_bytes",
            "latency",
            "param_bytes",
            "overhead_seconds",
            "batch_seconds",
        ):
            v = getattr(self, name)
            if (
                not isinstance(v, (int, float))
                or isinstance(v, bool)
                or not v >= 0
                or math.isinf(v)
            ):
                raise ValueError(f"Costs.{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.bandwidth, (int, float)) or not self.bandwidth > 0:
            raise ValueError(f"Costs.bandwidth must be > 0, got {self.bandwidth!r}")
        if self.vjp_param_seconds is None:
            object.__setattr__(self, "vjp_param_seconds", 1.5 * self.vjp_seconds)
        elif not self.vjp_param_seconds >= 0:
            raise ValueError(
                f"Costs.vjp_param_seconds must be >= 0, got {self.vjp_param_seconds!r}"
            )
        defaults = {
            "split_input_seconds": self.vjp_seconds,
            "split_weights_seconds": max(self.vjp_param() - self.vjp_seconds, 0.0),
        }
        for name, default in defaults.items():
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, default)
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"Costs.{name} must be a finite number >= 0, got {v!r}")

    def vjp_param(self) -> float:
        """Seconds of a VJP with parameter gradients (filled in by ``__post_init__``)."""
        assert self.vjp_param_seconds is not None
        return self.vjp_param_seconds

    def split(self) -> tuple[float, float]:
        """(the input's part, the parameters' part) of a split VJP (``__post_init__`` fills
        them in)."""
        assert self.split_input_seconds is not None and self.split_weights_seconds is not None
        return self.split_input_seconds, self.split_weights_seconds

    def message_seconds(self) -> float:
        return self.latency + self.message_bytes / self.bandwidth


@dataclass
class Prediction:
    """The predicted time per batch on `ranks` layer-parallel ranks: ``seconds`` is the
    forward's and the backward's seconds plus ``Costs.batch_seconds`` (and, with data
    parallelism, the gradients' allreduce)."""

    ranks: int
    data_parallel: int
    seconds: float
    serial_seconds: float
    forward_seconds: float
    backward_seconds: float
    steps_per_rank: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.serial_seconds / self.seconds

    @property
    def efficiency(self) -> float:
        return self.speedup / (self.ranks * self.data_parallel)


def _check(num_steps: int, ranks: int) -> None:
    check_int("num_steps", num_steps)
    check_int("ranks", ranks)
    if ranks > num_steps:
        raise ValueError(
            f"ranks={ranks} is more than num_steps={num_steps}: every rank needs a step"
        )


def _training(options: Any) -> MGRITOptions:
    # Training always ends with the FC relaxation; a planned solve runs all its iterations, with
    # no stopping test and so no allreduce between them (Note [deferred status] in cycle.c).
    return replace(options, final_fc_relax=True, tol=0.0)


def schedule(
    num_steps: int,
    ranks: int,
    options: MGRITOptions,
    adjoint: bool = False,
    microbatches: int = 1,
) -> list[np.ndarray]:
    """Each rank's actions, from the C core's virtual ranks (structured numpy arrays); with
    ``microbatches``, each action once per microbatch, in the order the core runs them."""
    _check(num_steps, ranks)
    check_int("microbatches", microbatches, 1, 254)
    if not isinstance(options, MGRITOptions):
        raise TypeError(f"options must be an MGRITOptions, got {type(options).__name__}")
    return virtual_schedule(
        num_steps, ranks, _training(options), mirror=adjoint, parts=microbatches
    )


def step_counts(traces: Sequence[np.ndarray]) -> list[dict[int, int]]:
    """Per rank, {level: steps run} (all step kinds), from schedule()'s traces."""
    codes = [OPS.index(op) for op in STEP_OPS]
    out = []
    for t in traces:
        mask = np.isin(t["op"], codes)
        levels, counts = np.unique(t["level"][mask], return_counts=True)
        out.append({int(lv): int(c) for lv, c in zip(levels, counts)})
    return out


def spatial_scale(levels: Sequence[int], dims: int, num_levels: int = 16) -> tuple[float, ...]:
    """Costs.level_scale for spatial coarsening on `levels` in `dims` dimensions: each coarsened
    level divides a step's work (and a message) by 2^dims."""
    out, f = [], 1.0
    for lv in range(num_levels):
        if lv in set(levels):
            f /= 2**dims
        out.append(f)
    return tuple(out)


# Note [shared cores]: simulate() gives every rank a core of its own.  With SharedCores, P ranks
# share ``cores`` cores (the host bench/scaling_measured.py emulates many ranks on):
# - a step action is ``cpu`` seconds of work that needs a core, then the rest of its cost
#   without one (an emulated layer sleeps, as a layer on an accelerator leaves its CPU idle);
# - the CPU parts run in the order the ranks ask, at most ``cores`` at a time, each to its end
#   (a burst of a fraction of a millisecond is shorter than the scheduler's time slice);
# - a rank that waits (for a message, or for the other ranks of an allreduce) polls, asking for
#   ``wait_cpu`` of a core; with no more ranks than cores it spins on a core of its own.  While
#   the running CPU parts and the polling ask for more than ``cores`` cores, the running parts
#   slow down in proportion;
# - with more ranks than cores the core's waits nap between tests (Note [polled waits] in
#   cbridge/src/comm.c), a tenth of the time waited so far, 0.1 ms to 1 ms: a message that
#   arrives during a nap is seen half a nap later on average, plus ``seen_late`` (what the
#   machine adds, measured by handing a state from rank to rank).
# With ``cores`` >= P this is exactly the plain simulation (tested).
NAP_MIN, NAP_MAX, SPIN_SECONDS = 1e-4, 1e-3, 2e-4  # comm.c's keep_waiting


@dataclass(frozen=True)
class SharedCores:
    """Ranks that share ``cores`` cores (Note [shared cores]): ``cpu`` seconds of each step
    action need a core, a waiting rank asks for ``wait_cpu`` of one, and a napping rank sees
    its message ``seen_late`` seconds later still."""

    cores: int
    cpu: float
    wait_cpu: float
    seen_late: float = 0.0


@overload
def simulate(
    traces: Sequence[np.ndarray],
    step_cost: float,
    done_cost: float,
    message_seconds: float,
    latency: float,
    level_scale: Optional[Sequence[float]] = ...,
    message_scale: Optional[Sequence[float]] = ...,
    critical_path: Literal[False] = ...,
) -> float: ...


@overload
def simulate(
    traces: Sequence[np.ndarray],
    step_cost: float,
    done_cost: float,
    message_seconds: float,
    latency: float,
    level_scale: Optional[Sequence[float]] = ...,
    message_scale: Optional[Sequence[float]] = ...,
    *,
    critical_path: Literal[True],
) -> tuple[float, dict[str, float]]: ...


@overload
def simulate(
    traces: Sequence[np.ndarray],
    step_cost: float,
    done_cost: float,
    message_seconds: float,
    latency: float,
    level_scale: Optional[Sequence[float]] = ...,
    message_scale: Optional[Sequence[float]] = ...,
    critical_path: Literal[False] = ...,
    *,
    shared: SharedCores,
) -> tuple[float, float]: ...


def simulate(
    traces: Sequence[np.ndarray],
    step_cost: float,
    done_cost: float,
    message_seconds: float,
    latency: float,
    level_scale: Optional[Sequence[float]] = None,
    message_scale: Optional[Sequence[float]] = None,
    critical_path: bool = False,
    *,
    shared: Optional[SharedCores] = None,
) -> Union[float, tuple[float, dict[str, float]], tuple[float, float]]:
    """The time at which the last rank finishes, walking every rank's actions (seconds).
    `message_scale` defaults to `level_scale`.

    With ``shared``, the ranks share fewer cores than they are (Note [shared cores]; no level
    scales): returns ``(seconds, CPU seconds of all ranks)``.

    With ``critical_path``, returns ``(seconds, {what: seconds})`` instead: the chain of actions
    that set the finishing time, by kind ("level L steps", "final relaxation", "messages",
    "allreduces"); its parts add up to the time.  Each rank carries the path that led to its
    clock: a receive that waits takes the sender's path plus the message, an allreduce the
    path of the last rank to arrive."""
    if shared is not None:
        if critical_path or level_scale is not None or message_scale is not None:
            raise ValueError("simulate(shared=...) models no critical path and no level scales")
        return _simulate_shared(traces, step_cost, done_cost, message_seconds, latency, shared)
    sim = _Simulation(
        traces,
        step_cost,
        done_cost,
        message_seconds,
        latency,
        level_scale,
        level_scale if message_scale is None else message_scale,
        critical_path,
    )
    p = len(traces)
    allreduce = latency * max(1.0, math.ceil(math.log2(p))) if p > 1 else 0.0
    # Messages only go from lower to higher ranks (docs/ARCHITECTURE.md), so walking the ranks in
    # order up to each allreduce resolves every receive.
    while True:
        reached = sum(sim.advance(r) for r in range(p))
        if reached == 0:
            return sim.finish()
        if reached != p:
            raise RuntimeError("ranks disagree on the number of allreduces")
        sim.allreduce(allreduce)


def _simulate_shared(
    traces: Sequence[np.ndarray],
    step_cost: float,
    done_cost: float,
    message_seconds: float,
    latency: float,
    shared: "SharedCores",
) -> tuple[float, float]:
    """(seconds until the last rank finishes, CPU seconds of all ranks), the ranks of
    ``traces`` sharing ``shared.cores`` cores (Note [shared cores])."""
    cores, cpu, wait_cpu = shared.cores, shared.cpu, shared.wait_cpu
    seen_late = shared.seen_late
    step_codes = {OPS.index(op) for op in STEP_OPS}
    send, recv, norm = OPS.index("send"), OPS.index("recv"), OPS.index("norm")
    p = len(traces)
    over = p > cores
    columns = [(t["op"], t["level"], t["index"], t["peer"], t["done"], len(t)) for t in traces]
    pos = [0] * p
    # per rank: ("cpu", work left, seconds after it) | ("off", until) | ("recv", key, since)
    # | ("sync",) | ("done",)
    state: list[Any] = [None] * p
    arrivals: dict[tuple[int, int, int, int], list[float]] = {}
    in_cpu: list[int] = []  # ranks in a CPU part, in the order they asked: the first `cores` run
    now, cpu_used = 0.0, 0.0
    allreduce = latency * max(1.0, math.ceil(math.log2(p))) if p > 1 else 0.0

    def advance(r: int) -> None:
        """Runs rank r's actions from pos[r] at `now` until one takes time."""
        op, level, index, peer, done, n = columns[r]
        a = pos[r]
        while a < n:
            o = op[a]
            if o in step_codes:
                cost = done_cost if done[a] else step_cost
                work = min(cpu, cost)
                state[r], pos[r] = ("cpu", work, cost - work), a + 1
                in_cpu.append(r)
                return
            if o == send:
                arrivals.setdefault((r, int(peer[a]), int(level[a]), int(index[a])), []).append(
                    now + latency + message_seconds
                )
                if latency > 0:
                    state[r], pos[r] = ("off", now + latency), a + 1
                    return
            elif o == recv:
                key = (int(peer[a]), r, int(level[a]), int(index[a]))
                queue = arrivals.get(key)
                if not queue or queue[0] > now:
                    state[r], pos[r] = ("recv", key, now), a
                    return
                queue.pop(0)
            elif o == norm:
                state[r], pos[r] = ("sync",), a + 1
                return
            a += 1
        state[r], pos[r] = ("done",), a

    def seen(r: int) -> float:
        """When rank r's awaited message is seen (inf: not sent yet)."""
        _, key, since = state[r]
        queue = arrivals.get(key)
        if not queue:
            return math.inf
        t = max(queue[0], since)
        waited = t - since
        if over and waited > SPIN_SECONDS:
            t += min(max(waited / 10, NAP_MIN), NAP_MAX) / 2 + seen_late
        return t

    for r in range(p):
        advance(r)
    while True:
        kinds = [s[0] for s in state]
        if all(k == "done" for k in kinds):
            return now, cpu_used
        if all(k in ("sync", "done") for k in kinds):
            if "done" in kinds:
                raise RuntimeError("ranks disagree on the number of allreduces")
            now += allreduce
            for r in range(p):
                advance(r)
            continue
        running = set(in_cpu[:cores])
        computing = len(running)
        waiting = kinds.count("recv") + kinds.count("sync")
        asked = computing + (wait_cpu if over else 1.0) * waiting
        rate = 1.0 if asked <= cores else cores / asked
        nxt = math.inf
        for r, k in enumerate(kinds):
            if k == "cpu" and r in running:
                nxt = min(nxt, now + state[r][1] / rate)
            elif k == "off":
                nxt = min(nxt, state[r][1])
            elif k == "recv":
                nxt = min(nxt, seen(r))
        if nxt == math.inf:
            raise RuntimeError("a rank waits for a message that no rank sends")
        dt = nxt - now
        cpu_used += dt * min(asked, cores)
        now = nxt
        for r, k in enumerate(kinds):
            s = state[r]
            if k == "cpu" and r in running:
                left = s[1] - rate * dt
                if left <= 1e-12 * (1 + now):
                    in_cpu.remove(r)
                    if s[2] > 0:
                        state[r] = ("off", now + s[2])
                    else:
                        advance(r)
                else:
                    state[r] = ("cpu", left, s[2])
            elif k == "off" and s[1] <= now:
                advance(r)
            elif k == "recv" and seen(r) <= now:
                arrivals[s[1]].pop(0)
                pos[r] += 1
                advance(r)


def _scaled(scale: Optional[Sequence[float]], level: int) -> float:
    """A level's cost multiplier (the last one repeats); 1 without scales."""
    return 1.0 if scale is None else scale[min(int(level), len(scale) - 1)]


class _Simulation:
    """The state of :func:`simulate`: each rank's clock and position in its trace, the messages
    in flight (their arrival times), and, for the critical path, what set each clock."""

    def __init__(
        self,
        traces,
        step_cost,
        done_cost,
        message_seconds,
        latency,
        level_scale,
        message_scale,
        critical_path,
    ) -> None:
        self.traces, self.latency = traces, latency
        self.step_cost, self.done_cost, self.message_seconds = step_cost, done_cost, message_seconds
        self.level_scale, self.message_scale = level_scale, message_scale
        self.step_codes = {OPS.index(op) for op in STEP_OPS}
        self.send, self.recv, self.norm = OPS.index("send"), OPS.index("recv"), OPS.index("norm")
        p = len(traces)
        self.clock, self.pos = [0.0] * p, [0] * p
        self.arrivals: dict[tuple, list] = {}
        self.path: Optional[list[dict[str, float]]] = (
            [{} for _ in range(p)] if critical_path else None
        )

    def add(self, r: int, what: str, seconds: float) -> None:
        if self.path is not None:
            self.path[r][what] = self.path[r].get(what, 0.0) + seconds

    def advance(self, r: int) -> bool:
        """Walks rank ``r`` to its next allreduce (True) or to its trace's end (False)."""
        ops = self.traces[r]
        op, level, index, peer, done = (ops[k] for k in ("op", "level", "index", "peer", "done"))
        t, a, n = self.clock[r], self.pos[r], len(ops)
        while a < n and op[a] != self.norm:
            if op[a] in self.step_codes:
                cost = (
                    self.done_cost
                    if done[a]
                    else _scaled(self.level_scale, level[a]) * (self.step_cost)
                )
                t += cost
                self.add(r, "final relaxation" if done[a] else f"level {int(level[a])} steps", cost)
            elif op[a] == self.send:
                t += self.latency
                self.add(r, "messages", self.latency)
                f = _scaled(self.message_scale, level[a])
                flight = self.latency + f * (self.message_seconds - self.latency)
                route = (
                    None
                    if self.path is None
                    else {**self.path[r], "messages": self.path[r].get("messages", 0.0) + flight}
                )
                key = (r, int(peer[a]), int(level[a]), int(index[a]))
                self.arrivals.setdefault(key, []).append((t + flight, route))
            elif op[a] == self.recv:
                key = (int(peer[a]), r, int(level[a]), int(index[a]))
                arrival, route = self.arrivals[key].pop(0)
                if arrival > t:
                    t = arrival
                    if self.path is not None:
                        self.path[r] = dict(route)
            a += 1
        self.clock[r], self.pos[r] = t, a
        return a < n

    def allreduce(self, seconds: float) -> None:
        """Every rank waits for the last, then the allreduce's own time."""
        t = max(self.clock) + seconds
        if self.path is not None:
            last = max(range(len(self.clock)), key=lambda r: self.clock[r])
            route = {**self.path[last], "allreduces": self.path[last].get("allreduces", 0.0)}
            route["allreduces"] += seconds
            self.path = [dict(route) for _ in self.clock]
        self.clock = [t] * len(self.clock)
        self.pos = [a + 1 for a in self.pos]

    def finish(self) -> Any:
        if self.path is not None:
            last = max(range(len(self.clock)), key=lambda r: self.clock[r])
            return self.clock[last], self.path[last]
        return max(self.clock)


def predict(
    num_steps: int,
    ranks: int,
    forward: MGRITOptions,
    backward: MGRITOptions,
    costs: Costs,
    data_parallel: int = 1,
    microbatches: int = 1,
    serial_seconds: Optional[float] = None,
) -> Prediction:
    """Predicted seconds per batch on `ranks` layer-parallel ranks (x `data_parallel` groups,
    each with 1 / data_parallel of the batch, and a gradient allreduce).

    ``microbatches``: MGRIT in that many microbatches (Note [parts] in cbridge/src/cycle.c);
    then ``costs`` are those of a step, a VJP and a message at the microbatch's size (a step's
    cost is not linear in its batch on a CPU: measure it there), and ``serial_seconds`` is plain
    PyTorch's time for the whole batch (default: the microbatches one after another)."""
    check_int("data_parallel", data_parallel)
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a Costs, got {type(costs).__name__}")
    share = 1.0 / data_parallel  # a layer's cost scales with the batch it sees
    msg = costs.latency + share * costs.message_bytes / costs.bandwidth
    fwd_traces = schedule(num_steps, ranks, forward, microbatches=microbatches)
    bwd_traces = schedule(num_steps, ranks, backward, adjoint=True, microbatches=microbatches)
    over = costs.overhead_seconds
    tf = simulate(
        fwd_traces,
        share * costs.step_seconds + over,
        share * costs.step_seconds + over,
        msg,
        costs.latency,
        costs.level_scale,
        costs.message_scale,
    )
    tb = simulate(
        bwd_traces,
        share * costs.vjp_seconds + over,
        share * costs.vjp_param() + over,
        msg,
        costs.latency,
        costs.level_scale,
        costs.message_scale,
    )
    total = tf + tb + costs.batch_seconds
    if data_parallel > 1:  # ring allreduce of the gradients of one rank's layers
        per_rank_bytes = costs.param_bytes / ranks
        total += (
            2
            * (data_parallel - 1)
            * (costs.latency + per_rank_bytes / data_parallel / costs.bandwidth)
        )
    if serial_seconds is None:
        serial_seconds = microbatches * num_steps * (costs.step_seconds + costs.vjp_param())
    counts = [sum(c.values()) for c in step_counts(fwd_traces)]
    return Prediction(ranks, data_parallel, total, serial_seconds, tf, tb, counts)


# Note [pipeline model]: a pipeline over the ranks in M microbatches (layerbraid's exact path with
# microbatches=M, torch.distributed.pipelining's GPipe and 1F1B) is simulated action by action:
# rank r runs its actions in its schedule's order, the forward of microbatch m after rank r - 1's
# (plus a message), its backward after rank r + 1's backward of m (plus a message) and its own
# forward of m.  A rank's forward of a microbatch costs its owned steps times a step's seconds,
# its backward its owned steps times a VJP with parameter gradients, both at the microbatch's
# size (a step's cost is not linear in its batch on a CPU: measure it there).  Schedule "exact"
# is layerbraid's exact path: GPipe's order, and past the first rank the first VJPs of each
# backward split as zero-bubble schedules split them (Note [deferred W] in _engine/pipeline.py):
# the input's gradient (a VJP without parameter gradients) first, sent at once, and the
# parameters' (the difference) deferred, run while the rank waits for the next microbatch's
# gradient and at the end; how many are split is the simulation's fastest count (Note [split
# count] in _engine/pipeline_model.py).  The close layer and the loss are not modelled, nor is
# the contention of ranks that share a node's memory.
PIPELINE_SCHEDULES = pipeline_model.PIPELINE_SCHEDULES


pipeline_orders = pipeline_model.orders


def predict_pipeline(
    num_steps: int,
    ranks: int,
    microbatches: int,
    costs: Costs,
    schedule: str = "exact",
    serial_seconds: Optional[float] = None,
    split_first: Optional[int] = None,
) -> Prediction:
    """Predicted seconds per batch of a pipeline of ``microbatches`` microbatches over ``ranks``
    ranks (Note [pipeline model]), each rank the steps the core's block distribution gives it;
    ``costs`` measured at the microbatch's size.  ``schedule``: "exact" (layerbraid's exact
    path), "gpipe" or "1f1b" (torch.distributed.pipelining's).  ``serial_seconds``: plain
    PyTorch's time for the whole batch (default: the microbatches' steps one after another at
    these costs).  ``split_first``: under "exact", how many leading VJPs of each backward the
    ranks past the first split (default: the fastest count, as the exact path chooses it).  The
    prediction's ``forward_seconds`` is when the last forward ends (under 1F1B, after some
    backwards)."""
    _check(num_steps, ranks)
    check_int("microbatches", microbatches)
    pipeline_orders(ranks, microbatches, schedule)  # a clear error for an unknown schedule
    owned = [sum(c.values()) for c in step_counts(schedule_of_exact(num_steps, ranks))]
    over = costs.overhead_seconds
    part_x, part_w = costs.split()
    stages = pipeline_model.StageCosts(
        forward=[n * (costs.step_seconds + over) for n in owned],
        vjp=[n * (costs.vjp_param() + over) for n in owned],
        split_input=[n * (part_x + over) for n in owned],
        split_weights=[n * part_w for n in owned],
        message=costs.message_seconds(),
    )
    if split_first is None:
        split_first = pipeline_model.best_split_count(stages, microbatches)
    forward, chain = pipeline_model.simulate(stages, microbatches, schedule, split_first)
    if serial_seconds is None:
        serial_seconds = microbatches * num_steps * (costs.step_seconds + costs.vjp_param())
    return Prediction(
        ranks, 1, chain + costs.batch_seconds, serial_seconds, forward, chain - forward, owned
    )


def schedule_of_exact(num_steps: int, ranks: int) -> list[np.ndarray]:
    """The exact solve's schedule (one level): each rank steps the steps it owns."""
    return schedule(num_steps, ranks, MGRITOptions(max_levels=1))


def sweep(
    num_steps: int,
    ranks_list: Sequence[int],
    forward: MGRITOptions,
    backward: MGRITOptions,
    costs: Costs,
    data_parallel: int = 1,
) -> list[Prediction]:
    """predict() for each rank count that has at least one step per rank."""
    return [
        predict(num_steps, p, forward, backward, costs, data_parallel)
        for p in ranks_list
        if p <= num_steps
    ]


def recommend(
    num_steps: int,
    ranks: int,
    costs: Costs,
    *,
    min_fwd_iters: int = 2,
    min_bwd_iters: int = 1,
    levels: Sequence[int] = (2, 3, 4),
    cfactors: Sequence[int] = (2, 4, 8),
) -> tuple[Prediction, MGRITOptions, MGRITOptions]:
    """The fastest predicted settings with at least the given iterations (skip on, F-relaxation
    on the fine level and FCF below, as TorchBraid's examples run).  Accuracy is not modelled:
    check the gradient error of the chosen settings on your network (bench/workers/resnet.py)."""
    best = None
    for lv in levels:
        for cf in cfactors:
            nrelax = tuple([0] + [1] * (lv - 2)) if lv > 2 else 0
            fwd = MGRITOptions(
                max_levels=lv,
                cfactor=cf,
                nrelax=nrelax,
                max_iters=min_fwd_iters,
                skip_first_downcycle=True,
            )
            bwd = replace(fwd, max_iters=min_bwd_iters)
            p = predict(num_steps, ranks, fwd, bwd, costs)
            if best is None or p.seconds < best[0].seconds:
                best = (p, fwd, bwd)
    assert best is not None, "no levels or cfactors to choose from"
    return best


@dataclass
class Setting:
    """One row of :func:`settings_table`: the exact solve's and the fastest multilevel
    settings' predicted speedups on ``ranks`` ranks for ``num_steps`` layers."""

    num_steps: int
    ranks: int
    exact_speedup: float
    levels: int
    cfactor: int
    multilevel_speedup: float

    @property
    def choice(self) -> str:
        """The faster of the two, as the guide's table says it."""
        if self.exact_speedup >= self.multilevel_speedup:
            return "1 level (exact)"
        return f"{self.levels} levels, cfactor {self.cfactor}"


def settings_table(
    depths: Sequence[int],
    ranks_list: Sequence[int],
    costs: Costs,
    *,
    min_fwd_iters: int = 2,
    min_bwd_iters: int = 1,
) -> list[Setting]:
    """For each depth and rank count (at least one layer per rank, two ranks or more): the
    predicted speedup of the exact solve (one level: the steps run one rank after another)
    and of the fastest multilevel settings at the given iterations (:func:`recommend`).
    Accuracy is not modelled: multilevel settings at few iterations give inexact gradients,
    which an audit measures (``layerbraid.accuracy.audit_gradients``)."""
    one = MGRITOptions(max_levels=1)
    rows = []
    for n in depths:
        for p in ranks_list:
            if p < 2 or p > n:
                continue
            exact = predict(n, p, one, one, costs)
            best, fwd, _ = recommend(
                n, p, costs, min_fwd_iters=min_fwd_iters, min_bwd_iters=min_bwd_iters
            )
            cf = fwd.cfactor if isinstance(fwd.cfactor, int) else fwd.cfactor[0]
            rows.append(Setting(n, p, exact.speedup, fwd.max_levels, cf, best.speedup))
    return rows


def measure_step(
    layer: Any, x: Any, repeats: int = 20, dt: float = 0.1
) -> tuple[float, float, float]:
    """(step_seconds, vjp_seconds, vjp_param_seconds) of ``x + dt * layer(x)`` on this machine,
    medians of `repeats` runs."""
    import torch

    from ._engine.step_rule import combine

    fwd, vjp, vjp_p = [], [], []
    params = [p for p in layer.parameters() if p.requires_grad]
    for _ in range(repeats + 1):
        xx = x.detach().clone().requires_grad_(True)
        t0 = time.perf_counter()
        y = combine(xx, dt, layer(xx))
        t1 = time.perf_counter()
        torch.autograd.grad(y, xx, torch.ones_like(y), retain_graph=True)
        t2 = time.perf_counter()
        torch.autograd.grad(y, [xx] + params, torch.ones_like(y))
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        vjp.append(t2 - t1)
        vjp_p.append(t3 - t2)
    med = lambda v: float(np.median(v[1:]))  # noqa: E731
    return med(fwd), med(vjp), med(vjp_p)


def wait_cpu_seconds() -> float:
    """The CPU seconds this process has spent waiting for other ranks since it started: in
    the transports' polled waits and in the MGRIT core's, beyond each wait's first tests.  A
    rank's CPU time less this is its work's, which ``Costs.overhead_seconds`` charges per step
    action; the waiting itself is the simulation's, not a cost of every action."""
    from ._comm.waits import wait_cpu_seconds as polled
    from ._engine.schedule import lib

    return polled() + float(lib.mgrit_wait_cpu_seconds())


def measure_split(layer: Any, x: Any, repeats: int = 20, dt: float = 0.1) -> tuple[float, float]:
    """(split_input_seconds, split_weights_seconds) of ``x + dt * layer(x)`` on this machine
    (medians of ``repeats`` runs): the two parts of its VJP as the exact path's microbatched
    backward splits it past the first rank.  Where the VJP is not split (torch lacks the
    helpers, or the layer is a custom autograd Function): the fused VJP and nothing."""
    import torch

    from ._engine.step_rule import combine
    from ._engine.torch_private import split_vjp

    first, second = [], []
    params = [p for p in layer.parameters() if p.requires_grad]
    for _ in range(repeats + 1):
        xx = x.detach().clone().requires_grad_(True)
        y = combine(xx, dt, layer(xx))
        g = torch.ones_like(y)
        t0 = time.perf_counter()
        parts = split_vjp(y, g, xx, params)
        if parts is None:
            torch.autograd.grad(y, [xx] + params, g)
        t1 = time.perf_counter()
        if parts is not None:
            parts[1](False)
        first.append(t1 - t0)
        second.append(time.perf_counter() - t1 if parts is not None else 0.0)
    return float(np.median(first[1:])), float(np.median(second[1:]))


@dataclass
class MicrobatchChoice:
    """What :func:`choose_microbatches` chose: the microbatch count measured fastest (predicted
    fastest where nothing was timed), each candidate's predicted seconds per batch (empty where
    nothing was measured: one layer-parallel rank, or one sample), plain PyTorch's predicted
    time at the same step costs (the steps alone, as the predictions), and the seconds of a
    forward and backward of the whole model that the candidates near the predicted best took
    (medians; empty with ``trials=0``)."""

    microbatches: int
    seconds: dict[int, float]
    serial_seconds: float
    measured: dict[int, float] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: the choice, and each candidate's measured or predicted time."""
        if not self.seconds:
            return "microbatches 1 (nothing to pipeline: one layer-parallel rank, or one sample)"
        if not self.measured:
            rows = ", ".join(
                f"{m}: {1e3 * t:.1f} ms ({self.serial_seconds / t:.2f}x)"
                for m, t in sorted(self.seconds.items())
            )
            return (
                f"microbatches {self.microbatches} (predicted per batch, speedup over plain "
                f"PyTorch's {1e3 * self.serial_seconds:.1f} ms: {rows})"
            )
        timed = ", ".join(f"{m}: {1e3 * t:.1f} ms" for m, t in sorted(self.measured.items()))
        skipped = sorted(set(self.seconds) - set(self.measured))
        best = min(self.seconds.values())
        rest = "; not timed, predicted slower: " + ", ".join(
            f"{m} ({self.seconds[m] / best:.2f}x)" for m in skipped
        )
        return (
            f"microbatches {self.microbatches} (a forward and backward of the model, measured: "
            f"{timed}{rest if skipped else ''})"
        )


def choose_microbatches(
    model: Any,
    x: Any,
    candidates: Sequence[int] = (1, 2, 4, 8),
    *,
    latency: float = 50e-6,
    bandwidth: float = 1e9,
    repeats: int = 10,
    trials: int = 5,
    near: float = 1.25,
) -> MicrobatchChoice:
    """The microbatch count (``model.microbatches``) that runs ``model`` fastest on batches
    like ``x``.  Collective over the model's layer group: every rank returns the same choice.

    First the planner ranks the candidates: the first rank measures one step
    ``x + dt * layer(x)`` and its VJPs (:func:`measure_step`) of its first step layer, on its
    input state (the open layer's output for ``x``), at each candidate's microbatch size (a
    step's cost is not linear in its batch); the other ranks' layers are taken to cost the
    same.  With exact solves each candidate is the microbatched exact path
    (:func:`predict_pipeline`, schedule "exact"); with MGRIT, the model's solves in that many
    microbatches (:func:`predict`).  ``latency`` and ``bandwidth``: the messages' (the defaults
    are this machine's processes on one node, roughly).

    The planner models the chain alone: not the layers around it, nor what a forward and a
    backward cost besides their steps and messages (the input's handshake, the checks, the
    VJPs' bookkeeping), which on a small network decide between the best candidates.  So the
    candidates it predicts within ``near`` times its best are then timed as they run:
    forwards and backwards of the whole model on ``x``, the candidates in turn, two rounds to
    warm up and ``trials`` timed (the sum of the output as the loss, its gradients taken with
    ``torch.autograd.grad``: no ``.grad`` changes, no gradient hook fires, and torch's random
    number generators are restored), and the fastest median wins; a batch's time is its
    slowest rank's.
    ``trials=0`` takes the planner's choice untimed.  One layer-parallel rank, or a batch of
    one sample, needs no measurement: 1."""
    import torch

    comm = model.comm
    batch = int(x.shape[0]) if getattr(x, "dim", lambda: 0)() > 0 else 1
    ranks = comm.Get_size()
    pool = sorted({m for m in candidates if 1 <= m <= min(batch, 254)} | {1})
    if ranks == 1 or len(pool) == 1:  # nothing measured: ``seconds`` is empty
        return MicrobatchChoice(1, {}, 0.0)
    choice, error = None, None
    if comm.Get_rank() == 0:
        try:
            choice = _measure_and_choose(model, x, pool, ranks, latency, bandwidth, repeats, torch)
        except Exception as exc:  # raised on every rank below, not waited for
            error = exc
    comm.raise_on_every_rank(error, "the microbatch choice's measurement")
    out = comm.bcast_obj(choice, 0, "the microbatch count the first rank chose")
    assert isinstance(out, MicrobatchChoice)
    if trials < 1:
        return out
    best = min(out.seconds.values())
    timed = _time_passes(model, x, [m for m in pool if out.seconds[m] <= near * best], trials)
    return replace(out, microbatches=min(timed, key=lambda m: timed[m]), measured=timed)


def _time_passes(
    model: Any, x: Any, counts: Sequence[int], trials: int, warmups: int = 2
) -> dict[int, float]:
    """{count: the median seconds of a forward and backward of ``model`` on ``x`` in that many
    microbatches}: ``warmups`` rounds, then ``trials`` timed, each round one pass per count in
    turn (so that a machine whose speed drifts, or warms up, slows every count alike); a pass's
    time is its slowest rank's (collective; the same on every rank).  Leaves the model's
    microbatch count, every ``.grad`` and torch's random number generators as they were."""
    import torch

    comm, kept = model.comm, model.microbatches
    # the anchor too: every rank must run its part of the backward (the others wait for its
    # messages), a rank whose parameters are all frozen as well
    inputs = [p for p in model.parameters() if p.requires_grad] + [model._anchor]
    devices = [x.device] if getattr(x, "is_cuda", False) else []
    seconds: dict[int, list[float]] = {m: [] for m in counts}
    try:
        with torch.random.fork_rng(devices=devices):
            for k in range(warmups + trials):
                for m in counts:
                    model.microbatches = m
                    t0 = time.perf_counter()
                    out = model(x)
                    if out.requires_grad:
                        torch.autograd.grad(out.sum(), inputs, allow_unused=True)
                    if out.is_cuda:
                        torch.cuda.synchronize(out.device)
                    took = time.perf_counter() - t0
                    slowest = comm.allreduce_floats([took], "max", "the microbatch choice's timing")
                    if k >= warmups:
                        seconds[m].append(slowest[0])
    finally:
        model.microbatches = kept
    return {m: float(np.median(v)) for m, v in seconds.items()}


def _measure_and_choose(
    model: Any,
    x: Any,
    pool: Sequence[int],
    ranks: int,
    latency: float,
    bandwidth: float,
    repeats: int,
    torch: Any,
) -> MicrobatchChoice:
    """choose_microbatches on the first rank: its measurements and the predictions."""
    with torch.no_grad():
        h = model.open(x) if model.open is not None else x
    layer = model.owned_steps()[0][1]
    n = model.num_steps
    exact = model.forward_options.max_levels == 1 and model.backward_options.max_levels == 1
    dt = float(model.t_final) / n
    seconds: dict[int, float] = {}
    serial = None
    for m in pool:
        rows = -(-int(h.shape[0]) // m)  # the largest microbatch
        xm = h[:rows].detach()
        step, vjp, vjp_p = measure_step(layer, xm, repeats, dt)
        part_x, part_w = measure_split(layer, xm, repeats, dt) if exact and m > 1 else (None, None)
        costs = Costs(
            step,
            vjp,
            vjp_p,
            message_bytes=xm.numel() * xm.element_size(),
            latency=latency,
            bandwidth=bandwidth,
            split_input_seconds=part_x,
            split_weights_seconds=part_w,
        )
        if m == 1:
            serial = n * (step + vjp_p)
        assert serial is not None  # pool starts at 1
        if exact:
            seconds[m] = predict_pipeline(n, ranks, m, costs, "exact", serial).seconds
        else:
            seconds[m] = predict(
                n,
                ranks,
                model.forward_options,
                model.backward_options,
                costs,
                microbatches=m,
                serial_seconds=serial,
            ).seconds
    assert serial is not None
    best = min(seconds, key=lambda m: seconds[m])
    return MicrobatchChoice(best, seconds, serial)


if __name__ == "__main__":  # the command moved (importing it here would make a circle)
    raise SystemExit("python -m layerbraid.plan is now python -m layerbraid.tools.plan")
