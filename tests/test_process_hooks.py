"""Process-wide state: importing layerbraid changes none; a job of 2 ranks gets exactly the
changes launch.install_process_hooks lists; the opt-out variable removes all of them; calling
abort_on_exception() first still starts the exit notices.  Each case is a job of its own,
judged rank by rank from what each rank wrote."""

import json
import os
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


def test_a_two_rank_job_gets_exactly_the_listed_changes(tmp_path):
    for rank in run_probe(tmp_path, 2):
        assert rank["import"] == []
        assert rank["build"] == ALL and rank["notices"] and rank["atexit_added"] == 1


def test_the_opt_out_variable_removes_every_change(tmp_path):
    for rank in run_probe(tmp_path, 2, env={"LAYERBRAID_ABORT_ON_EXCEPTION": "0"}):
        assert rank["import"] == [] and rank["build"] == [] and not rank["notices"]


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
