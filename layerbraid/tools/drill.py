"""A fault drill: does a fault on one rank end every rank of the job, with its cause, within
seconds, on this machine's MPI?

    python -m layerbraid.tools.drill                        # every scenario on 2 ranks
    python -m layerbraid.tools.drill --ranks 3 --scenarios stall-clip exit-end
    python -m layerbraid.tools.drill --launcher torchrun    # torch.distributed (gloo)

Each scenario is a short layer-parallel training job (``mpiexec -l -n RANKS python -m
layerbraid.tools.drill --job SCENARIO``, with LAYERBRAID_TIMEOUT=3) in which one rank raises,
stalls, exits, is killed, or gets Ctrl-C at a chosen point: before a forward, inside the MGRIT core,
before a collective of its own (the clip, the checkpoint, the loader's seed, the grid), or by
never arriving at one.  The faulty rank prints ``FAULT <unix time>`` just before the fault; the
driver reads each rank's output (mpiexec's ``-l`` tags, as MPICH's Hydra launcher writes them),
kills the whole job if it outlives ``--limit`` seconds whether or not it prints, and checks
that it ended nonzero with the cause printed where the scenario says: by the faulty rank for a
fault it raises itself, by a waiting rank where a collective caught it, by the launcher for a
killed process.  The test suite and the reliability report (docs/reliability.md) run these
same scenarios, under both launchers; layerbraid.tools.restarts drills the restarts that follow a
killed process under torchrun.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import layerbraid
from layerbraid.data import LayerParallelLoader
from layerbraid.launch import world
from layerbraid.nn import ConvBlock, LayerParallelGRU


class _Net(layerbraid.LayerParallelModule):
    """open conv -> conv steps -> flatten + linear, on 8x8 single-channel images, 3 classes."""

    def __init__(self, comm: Any, num_steps: int = 4, channels: int = 4) -> None:
        super().__init__(num_steps=num_steps, t_final=1.0, comm=comm)
        self.channels = channels
        self.open = nn.Conv2d(1, channels, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(channels * 64, 3))

    def step_layer(self, index: int) -> nn.Module:
        return ConvBlock(self.channels)


def _batch(n: int) -> Any:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (n,), generator=g),
    )


class InjectedFault(RuntimeError):
    pass


def fault_here() -> None:
    # one write with its newline: two faulty ranks' lines must not run into each other
    sys.stdout.write(f"FAULT {time.time():.3f}\n")
    sys.stdout.flush()


def fail_on(rank: int, where: str) -> None:
    if world().Get_rank() == rank:
        fault_here()
        raise InjectedFault(f"injected fault on rank {rank} before {where}")


class FailingClose(nn.Module):
    def forward(self, x: Any) -> Any:
        fault_here()
        raise InjectedFault("injected fault in the close layer on the last rank")


class BadStep(_Net):
    def step_layer(self, index: int) -> nn.Module:
        if index == self.num_steps - 1:
            fault_here()
            raise InjectedFault("injected fault in step_layer on the last rank")
        return super().step_layer(index)


# scenario: (what happens, the text of the cause, which rank must print it: "faulty" (the rank
# that printed FAULT), "waiting" (another rank, which caught the fault in a collective), "any"
# (some rank: the fault reached them all) or "job" (the launcher's output))
SCENARIOS = {
    "loader": (
        "rank 1 raises before the loader's seed agreement",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "forward": (
        "rank 1 raises before a forward",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "backward": (
        "rank 1 raises between forward and backward",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "clip": (
        "rank 1 raises before clip_grad_norm_",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "checkpoint": (
        "rank 1 raises before save_checkpoint",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "close-layer": (
        "the close layer raises on the last rank",
        "InjectedFault: injected fault in the close layer",
        "faulty",
    ),
    "step-layer": (
        "step_layer raises on the last rank while the model is built",
        "InjectedFault: injected fault in step_layer",
        "faulty",
    ),
    "from-serial": (
        "rank 1 passes from_serial an empty list of blocks while rank 0 builds the model",
        "ValueError: steps is empty",
        "faulty",
    ),
    "chain": (
        "from_serial's last block does not chain (8 features for a state of 4) on rank 1",
        "(in step layer 3, a Linear, on a state of shape (16, 4)",
        "waiting",
    ),
    "nan": (
        "the input holds Inf: named as bad input on every rank, before any step",
        "the input holds 256 NaN or Inf value(s)",
        "faulty",
    ),
    "skip-forward": (
        "rank 1 skips the last forward: a stall in the forward's barrier",
        "for rank 1 to reach the forward of model(x); it never did",
        "waiting",
    ),
    "skip-backward": (
        "rank 1 skips the last backward: a stall in the MGRIT core",
        "from rank 1 (level",
        "waiting",
    ),
    # mpiexec forwards Ctrl-C to every rank: whichever rank handles it first prints the cause
    # and aborts the job, possibly before another rank (inside the core) has printed its own
    "sigint": ("Ctrl-C: SIGINT to mpiexec while training", "KeyboardInterrupt", "any"),
    "kill": ("rank 1 is killed (SIGKILL) while training", "signal 9", "job"),
    "rnn": (
        "rank 1 raises before a layer-parallel GRU forward",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "grid": (
        "rank 1 raises before a data-parallel model broadcasts its weights",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    # the named collective itself sees the fault: rank 1 never arrives, or exits
    "stall-start": (
        "rank 1 never builds anything of layerbraid's",
        "every rank to build its first layer-parallel model",
        "waiting",
    ),
    "stall-construction": (
        "rank 1 never builds a second model",
        "the construction of an MGRIT solver",
        "waiting",
    ),
    "stall-grid": (
        "rank 1 never builds the ProcessGrid",
        "the construction of a ProcessGrid",
        "waiting",
    ),
    "stall-loader": ("rank 1 never builds the loader", "the loader's seed", "waiting"),
    "stall-close": (
        "the close layer never returns on the last rank",
        "close layer's status at the end of model(x)",
        "waiting",
    ),
    "stall-clip": (
        "rank 1 never calls clip_grad_norm_",
        "the gradient norm of clip_grad_norm_",
        "waiting",
    ),
    "stall-checkpoint": (
        "rank 1 never calls save_checkpoint",
        "every rank's part of the state to save in",
        "waiting",
    ),
    "resume": (
        "rank 1 raises before checkpoint.resume",
        "InjectedFault: injected fault on rank 1",
        "faulty",
    ),
    "stall-resume": (
        "rank 1 never calls checkpoint.resume",
        "the loader's seed",
        "waiting",
    ),
    "stall-to-serial": (
        "to_serial() called on rank 0 only",
        "every rank's part of the weights of every step layer",
        "waiting",
    ),
    "exit-forward": (
        "rank 1 calls sys.exit(3) before a forward",
        "rank 1 exited (SystemExit 3) while rank 0 waited for its neighbours to "
        "reach the forward of model(x)",
        "waiting",
    ),
    "exit-backward": (
        "rank 1 calls sys.exit(0) between forward and backward",
        "rank 1 exited (SystemExit 0) while rank 0 waited for a message of an MGRIT solve",
        "waiting",
    ),
    "exit-end": (
        "rank 1's script ends before the checkpoint",
        "rank 1 exited (the end of its script) while rank 0 waited",
        "waiting",
    ),
}
# Where torchrun's job prints another text for the same cause: it says "Signal 9 (SIGKILL)"; its
# process group is made before any of layerbraid's, so the first collective a rank that never
# starts can leave waiting is a solver's construction (MPI's first is the notice communicator);
# gloo's broadcast waits at the root too, so resume's own broadcast catches a rank that never
# calls it (MPI's root sends and goes on: the next collective, the loader's seed, catches it).
TORCHRUN_CAUSES = {
    "kill": "Signal 9 (SIGKILL)",
    "stall-start": "the construction of an MGRIT solver",
    "stall-resume": "rank 0's whether",
}
TIMEOUT = 3  # LAYERBRAID_TIMEOUT (seconds) for every scenario
LAUNCHERS = ("mpiexec", "torchrun")


def cause_of(scenario: str, launcher: str = "mpiexec") -> str:
    """The text of ``scenario``'s cause as a job under ``launcher`` prints it."""
    if launcher == "torchrun" and scenario in TORCHRUN_CAUSES:
        return TORCHRUN_CAUSES[scenario]
    return SCENARIOS[scenario][1]


