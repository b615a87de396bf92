"""Gradient accuracy in real training: the true error of every mode's gradients (audits), the
calibrated estimate judged against it, test accuracy and time beside plain PyTorch.

    python -m bench.accuracy            (docs/accuracy.md, .json and .png; about 7 minutes on 2 cores)
    python -m bench.accuracy --report   (rewrites the .md and .png from the last run's raw data, runs/reports/)
    python -m bench.accuracy --only EXAMPLE/MODE [...]   (reruns those into the last run's raw data here)

Four networks, each trained in every mode with the same seed, batches and initial weights, in
one job on 2 ranks: examples/mnist.py's network (its first 100 batches; 8 steps, 2 levels,
cfactor 4, F-relaxation), examples/volumes3d.py's (its first 12 batches; 3 levels, cfactor 2,
spatial coarsening "branch" on levels 1 and 2), examples/sequence_classification.py's GRU on
MNIST rows (its first 100 batches; 2 levels, cfactor 4) and a deeper ReLU conv chain no example
uses by default (mnist's network with 24 steps over T = 2, SGD with momentum, its first 40
batches).  One run of each, one seed: the repetitions are the batches, each mode's paired with
plain PyTorch's, and the spreads below are over them (a full epoch of each, three of volumes3d,
took 85 minutes; twice these batches with the variants below, 20).  Modes: serial (plain
PyTorch on one rank, the speedup reference, without any penalty), exact (one MGRIT level:
sequential stepping across the ranks), fixed (2 forward / 1 adjoint iteration, the first
down-cycle skipped), relaxed (2 forward / 1 adjoint iteration, the first down-cycle relaxed:
the work of a warm solve, from the cold guess), relaxed1 (1 forward / 1 adjoint iteration, the
first down-cycle relaxed), guard (relaxed1 under ``layerbraid.accuracy.BiasGuard``: in windows
of 10 batches, a stall with an audited gradient error above 0.05 raises every solve's
iterations by one; its audits count as training's time), warm (fixed, each solve starting from the previous batch's states
and so not skipping its first down-cycle), warm1 (warm starts at 1
forward / 1 adjoint iteration), smooth (fixed, the loss plus 0.1 times the depth-smoothness
penalty, ``LayerParallelModule.depth_smoothness``), smooth3 (fixed, the penalty at 0.3),
serial_smooth and serial_smooth3 (plain PyTorch on one rank trained with the penalty of smooth
and smooth3: what the penalty alone does to serial training), adaptive (target_error 1e-2, at
most 10 iterations per solve), adaptive_warm (adaptive with warm starts), tuned (``IterationTuner`` at
1e-2 with its default margin 2: from fixed's counts, every 20 batches the probe moves every
solve's iterations to the fewest whose probed error is at most the aim, 1e-2 / 2: down by one,
or above the aim up within the batch, one iteration at a time, until one more changes the
gradients by no more than the aim; the tuner's time counts as training's)
and tuned_warm (tuned with warm starts); the GRU has no warm starts or penalty (its steps share
their weights), relaxed1, guard, warm1, smooth3 and serial_smooth3 run only when asked (``--only
EXAMPLE/MODE``), and so do volumes3d's adaptive_warm and tuned_warm (its slowest modes).  "Serial's final accuracy" is always the unpenalized
serial run's.  The example's default
mode is marked.  The modes take turns batch by batch (bench/workers/accuracy.py), so each
batch's time in a mode is paired with plain PyTorch's on the same batch, measured seconds apart
under the same load: the speedup per batch is plain PyTorch's time for that batch over the
mode's (> 1 is faster), shown as the median and quartiles over the batches beside the speedup
of the whole epochs.  At the batches that ``layerbraid.accuracy.audit_due(batch, AUDIT)`` names (0, 1,
2, 4, ... below AUDIT, then every AUDIT-th, counted over the run)
``layerbraid.accuracy.audit_gradients`` measures the true gradient error and calibrates the estimate;
every LOG-th batch between audits the true error is measured without calibrating (an audit
with ``calibrate=False``) beside the estimate in force, which saw only earlier audits: those
batches judge the estimate, and ``layerbraid.accuracy.probe_gradients`` measures beside it how much
the gradients change with one more iteration of each solve (the probe: an estimate of the error
that needs no calibration), judged at the same batches.  Audits, measurements and probes are
not timed.
"""
import json
import math
import statistics
import subprocess

from layerbraid.accuracy import ROUNDOFF_EPSILONS

from bench.harness import (DOCS, QUICK, ROOT, SAME, SAME_LEGEND, generate, launch, parser,
                           provenance, raw_path, save_data, time_to)

