"""The reports under docs/ and the code they measure: the suite says which are stale."""
import ast
import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_every_report_has_its_command_and_the_stale_ones_are_listed():
    """``python -m bench`` lists every docs/ report with the command that regenerates it, and
    the reports older than their code.  The stale list is shown as a warning in the summary: a
    change to measured code reruns its reports in the same piece of work."""
    if not (ROOT / "bench" / "reports.py").exists():
        pytest.skip("bench/ is not next to the tests")
    out = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pages = {"ARCHITECTURE.md", "index.md", "api.md"}  # the site's pages that measure nothing
    reports = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
                     if p.name not in pages)
    readme = (ROOT / "bench" / "README.md").read_text()
    for report in reports:  # every report has its row, the same in bench/README.md
        row = next((line for line in out.stdout.splitlines() if line.startswith(f"| {report} |")),
                   None)
        assert row is not None and "`python -m bench." in row, report
        assert row in readme, f"bench/README.md lacks: {row}"
        for module in row.split("`")[1].split("; "):  # each names a module that exists
            path = ROOT / (module.removeprefix("python -m ").replace(".", "/") + ".py")
            assert path.is_file(), (report, module)
    if "stale report(s)" in out.stdout:
        warnings.warn(out.stdout[out.stdout.index("stale report(s)") - 3:].strip())
    else:
        assert "no stale report" in out.stdout or "no git history" in out.stdout, out.stdout


def _bench(name="reports"):
    """bench/NAME.py as a module (skips where bench/ is not next to the tests)."""
    if not (ROOT / "bench" / f"{name}.py").exists():
        pytest.skip("bench/ is not next to the tests")
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"bench.{name}")
    finally:
        sys.path.remove(str(ROOT))


def _bench_reports():
    """bench/reports.py as a module (skips where bench/ is not next to the tests)."""
    return _bench("reports")


def test_every_worker_a_report_launches_is_code_it_measures():
    """The stale check can only see changes to the files a report lists: every worker that a
    report's generators launch (``launch("NAME", ...)``, or a constant naming
    bench/workers/NAME.py) is among them."""
    REPORTS = _bench_reports().REPORTS
    checked = 0
    for report, (modules, code) in REPORTS.items():
        for module in modules:  # bench.scaling launches none: it models (layerbraid.plan)
            text = (ROOT / (module.replace(".", "/") + ".py")).read_text()
            names = set(re.findall(r'launch\("(\w+)"', text)) | set(
                re.findall(r'= "(\w+)"\s*# bench/workers/\1\.py', text))
            for name in names:
                assert f"bench/workers/{name}.py" in code, (report, module, name)
                checked += 1
    assert checked >= 12, checked  # the patterns still find the launches


