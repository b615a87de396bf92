"""Every report under docs/, the command that regenerates it, the code it measures, and which
reports are older than that code.

    python -m bench.reports              # the table, and the stale reports
    python -m bench.reports --stale      # only the stale list (what the test suite prints)

A report is stale when a commit changed the code it measures after the commit that last wrote
the report (both from git's history; a working tree with uncommitted changes to that code
counts as newer).  The rule: a change to measured code reruns its reports in the same piece of
work.  Without git history (an unpacked wheel, a shallow copy) nothing can be said, and the
check says so.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The code every report exercises: the core, and the Python on its path.
_CORE = ["cbridge/src", "cbridge/include", "layerbraid/_engine/bridge.py",
         "layerbraid/_engine/schedule.py", "layerbraid/_engine/states.py", "layerbraid/options.py"]
# Everything the solve engine imports runs in every solve (tests/test_reports.py checks the
# list against _engine/chain.py's imports), but for the exception classes of layerbraid/errors.py.
_ENGINE = _CORE + ["layerbraid/_engine/chain.py", "layerbraid/_engine/steps.py",
                   "layerbraid/_engine/warn.py",
                   "layerbraid/_comm/__init__.py", "layerbraid/_comm/mpi.py",
                   "layerbraid/_comm/base.py", "layerbraid/_comm/dist.py",
                   "layerbraid/_comm/stream.py", "layerbraid/_comm/waits.py",
                   "layerbraid/_comm/wire.py", "layerbraid/_comm/world.py",
                   "layerbraid/_comm/timeouts.py",
                   "layerbraid/stats.py"]
# The ResNet path, and ConvBlock (layerbraid/nn/__init__.py): the layer the ResNet benchmarks
# and the examples step.
_RESNET = _ENGINE + ["layerbraid/module.py", "layerbraid/_engine/handshake.py",
                     "layerbraid/_engine/layer_steps.py", "layerbraid/_engine/torch_private.py",
                     "layerbraid/_engine/step_rule.py",
                     "layerbraid/_engine/ownership.py", "layerbraid/_engine/autograd.py",
                     "layerbraid/_engine/pipeline.py", "layerbraid/nn/__init__.py"]
# The examples' networks that reports train or time.  bench.harness.example loads
# examples/training_loop.py too, because the scripts import it, but no report runs any of it:
# the workers have loops of their own (tests/test_reports.py checks that the examples use
# what they import from it in main() alone, and that bench/ calls none of it).
_MNIST = ["examples/mnist.py"]
_VOLUMES = ["examples/volumes3d.py", "layerbraid/coarsening.py"]

# How jobs start (bench/harness.py): named by the reports whose jobs bind each rank to cores of
# its own (harness.binding), since how the ranks sit on the cores changes what they time.
_HARNESS = ["bench/harness.py"]

# report -> (the module that regenerates it, the code it measures)
REPORTS = {
    "docs/bench_core.md": (["bench.core"],
                           _RESNET + _HARNESS + ["layerbraid/mgrit.py", "bench/core.py",
                                                 "bench/workers/core_bench.c",
                                                 "bench/workers/core_python.py",
                                                 "bench/workers/tax.py",
                                                 "bench/workers/resnet.py"]),
    "docs/bench_resnet.md": (["bench.resnet"],
                             _RESNET + _HARNESS + ["bench/resnet.py",
                                                   "bench/workers/resnet.py"]),
    "docs/bench_grid.md": (["bench.grid"],
                           _RESNET + _MNIST + _HARNESS + ["layerbraid/grid.py", "bench/grid.py",
                                                          "bench/workers/grid.py"]),
    "docs/bench_rnn.md": (["bench.rnn"],
                          _ENGINE + _HARNESS + ["layerbraid/nn/rnn.py",
                                                "layerbraid/nn/_cell_steps.py",
                                                "layerbraid/nn/_cells.py",
                                                "layerbraid/_engine/torch_private.py",
                                                "bench/rnn.py", "bench/workers/rnn.py"]),
    "docs/bench_spatial.md": (["bench.spatial"],
                              _RESNET + _VOLUMES + _HARNESS + [
                                  "bench/spatial.py", "bench/workers/spatial_timing.py",
                                  "bench/workers/spatial_convergence.py",
                                  "bench/workers/spatial_trained.py"]),
    "docs/performance.md": (["bench.performance"],
                            _RESNET + _MNIST + _HARNESS + ["layerbraid/grid.py",
                                                           "layerbraid/plan.py",
                                                           "bench/performance.py",
                                                           "bench/workers/performance.py",
                                                           "bench/workers/resnet.py"]),
    "docs/vs_pipelining.md": (["bench.vs_pipelining"],
                              _RESNET + _HARNESS + ["layerbraid/convert.py",
                                                    "layerbraid/plan.py",
                                                    "bench/vs_pipelining.py",
                                                    "bench/workers/vs_pipelining.py",
                                                    "bench/workers/emulated.py",
                                                    "bench/workers/hand_off.py",
                                                    "bench/workers/resnet.py"]),
    "docs/plan_validation.md": (["bench.plan_validation"],
                                _RESNET + _HARNESS + ["layerbraid/plan.py",
                                                      "bench/plan_validation.py",
                                                      "bench/workers/resnet.py"]),
    "docs/scaling.md": (["bench.scaling", "bench.scaling_measured"],
                        _RESNET + ["layerbraid/plan.py", "bench/scaling.py",
                                   "bench/scaling_measured.py", "bench/workers/emulated.py",
                                   "bench/workers/resnet.py",
                                   "bench/workers/hand_off.py"]),
    "docs/reliability.md": (["bench.reliability"],
                            _RESNET + ["layerbraid/launch.py", "layerbraid/checkpoint.py",
                                       "layerbraid/clip.py", "layerbraid/data/loader.py",
                                       "layerbraid/tools/drill.py", "bench/reliability.py"]),
    "docs/accuracy.md": (["bench.accuracy"],
                         _RESNET + _MNIST + _VOLUMES + [
                             "examples/sequence_classification.py", "layerbraid/nn/rnn.py",
                             "layerbraid/nn/_cell_steps.py", "layerbraid/nn/_cells.py",
                             "layerbraid/accuracy", "bench/accuracy.py",
                             "bench/workers/accuracy.py"]),
    "docs/attention.md": (["bench.attention"],
                          _RESNET + ["examples/transformer.py", "layerbraid/nn/transformer.py",
                                     "layerbraid/accuracy", "bench/attention.py",
                                     "bench/workers/accuracy.py"]),
    "docs/contraction.md": (["bench.contraction"],
                            _RESNET + _VOLUMES + ["bench/contraction.py",
                                                  "bench/workers/contraction.py"]),
    "docs/depth.md": (["bench.depth"],
                      _RESNET + _MNIST + _VOLUMES + _HARNESS + [
                          "layerbraid/depth/__init__.py", "layerbraid/depth/mgopt.py",
                          "layerbraid/depth/spline.py", "layerbraid/parameterization.py",
                          "layerbraid/data/loader.py", "bench/depth.py",
                          "bench/workers/depth.py"]),
}


# Reports that several generators write in sections, each keeping its own raw data: the files
# that date each section (the report is as old as its oldest).
WRITTEN_IN_PARTS = {"docs/scaling.md": ["docs/scaling.md", "docs/scaling_measured.json"]}


def command(report):
    """The shell command that regenerates ``report``, run from the repository's root."""
    return "; ".join(f"python -m {m}" for m in REPORTS[report][0])


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


