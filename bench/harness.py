"""What every benchmark script shares: the one way a job is started under mpiexec (a worker
module of bench/workers/, an example, a compiled program), reading the JSON lines a worker
prints, the examples' networks, and writing a report with its provenance.

Every entry point is run from the repository's root as ``python -m bench.NAME``; a worker as
``mpiexec -n RANKS python -m bench.workers.NAME`` (what :func:`launch` does).
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where reports are written (docs/), and whether to measure the least that exercises every
# code path of a report: ``python -m bench --run all --quick`` sets both for its modules, with
# a temporary directory, so that the test suite can run every generator without touching docs/.
DOCS = Path(os.environ.get("LAYERBRAID_BENCH_DOCS") or ROOT / "docs")
QUICK = os.environ.get("LAYERBRAID_BENCH_QUICK") == "1"
# Note [raw data]: a run's raw data (every batch, every output) stay on the machine that ran it,
# under runs/reports/ (not committed); git holds the report and a compact summary of its data
# (docs/NAME.json, at most about 100 kB: long lists of numbers become their quartiles, long
# lists of rows their per-field quartiles, numbers 4 significant digits).  ``--report``
# rewrites a report from the raw data, where they are.
RAW = ROOT / "runs" / "reports" if DOCS == ROOT / "docs" else DOCS / "raw"
LONG = 16  # a list longer than this is summarized


def pick(full, quick):
    """``full``, or ``quick`` in a quick run."""
    return quick if QUICK else full


def steady_allocator():
    """layerbraid.launch.steady_allocator(), which a job of 2+ ranks gets with its first model:
    workers call it first thing, so that every row, plain PyTorch's too, allocates alike and no
    time depends on what else the process ran (in a 2-rank job, rank 0's half of a
    layer-parallel step leaves a smaller heap than plain PyTorch's whole chain needs; glibc gave
    the difference back to the OS after every plain run, and the next one took about 35,000
    page faults at 64 benchmark conv steps, batch 50).  Imported here, not at the top: the
    report drivers import this module and must not start MPI."""
    from layerbraid.launch import steady_allocator as steady

    steady()


def available_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def binding(ranks, cores_per_rank):
    """mpiexec's options that give each of ``ranks`` ranks ``cores_per_rank`` cores of its own
    (``-bind-to core:K``), or none: when ``cores_per_rank`` is None, or when the job needs more
    cores than this process may use (an oversubscribed job is left to the OS's scheduler).
    MPICH binds nothing by default, and on this 2-core machine an unbound 2-rank job of the
    benchmark layer ran whole stretches of its timed pairs about 35% slower (2 of 5 jobs, their
    time in MPI 4x the others'), which bound jobs did not (6 of 6)."""
    if cores_per_rank is None or ranks * cores_per_rank > available_cores():
        return []
    return ["-bind-to", f"core:{cores_per_rank}"]


def mpiexec(ranks, argv, timeout=3600, env=None, check=True, cores_per_rank=None):
    """Runs ``argv`` on ``ranks`` ranks under mpiexec, from the repository's root; returns the
    completed process (output captured).  With ``check``, a nonzero exit raises with the job's
    output.  ``cores_per_rank``: bind each rank to that many cores of its own (see
    :func:`binding`); None leaves the ranks unbound."""
    cmd = ["mpiexec", *binding(ranks, cores_per_rank), "-n", str(ranks), *map(str, argv)]
    # a fresh MPI job, whatever launched this process (a test under mpiexec, a singleton)
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def torchrun(ranks, argv, timeout=3600, env=None, cores_per_rank=None):
    """Runs ``argv`` (a module and its arguments) on ``ranks`` processes under torchrun
    (torch.distributed, gloo), from the repository's root; the same contract as
    :func:`mpiexec`.  torchrun binds nothing: with ``cores_per_rank`` each process binds itself
    to cores of its own (:func:`bind_self`, through BENCH_CORES_PER_RANK), as mpiexec's
    ``-bind-to`` does for MPI jobs."""
    env = dict(os.environ if env is None else env)
    if cores_per_rank is not None and binding(ranks, cores_per_rank):
        env["BENCH_CORES_PER_RANK"] = str(cores_per_rank)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), *map(str, argv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def bind_self():
    """Under torchrun with BENCH_CORES_PER_RANK=k: binds this process (local rank r) to cores
    r*k .. r*k + k - 1 of those it may use (see :func:`binding`)."""
    k = os.environ.get("BENCH_CORES_PER_RANK")
    if not k or "LOCAL_RANK" not in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    r, k = int(os.environ["LOCAL_RANK"]), int(k)
    os.sched_setaffinity(0, cores[r * k:(r + 1) * k])


def python(ranks, module, *args, timeout=3600, env=None, cores_per_rank=None,
           launcher="mpiexec"):
    """``python -m module args`` on ``ranks`` ranks (see :func:`mpiexec`), or under torchrun
    (:func:`torchrun`) with ``launcher="torchrun"``."""
    if launcher == "torchrun":
        return torchrun(ranks, ["-m", module, *args], timeout=timeout, env=env,
                        cores_per_rank=cores_per_rank)
    return mpiexec(ranks, [sys.executable, "-m", module, *args], timeout=timeout, env=env,
                   cores_per_rank=cores_per_rank)


def launch(worker, ranks, *args, timeout=3600, echo=True, env=None, cores_per_rank=None,
           launcher="mpiexec"):
    """Runs the worker bench/workers/<worker>.py on ``ranks`` ranks; returns the JSON objects
    it printed (one per line; other lines are ignored).  Raises with the worker's output on
    failure.  ``cores_per_rank``: see :func:`mpiexec`; ``launcher``: "mpiexec" (MPI) or
    "torchrun" (torch.distributed, gloo)."""
    proc = python(ranks, f"bench.workers.{worker}", *args, timeout=timeout, env=env,
                  cores_per_rank=cores_per_rank, launcher=launcher)
    rows = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
            if echo:
                print(line, flush=True)
    return rows


def example(name):
    """The module of examples/<name>.py (its networks and defaults; its main() is not run).
    The examples are scripts that import their neighbours common.py and training_loop.py, so
    those are loaded first under their names."""
    def load(module, path):
        if module not in sys.modules:
            spec = importlib.util.spec_from_file_location(module, path)
            sys.modules[module] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module])
        return sys.modules[module]

    load("common", ROOT / "examples" / "common.py")
    load("training_loop", ROOT / "examples" / "training_loop.py")
    return load(f"example_{name}", ROOT / "examples" / f"{name}.py")