def _package_imports(path):
    """The files of the package that ``path`` (a module of it) imports, relatively or by its
    absolute name, at any depth of the module (imports inside functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
        elif (node.module or "").split(".")[0] == "layerbraid":
            base = ROOT
        else:
            continue
        names = [node.module] if node.module else [a.name for a in node.names]
        for name in names:
            target = base.joinpath(*name.split("."))
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if candidate.exists():
                    out.add(candidate)
    return out


def test_the_engine_list_holds_everything_the_engine_imports():
    """Every report lists the solve engine's files (bench/reports.py _ENGINE): a change to any
    file that _engine/chain.py reaches through its imports runs in every solve, so it must stale the
    reports.  Only layerbraid/errors.py (exception classes) is left out."""
    reports = _bench_reports()
    _ENGINE, REPORTS = reports._ENGINE, reports.REPORTS
    seen, todo = set(), [ROOT / "layerbraid" / "_engine/chain.py"]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(_package_imports(path))
    reached = {p.relative_to(ROOT).as_posix() for p in seen} - {"layerbraid/errors.py"}
    assert len(reached) >= 8, reached  # the walk still follows the engine's imports
    assert reached <= set(_ENGINE), sorted(reached - set(_ENGINE))
    for report, (_, code) in REPORTS.items():
        assert set(_ENGINE) <= set(code), report


def test_the_reports_measure_the_examples_networks_not_their_training_loop():
    """No report lists examples/training_loop.py: bench/harness.py loads it only because the
    example scripts import it, and nothing a report runs calls it.  So: in bench/, only the
    loader names it; it defines and does nothing at import; and each example that a report
    loads uses what it imports from it inside main() alone (the function the reports never
    run)."""
    if not (ROOT / "bench" / "harness.py").exists():
        pytest.skip("bench/ is not next to the tests")
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if path.name not in ("harness.py", "reports.py"):
            assert "training_loop" not in path.read_text(), path
    loop = ast.parse((ROOT / "examples" / "training_loop.py").read_text())
    for node in loop.body:  # imports, definitions, constants, the docstring
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef,
                                 ast.Expr, ast.Assign)), node.lineno
        if isinstance(node, (ast.Expr, ast.Assign)):
            assert isinstance(node.value, ast.Constant), node.lineno
    for name in ("mnist", "volumes3d", "sequence_classification"):
        tree = ast.parse((ROOT / "examples" / f"{name}.py").read_text())
        assert not any(isinstance(n, ast.Import) and any(a.name == "training_loop"
                                                          for a in n.names)
                       for n in ast.walk(tree)), name
        taken = {a.asname or a.name for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module == "training_loop"
                 for a in n.names}
        assert taken, name
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        inside = {id(n) for n in ast.walk(main)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and n.id in taken:
                assert id(n) in inside, f"examples/{name}.py:{n.lineno} uses {n.id} outside main()"
    for report, (_, code) in _bench_reports().REPORTS.items():
        assert "examples/training_loop.py" not in code, report


def test_bench_has_one_launch_convention():
    """Every benchmark is a module run as ``python -m bench.NAME`` from the repository's root,
    its jobs started through bench/harness.py: no script edits sys.path, imports from tests/,
    or builds its own mpiexec command line."""
    files = sorted((ROOT / "bench").rglob("*.py"))
    if not files:
        pytest.skip("bench/ is not next to the tests")
    for path in files:
        text = path.read_text()
        name = path.relative_to(ROOT).as_posix()
        assert "sys.path" not in text, name
        assert not re.search(r"^\s*(from|import) (tests|faults|nets)\b", text, re.M), name
        if path.name != "harness.py":
            assert '"mpiexec"' not in text, f"{name} starts mpiexec itself, not by harness"


_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)), flush=True)"


def test_a_bound_job_gives_each_rank_cores_of_its_own():
    """bench.harness.mpiexec(..., cores_per_rank=K): each rank of a job that fits on the cores
    runs on K cores no other rank of it has (MPICH binds nothing by default: there every rank
    may run on every core); a job that would need more cores than there are is left unbound."""
    harness = _bench("harness")
    if not hasattr(__import__("os"), "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cores = harness.available_cores()
    if cores < 2:
        pytest.skip("one core: nothing to bind apart")

    def sets(ranks, per_rank):
        out = harness.mpiexec(ranks, [sys.executable, "-c", _AFFINITY], timeout=120,
                              cores_per_rank=per_rank).stdout
        # every list the ranks printed, wherever it landed: two ranks' lines can arrive run
        # together ("[0][1]"), which a line-by-line parse would take for one expression
        return [tuple(ast.literal_eval(m)) for m in re.findall(r"\[[\d, ]*\]", out)]

    bound = sets(2, 1)
    assert len(bound) == 2 and all(len(s) == 1 for s in bound), bound
    assert bound[0] != bound[1], bound  # a core each, not the same one
    assert harness.binding(2, 1) == ["-bind-to", "core:1"]
    # oversubscribed, or no binding asked for: no option, every rank on every core
    assert harness.binding(cores + 1, 1) == [] and harness.binding(2, None) == []
    unbound = sets(cores + 1, 1)
    assert len(unbound) == cores + 1 and all(len(s) == cores for s in unbound), unbound


@pytest.mark.timeout(900)
def test_every_report_generator_runs_in_quick_mode(tmp_path):
    """``make reports QUICK=1`` (``python -m bench --run all --quick``): every generator
    measures the least that exercises its code and writes its report, here into tmp_path
    (docs/ untouched), so that a generator broken by a change is seen at once."""
    if not (ROOT / "bench" / "reports.py").exists():
        pytest.skip("bench/ is not next to the tests")
    # two reports at a time: their timings mean nothing here, and one report's job often
    # leaves a core idle (a 1-rank job, a process starting)
    out = subprocess.run([sys.executable, "-m", "bench", "--run", "all", "--quick", "--jobs", "2",
                          "--docs", str(tmp_path)], capture_output=True, text=True, timeout=880,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    listed = subprocess.run([sys.executable, "-m", "bench"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT).stdout
    reports = [line.split("|")[1].strip() for line in listed.splitlines()
               if line.startswith("| docs/")]
    for report in reports:
        written = tmp_path / Path(report).name
        assert written.exists() and written.stat().st_size > 0, (report, out.stdout[-2000:])
    # each generator kept its raw data apart (tmp_path/raw here, runs/reports/ for docs/) and
    # wrote their summary beside its report
    for raw in (tmp_path / "raw").glob("*.json"):
        summary = json.loads((tmp_path / raw.name).read_text())
        assert summary["summary"].startswith("a compact summary") and summary.keys() - {
            "summary"} == json.loads(raw.read_text()).keys(), raw.name
    assert {p.name for p in (tmp_path / "raw").glob("*.json")} >= {
        "bench_core.json", "accuracy.json", "reliability.json", "performance.json"}
    # the 2-rank benchmark-layer job measured its costs with every rank busy, and the report
    # shows the bound they give
    performance = (tmp_path / "performance.md").read_text()
    busy = performance.split("### The work bound with every rank stepping at once")[1]
    assert "| N=64, 2 ranks, 2 levels, 2/1 iterations |" in busy.split("###")[0]
    split = performance.split("### Where each rank's time goes")[1].split("###")[0]
    for rank in (0, 1):
        assert f"| N=64, 2 ranks, 2 levels, 2/1 iterations | {rank} |" in split


def test_the_accuracy_reports_default_modes_are_the_examples_defaults():
    """docs/accuracy.md marks each example's default mode (bench/accuracy.py DEFAULTS): the
    iterations and first down-cycle that the example's --help states are that mode's."""
    accuracy = _bench("accuracy")
    DEFAULTS, MODE_FLAGS = accuracy.DEFAULTS, accuracy.MODE_FLAGS
    scripts = {"mnist": "mnist.py", "volumes3d": "volumes3d.py",
               "sequence": "sequence_classification.py"}
    assert set(DEFAULTS) == set(scripts)
    for example, mode in DEFAULTS.items():
        out = subprocess.run([sys.executable, str(ROOT / "examples" / scripts[example]), "--help"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        levels = int(re.search(r"--lp-levels L MGRIT levels;.*?\(default (\d+)\)",
                               text).group(1))
        stated = {
            "levels": 1 if levels == 1 else "more",
            "fwd_iters": int(re.search(r"iterations of the forward solve \(default (\d+)\)",
                                       text).group(1)),
            "bwd_iters": int(re.search(r"iterations of the adjoint solve \(default (\d+)\)",
                                       text).group(1)),
            "skip": re.search(r"first down-cycle \(default: (on|off)\)", text).group(1)}
        want = MODE_FLAGS[mode]
        assert {k: stated[k] for k in want} == want, (example, mode, stated)


def test_the_accuracy_reports_tuned_sentence_counts_from_the_rows():
    """A tuned run's sentence is computed from its tuning rows and measured batches: probes
    judged against the aim the rows carry, misses split into probed batches and batches
    between probes, with their error over the target."""
    accuracy = _bench("accuracy")
    _tuned_sentence = accuracy._tuned_sentence

    def tuning(batch, change, ran, its, climb=()):
        return dict(epoch=1, batch=batch, change=change, ran=[list(ran)],
                    iterations=[list(its)], aim=5e-3, seconds=0.5, climb=list(climb))

    tunings = [tuning(0, 2e-2, (2, 1), (4, 3), [8e-3, 1e-3]), tuning(1, 3e-3, (4, 3), (4, 3)),
               tuning(2, 3e-3, (4, 3), (3, 2)), tuning(20, 7e-3, (3, 2), (4, 3), [2e-3])]
    measured = [dict(epoch=1, batch=b, grad_error=e)
                for b, e in [(1, 1.5e-2), (5, 2e-3), (10, 1.2e-2), (15, 2.5e-2), (20, 1e-3)]]
    text = _tuned_sentence("tuned", tunings, 20.0, 1e-2, measured)
    assert "probed 4 batches, climbed at 2 of them (3 solve(s) beyond their probes) and" \
        in text
    for t in tunings:  # rows of runs from before the climb within a batch: no count to give
        del t["climb"]
    assert "probed 4 batches, climbed at 2 of them and moved" in \
        _tuned_sentence("tuned", tunings, 20.0, 1e-2, measured)
    assert "moved the iterations 3 times, through 2/1, 3/2, 4/3, ending at 4/3" in text
    assert "at 2 of them (50%) the probe met the aim 0.005 (the target 0.01 over the margin 2)" \
        in text
    assert "the tuner took 10% of the training time" in text
    assert "Of the 3 measured batch(es) above the target, 1 was a probed batch" in text
    assert "and 2 lay between probes, at 1.2-2.5x the target." in text


def test_a_rerun_keeps_each_stored_runs_own_pairing_reference():
    """`bench.accuracy --only` replaces serial: the runs it does not rerun keep the serial run
    of their own job as their pairing reference (their batches were timed beside it); the
    rerun ones pair with the new serial, and a second rerun keeps the first reference."""
    accuracy = _bench("accuracy")
    keep_references, references = accuracy.keep_references, accuracy.references

    def run(seconds):
        return [dict(kind="epoch", seconds=seconds, batch_seconds=[seconds / 2] * 2)]

    job_a, job_b = dict(commit="a", date="1"), dict(commit="b", date="2")
    data = {"runs": {"mnist/serial": run(1.0), "mnist/exact": run(1.1), "mnist/tuned": run(2.0)},
            "measured": {"mnist/serial": job_a, "mnist/exact": job_a, "mnist/tuned": job_a}}
    keep_references(data, "mnist", ["serial", "tuned"])
    data["runs"].update({"mnist/serial": run(1.5), "mnist/tuned": run(2.5)})
    data["measured"].update({"mnist/serial": job_b, "mnist/tuned": job_b})
    ep = {m: [r for r in data["runs"][f"mnist/{m}"] if r["kind"] == "epoch"]
          for m in ("serial", "exact", "tuned")}
    refs = references(data, "mnist", ep)
    assert refs["exact"][0]["seconds"] == 1.0  # its own job's serial
    assert refs["tuned"] is ep["serial"] and refs["serial"] is ep["serial"]
    keep_references(data, "mnist", ["serial", "tuned"])  # again: exact keeps job a's
    assert data["references"]["mnist/exact"][0]["seconds"] == 1.0
    assert "mnist/tuned" not in data["references"]


def test_runs_timed_in_one_job_are_compared_batch_by_batch_after_a_rerun():
    """Two stored runs of one job keep equal copies of that job's serial run as their pairing
    reference (`--only` reran others): their times are still compared batch by batch, not
    each against its own job's plain PyTorch."""
    accuracy = _bench("accuracy")

    def epochs(seconds):
        return [dict(kind="epoch", seconds=sum(seconds), batch_seconds=list(seconds),
                     test_accuracy=0.9)]

    def logged(error):
        return [dict(kind="batch", grad_error=error, it_fwd=1, it_bwd=1, estimate=None,
                     raw_estimate=None, calibrated=False)]

    serial = epochs([1.0, 1.0, 1.0, 1.0])
    ep = {"serial": epochs([1.5, 1.5, 1.5, 1.5]), "warm1": epochs([2.0, 2.2, 2.0, 2.2]),
          "relaxed1": epochs([2.0, 2.0, 2.0, 2.0])}
    rows = {"serial": [], "warm1": logged(1e-3), "relaxed1": logged(2e-3)}
    refs = {"serial": ep["serial"], "warm1": [dict(r) for r in serial],
            "relaxed1": [dict(r) for r in serial]}
    text = "\n".join(accuracy._findings("mnist", ep, rows, refs, 0.0, 1e-2))
    assert "warm1 costs 1.05x relaxed1's time per epoch, 1.05 [1.00-1.10]x per batch " \
        "(median [quartiles], paired)" in text, text