WORKER = "accuracy"  # bench/workers/accuracy.py
TARGET = 1e-2
FLOOR = 1e-5  # float32 round-off of a gradient, and a margin
FACTOR = 3.0  # an estimate "holds" within this factor of the true error, either way
# the depth-smoothness penalty's weight in each penalized mode; serial_MODE trains plain
# PyTorch with MODE's penalty
PENALTIES = {"smooth": 0.1, "smooth3": 0.3}
MODES = ["serial", "exact", "fixed", "relaxed", "relaxed1", "guard", "warm", "warm1", "smooth",
         "smooth3", "serial_smooth", "serial_smooth3", "adaptive", "adaptive_warm", "tuned",
         "tuned_warm"]
# The variants of other modes (one iteration fewer, a stronger penalty): run with --only.
VARIANTS = ("relaxed1", "guard", "warm1", "smooth3", "serial_smooth3")
# volumes3d's slowest modes, warm starts of the searches (mnist and convchain run them)
WARM_SEARCHES = ("adaptive_warm", "tuned_warm")
# Repetitions: the batches below (a run of every mode took 85 minutes at full epochs, 20
# minutes at 200 MNIST and GRU, 24 volumes3d and 80 conv-chain batches with the variants;
# these took 7.2 minutes at commit 97f21d0 on 2 cores, audits included).
RUNS = {"mnist": dict(epochs=1, log_every=10, audit_every=50, max_batches=100,
                      modes=[m for m in MODES if m not in VARIANTS], variants=VARIANTS),
        "volumes3d": dict(epochs=1, log_every=2, audit_every=8, max_batches=12,
                          modes=[m for m in MODES if m not in VARIANTS + WARM_SEARCHES],
                          variants=VARIANTS + WARM_SEARCHES),
        "sequence": dict(epochs=1, log_every=10, audit_every=50, max_batches=100,
                         modes=["serial", "exact", "fixed", "adaptive", "tuned"]),  # no penalty: shared weights
        "convchain": dict(epochs=1, log_every=5, audit_every=20, max_batches=40,
                          modes=[m for m in MODES if m not in VARIANTS], variants=VARIANTS)}
# Each example's default mode: what `mpiexec -n 2 python examples/EXAMPLE.py` runs
# (tests/test_examples.py checks these against the examples' flags); convchain is no example.
DEFAULTS = {"mnist": "exact", "volumes3d": "exact", "sequence": "exact"}
# The levels, iterations and first down-cycle of those modes, as the examples' --help states
# them (levels: 1, or the example's own hierarchy, "more").
MODE_FLAGS = {"exact": {"levels": 1},
              "fixed": {"levels": "more", "fwd_iters": 2, "bwd_iters": 1, "skip": "on"},
              "relaxed1": {"levels": "more", "fwd_iters": 1, "bwd_iters": 1, "skip": "off"}}
if QUICK:
    RUNS = {"mnist": dict(epochs=1, log_every=2, audit_every=3, max_batches=6,
                          modes=["serial", "fixed", "smooth3", "serial_smooth3"])}
OUT = DOCS / "accuracy"


def measure(only=None):
    """Runs every example, all its modes in one job (``only``: those EXAMPLE or EXAMPLE/MODE
    runs, each job with serial, the pairing reference, kept beside the stored runs).  A stored
    run that is not rerun keeps the serial run of its own job as its pairing reference
    (``references``): its batches were timed beside that one, not beside the new serial's."""
    path = raw_path(OUT)  # --only adds to the raw data of the last run here
    if only and not path.exists():  # else the report would keep the asked runs alone
        raise SystemExit(f"--only adds to the last full run's raw data, and {path} does not "
                         "exist here: run python -m bench.accuracy first")
    data = json.loads(path.read_text()) if only else {"target": TARGET, "runs": {}}
    for example, cfg in RUNS.items():
        modes = cfg.get("modes", MODES)
        if only:  # the variants too, where asked for by name
            modes = [m for m in modes if example in only or f"{example}/{m}" in only] + \
                [m for m in cfg.get("variants", ()) if f"{example}/{m}" in only]
            if not modes:
                continue
            modes = ["serial"] + [m for m in modes if m != "serial"]
        print(f"--- {example}: {', '.join(modes)}", flush=True)
        rows = launch(WORKER, 2, example, ",".join(modes), cfg["epochs"], cfg["log_every"],
                      TARGET, cfg["max_batches"], cfg["audit_every"],
                      ",".join(f"{m}={g:g}" for m, g in PENALTIES.items()), echo=False,
                      timeout=4 * 3600)
        when = provenance()
        keep_references(data, example, modes)
        for m in modes:
            data["runs"][f"{example}/{m}"] = [r for r in rows if r.get("mode") == m]
            data.setdefault("measured", {})[f"{example}/{m}"] = when
            last = [r for r in data["runs"][f"{example}/{m}"] if r["kind"] == "epoch"][-1]
            print(f"    {m}: {last['seconds']:.1f} s, test accuracy {last['test_accuracy']:.4f}",
                  flush=True)
        save_data(OUT, data)  # after each example: a failure later keeps what was measured
    return data


