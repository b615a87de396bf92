"""The restart drill: does a job that torchrun restarts after a process was killed resume from its
last checkpoint and end with the weights of an uninterrupted run?

    python -m layerbraid.tools.restarts                     # both modes
    python -m layerbraid.tools.restarts --modes elastic

The job trains the drill's small network (4 steps, float64, exact solves) for 9 batches of 8,
checkpointing every 2 batches, and starts with ``layerbraid.checkpoint.resume``, as the guide's
faults page shows.  One process SIGKILLs itself before batch 5 of the first attempt:

- ``fixed``: ``torchrun --nproc-per-node 2 --max-restarts 1``; torchrun starts both processes
  again, and they resume at batch 4 on 2 processes.
- ``elastic``: two torchrun agents of one process each (``--nnodes 1:2``, one hosting the
  rendezvous); the killed process takes its agent with it, as a lost node does, and the agent that
  is left starts its process again in a job of 1, which resumes at batch 4 alone (the steps
  re-split over the ranks that came back: a checkpoint loads on any rank count).

Each mode's final weights are compared with a run of the same job without a kill or launcher (one
process), to round-off.  mpiexec has no restarts: the same job resumes when it is launched again,
on any number of ranks.  The reliability report (docs/reliability.md) runs this drill too.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import layerbraid
from layerbraid.data import LayerParallelLoader
from layerbraid.tools.drill import _Net

TOTAL = 9  # batches: one epoch of 6 and half of the next
KILL_AT = 5  # the batch before which the killed process dies in the first attempt
CHECKPOINT_EVERY = 2
MODES = {
    "fixed": "torchrun --max-restarts 1, 2 processes: one is SIGKILLed, both start again",
    "elastic": "two agents (--nnodes 1:2): one is SIGKILLed with its process, 1 process resumes",
}
# Who dies: "rank1" (the process of rank 1, alone) or "agent" (the processes of the agent this
# variable is set for, with their agent)
KILL_ENV = "LAYERBRAID_DRILL_KILL"


def job(out: str) -> None:
    """The training job (on this process): its final weights go to ``out`` (first rank)."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    comm = layerbraid.launch.world()
    rank = comm.Get_rank()
    torch.manual_seed(0)
    model = _Net(comm, num_steps=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 1, 8, 8, generator=g)
    data = TensorDataset(x, torch.randint(0, 3, (48,), generator=g))
    loader = LayerParallelLoader(data, 8, comm=model, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = out + ".ckpt"
    extra = layerbraid.checkpoint.resume(model, ckpt, opt, loader)
    step = 0 if extra is None else extra["step"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    size = comm.Get_size()
    _say(f"START {time.time():.3f} rank {rank} of {size} attempt {attempt} at batch {step}")
    who = os.environ.get(KILL_ENV) if attempt == 0 else None
    doomed = who == "agent" or (who == "rank1" and rank == 1)
    while step < TOTAL:
        for xb, yb in loader:
            if doomed and step == KILL_AT:
                _die(with_agent=who == "agent")
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            step += 1
            if step % CHECKPOINT_EVERY == 0:
                model.save_checkpoint(ckpt, opt, {"step": step}, loader=loader)
            if step == TOTAL:
                break
    state = model._gather_state()
    if rank == 0:
        torch.save(state, out)
    _say(f"rank {rank} finished {TOTAL} batches")


def _say(line: str) -> None:
    """One write of the line and its newline: the processes share the agent's pipe, and an
    unbuffered print writes the two apart, so two lines could run into one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _die(with_agent: bool) -> None:
    """SIGKILL this process (and first its torchrun agent, where ``with_agent``: a lost node)."""
    _say(f"KILL {time.time():.3f}")
    if with_agent:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    # a fresh job: none of a calling MPI job's or launcher's variables
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "PMI_",
                "PMIX_",
                "OMPI_",
                "HYDRA",
                "_PYTEST_MPI",
                "TORCHELASTIC",
                "MASTER_",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_",
            )
        )
    }
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _agents(mode: str, out: Path) -> list[list[str]]:
    """The command line of each torchrun agent of ``mode``."""
    job_args = ["-m", "layerbraid.tools.restarts", "--job", str(out)]
    run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]
    if mode == "fixed":
        return [[*run, "--standalone", "--nproc-per-node", "2", *job_args]]
    port = _free_port()
    # short rendezvous timeouts: the lost agent's heartbeat is missed after 3 s, and the one
    # left waits 2 s for late joiners before it goes on alone
    conf = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=60"
    common = [
        *run,
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"drill{port}",
    ]
    return [
        [*common, "--rdzv-conf", f"is_host=1,{conf}", *job_args],
        [*common, "--rdzv-conf", f"is_host=0,{conf}", *job_args],
    ]


def _launch(mode: str, out: Path) -> list[subprocess.Popen]:
    procs = []
    for i, cmd in enumerate(_agents(mode, out)):
        # fixed: the process of rank 1 is killed; elastic: the second agent's, with its agent
        kill = {KILL_ENV: "rank1"} if mode == "fixed" else {KILL_ENV: "agent"} if i == 1 else {}
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=_env(**kill),
                start_new_session=True,
            )
        )
        if i == 0 and mode == "elastic":
            time.sleep(1.0)  # the host agent's store first
    return procs


def run(mode: str, limit: float = 180) -> dict[str, Any]:
    """Runs ``mode`` (and the uninterrupted reference) under a wall-time limit: {"rc" (the first
    agent's exit status), "hung", "lines", "kill" (time of the kill), "resumed" (time the first
    process of the second attempt started), "starts" ([(rank, size, attempt, batch)]),
    "finished" (how many ranks said so), "max_diff" (largest difference of a weight from the
    reference's), "seconds" (the whole job)}."""
    with tempfile.TemporaryDirectory(prefix="layerbraid-restart-") as tmp:
        ref, out = Path(tmp) / "reference.pt", Path(tmp) / "killed.pt"
        subprocess.run(
            [sys.executable, "-m", "layerbraid.tools.restarts", "--job", str(ref)],
            check=True,
            env=_env(),
            timeout=limit,
            capture_output=True,
        )
        t0 = time.time()
        procs = _launch(mode, out)
        lines: list[str] = []
        readers = [threading.Thread(target=_read, args=(p, lines), daemon=True) for p in procs]
        for r in readers:
            r.start()
        hung = False
        try:
            rc = procs[0].wait(timeout=limit)
        except subprocess.TimeoutExpired:
            hung, rc = True, None
        for p in procs:  # the killed agent is gone; anything left over is ended
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for r in readers:
            r.join(5)
        seconds = time.time() - t0
        result = _parse(lines)
        result.update(rc=rc, hung=hung, lines=lines, seconds=seconds, max_diff=None)
        if out.exists():
            a, b = torch.load(ref), torch.load(out)
            if a.keys() == b.keys():
                result["max_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
        return result


def _read(proc: subprocess.Popen, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)


def _parse(lines: list[str]) -> dict[str, Any]:
    kill, starts, resumed = None, [], None
    text = "".join(lines)  # a line may still hold two processes' (another's write cut in)
    if (m := re.search(r"KILL (\d+\.\d+)", text)) is not None:
        kill = float(m.group(1))
    for m in re.finditer(
        r"START (\d+\.\d+) rank (\d+) of (\d+) attempt (\d+) at batch (\d+)", text
    ):
        starts.append(tuple(int(g) for g in m.groups()[1:]))
        if int(m.group(4)) > 0 and resumed is None:
            resumed = float(m.group(1))
    finished = text.count(f"finished {TOTAL} batches")
    return {"kill": kill, "resumed": resumed, "starts": starts, "finished": finished}


def problems(mode: str, result: dict[str, Any]) -> list[str]:
    """What went wrong in ``result`` (from :func:`run`), as sentences; empty when the job was
    killed, resumed from the last checkpoint and ended with the reference's weights."""
    out = []
    if result["hung"]:
        out.append("the job was still running at the limit and was killed")
    if result["rc"] != 0:
        out.append(f"the job ended with exit status {result['rc']}")
    if result["kill"] is None:
        out.append("no process was killed")
    size = 2 if mode == "fixed" else 1
    last = KILL_AT - KILL_AT % CHECKPOINT_EVERY
    again = [s for s in result["starts"] if s[2] == 1]
    if sorted(s[0] for s in again) != list(range(size)) or any(
        s[1] != size or s[3] != last for s in again
    ):
        out.append(
            f"the second attempt was not {size} process(es) resuming at batch {last}: {again}"
        )
    if result["finished"] != size:
        out.append(f"{result['finished']} process(es) finished, not {size}")
    if result["max_diff"] is None or result["max_diff"] > 1e-12:
        out.append(f"the weights differ from the uninterrupted run's by {result['max_diff']}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--limit", type=float, default=180, help="seconds before a run is a hang")
    p.add_argument("--job", metavar="OUT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job is not None:
        job(a.job)
        return 0
    failed = 0
    for mode in a.modes:
        result = run(mode, a.limit)
        wrong = problems(mode, result)
        failed += bool(wrong)
        latency = (
            "-"
            if result["kill"] is None or result["resumed"] is None
            else f"{result['resumed'] - result['kill']:.1f} s"
        )
        print(
            f"{'FAILED' if wrong else 'ok':6} {mode}: {MODES[mode]}; resumed {latency} after "
            f"the kill; weights off by {result['max_diff']}",
            flush=True,
        )
        for line in wrong:
            print(f"       {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