def test_the_busy_bound_is_computed_pair_by_pair_and_judged_against_the_target():
    """bench.performance's busy bound: the work bound at the costs measured with every rank
    stepping, and the finding it gives for a row below its target."""
    from bench import performance

    ranks, steps, levels, fwd, bwd, target, _ = performance.LAYER_ROWS[5]  # N=16, 2/1
    label = performance._layer_label(ranks, steps, levels, fwd, bwd)
    alone = [(1e-3, 1e-3, 2e-3), (2e-3, 2e-3, 4e-3)]
    busy = [tuple(1.2 * c for c in a) for a in alone]
    bounds = [performance.work_bound(steps, ranks, levels, fwd, bwd, *c) for c in busy]
    plain = [steps * (a[0] + a[2]) for a in alone]  # plain PyTorch at its own bound
    run = {"lp_times": bounds, "serial_times": plain,  # layerbraid exactly at the busy bound
           **{key: [c[i] for c in alone] for i, key in
              enumerate(("step_times", "vjp_times", "vjp_param_times"))},
           **{"busy_" + key: [c[i] for c in busy] for i, key in
              enumerate(("step_times", "vjp_times", "vjp_param_times"))}}
    table = "\n".join(performance._busy_table({label: [run]}))
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1].startswith("1.20 ") and cells[2].startswith("1.20 ")
    assert cells[5].startswith("1.00 ")  # the time over the busy bound
    allowed = [p / b for p, b in zip(plain, bounds)]
    assert max(allowed) < target  # this schedule's work on these costs is slower than asked
    (finding,) = performance._busy_findings({label: [run]})
    assert "below that bound" in finding and "+20%" in finding
    # a job without busy costs (one rank) gives no row
    lone = {k: v for k, v in run.items() if not k.startswith("busy_")}
    assert performance._busy_table({label: [lone]}) == []