def run(
    scenario, ranks: int = 2, limit: int = 60, mpiexec: str = "mpiexec", launcher: str = "mpiexec"
):
    """Runs the job under a wall-time limit (enforced whether or not output arrives: the whole
    job is killed at ``limit`` s).  Returns {"rc", "hung", "seconds" (fault to the end of the
    job), "faulty" (the rank that printed FAULT), "outputs" ({rank: its lines}), "job" (lines
    no rank printed), "cause_on" (the ranks that printed the cause), "cause" (the cause
    printed where the scenario says), "output" (everything)}."""
    proc = _launch(scenario, ranks, mpiexec, launcher)
    rc, hung, lines, fault, faulty, end = _watch(proc, scenario, limit)
    outputs, job = _by_rank(lines, ranks)
    cause, where = cause_of(scenario, launcher), SCENARIOS[scenario][2]
    cause_on = [r for r, text in outputs.items() if cause in text]
    if where == "faulty":
        shown = faulty in cause_on
    elif where == "waiting":
        shown = any(r != faulty for r in cause_on)
    elif where == "any":
        shown = bool(cause_on)
    else:
        shown = cause in job or bool(cause_on)
    return {
        "rc": rc,
        "hung": hung,
        "faulty": faulty,
        "outputs": outputs,
        "job": job,
        "seconds": None if fault is None else end - fault,
        "cause_on": cause_on,
        "cause": shown,
        "launcher": launcher,
        "output": "".join(lines),
    }


