"""What every benchmark script shares: running a worker of bench/workers/ under mpiexec and
reading the JSON lines it prints, and writing a report."""
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "bench" / "workers"


def launch(worker, ranks, *args, timeout=3600, echo=True):
    """Runs bench/workers/<worker>.py on ``ranks`` ranks; returns the JSON objects it printed
    (one per line; other lines are ignored).  Raises with the worker's output on failure."""
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(WORKERS / f"{worker}.py"),
           *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
            if echo:
                print(line, flush=True)
    return rows


def write_report(path, lines):
    path = Path(path)
    path.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def provenance():
    """{"commit", "date", "machine"}: what a report was measured on.  The commit is the
    checked-out one, with "+changes" when the working tree differs from it."""
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", "layerbraid", "cbridge",
           "bench", "tests"):
        commit += "+changes"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{cores} cores, {cpu}"}