def test_rank_work_counts_the_schedules_steps_and_vjps():
    """bench.performance.rank_work prices each rank's steps and VJPs: the counts a 2-rank N=16
    2/1 solve traced in the core (22 steps and 10 VJPs per rank, 8 of them in the final
    relaxation), and plain PyTorch's N steps and N VJPs on one level and one rank."""
    from bench.performance import rank_work

    assert rank_work(16, 2, 2, 2, 1, 1.0, 0.0, 0.0) == [22.0, 22.0]
    assert rank_work(16, 2, 2, 2, 1, 0.0, 1.0, 1.0) == [10.0, 10.0]
    assert rank_work(16, 2, 2, 2, 1, 0.0, 0.0, 1.0) == [8.0, 8.0]
    assert rank_work(64, 1, 1, 1, 1, 1.0, 0.0, 1.0) == [128.0]


def test_no_committed_file_under_docs_exceeds_100_kib():
    """Git holds reports and compact summaries (Note [raw data] in bench/harness.py), not raw
    per-batch data: every file under docs/ is at most 100 KiB."""
    big = {p.relative_to(ROOT).as_posix(): p.stat().st_size
           for p in (ROOT / "docs").rglob("*") if p.is_file() and p.stat().st_size > 100 * 1024}
    assert not big, big