def keep_references(data, example, rerun):
    """Before ``rerun`` (modes of ``example``, serial among them) replace their stored runs:
    every stored run of the example that stays keeps the serial run measured in its own job
    (the same provenance) as its pairing reference, unless it has one already; a rerun run
    pairs with the new serial and drops its old reference."""
    refs = data.setdefault("references", {})
    measured = data.get("measured", {})
    old_serial = data["runs"].get(f"{example}/serial")
    for m in MODES:
        key = f"{example}/{m}"
        if m == "serial" or key not in data["runs"]:
            continue
        if m in rerun:
            refs.pop(key, None)
        elif key not in refs and old_serial and \
                measured.get(key) == measured.get(f"{example}/serial"):
            refs[key] = old_serial


def references(data, example, ep):
    """Per mode of ``example`` (its epochs ``ep``), the epochs of the serial run its batches
    were timed beside: its own job's (``references``), else the stored serial run."""
    refs = data.get("references", {})
    return {m: [r for r in refs[f"{example}/{m}"] if r["kind"] == "epoch"]
            if f"{example}/{m}" in refs else ep["serial"] for m in ep}


def paired(epochs_a, epochs_b):
    """Run a's time over run b's, batch by batch (the same batches, measured in turn; with a
    = serial: the speedup per batch), or None when the runs did not keep each batch's time."""
    out = []
    for s, e in zip(epochs_a, epochs_b):
        a, b = s.get("batch_seconds"), e.get("batch_seconds")
        if not a or not b or len(a) != len(b):
            return None
        out += [x / y for x, y in zip(a, b) if y > 0]
    return out or None


def holds(rows):
    """(estimate within FACTOR of the true error, judged) over the logged batches above the
    floor whose estimate was calibrated by an earlier audit; the same for the raw estimate."""
    judged = [r for r in rows if r["kind"] == "batch" and r["grad_error"] > FLOOR
              and r.get("calibrated") and r["estimate"]]
    ok = sum(r["grad_error"] / FACTOR <= r["estimate"] <= r["grad_error"] * FACTOR
             for r in judged)
    raw = sum(r["grad_error"] / FACTOR <= r["raw_estimate"] <= r["grad_error"] * FACTOR
              for r in judged)
    return ok, raw, len(judged)


def probe_holds(rows):
    """(probe within FACTOR of the true error, judged, the probe's mean seconds, the same
    batches' exact measurement's mean seconds) over the logged batches above the floor that
    were probed; None where none was."""
    judged = [r for r in rows if r["kind"] == "batch" and r["grad_error"] > FLOOR
              and r.get("probe") is not None]
    if not judged:
        return None
    ok = sum(r["grad_error"] / FACTOR <= r["probe"] <= r["grad_error"] * FACTOR for r in judged)
    return (ok, len(judged), statistics.mean(r["probe_seconds"] for r in judged),
            statistics.mean(r["audit_seconds"] for r in judged))


