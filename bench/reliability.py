"""Fault injection: every scenario of layerbraid.tools.drill (``python -m layerbraid.tools.drill``) on 2 and 3 ranks, several times; writes
docs/reliability.md; its raw data under runs/reports/, their summary docs/reliability.json.

    python -m bench.reliability                  # about 12 minutes here
    python -m bench.reliability --repeats 1 --ranks 2 --scenarios stall-clip exit-end

Under both launchers: mpiexec (MPI) and torchrun (torch.distributed, gloo; 2 ranks).  Then the
restart drill (layerbraid.tools.restarts): a process SIGKILLed under torchrun --max-restarts,
with a fixed and an elastic process count, its time from the kill to the resumed start.

For each run: the exit status of the whole job, which ranks printed the cause, and the seconds
from the fault (the faulty rank's clock, or the moment the signal is sent) to the end of the
last rank.  Every run is killed at --limit seconds whether or not it prints (a hang); the
whole script stops starting runs after --budget seconds and says so in the report.
"""
import argparse
import statistics
import time
from pathlib import Path

from bench.harness import DOCS, pick, provenance, save_data, write_report
from layerbraid.tools import drill, restarts


def _raw(scenario, launcher, ranks, r):
    return {"scenario": scenario, "launcher": launcher, "ranks": ranks, "rc": r["rc"],
            "hung": r["hung"], "seconds": r["seconds"], "faulty": r["faulty"],
            "cause_on": r["cause_on"], "cause_shown": r["cause"],
            "outputs": {str(k): v[-1500:] for k, v in r["outputs"].items()}}


def _row(scenario, launcher, ranks, runs):
    """(scenario, launcher, what, ranks, ended with the cause, runs, hangs, seconds, cause,
    where, the ranks that printed it) of one table row."""
    what, _, where = drill.SCENARIOS[scenario]
    hangs = sum(r["hung"] for r in runs)
    ok = sum(r["rc"] != 0 and r["cause"] and not r["hung"] for r in runs)
    secs = [r["seconds"] for r in runs if r["seconds"] is not None]
    caught = sorted({k for r in runs for k in r["cause_on"]})
    return (scenario, launcher, what, ranks, ok, len(runs), hangs, secs,
            drill.cause_of(scenario, launcher), where, caught)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1)  # 2 took 14 minutes
    p.add_argument("--ranks", type=int, nargs="+", default=pick([2, 3], [2]))
    p.add_argument("--limit", type=float, default=60, help="seconds before a run is a hang")
    p.add_argument("--budget", type=float, default=3600, help="seconds for the whole script")
    p.add_argument("--scenarios", nargs="+",
                   default=pick(list(drill.SCENARIOS), ["forward"]))
    p.add_argument("--launchers", nargs="+", choices=drill.LAUNCHERS,
                   default=list(drill.LAUNCHERS))
    p.add_argument("--restart-repeats", type=int, default=pick(3, 1))
    p.add_argument("--restart-modes", nargs="+", choices=list(restarts.MODES),
                   default=pick(list(restarts.MODES), []))  # quick: tests/test_restarts.py runs them
    p.add_argument("--out", type=Path, default=DOCS / "reliability.md")
    a = p.parse_args(argv)
    rows, raw, skipped = [], [], []
    t0 = time.time()
    cases = [(s, launcher, ranks) for s in a.scenarios for launcher in a.launchers
             for ranks in (a.ranks if launcher == drill.LAUNCHERS[0] else [2])]
    for scenario, launcher, ranks in cases:
        if time.time() - t0 > a.budget:
            skipped.append((scenario, launcher, ranks))
            continue
        runs = [drill.run(scenario, ranks, a.limit, launcher=launcher) for _ in range(a.repeats)]
        raw += [_raw(scenario, launcher, ranks, r) for r in runs]
        rows.append(_row(scenario, launcher, ranks, runs))
        print(f"{scenario} under {launcher} on {ranks} ranks: {rows[-1][4]}/{len(runs)} ended "
              f"with the cause (printed by ranks {rows[-1][-1]})", flush=True)
    restart_runs = {m: [restarts.run(m) for _ in range(a.restart_repeats)]
                    for m in a.restart_modes}
    info = provenance()
    save_data(a.out, {**info, "runs": raw, "restarts": {
        m: [{k: v for k, v in r.items() if k != "lines"} | {"tail": "".join(r["lines"])[-1500:]}
            for r in runs] for m, runs in restart_runs.items()}})
    lines = _header(info, a, time.time() - t0) + _fault_table(rows)
    if skipped:
        lines += ["", f"Not run (the {a.budget:.0f} s budget ran out): "
                  + ", ".join(f"{s} under {la} on {r} ranks" for s, la, r in skipped) + "."]
    lines += _restart_table(restart_runs)
    lines += [
        "",
        "How each is handled: an uncaught exception on any rank prints its traceback and aborts "
        "the job (`layerbraid.abort_on_exception`); errors inside a forward or backward (the "
        "close layer, step_layer, non-finite values) are raised on every rank; every "
        "collective layerbraid issues, in Python or in the MGRIT core, is a polled wait: a "
        "rank that waits longer than the timeout raises `StallError` naming the call (and, "
        "inside the core, the rank it waited for); a rank that exits early tells the ranks "
        "that wait for it, which raise `RemoteRankError` saying so; Ctrl-C reaches ranks "
        "waiting in any of these waits.  Under torchrun the abort posts the cause to the "
        "job's store and torchrun ends the other processes.",
    ]
    write_report(a.out, lines)