def test_a_summary_keeps_the_shape_and_quartiles_of_the_raw_data(tmp_path, monkeypatch):
    harness = _bench("harness")
    monkeypatch.setattr(harness, "RAW", tmp_path / "raw")
    rows = [{"kind": "batch", "error": float(i), "mode": "fixed"} for i in range(101)]
    rows += [{"kind": "epoch", "seconds": 3.0, "mode": "fixed"}]
    data = {"commit": "abc", "times": [float(i) for i in range(1, 18)], "short": [1.0, 2.0],
            "rows": rows, "log": "x" * 1000}
    harness.save_data(tmp_path / "r.md", data)
    assert harness.load_raw(tmp_path / "r.md") == data  # the raw data, whole
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["commit"] == "abc" and summary["short"] == [1.0, 2.0]
    assert summary["times"] == {"n": 17, "min_q1_median_q3_max": [1.0, 5.0, 9.0, 13.0, 17.0]}
    assert summary["rows"]["batch"] == {"n": 101, "error": [0.0, 25.0, 50.0, 75.0, 100.0],
                                        "mode": "fixed"}
    assert summary["rows"]["epoch"] == {"n": 1, "seconds": 3.0, "mode": "fixed"}
    assert len(summary["log"]) < 500
    with pytest.raises(SystemExit, match="no raw data of a run here"):
        harness.load_raw(tmp_path / "other.md")


def test_the_numbers_quoted_from_the_pipelining_report_are_its_own():
    """The README's ratio to the fastest pipelining row, and the tuning guide's speedups, are
    what docs/vs_pipelining.md (and its summary) say, at the commit they name."""
    data = json.loads((ROOT / "docs" / "vs_pipelining.json").read_text())
    report = (ROOT / "docs" / "vs_pipelining.md").read_text()
    job = next(j for j in data["jobs"] if j["batch"] == 50 and "gloo" in j["transport"])
    med = job["medians"]
    best_pipe = min(v for k, v in med.items() if k.split("-")[0] in ("gpipe", "1f1b"))
    exact = {k: v for k, v in med.items() if k.startswith("lp-") and k[3:].isdigit()}
    fastest = min(exact, key=exact.get)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"the exact path in {fastest[3:]} microbatches ran at " \
           f"{best_pipe / exact[fastest]:.2f}x the speed" in readme
    assert f"commit {data['commit'][:7]}" in readme
    guide = " ".join((ROOT / "docs" / "guide" / "tuning.md").read_text().split())
    assert f"commit {data['commit'][:7]}" in guide
    # the emulated section: its commit, the crossover's two rows and the planner's count
    emu = data["emulated"]
    assert f"commit\n{emu['commit'][:7]}" in readme or f"commit {emu['commit'][:7]}" in readme
    assert f"commit {emu['commit'][:7]}" in guide
    crossover = next(line for line in report.splitlines()
                     if line.startswith("- MGRIT overtakes the pipeline (measured) from"))
    ranks = int(crossover.split(" from ")[1].split()[0])
    table = report.split("## More ranks, emulated layers")[1]
    rows = [line.split("|") for line in table.splitlines() if line.startswith(f"| {ranks} |")]
    best = {kind: max(float(r[4]) for r in rows if kind in r[2]) for kind in ("exact", "MGRIT")}
    said = f"{best['MGRIT']:.2f}x serial's speed against {best['exact']:.2f}x"
    assert said in " ".join(readme.split()) and said in " ".join(guide.split()), said
    within = re.search(r"Emulated rows: .* over (\d+) rows \((\d+) within 15%\)", report)
    assert f"({within.group(2)} of {within.group(1)})" in guide
    within = re.search(r"2-process rows: .* over the (\d+) modelled rows \((\d+) within 15%\)",
                       report)
    assert f"predicted {within.group(2)} of the {within.group(1)} 2-process rows within 15%" \
        in guide
    batch50 = report.split("## Batch 50, 2 processes, torch")[1].split("##")[0]
    flat = guide
    for m, said in ((2, "2 microbatches ran at {}x"), (5, "5 at {}x"), (1, "1 microbatch: {}x")):
        row = next(line for line in batch50.splitlines()
                   if line.startswith(f"| layerbraid exact, {m} microbatch"))
        speedup = row.split("|")[3].split()[0]
        assert said.format(speedup) in flat, (m, speedup)
    plain = next(line for line in batch50.splitlines() if line.startswith("| plain PyTorch"))
    low, high = plain.split("|")[2].split("[")[1].rstrip("] ").split("-")
    assert f"ranged over {low}-{high} ms" in flat