def spread(values, fmt=".2f", scale=1.0):
    """``median [min-max]`` of ``values`` (times ``scale``), as a table cell."""
    v = sorted(x * scale for x in values)
    med = statistics.median(v)
    return f"{med:{fmt}} [{v[0]:{fmt}}-{v[-1]:{fmt}}]"


def time_to(rows, goal):
    """Training seconds up to the first of ``rows`` (epochs or segments, in order, each with
    its "seconds" and "test_accuracy") whose test accuracy reaches ``goal``; None if none."""
    total = 0.0
    for r in rows:
        total += r["seconds"]
        if r["test_accuracy"] >= goal:
            return total
    return None


SAME = "~"  # marks a speedup whose spread includes 1.0
SAME_LEGEND = (f"{SAME}: the speedup's spread includes 1.0, so the row is not distinguishable "
               "from plain PyTorch in this run.")


def speedup(reference, times):
    """Speedups reference[i] / times[i] of paired timings (each pair from the same round):
    ``(median, min, max, cell)`` where cell is ``median [min-max]``, marked with SAME when the
    spread includes 1.0."""
    r = sorted(a / b for a, b in zip(reference, times))
    med = statistics.median(r)
    cell = f"{med:.2f} [{r[0]:.2f}-{r[-1]:.2f}]" + (f" {SAME}" if r[0] <= 1.0 <= r[-1] else "")
    return med, r[0], r[-1], cell


def raw_path(out):
    """Where the raw data of the report ``out`` are kept (Note [raw data])."""
    return RAW / Path(out).with_suffix(".json").name


def save_data(out, data):
    """Keeps ``data`` whole as the raw data of the report ``out`` and writes its compact
    summary beside the report (Note [raw data])."""
    raw = raw_path(out)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(data, indent=1) + "\n")
    where = raw.relative_to(ROOT) if raw.is_relative_to(ROOT) else raw
    head = {"summary": f"a compact summary of the run's raw data ({where} where it ran)"}
    text = json.dumps({**head, **summarize(data)}, indent=1)
    # a list of numbers or short strings on one line (json's indent gives each its own)
    text = re.sub(r"\[\s*([^\[\]{}]*?)\s*\]",
                  lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text)
    Path(out).with_suffix(".json").write_text(text + "\n")