_FOOTER = re.compile(r"_Written by `[^`]*` at commit ([0-9a-f]{7,40})")


def _written_at(report):
    """The commit a report's last line says it was written at (``harness.generate``'s
    footer), or None."""
    try:
        lines = (ROOT / report).read_text().rstrip().splitlines()
    except OSError:
        return None
    m = _FOOTER.search(lines[-1]) if lines else None
    return m.group(1) if m and _git("cat-file", "-e", m.group(1) + "^{commit}") is not None \
        else None


def stale():
    """[(report, report's commit, code's commit, why)] for every stale report, or None when
    git's history is not available.  A report is stale when its code changed after the commit
    its footer names (a report committed together with a change to its code, but written
    before it, is stale too), or, without a footer, after the report's own last commit."""
    if _git("rev-parse", "--is-inside-work-tree") != "true" or \
            _git("rev-parse", "--is-shallow-repository") == "true":
        return None
    out = []
    for report, (_, code) in REPORTS.items():
        # a report written in parts: its age is its oldest part's
        parts = WRITTEN_IN_PARTS.get(report, [report])
        ages = [_last_change([p]) for p in parts]
        written = None if None in ages else min(ages)
        changed = _last_change(code)
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *code)
        footer = _written_at(report)
        if written is None:
            out.append((report, "-", changed[1] if changed else "-", "never committed"))
        elif dirty:
            out.append((report, written[1], "working tree", "uncommitted changes to its code"))
        elif changed is not None and changed[0] > written[0]:
            out.append((report, written[1], changed[1], "its code changed after it"))
        elif footer and changed is not None and \
                _git("diff", "--quiet", footer, "HEAD", "--", *code) is None:
            out.append((report, footer[:7], changed[1],
                        "its code changed after the commit it was written at"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stale", action="store_true", help="print only the stale reports")
    p.add_argument("--run", nargs="+", metavar="REPORT",
                   help="regenerate these reports (docs/NAME.md or NAME), or 'all', or 'stale'")
    p.add_argument("--quick", action="store_true",
                   help="with --run: measure the least that exercises every code path of each "
                        "report, and write them to --docs (a temporary directory by default), "
                        "not to docs/")
    p.add_argument("--docs", type=Path, help="with --run: write the reports here")
    p.add_argument("--jobs", type=int, default=1,
                   help="with --run --quick: regenerate this many reports at a time (their "
                        "timings mean nothing then; a full run always takes one at a time)")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs must be >= 1, got {a.jobs}")
    if a.jobs > 1 and not a.quick:
        p.error("--jobs needs --quick: reports that time share the machine with nothing else")
    if a.run:
        return regenerate(a.run, a.quick, a.docs, a.jobs)
    if not a.stale:
        print("| report | regenerate with |\n|---|---|")
        for report in REPORTS:
            print(f"| {report} | `{command(report)}` |")
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
        print(f"  {report}: written at {theirs}, code at {code} ({why}): {command(report)}")
    return 0


def regenerate(names, quick=False, docs=None, jobs=1):
    """Runs the modules of the reports ``names`` one after another, from the repository's root;
    stops at the first that fails.  ``quick``: the smallest measurements, written to ``docs``
    (a temporary directory unless given); there, ``jobs`` reports may run at a time (each
    report's modules still one after another), each one's output printed when it ends, and
    every report runs whatever another's fate."""
    if quick and docs is None:
        with tempfile.TemporaryDirectory() as tmp:
            return regenerate(names, True, Path(tmp), jobs)
    env = dict(os.environ)
    if quick:
        env["LAYERBRAID_BENCH_QUICK"] = "1"
    if docs is not None:
        docs.mkdir(parents=True, exist_ok=True)
        env["LAYERBRAID_BENCH_DOCS"] = str(docs)
    if names == ["all"]:
        chosen = list(REPORTS)
    elif names == ["stale"]:
        found = stale()
        if found is None:
            print("no git history here: cannot tell which reports are stale")
            return 1
        chosen = [report for report, *_ in found]
    else:
        by_name = {Path(r).stem: r for r in REPORTS}
        unknown = [n for n in names if n not in REPORTS and n not in by_name]
        if unknown:
            print(f"unknown report(s) {unknown}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        chosen = [n if n in REPORTS else by_name[n] for n in names]
    if quick and jobs > 1:
        return _regenerate_side_by_side(chosen, env, jobs)
    times, start = {}, time.time()
    for report in chosen:
        for module in REPORTS[report][0]:
            print(f"--- {report}: python -m {module}" + (" (quick)" if quick else ""), flush=True)
            t0 = time.time()
            rc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env).returncode
            times[module] = time.time() - t0
            print(f"--- {times[module]:.0f} s", flush=True)
            if rc != 0:
                print(f"python -m {module} failed ({rc})", file=sys.stderr)
                return rc
    print("--- minutes per module: " + ", ".join(f"{m} {t / 60:.1f}" for m, t in times.items())
          + f"; all {(time.time() - start) / 60:.1f}", flush=True)
    return 0


def _regenerate_side_by_side(chosen, env, jobs):
    """Quick runs of the reports ``chosen``, ``jobs`` at a time; returns the first failing
    module's exit status (in ``chosen``'s order), or 0."""
    from concurrent.futures import ThreadPoolExecutor

    def one(report):
        out, t0 = [], time.time()
        for module in REPORTS[report][0]:
            proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env,
                                  capture_output=True, text=True)
            out.append(f"--- {report}: python -m {module} (quick)\n{proc.stdout}{proc.stderr}")
            if proc.returncode != 0:
                return report, module, proc.returncode, out, time.time() - t0
        return report, None, 0, out, time.time() - t0

    start = time.time()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, chosen))
    print(f"--- all {len(chosen)} reports (quick, {jobs} at a time): "
          f"{(time.time() - start) / 60:.1f} minutes", flush=True)
    for report, module, rc, out, seconds in results:
        print("".join(out) + f"--- {seconds:.0f} s", flush=True)
    for report, module, rc, out, seconds in results:
        if rc != 0:
            print(f"python -m {module} failed ({rc})", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