def report(data):
    target = data["target"]
    lines = ["# Gradient accuracy in training", "",
             "Generated by `python -m bench.accuracy` (raw data: runs/reports/accuracy.json where it ran, their summary docs/accuracy.json). " +
             __doc__.split("\n\n", 2)[2].replace("\n", " ").strip() + " " + SAME_LEGEND, ""]
    for example in RUNS:
        runs = {m: data["runs"].get(f"{example}/{m}") for m in MODES}
        if not runs["serial"]:
            continue
        ep = {m: [r for r in rows if r["kind"] == "epoch"] for m, rows in runs.items() if rows}
        rows = {m: [r for r in runs[m] if r["kind"] in ("batch", "audit")] for m in ep}
        refs = references(data, example, ep)
        goal = ep["serial"][-1]["test_accuracy"] - 0.01
        lines += [f"## {example} ({len(ep['serial'])} epoch(s), {ep['serial'][0]['batches']} "
                  "batches each)", "",
                  "| mode | s/epoch (min-max over the epochs) | s/batch: median [quartiles] | "
                  "speedup: epochs; per batch, median [quartiles] | final test accuracy | "
                  "time to serial's "
                  "final accuracy - 1 point | true grad error: median / max | calibrated "
                  f"estimate within {FACTOR:g}x (raw alone) | probe within {FACTOR:g}x | "
                  f"true error <= {target:g} | "
                  "iterations fwd / bwd (mean) | audits: s each (share of training) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for m in MODES:
            if m not in ep:
                continue
            secs = [r["seconds"] for r in ep[m]]
            sec = statistics.mean(secs)
            reach = time_to(ep[m], goal)
            per_batch = [t for r in ep[m] for t in r.get("batch_seconds", [])]
            pairs = paired(refs[m], ep[m]) if m != "serial" else None
            ref_sec = statistics.mean(r["seconds"] for r in refs[m])
            row = [f"{m} (the default)" if DEFAULTS.get(example) == m else m,
                   f"{sec:.1f} ({min(secs):.1f}-{max(secs):.1f})",
                   quartiles(per_batch, ".3f") if per_batch else "-",
                   f"{ref_sec / sec:.2f}; " + (quartiles(pairs) + _same(pairs) if pairs else
                                             "1 (the reference)" if m == "serial" else "-"),
                   f"{100 * ep[m][-1]['test_accuracy']:.2f}%",
                   f"{reach:.0f} s" if reach is not None else "not reached"]
            b = rows[m]
            if b:
                errs = [r["grad_error"] for r in b]
                ok, raw, n = holds(b)
                probed = probe_holds(b)
                logged = [r for r in b if r["kind"] == "batch"]
                audits = [r for r in b if r["kind"] == "audit"]
                a_sec = statistics.mean(r["seconds"] for r in audits) if audits else 0.0
                share = a_sec * len(audits) / max(sum(secs), 1e-9)
                row += [f"{statistics.median(errs):.1e} / {max(errs):.1e}",
                        f"{ok}/{n} ({raw}/{n})" if n else "- (no error above the floor)",
                        f"{probed[0]}/{probed[1]}" if probed else "-",
                        f"{sum(e <= target for e in errs)}/{len(errs)}",
                        f"{statistics.mean(r['it_fwd'] for r in logged):.1f} / "
                        f"{statistics.mean(r['it_bwd'] for r in logged):.1f}" if logged else "-",
                        f"{a_sec:.2f} ({100 * share:.0f}%)" if audits else "-"]
            else:  # plain PyTorch: serial, and serial trained with a penalty
                row += ["0 (the reference)" if m == "serial" else "- (plain PyTorch)",
                        "-", "-", "-", "-", "-"]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", _measured(data.get("measured", {}), example, list(ep)),
                  "", f"![true error and estimate per logged batch]({OUT.name}_{example}.png)", ""]
        tunings = {m: [r for r in runs[m] if r["kind"] == "tuning"] for m in ep}
        lines += _findings(example, ep, rows, refs, goal, target, tunings) + [""]
        _plot(example, rows, target)
    lines += _replayed(data) + ["## Reading it", "", FINDINGS]
    return lines


# Calibration rules replayed on the stored runs: (label, the calibration from the audits' ratios
# of true to raw error so far, oldest first, whether every measured batch counts as an audit)
def _geomean3(rs):
    return math.exp(statistics.mean(math.log(r) for r in rs[-3:]))


# (label, calibration from the ratios so far, calibrate from every measured batch, the raw
# estimate it scales: the gradient's, or one solve's alone)
RULES = [("geometric mean of the last 3 (layerbraid's)", _geomean3, False, "raw_estimate"),
         ("the latest audit", lambda rs: rs[-1], False, "raw_estimate"),
         ("median of the last 3", lambda rs: statistics.median(rs[-3:]), False, "raw_estimate"),
         ("the previous measured batch (an audit every LOG batches)", lambda rs: rs[-1], True,
          "raw_estimate"),
         ("the forward's raw estimate alone, geometric mean of the last 3", _geomean3, False,
          "raw_fwd"),
         ("the adjoint's raw estimate alone, geometric mean of the last 3", _geomean3, False,
          "raw_bwd")]
# an audit at float32 round-off leaves the calibration as it is
AUDIT_FLOOR = ROUNDOFF_EPSILONS * 2.0 ** -23


def replay(rows, rule, every_measured=False, field="raw_estimate"):
    """(batches whose estimate ``rule`` would have put within FACTOR of the true error, judged
    batches): the logged batches' raw estimates (``field``) times the calibration that ``rule``
    makes of the audits before them (``every_measured``: of every measured batch before
    them)."""
    ratios, ok, n = [], 0, 0
    for r in rows:
        e, raw = r["grad_error"], r.get(field)
        if r["kind"] == "batch" and ratios and e > FLOOR and raw:
            n += 1
            ok += e / FACTOR <= raw * rule(ratios) <= e * FACTOR
        if (r["kind"] == "audit" or every_measured) and raw and math.isfinite(e) and \
                e > AUDIT_FLOOR:
            ratios.append(e / raw)
    return ok, n