def load_raw(out):
    """The raw data of the report ``out``'s last run on this machine (Note [raw data])."""
    raw = raw_path(out)
    if not raw.exists():
        raise SystemExit(f"{raw}: no raw data of a run here (git holds only their summary, "
                         f"{Path(out).with_suffix('.json').name}): rerun the report to measure")
    return json.loads(raw.read_text())


def _five(values):
    """[min, q1, median, q3, max] of ``values``, 4 significant digits."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return [_round(x) for x in (v[0], q[0], q[1], q[2], v[-1])]


def _round(x):
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rows(rows):
    """A long list of dicts, by their ``kind`` where they have one: per field, [min, q1,
    median, q3, max] of its numbers, or its value where it has one, or its distinct values (at
    most LONG of them)."""
    groups = {}
    for r in rows:
        groups.setdefault(str(r.get("kind", "rows")), []).append(r)
    out = {}
    for kind, group in groups.items():
        fields = {"n": len(group)}
        for key in dict.fromkeys(k for r in group for k in r if k != "kind"):
            values = [r[key] for r in group if key in r and r[key] is not None]
            if values and all(_is_number(v) for v in values):
                fields[key] = _five(values) if len(set(values)) > 1 else _round(values[0])
                continue
            distinct = list(dict.fromkeys(json.dumps(v, sort_keys=True)[:200] for v in values))
            if len(distinct) == 1:
                fields[key] = summarize(values[0])
            else:
                fields[key] = distinct[:LONG] + ([f"... {len(distinct) - LONG} more"]
                                                 if len(distinct) > LONG else [])
        out[kind] = fields
    return out


def summarize(data):
    """The compact summary of ``data`` (Note [raw data])."""
    if isinstance(data, dict):
        return {k: summarize(v) for k, v in data.items()}
    if isinstance(data, list):
        if len(data) > LONG and all(_is_number(v) for v in data):
            return {"n": len(data), "min_q1_median_q3_max": _five(data)}
        if len(data) > LONG and all(isinstance(v, dict) for v in data):
            return _rows(data)
        return [summarize(v) for v in data[:LONG]] + (
            [f"... {len(data) - LONG} more"] if len(data) > LONG else [])
    if isinstance(data, str) and len(data) > 400:
        return data[:200] + " [...] " + data[-200:]
    return _round(data)


def generate(out, measure, report, parser=None, argv=None, doc=None):
    """The main of every report generator: ``measure(args)`` returns the raw data, kept as
    raw data and their summary (:func:`save_data`) before ``report(data)`` writes the report (lines for ``out``'s .md, to which
    a last line adds the command and commit that wrote it, or None where ``report`` writes it
    itself); with ``--report`` the data come from the raw data of the last run instead, so a report can be
    rewritten without measuring again (after a change to how it is written).  ``parser`` holds the generator's own
    options (an ``--out PATH`` among them replaces ``out``); ``doc`` is its help text."""
    p = parser or argparse.ArgumentParser(description=doc,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", action="store_true",
                   help="rewrite the report from the raw data of the last run (its .json)")
    a = p.parse_args(argv)
    out = Path(getattr(a, "out", None) or out)
    if a.report:
        data = load_raw(out)
    else:
        data = measure(a)
        save_data(out, data)
    lines = report(data)
    if lines is not None:
        main = getattr(sys.modules["__main__"], "__spec__", None)
        command = f"python -m {main.name if main else 'bench'}" + (" --report" if a.report else "")
        now = provenance()
        write_report(out.with_suffix(".md"), list(lines) + [
            "", f"_Written by `{command}` at commit {now['commit']} on {now['date']}"
            + (" from the raw data kept by the run above._" if a.report else "._")])
    return data


def parser(doc):
    """An argument parser for a generator's own options (its help text is ``doc``)."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def write_report(path, lines):
    path = Path(path)
    path.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def write_section(path, name, lines):
    """Writes ``lines`` as the section ``name`` of the report at ``path``: between the markers
    ``<!-- section: NAME -->`` and ``<!-- /section: NAME -->``, replacing what was there and
    keeping every other section (a report that two scripts write); appended the first time."""
    path = Path(path)
    begin, end = f"<!-- section: {name} -->", f"<!-- /section: {name} -->"
    block = "\n".join([begin, *lines, end])
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)
    print(f"wrote the section {name!r} of {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


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
    cores = available_cores()
    return {"commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{cores} cores, {cpu}"}