def _launch(scenario: str, ranks: int, mpiexec: str, launcher: str = "mpiexec") -> Any:
    """The scenario's job, each line of output tagged with its rank (``mpiexec -l``, or
    torchrun's ``--tee 3``, whose tags _watch rewrites as mpiexec's)."""
    # Not the calling process's MPI job: a fresh one (no PMI variables of a singleton).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI"))
    }
    env.update(PYTHONUNBUFFERED="1", LAYERBRAID_TIMEOUT=str(TIMEOUT))
    cmd = [mpiexec, "-l", "-n", str(ranks), sys.executable, "-m", "layerbraid.tools.drill"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3"]
        cmd += ["--nproc-per-node", str(ranks), "-m", "layerbraid.tools.drill"]
    return subprocess.Popen(
        [*cmd, "--job", scenario],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _watch(proc: Any, scenario: str, limit: float) -> tuple[Any, ...]:
    """Reads the job's output as it comes until it ends or ``limit`` s pass (then it is
    killed): (rc, hung, lines, time of the fault, faulty rank, time of the end)."""
    lines: list[str] = []
    state: dict[str, Any] = {"fault": None, "faulty": None}

    def read() -> None:
        for line in proc.stdout:  # the job's output, as it comes; each line tagged "[rank] "
            line = re.sub(r"\[default(\d+)\]:", r"[\1] ", line)  # torchrun's tags
            lines.append(line)
            found = re.match(r"\[(\d+)\] FAULT (\d+\.\d+)", line)
            if found and state["fault"] is None:
                state["faulty"], state["fault"] = int(found.group(1)), float(found.group(2))
                if scenario == "sigint":
                    proc.send_signal(signal.SIGINT)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hung = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    end = time.time()
    reader.join(5)
    return rc, hung, lines, state["fault"], state["faulty"], end


def _by_rank(lines: list[str], ranks: int) -> tuple[dict[int, str], str]:
    """({rank: its text}, the launcher's own text) from ``mpiexec -l`` output."""
    # mpiexec -l tags each piece of a rank's output it forwards, and a piece can end mid-line:
    # "[1] InjectedFa" "[1] ult ..." arrive as "[1] InjectedFa[1] ult ...".  Each tag starts a
    # piece of its rank's stream; text before any tag on a line is the launcher's own.
    outputs, job = {r: "" for r in range(ranks)}, ""
    for line in lines:
        pieces = re.split(r"\[(\d+)\] ", line)
        job += pieces[0] if not pieces[0].isspace() else ""
        for r, text in zip(pieces[1::2], pieces[2::2]):
            if int(r) in outputs:
                outputs[int(r)] += text
            else:
                job += text
    return outputs, job


def sleep_forever() -> None:
    fault_here()
    time.sleep(3600)


def skip_ahead() -> None:
    """The fault of the skip scenarios: this rank skips a collective and goes on to the next,
    where it stalls too.  It pauses one stall timeout first, so that the waiting rank's deadline
    (which names the skipped collective) always fires before this rank's own."""
    fault_here()
    time.sleep(float(os.environ.get("LAYERBRAID_TIMEOUT", TIMEOUT)))


def exit_now(status: int) -> None:
    fault_here()
    sys.exit(status)


class StallingClose(nn.Module):
    def forward(self, x: Any) -> None:
        sleep_forever()


def job(scenario: str) -> None:
    """The training job of ``scenario``, on this rank (run under mpiexec)."""
    WORLD = world()
    torch.set_default_dtype(torch.float64)
    x, y = _batch(16)
    one = WORLD.rank == 1
    if scenario == "rnn":
        gru = LayerParallelGRU(3, 4, comm=WORLD)
        gru(torch.ones(2, 6, 3))[0].sum().backward()
        fail_on(1, "a GRU forward")
        gru(torch.ones(2, 6, 3))
    if scenario == "grid":
        grid = layerbraid.ProcessGrid(WORLD, data_parallel=WORLD.size)
        fail_on(1, "a data-parallel model's weight broadcast")
        _Net(grid, num_steps=4)
    if scenario == "step-layer":
        BadStep(WORLD, num_steps=4)
    if scenario == "stall-start" and one:
        sleep_forever()
    model = _Net(WORLD, num_steps=4)
    if scenario == "from-serial":  # bad input on one rank, before the construction's collectives
        blocks = [nn.Linear(4, 4) for _ in range(4)]
        if one:
            fault_here()
            blocks = []
        layerbraid.from_serial(steps=blocks, dt=0.25, comm=WORLD)
    if scenario == "chain":  # the blocks build; the last one fails in the first forward
        blocks = [nn.Linear(4, 4) for _ in range(3)] + [nn.Linear(8, 8)]
        chain = layerbraid.from_serial(steps=blocks, dt=0.25, comm=WORLD)
        if WORLD.rank == WORLD.size - 1:
            fault_here()
        chain(torch.zeros(16, 4))
    if scenario == "stall-construction":
        if one:
            sleep_forever()
        _Net(WORLD, num_steps=4)
    if scenario == "stall-grid":
        if one:
            sleep_forever()
        layerbraid.ProcessGrid(WORLD, data_parallel=WORLD.size)
    if scenario == "resume":
        fail_on(1, "checkpoint.resume")
    if scenario == "stall-resume" and one:
        sleep_forever()
    if scenario in ("resume", "stall-resume"):  # no checkpoint yet: every rank learns it from 0
        layerbraid.checkpoint.resume(model, os.path.join(tempfile.gettempdir(), "no-such.ckpt"))
    if scenario == "close-layer" and WORLD.rank == WORLD.size - 1:
        model.close = FailingClose()  # type: ignore[assignment]
    if scenario == "loader":
        fail_on(1, "the loader's seed agreement")
    if scenario == "stall-loader" and one:
        sleep_forever()
    loader = LayerParallelLoader(TensorDataset(x, y), 4, comm=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(scenario, WORLD, model, loader, opt)
    _finish(scenario, WORLD, model, opt)


def _train(scenario: str, WORLD: Any, model: Any, loader: Any, opt: Any) -> None:
    """The drill's training loop, with the scenario's fault injected where it says."""
    one = WORLD.rank == 1
    steps = 100000 if scenario in ("sigint", "kill") else 6
    batches = iter(loader)
    for step in range(steps):
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        last = step == steps - 1
        if scenario == "forward" and step == 2:
            fail_on(1, "a forward")
        if scenario == "exit-forward" and step == 2 and one:
            exit_now(3)
        if scenario == "nan" and step == 2:
            fault_here()
            xb = xb * float("inf")
        if scenario == "skip-forward" and last and one:
            skip_ahead()
            continue
        if scenario == "kill" and step == 3 and one:
            fault_here()
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "sigint" and step == 3 and WORLD.rank == 0:
            fault_here()  # the driver sends SIGINT to mpiexec when it reads this
        if scenario == "stall-close" and step == 2 and WORLD.rank == WORLD.size - 1:
            model.close = StallingClose()
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        if scenario == "backward" and step == 2:
            fail_on(1, "the backward")
        if scenario == "exit-backward" and step == 2 and one:
            exit_now(0)
        if scenario == "skip-backward" and last and one:
            skip_ahead()
            continue
        loss.backward()
        if scenario == "clip" and step == 2:
            fail_on(1, "clip_grad_norm_")
        if scenario == "stall-clip" and step == 2 and one:
            sleep_forever()
        layerbraid.clip_grad_norm_(model, 1.0)
        opt.step()


def _finish(scenario: str, WORLD: Any, model: Any, opt: Any) -> None:
    """After training: the serial copy, the checkpoint and the final barrier."""
    one = WORLD.rank == 1
    path = WORLD.bcast(
        os.path.join(tempfile.gettempdir(), f"layerbraid-drill-{os.getpid()}.ckpt"), root=0
    )
    if scenario == "stall-to-serial":
        if WORLD.rank == 0:
            model.to_serial()  # the "on rank 0 only" habit
        else:
            sleep_forever()
    if scenario == "exit-end" and one:
        fault_here()
        return
    if scenario == "checkpoint":
        fail_on(1, "save_checkpoint")
    if scenario == "stall-checkpoint" and one:
        sleep_forever()
    layerbraid.save_checkpoint(model, path, opt)
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.unlink(path)
    print(f"rank {WORLD.rank}: no fault happened", flush=True)


def problems(scenario: str, result: dict[str, Any], limit: float) -> list[str]:
    """What went wrong in ``result`` (from :func:`run`), as sentences; empty when the job ended
    as the scenario says it must."""
    out = []
    if result["hung"]:
        out.append(f"the job was still running after {limit} s and was killed")
    if result["seconds"] is None:
        out.append("no rank printed FAULT: the fault was never injected")
    if result["rc"] == 0:
        out.append("the job ended with exit status 0")
    if not result["cause"]:
        by = {
            "faulty": "the faulty rank",
            "waiting": "a waiting rank",
            "any": "any rank",
            "job": "the launcher",
        }
        out.append(f"the cause was not printed by {by[SCENARIOS[scenario][2]]}")
    if any("no fault happened" in text for text in result["outputs"].values()):
        out.append("a rank finished as if nothing happened")
    return out


def main(argv: Optional[Sequence[str]] = None) -> Optional[int]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="ranks per job (at least 2)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        choices=sorted(SCENARIOS),
        metavar="SCENARIO",
        default=list(SCENARIOS),
        help="default: all of " + ", ".join(SCENARIOS),
    )
    p.add_argument("--limit", type=float, default=60, help="seconds before a job is a hang")
    p.add_argument("--mpiexec", default="mpiexec", help="an MPICH (Hydra) mpiexec")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="mpiexec",
        help="start each job with mpiexec (MPI) or torchrun (torch.distributed, gloo)",
    )
    p.add_argument("--job", metavar="SCENARIO", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job is not None:
        job(a.job)  # the job's end is the script's end (exit-end expects just that)
        return 0
    if a.ranks < 2:
        p.error(f"--ranks must be at least 2, got {a.ranks}")
    failed = 0
    for scenario in a.scenarios:
        result = run(scenario, a.ranks, a.limit, a.mpiexec, a.launcher)
        wrong = problems(scenario, result, a.limit)
        failed += bool(wrong)
        took = "-" if result["seconds"] is None else f"{result['seconds']:.1f} s after the fault"
        print(
            f"{'FAILED' if wrong else 'ok':6} {scenario}: {SCENARIOS[scenario][0]}; ended "
            f"{took}; cause printed by rank(s) {result['cause_on'] or '-'}",
            flush=True,
        )
        for line in wrong:
            print(f"       {line}", flush=True)
    print(
        f"{len(a.scenarios) - failed} of {len(a.scenarios)} scenarios ended every rank with "
        "their cause"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if main():
        sys.exit(1)