def _replayed(data):
    """The section that replays other calibration rules on every run with judged batches."""
    rows = []
    for key, run in data["runs"].items():
        b = [r for r in run if r["kind"] in ("batch", "audit")]
        counts = [replay(b, rule, every, field) for _, rule, every, field in RULES]
        if b and counts[0][1]:
            rows.append((key, counts))
    if not rows:
        return []
    lines = ["## Calibration rules, replayed", "",
             "Each run's logged batches again, with the estimate calibrated by other rules from "
             "the same audits: judged batches whose estimate is within "
             f"{FACTOR:g}x of the true error.  The first rule is the one the runs used (its "
             "counts are the tables' above, recomputed); in the adaptive modes the iterations "
             "followed that rule's estimate, which a replay cannot change.  The last rule "
             "calibrates each judged batch with the ratio of true to raw error measured at the "
             "logged batch before it, LOG batches earlier, as if every logged batch were an "
             "audit: where even it misses, that ratio moved by more than "
             f"{FACTOR:g}x between two logged batches.  The last two scale one solve's raw "
             "estimate alone (the forward's, the adjoint's) instead of the gradient's, which "
             "adds the two: they show which solve's error the true one follows.", "",
             "| run | " + " | ".join(label for label, _, _, _ in RULES) + " |",
             "|---|" + "---|" * len(RULES)]
    for key, counts in rows:
        lines.append(f"| {key} | " + " | ".join(f"{ok}/{n} ({100 * ok / n:.0f}%)" if n else "-"
                                                for ok, n in counts) + " |")
    lines.append("")
    for k, (label, _, _, _) in enumerate(RULES):
        judged = [counts[k] for _, counts in rows if counts[k][1]]
        met = [ok for ok, n in judged if ok >= 0.9 * n]
        lines.append(f"- {label}: at least 90% in {len(met)} of {len(judged)} runs.")
    return lines + [""]


FINDINGS = f"""- The raw estimate is a solve's own error from its residuals (Note [error estimate] in
  layerbraid/stats.py); the gradient's error also comes from the adjoint being linearized at the
  forward's approximate states.  Neither is exact on a trained network, so the estimate users see
  is the raw one times the ratio of true to raw error measured by the last audits (Note
  [calibrated estimate] in layerbraid/accuracy/audit.py).  The judged batches are those whose true error
  is above {FLOOR:g} (float32 round-off and a margin) and which an earlier audit calibrated.
- The probe (Note [gradient probe] in layerbraid/accuracy/probe.py) is the relative change of the
  gradients when the batch is solved again with one more iteration in each solve (with warm
  starts: continued from the batch's own solution): an iterate's error is what further
  iterations remove, so the change is within 1 / (1 - q) of the error for solves that shrink it
  by q per iteration, with no assumption about the steps and no calibration.  It is judged at
  every logged batch above the floor, the first ones included.
- The tuned modes aim their iterations with the probe (Note [tuned iterations] in
  layerbraid/accuracy/tuner.py): at each of their probes, above the aim the tuner climbs within the
  batch (it solves the batch again with one iteration more in every solve, and again, until
  one more iteration changes the gradients by no more than the aim; the counts become the
  fewest that met it, and the batch trains on the climb's last solve); at a probe at or below
  the aim the batch is solved once more with one fewer, from the cold guess, and the counts go
  down if that change meets the aim.  Their time per batch includes the tuner's.
- An audit costs one exact forward and backward of the batch: about plain PyTorch's time for it,
  spread over the ranks as a pipeline.  A probe costs one layer-parallel forward and backward at
  one iteration more than the batch's."""


def quartiles(values, fmt=".2f"):
    """``median [first-third quartile]`` of ``values``: over hundreds of batches the extremes
    are the first batch's warm-up and the machine's hiccups, the quartiles the batches' spread."""
    q1, med, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{med:{fmt}} [{q1:{fmt}}-{q3:{fmt}}]"


def _same(pairs):
    """The mark of a paired speedup whose quartiles include 1.0."""
    q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
    return f" {SAME}" if q1 <= 1.0 <= q3 else ""