def _flat(path):
    return " ".join((ROOT / path).read_text().split())


def _floats(text):
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+", text)]


def test_the_numbers_quoted_from_the_depth_report_are_its_own():
    """The guide's "When it pays" and the README's line on training over depths quote
    docs/depth.md's findings, at the commit they name; the counts of seeds are recounted from
    the per-seed accuracies the report lists."""
    meta = json.loads((ROOT / "docs" / "depth.json").read_text())
    commit = (meta.get("measured", {}).get("mnist") or meta)["commit"][:7]
    report, guide, readme = (_flat("docs/depth.md"), _flat("docs/guide/depth.md"),
                             _flat("README.md"))
    report = report.split("## mnist32", 1)[0]  # the 8-step network's section
    assert f"measured at commit {commit}" in guide and f"commit {commit})" in readme
    lines = {m.group(1): m.group(2) for m in re.finditer(r"- (nested iteration|MG/Opt|spline "
                                                          r"steps): (.*?)(?= - |$)", report)}
    nested, mgopt, spline = lines["nested iteration"], lines["MG/Opt"], lines["spline steps"]

    def ratio(text, what):
        m = re.search(what + r" ratio ([\d.]+) \[([\d.]+)-([\d.]+)\]", text)
        return m.group(1), m.group(2), m.group(3)

    t, b = ratio(nested, "time"), ratio(nested, "batch")
    assert f"time ratio {t[0]}, {t[1]}-{t[2]}" in guide and f"ratio {b[0]}, {b[1]}-{b[2]}" in guide
    assert re.search(r"Not distinguishable", nested) and "not distinguishable" in guide
    acc = re.search(r"final accuracy ([-+][\d.]+) points .*?noise of \+-([\d.]+) points", nested)
    assert f"accuracy {abs(float(acc.group(1))):.2f} points lower" in guide
    assert f"noise ({acc.group(2)} points)" in guide
    half = re.search(r"trained (\d+) of its (\d+) batches", nested)
    assert f"{half.group(1)} of the {half.group(2)} batches" in guide
    b = ratio(mgopt, "batch")
    assert f"fewer batches to the target (ratio {b[0]}, {b[1]}-{b[2]})" in guide
    gain = re.search(r"final accuracy \+([\d.]+) points", mgopt).group(1)
    assert f"ends {gain} points higher" in guide and f"ended {gain} points above" in readme
    t = ratio(mgopt, "time")
    assert "later in every seed" in mgopt and f"(time ratio {t[0]})" in guide
    assert f"(time ratio {t[0]})" in readme
    steps = re.search(r"at equal fine optimizer steps .*? it had (.*?)% against full depth's "
                      r"(.*?)%", mgopt)
    wall = re.search(r"at equal training time .*? it had (.*?)% against full depth's (.*?)%",
                     mgopt)
    below = [sum(a < f for a, f in zip(_floats(m.group(1)), _floats(m.group(2))))
             for m in (steps, wall)]
    assert f"below full depth in {below[0]} of 5 seeds" in guide
    assert below[1] == 5 and "below in all 5" in guide
    sooner = re.search(r"sooner in (\d+), later in (\d+) of", spline)
    assert f"sooner in {sooner.group(1)} seeds, later in {sooner.group(2)}" in guide
    lower = re.search(r"final accuracy -([\d.]+) points", spline).group(1)
    assert f"final accuracy {lower} points lower" in guide


