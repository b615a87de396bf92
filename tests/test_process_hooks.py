"""Process-wide state: importing layerbraid changes none; a job of 2 ranks gets exactly the
changes launch.install_process_hooks lists, malloc's settings among them; the opt-out variable
removes all of them, the allocator's own variable (or the user's malloc settings) that one alone;
calling abort_on_exception() first still starts the exit notices.  Each case is a job of its own,
judged rank by rank from what each rank wrote."""

import ast
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("hooks_probe.py")
ALL = ["atexit", "excepthook", "exit", "threading"]


def run_probe(tmp_path, ranks, *flags, env=None):
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(PROBE), str(tmp_path), *flags]
    done = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]


GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_a_two_rank_job_gets_exactly_the_listed_changes(tmp_path):
    for rank in run_probe(tmp_path, 2):
        assert rank["import"] == []
        assert rank["build"] == ALL and rank["notices"] and rank["atexit_added"] == 1
        assert rank["allocator"] == [False, GLIBC]  # malloc's settings: with the build


def test_the_opt_out_variable_removes_every_change(tmp_path):
    for rank in run_probe(tmp_path, 2, env={"LAYERBRAID_ABORT_ON_EXCEPTION": "0"}):
        assert rank["import"] == [] and rank["build"] == [] and not rank["notices"]
        assert rank["allocator"] == [False, False]


def test_the_allocator_has_an_opt_out_of_its_own_and_yields_to_the_users_malloc(tmp_path):
    for env in [{"LAYERBRAID_STEADY_ALLOCATOR": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1048576"},
                {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}]:
        for rank in run_probe(tmp_path, 2, env=env):
            assert rank["build"] == ALL and rank["notices"], env  # the other changes stay
            assert rank["allocator"] == [False, False], env


_FAULTS = """
import resource, sys
import numpy as np
if sys.argv[1] == "steady":
    from layerbraid.launch import steady_allocator
    assert steady_allocator()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(131072) for _ in range(64)]  # 64 blocks of 1 MiB, written, then freed
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[1:])
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_the_steady_allocator_keeps_what_a_run_freed(tmp_path):
    """layerbraid.launch.steady_allocator(): a process that frees 64 MiB of 1 MiB blocks and
    allocates them again must not page-fault them in again (glibc's defaults do, on every
    round: the faults that cost the layer-parallel paths, which free more between their
    allocations, more than plain PyTorch)."""
    import resource

    def rounds(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], cwd=tmp_path, check=True,
                             capture_output=True, text=True, timeout=120).stdout
        return ast.literal_eval(out)

    default, steady = rounds("default"), rounds("steady")
    pages = 64 * 2**20 // resource.getpagesize()
    # the mechanism is there to remove: every round faults its blocks in again
    assert min(default) > pages // 2, default
    # and it is gone: at most a few pages per round (the interpreter's own)
    assert max(steady) < pages // 100, steady


def test_abort_on_exception_called_first_still_starts_the_exit_notices(tmp_path):
    for rank in run_probe(tmp_path, 2, "--early-abort-hook"):
        assert rank["build"] == ALL and rank["notices"] and rank["atexit_added"] == 1


def test_one_rank_changes_nothing(tmp_path):
    rank, = run_probe(tmp_path, 1)
    assert rank["import"] == [] and rank["build"] == [] and not rank["notices"]


@pytest.mark.parametrize("module", ["layerbraid", "layerbraid.nn", "layerbraid.data",
                                    "layerbraid.cli", "layerbraid.plan", "layerbraid.accuracy",
                                    "layerbraid.checkpoint", "layerbraid.module"])
def test_importing_changes_no_process_state(module):
    # torch and MPI register exit handlers of their own: imported first, they are not counted
    code = ("import atexit, sys, threading, numpy, torch, mpi4py.MPI\n"
            "b = (sys.excepthook, threading.excepthook, sys.exit, atexit._ncallbacks())\n"
            f"import {module}\n"
            "a = (sys.excepthook, threading.excepthook, sys.exit, atexit._ncallbacks())\n"
            "assert a == b, (b, a)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