def _measured(measured, example, modes):
    """Which code and date each mode's run was measured on (``--only`` reruns some runs), and
    whether the library and examples differ between those commits."""
    groups = {}
    for m in modes:
        p = measured.get(f"{example}/{m}")
        key = (p["commit"], p["date"][:10]) if p else ("unknown", "")
        groups.setdefault(key, []).append(m)
    text = "; ".join(f"{', '.join(ms)} at {c} on {d}" for (c, d), ms in groups.items())
    commits = sorted({c.removesuffix("+changes") for c, _ in groups if c != "unknown"})
    if len(commits) > 1:
        diff = subprocess.run(["git", "diff", "--name-only", commits[0], commits[-1], "--",
                               "layerbraid", "cbridge", "examples"], cwd=ROOT,
                              capture_output=True, text=True)
        changed = diff.stdout.split()
        text += (".  (git could not compare the commits)" if diff.returncode else
                 ".  The library and the examples differ between these commits in "
                 + ", ".join(changed) if changed else
                 ".  layerbraid/, cbridge/ and examples/ are the same at these commits")
        text += (".  Each run's speedups are paired with the plain PyTorch (serial) run of its "
                 "own job, measured beside it")
    return f"Runs measured: {text}."


def _iterations(rows):
    """Mean (forward, adjoint) MGRIT iterations over the logged batches; None without any."""
    logged = [r for r in rows if r["kind"] == "batch"]
    if not logged:
        return None
    return (statistics.mean(r["it_fwd"] for r in logged),
            statistics.mean(r["it_bwd"] for r in logged))


def _tuned_sentence(m, tunings, seconds, target, measured):
    """What a tuned run's tuner did (its "tuning" rows): where its counts went, how often its
    probe met the aim, its share of the training time (``seconds``, the tuner's
    included), and where the measured batches (``measured``) above the target were."""
    counts = [tuple(t["iterations"][0]) for t in tunings if t["iterations"][0] is not None]
    start = [tuple(tunings[0]["ran"][0])] if tunings[0]["ran"][0] is not None else []
    aim = tunings[0].get("aim", target)  # runs before the margin aimed at the target
    met = sum(t["change"] <= aim for t in tunings)
    moves = sum(t["ran"][0] is not None and tuple(t["ran"][0]) != tuple(t["iterations"][0])
                for t in tunings)
    share = sum(t["seconds"] for t in tunings) / max(seconds, 1e-9)
    climbs = [t for t in tunings if t["change"] > aim]
    text = f"- {m}: the tuner probed {len(tunings)} batches, climbed at {len(climbs)} of them"
    if climbs and all("climb" in t for t in climbs):  # runs before the climb within a batch
        text += f" ({sum(len(t['climb']) for t in climbs)} solve(s) beyond their probes)"
    text += (f" and moved the iterations {moves} times, through "
             + ", ".join(f"{f}/{b}" for f, b in sorted(set(start + counts))))
    if counts:
        text += f", ending at {counts[-1][0]}/{counts[-1][1]}"
    aimed = f"the aim {aim:g} (the target {target:g} over the margin {target / aim:g})" \
        if aim != target else f"the target {target:g}"
    text += (f" (forward/adjoint); at {met} of them ({100 * met / len(tunings):.0f}%) the "
             f"probe met {aimed} at the counts the batch ran; the tuner "
             f"took {100 * share:.0f}% of the training time.")
    probed = {(t["epoch"], t["batch"]) for t in tunings}
    misses = [r for r in measured if r["grad_error"] > target]
    between = [r["grad_error"] / target for r in misses if (r["epoch"], r["batch"]) not in probed]
    if misses:
        at_probe = len(misses) - len(between)
        text += (f" Of the {len(misses)} measured batch(es) above the target, {at_probe} "
                 f"{'was a probed batch' if at_probe == 1 else 'were probed batches'} (above "
                 f"the aim a probed batch trains on the gradients of its climb's last "
                 f"solve)")
        spread = (f"{min(between):.1f}-{max(between):.1f}x" if len(between) > 1 else
                  f"{between[0]:.1f}x" if between else "")
        text += (f" and {len(between)} lay between probes, at {spread} the target."
                 if between else ".")
    return text


