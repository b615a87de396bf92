"""Every report under docs/, the command that regenerates it, the code it measures, and which
reports are older than that code.

    python bench/reports.py              # the table, and the stale reports
    python bench/reports.py --stale      # only the stale list (what the test suite prints)

A report is stale when a commit changed the code it measures after the commit that last wrote
the report (both from git's history; a working tree with uncommitted changes to that code
counts as newer).  The rule: a change to measured code reruns its reports in the same piece of
work.  Without git history (an unpacked wheel, a shallow copy) nothing can be said, and the
check says so.
"""
import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The code every report exercises: the core, and the Python on its path.
_CORE = ["cbridge/src", "cbridge/include", "layerbraid/_bridge.py", "layerbraid/_states.py"]
_ENGINE = _CORE + ["layerbraid/_chain.py", "layerbraid/_comm.py", "layerbraid/_transport.py"]
_RESNET = _ENGINE + ["layerbraid/module.py", "layerbraid/_layer_steps.py",
                     "layerbraid/_ownership.py", "layerbraid/_autograd.py"]

# report -> (the command that regenerates it, the code it measures)
REPORTS = {
    "docs/bench_core.md": ("python bench/bench_core.py", _CORE + ["layerbraid/mgrit.py",
                                                                  "bench/core_bench.c"]),
    "docs/bench_resnet.md": ("python bench/report_resnet.py",
                             _RESNET + ["bench/bench_resnet.py"]),
    "docs/bench_grid.md": ("python bench/bench_grid.py",
                           _RESNET + ["layerbraid/grid.py", "bench/workers/grid.py"]),
    "docs/bench_rnn.md": ("python bench/bench_rnn.py",
                          _ENGINE + ["layerbraid/nn/rnn.py", "layerbraid/nn/_cell_steps.py",
                                     "layerbraid/nn/_cells.py", "bench/workers/rnn.py"]),
    "docs/bench_spatial.md": ("python bench/bench_spatial.py",
                              _RESNET + ["layerbraid/coarsening.py",
                                         "bench/workers/spatial_timing.py"]),
    "docs/performance.md": ("python bench/performance.py",
                            _RESNET + ["layerbraid/grid.py", "layerbraid/plan.py"]),
    "docs/plan_validation.md": ("python bench/validate_plan.py",
                                _RESNET + ["layerbraid/plan.py", "bench/bench_resnet.py"]),
    "docs/scaling.md": ("python bench/scaling_report.py; python bench/scaling_measured.py",
                        ["layerbraid/plan.py", "bench/workers/emulated.py",
                         "bench/shared_cores.py"]),
    "docs/reliability.md": ("python bench/reliability.py",
                            _RESNET + ["layerbraid/launch.py", "layerbraid/checkpoint.py",
                                       "layerbraid/clip.py", "layerbraid/data/loader.py",
                                       "tests/faults.py"]),
    "docs/accuracy.md": ("python bench/accuracy.py",
                         _RESNET + ["layerbraid/audit.py", "layerbraid/stats.py",
                                    "bench/workers/accuracy.py"]),
    "docs/contraction.md": ("python bench/contraction.py",
                            _RESNET + ["layerbraid/coarsening.py",
                                       "bench/workers/contraction.py"]),
}


def _git(*args):
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _last_change(paths):
    """(unix time, commit) of the last commit touching ``paths``; None without history."""
    line = _git("log", "-1", "--format=%ct %h", "--", *paths)
    if not line:
        return None
    t, commit = line.split()
    return int(t), commit


def stale():
    """[(report, report's commit, code's commit, why)] for every stale report, or None when
    git's history is not available."""
    if _git("rev-parse", "--is-inside-work-tree") != "true" or \
            _git("rev-parse", "--is-shallow-repository") == "true":
        return None
    out = []
    for report, (_, code) in REPORTS.items():
        written = _last_change([report])
        changed = _last_change(code)
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *code)
        if written is None:
            out.append((report, "-", changed[1] if changed else "-", "never committed"))
        elif dirty:
            out.append((report, written[1], "working tree", "uncommitted changes to its code"))
        elif changed is not None and changed[0] > written[0]:
            out.append((report, written[1], changed[1], "its code changed after it"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stale", action="store_true", help="print only the stale reports")
    a = p.parse_args(argv)
    if not a.stale:
        print("| report | regenerate with |\n|---|---|")
        for report, (command, _) in REPORTS.items():
            print(f"| {report} | `{command}` |")
        print()
    found = stale()
    if found is None:
        print("no git history here: cannot tell which reports are stale")
        return 0
    if not found:
        print("no stale report: every report is newer than the code it measures")
        return 0
    print(f"{len(found)} stale report(s) (rerun each with its command):")
    for report, theirs, code, why in found:
        print(f"  {report}: written at {theirs}, code at {code} ({why}): "
              f"{REPORTS[report][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