def test_the_numbers_quoted_from_the_32_step_depth_report_are_its_own():
    """The guide's and README's lines on the 32-step network quote its section of
    docs/depth.md, at the commit it names; seed counts are recounted from the per-seed lists."""
    meta = json.loads((ROOT / "docs" / "depth.json").read_text())
    commit = meta["measured"]["mnist32"]["commit"][:7]
    report = _flat("docs/depth.md").split("## mnist32", 1)[1]
    guide, readme = _flat("docs/guide/depth.md"), _flat("README.md")
    assert f"measured at commit {commit}" in guide and f"(commit {commit})" in readme
    lines = {m.group(1): m.group(2) for m in re.finditer(
        r"- (nested iteration|nested iteration, inherited frozen|MG/Opt|spline steps|Knots): "
        r"(.*?)(?= - |$)", report)}

    def ratio(text, what):
        m = re.search(what + r" ratio ([\d.]+) \[([\d.]+)-([\d.]+)\]", text)
        return m.group(1), m.group(2), m.group(3)

    nested = lines["nested iteration"]
    t, b = ratio(nested, "time"), ratio(nested, "batch")
    assert "It pays here" in nested and "sooner to the target in every seed" in guide
    assert f"(time ratio {t[0]}, {t[1]}-{t[2]})" in guide and f"(ratio {b[0]})" in guide
    assert f"(time ratio {t[0]})" in readme
    lower = re.search(r"final accuracy -([\d.]+) points .*?noise of \+-([\d.]+)", nested)
    assert f"final accuracy {lower.group(1)} points lower, inside the noise " \
           f"({lower.group(2)} points)" in guide
    half = re.search(r"trained (\d+) of its", nested).group(1)
    row = re.search(r"\| nested iteration \| 16 -> 32 \|(.*?)\| (\d+) \[[\d-]+\] \| [\d.]+ \[",
                    report)
    assert f"{half} of the {row.group(2)} batches to the target" in guide
    frozen = lines["nested iteration, inherited frozen"]
    t = ratio(frozen, "time")
    assert "Not distinguishable" in frozen and f"(time ratio {t[0]}, {t[1]}-{t[2]};" in guide
    counts = re.search(r"sooner in (\d+), later in (\d+) of 5 seeds", frozen)
    assert f"sooner than full depth in {counts.group(1)} seeds, later in {counts.group(2)}" \
           in guide
    lower = re.search(r"final accuracy -([\d.]+)", frozen).group(1)
    assert f"final accuracy {lower} points lower on average, inside the noise" in guide
    mgopt = lines["MG/Opt"]
    assert f"fewer batches (ratio {ratio(mgopt, 'batch')[0]})" in guide
    gain = re.search(r"final accuracy \+([\d.]+) points", mgopt).group(1)
    t = ratio(mgopt, "time")
    assert "later in every seed" in mgopt and f"ends {gain} points higher" in guide
    assert f"(time ratio {t[0]})" in guide and f"MG/Opt was later again ({t[0]})" in readme
    steps = re.search(r"at equal fine optimizer steps .*? it had (.*?)% against full depth's "
                      r"(.*?)%", mgopt)
    wall = re.search(r"at equal training time .*? it had (.*?)% against full depth's (.*?)%",
                     mgopt)
    pairs = list(zip(_floats(steps.group(1)), _floats(steps.group(2))))
    above, below = sum(a > f for a, f in pairs), sum(a < f for a, f in pairs)
    assert f"above full depth in {above} of 5 seeds and below in {below}" in guide
    assert all(a < f for a, f in zip(_floats(wall.group(1)), _floats(wall.group(2))))
    assert "at equal training time below in all 5" in guide
    spline = lines["spline steps"]
    assert "Not distinguishable" in spline
    lower = re.search(r"final accuracy -([\d.]+) points", spline).group(1)
    assert f"final accuracy {lower} points lower" in guide
    knots = lines["Knots"]
    mean = re.search(r"\(mean ([-+][\d.]+),", knots).group(1)
    per_seed = _floats(re.search(r"final accuracy (.*?) points", knots).group(1))
    assert f"final accuracy {mean} points on average (per seed within " \
           f"{max(abs(d) for d in per_seed):.2f})" in guide
    assert "as soon in every seed" in knots and "the default stays clamped" in knots
    assert 'so the default stays `knots="clamped"`' in guide