def _findings(example, ep, rows, refs, goal, target, tunings=None):
    """Sentences computed from this example's runs (``refs``: each mode's serial run, its
    pairing reference)."""
    out = []
    sec = {m: statistics.mean(r["seconds"] for r in ep[m]) for m in ep}
    acc = {m: ep[m][-1]["test_accuracy"] for m in ep}
    its = {m: _iterations(rows[m]) for m in rows if rows[m]}
    for m in (m for m in MODES if rows.get(m) and its.get(m)):
        errs = [r["grad_error"] for r in rows[m]]
        share = sum(e <= target for e in errs) / len(errs)
        if its[m][0] <= 2.0 and its[m][1] <= 1.0:
            out.append(f"- {m} ({its[m][0]:.1f} / {its[m][1]:.1f} iterations): the true gradient "
                       f"error is at most {target:g} at {100 * share:.0f}% of the {len(errs)} "
                       f"measured batches ({'at least' if share >= 0.9 else 'below'} 90%).")
    for m in (m for m in MODES if (tunings or {}).get(m)):
        out.append(_tuned_sentence(m, tunings[m], sum(r["seconds"] for r in ep[m]), target,
                                   rows.get(m, [])))
    for warm, cold in (("warm", "fixed"), ("warm", "relaxed"), ("warm1", "fixed"),
                       ("warm1", "relaxed1"),
                       ("adaptive_warm", "adaptive"), ("tuned_warm", "tuned"),
                       ("tuned", "adaptive")):
        if warm in sec and cold in sec and its.get(warm) and its.get(cold):
            if refs[warm] == refs[cold]:  # one job: warm's time over cold's, batch by batch
                ratio, how = paired(ep[warm], ep[cold]), "paired"
                epochs = sec[warm] / sec[cold]
            else:  # two jobs: each against its own job's plain PyTorch, batch by batch
                sw, sc = paired(refs[warm], ep[warm]), paired(refs[cold], ep[cold])
                ratio = [c / w for w, c in zip(sw, sc)] if sw and sc else None
                how = "each paired with its own job's plain PyTorch: measured in two jobs"
                epochs = (sec[warm] / _mean_seconds(refs[warm])) / \
                    (sec[cold] / _mean_seconds(refs[cold]))
            per_batch = (f", {quartiles(ratio)}x per batch (median [quartiles], {how})"
                         if ratio else "")
            out.append(f"- {warm} costs {epochs:.2f}x {cold}'s time per epoch"
                       f"{per_batch} "
                       f"({its[warm][0]:.1f} / {its[warm][1]:.1f} against {its[cold][0]:.1f} / "
                       f"{its[cold][1]:.1f} iterations); its median true gradient error is "
                       f"{statistics.median(r['grad_error'] for r in rows[warm]):.1e} against "
                       f"{statistics.median(r['grad_error'] for r in rows[cold]):.1e}.")
    for m in (m for m in MODES if rows.get(m)):
        ok, raw, n = holds(rows[m])
        if n:
            verdict = "meets" if ok >= 0.9 * n else "misses"
            out.append(f"- {m}: the calibrated estimate is within {FACTOR:g}x of the true error "
                       f"at {ok} of {n} judged batches ({100 * ok / n:.0f}%; the raw estimate "
                       f"alone at {raw}), so it {verdict} the 90% this report asks of it.")
        probed = probe_holds(rows[m])
        if probed:
            pok, pn, p_sec, a_sec = probed
            verdict = "meets" if pok >= 0.9 * pn else "misses"
            out.append(f"- {m}: the probe (one more iteration) is within {FACTOR:g}x of the true "
                       f"error at {pok} of {pn} logged batches above the floor "
                       f"({100 * pok / pn:.0f}%, no calibration), so it {verdict} the 90%; a "
                       f"probe took {p_sec:.2f} s, an exact measurement of the same batch "
                       f"{a_sec:.2f} s.")
    out += _penalized(ep, acc, rows, target)
    out += _advice(example, ep, rows, refs, acc, goal, target)
    return [f"### {example}: what the run shows", ""] + out


def _penalized(ep, acc, rows, target):
    """Per penalized mode with its penalized serial run: whether its accuracy gap is the
    penalty's or MGRIT's (the same penalty trained by plain PyTorch, and no penalty)."""
    out = []
    for m, gamma in PENALTIES.items():
        ref = f"serial_{m}"
        if m not in ep or ref not in ep:
            continue
        errs = [r["grad_error"] for r in rows.get(m, [])]
        errors = (f", true gradient error at most {target:g} at "
                  f"{100 * sum(e <= target for e in errs) / len(errs):.0f}% of the measured "
                  f"batches" if errs else "")
        gap, cost = acc[m] - acc[ref], acc[ref] - acc["serial"]
        out.append(f"- {m} (penalty {gamma:g}) reaches {100 * acc[m]:.2f}%{errors}; plain "
                   f"PyTorch with the same penalty {100 * acc[ref]:.2f}%, without it "
                   f"{100 * acc['serial']:.2f}%: MGRIT's share of the difference to serial is "
                   f"{100 * gap:+.2f} points, the penalty's own {100 * cost:+.2f}.")
    return out


def _mean_seconds(epochs):
    return statistics.mean(r["seconds"] for r in epochs)