def _header(info, a, seconds):
    return [
        "# Reliability: a fault on one rank ends every rank, with its cause",
        "",
        f"Generated by `python -m bench.reliability` on commit {info['commit']}, "
        f"{info['date']}, {info['machine']} ({a.repeats} run(s) of each scenario, launcher and "
        f"rank count, {seconds:.0f} s; more ranks than cores for 3).  Raw data under "
        "runs/reports/ where it ran, their summary docs/reliability.json.  Each run is a "
        "scenario of layerbraid.tools.drill (`python -m layerbraid.tools.drill`): a short "
        "layer-parallel training job (ODE-ResNet, 4 steps, float64) with one fault injected, "
        "every rank's output tagged with its rank, started by mpiexec (MPI) or torchrun "
        "(torch.distributed, gloo).  `ended with the cause` counts runs whose job exited "
        f"nonzero, within the {a.limit:.0f} s limit, with the cause printed by the rank the "
        "scenario names (`where`: the faulty rank for a fault it raises itself; a waiting rank "
        "where the collective it waits in caught the fault; the launcher for a killed rank); "
        "`caught on` lists the ranks that printed it.  `seconds` is from the fault to the end "
        "of the last rank (median / max over the runs).  Every run uses a 3 s stall timeout "
        "(LAYERBRAID_TIMEOUT=3; the default is 600 s), which the stall scenarios' seconds "
        "include.",
    ]


def _fault_table(rows):
    shown_by = {"faulty": "the faulty rank", "waiting": "a waiting rank", "any": "any rank",
                "job": "the launcher"}
    lines = [
        "",
        "| scenario | what happens | launcher | ranks | ended with the cause | hangs "
        "| seconds (median / max) | where | caught on | cause shown |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, launcher, what, ranks, ok, n, hangs, secs, cause, where, caught in rows:
        s = f"{statistics.median(secs):.2f} / {max(secs):.2f}" if secs else "-"
        lines.append(f"| {scenario} | {what} | {launcher} | {ranks} | {ok}/{n} | {hangs} | {s} | "
                     f"{shown_by[where]} | {', '.join(map(str, caught)) or '-'} | `{cause}` |")
    total = sum(r[5] for r in rows)
    ended = sum(r[4] for r in rows)
    total_hangs = sum(r[6] for r in rows)
    stall = [max(r[7]) for r in rows if r[7] and r[0].startswith(("stall-", "skip-"))]
    other = [max(r[7]) for r in rows if r[7] and not r[0].startswith(("stall-", "skip-"))]
    return lines + [
        "",
        f"{ended} of {total} runs ended with their cause; hangs: {total_hangs}.  Slowest end "
        f"of a job after its fault: {max(stall, default=float('nan')):.1f} s in the stall "
        f"scenarios (timeout {drill.TIMEOUT} s included), "
        f"{max(other, default=float('nan')):.1f} s in the others.",
    ]


def _restart_table(restart_runs):
    """The restart drill's rows: resumed and equal to the uninterrupted run, with the time from
    the kill to the resumed start."""
    lines = [
        "",
        "## Restarts",
        "",
        "The restart drill (`python -m layerbraid.tools.restarts`): a training job that "
        "checkpoints every 2 of its 9 batches and starts with `layerbraid.checkpoint.resume`; "
        "one process is SIGKILLed before batch 5.  `resumed` counts runs in which the job "
        "started again from batch 4, finished, and ended with the weights of a run never "
        "killed (float64, exact, to 1e-12); `kill to resume` is from the kill to the first "
        "process's start in the second attempt (torchrun's restart, the rendezvous, the new "
        "process group and the checkpoint load).  mpiexec has no restarts.",
        "",
        "| mode | what happens | resumed | kill to resume, s (median [min-max]) "
        "| weights' largest difference |",
        "|---|---|---|---|---|",
    ]
    for mode, runs in restart_runs.items():
        ok = sum(not restarts.problems(mode, r) for r in runs)
        lat = sorted(r["resumed"] - r["kill"] for r in runs
                     if r["resumed"] is not None and r["kill"] is not None)
        spread = (f"{statistics.median(lat):.1f} [{lat[0]:.1f}-{lat[-1]:.1f}]" if lat else "-")
        diffs = [r["max_diff"] for r in runs if r["max_diff"] is not None]
        lines.append(f"| {mode} | {restarts.MODES[mode]} | {ok}/{len(runs)} | {spread} | "
                     f"{max(diffs) if diffs else '-'} |")
    return lines

if __name__ == "__main__":
    main()