def test_the_restart_times_the_faults_page_quotes_are_the_reliability_reports():
    commit = json.loads((ROOT / "docs" / "reliability.json").read_text())["commit"][:7]
    page, report = _flat("docs/guide/faults.md"), (ROOT / "docs" / "reliability.md").read_text()
    assert f"docs/reliability.md (commit {commit})" in page
    for mode in ("fixed", "elastic"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {mode} |"))
        resumed, latency = row.split("|")[3].strip(), row.split("|")[4].strip()
        assert f"resumed {resumed.replace('/', ' of ')} runs of each" in page
        median, spread = latency.split(" ")
        assert f"{median} s {spread}" in page, (mode, latency)


def test_the_numbers_the_transformer_guide_quotes_are_the_attention_reports():
    """docs/guide/transformers.md quotes docs/attention.md: the commit, the cheap settings'
    median gradient errors, serial's final losses, the guard's final loss against the cheap
    setting's, and the tuner's time against serial's."""
    report = (ROOT / "docs" / "attention.md").read_text()
    guide = " ".join((ROOT / "docs" / "guide" / "transformers.md").read_text().split())
    commit = re.search(r"Measured on commit (\w{7})", report).group(1)
    assert f"measured at commit {commit}" in guide

    def cell(depth, mode, column):
        table = report.split(f"## {depth} layers")[1].split("##")[0]
        row = next(line for line in table.splitlines() if line.startswith(f"| {mode} |"))
        return row.split("|")[column].split()[0]

    def error(depth, mode):
        return f"{float(cell(depth, mode, 5)):.2f}"

    assert (f"median true gradient error of {error(16, 'relaxed1')} and "
            f"{error(32, 'relaxed1')}, and 2 / 1 iterations {error(16, 'fixed')} and "
            f"{error(32, 'fixed')}") in guide
    assert f"serial's ({cell(16, 'serial', 2)} and {cell(32, 'serial', 2)})" in guide
    assert f"({cell(32, 'guard', 2)} against {cell(32, 'relaxed1', 2)})" in guide
    ratios = [float(cell(d, "tuned", 6)) / float(cell(d, "serial", 6)) for d in (16, 32)]
    assert f"at {min(ratios):.1f}-{max(ratios):.1f} times serial's training time" in guide


def test_the_gpu_check_names_its_device_and_refuses_without_one():
    """bench.gpu's section names the device and gives each row's speedup over plain PyTorch of
    its own job (from a run's data); without CUDA it refuses, saying why."""
    from bench import gpu

    job = {"times": {"plain": [0.2, 0.4], "lp-2": [0.1, 0.2]}, "errors": {"plain": 0.0,
                                                                       "lp-2": 1e-8},
           "failed": {"1f1b-2": "RuntimeError: no CUDA send"}}
    data = {"commit": "abc", "date": "today", "machine": "m", "device": "NVIDIA H100",
            "gpus": 1, "seconds": 300, "tests": [("one process", "12 passed", 0)],
            "jobs": {"MPI": job}}
    text = "\n".join(gpu.section(data))
    assert "NVIDIA H100 (1 GPU(s))" in text and "| one process | 12 passed | 0 |" in text
    assert "| MPI | lp-2 | 150.0 [100.0-200.0] | 2.00 [2.00-2.00] | 1.0e-08 |" in text
    assert "| MPI | 1f1b-2 | not run: RuntimeError: no CUDA send | - | - |" in text
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            gpu.measure()


def test_the_numbers_quoted_from_the_performance_report_are_its_own():
    """The README's and the tuning guide's demo speedups (exact, and in 2 microbatches) and the
    guide's N=64 2-level row are what docs/performance.md says, at the commit they name."""
    report = (ROOT / "docs" / "performance.md").read_text()
    commit = re.search(r"on commit ([0-9a-f]{7})", report).group(1)
    readme, guide = _flat("README.md"), _flat("docs/guide/tuning.md")

    def speedup(label):
        row = next(line for line in report.splitlines() if line.startswith(f"| {label} |"))
        cells = [c.strip() for c in row.split("|")]
        m = re.match(r"([\d.]+) \[([\d.]+)-([\d.]+)\]", cells[3 if "N=" not in label else 4])
        return m.group(1), m.group(2), m.group(3)

    exact = speedup("layer parallel, 2 ranks, 1 level (exact)")
    micro = speedup("layer parallel, 2 ranks, 1 level (exact), 2 microbatches")
    deep = speedup("N=64, 2 ranks, 2 levels, 2/1 iterations")
    assert f"at {exact[0]}x plain PyTorch's speed" in readme and f"({exact[1]}-{exact[2]})" in readme
    assert f"2 microbatches at {micro[0]}x ({micro[1]}-{micro[2]}; docs/performance.md, " \
           f"commit {commit})" in readme
    assert f"docs/performance.md at commit {commit}" in guide
    for said in (f"{exact[0]} [{exact[1]}-{exact[2]}]", f"{micro[0]} [{micro[1]}-{micro[2]}]",
                 f"at {deep[0]} [{deep[1]}-{deep[2]}] (N = 64)"):
        assert said in guide, said