def _speed(ep, m, refs):
    """A mode's speedup: the median of its per-batch speedups paired with its own job's plain
    PyTorch (``refs[m]``), else that run's time per epoch over its."""
    pairs = paired(refs[m], ep[m])
    if pairs:
        return statistics.median(pairs)
    return _mean_seconds(refs[m]) / _mean_seconds(ep[m])


def _advice(example, ep, rows, refs, acc, goal, target):
    """Which mode to use, from the data: the fastest that trains like serial (final test
    accuracy within 1 point of serial's or above, and the true gradient error at most
    ``target`` at 90% or more of the measured batches); the fastest MGRIT mode among them
    as well when that is the exact one; what misses where none does."""
    lp = [m for m in MODES if m in ep and not m.startswith("serial")]
    close = [m for m in lp if acc[m] >= goal]

    def accurate(m):
        errs = [r["grad_error"] for r in rows.get(m, [])]
        return bool(errs) and sum(e <= target for e in errs) >= 0.9 * len(errs)

    def said(m):
        return (f"{m} (speedup per batch {_speed(ep, m, refs):.2f} on 2 ranks, final test "
                f"accuracy {100 * acc[m]:.2f}%)")

    out = []
    good = [m for m in close if accurate(m)]
    if good:
        best = max(good, key=lambda m: _speed(ep, m, refs))
        out.append(f"- Use {said(best)}: the fastest of the modes that train like serial here "
                   f"(final test accuracy within 1 point of serial's {100 * acc['serial']:.2f}% "
                   f"or above, true gradient error at most {target:g} at 90% or more of the "
                   f"measured batches): {', '.join(good)}.")
        mgrit = [m for m in good if m != "exact"]
        if best == "exact" and mgrit:
            fast = max(mgrit, key=lambda m: _speed(ep, m, refs))
            out.append(f"- The fastest MGRIT mode (2 or more levels) among them: {said(fast)}; "
                       "on 2 ranks MGRIT's iterations cost more than the exact pipeline saves, "
                       "they pay on more ranks (docs/scaling.md).")
    elif close:
        best = max(close, key=lambda m: _speed(ep, m, refs))
        out.append(f"- No mode met both bars (final test accuracy within 1 point of serial's "
                   f"{100 * acc['serial']:.2f}%, true gradient error at most {target:g} at 90% "
                   f"of the measured batches); within 1 point: {', '.join(close)}.  Use "
                   f"{said(best)}, the fastest of those, and audit its gradients "
                   "(`--lp-audit-every`).")
    else:
        out.append(f"- No layer-parallel mode came within 1 point of serial's final test accuracy "
                   f"({100 * acc['serial']:.2f}%): " + ", ".join(
                       f"{m} {100 * acc[m]:.2f}%" for m in lp) + ".")
        if lp:
            best = max(lp, key=lambda m: acc[m])
            out.append(f"- Use {said(best)}, the closest to serial here, and audit its gradients "
                       "(`--lp-audit-every`): no mode measured here trains like serial.")
    default = DEFAULTS.get(example)
    if default in ep:
        verdict = ("trains like serial by both bars" if default in good else
                   "misses the gradient bar" if default in close else
                   "misses serial's accuracy by more than 1 point")
        out.append(f"- The example's default, {said(default)}, {verdict}.")
    return out


def _plot(example, rows, target):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, m in enumerate(m for m in MODES if rows.get(m)):
        b = [r for r in rows[m] if r["kind"] == "batch"]
        x = list(range(len(b)))
        ax[0].semilogy(x, [r["grad_error"] for r in b], "o-", ms=2, color=f"C{k}",
                       label=f"{m}: true")
        ax[0].semilogy(x, [r["estimate"] for r in b], ":", color=f"C{k}",
                       label=f"{m}: calibrated estimate")
        ax[1].plot(x, [r["it_fwd"] + r["it_bwd"] for r in b], "o-", ms=2, color=f"C{k}", label=m)
    ax[0].axhline(target, color="k", lw=0.8, ls="--", label="adaptive target")
    ax[0].set_xlabel("logged batch")
    ax[0].set_ylabel("relative parameter-gradient error")
    ax[0].legend(fontsize=6, ncol=2)
    ax[1].set_xlabel("logged batch")
    ax[1].set_ylabel("MGRIT iterations (forward + adjoint)")
    ax[1].legend(fontsize=7)
    fig.suptitle(example)
    fig.tight_layout()
    fig.savefig(f"{OUT}_{example}.png", dpi=72)  # under 100 kB a figure
    plt.close(fig)


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--only", nargs="+", metavar="EXAMPLE/MODE",
                   help="rerun these runs, keeping the stored ones of the others")
    generate(OUT, lambda a: measure(a.only), report, p)
