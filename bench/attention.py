"""MGRIT on attention: the transformer example trained at several depths, each mode against
serial, with the true gradient error measured along the way and the bias guard beside the fixed
cheap setting.

    python -m bench.attention            (docs/attention.md, .json and .png)
    python -m bench.attention --report   (rewrites them from the last run's raw data)

bench/workers/accuracy.py trains examples/transformer.py's byte-level GPT (width 64, 4 heads,
64-byte windows of the standard library's source, Adam 3e-3, batch 32) with N = 8, 16 and 32
layers on 2 ranks, every mode from the same initial weights on the same batches, the modes
taking turns batch by batch, once per seed: serial (plain PyTorch on one rank), exact (one
MGRIT level: serial's gradients), relaxed1 (2 levels, cfactor 4, 1 forward / 1 adjoint
iteration, the first down-cycle relaxed: the cheapest setting), fixed (2 / 1 iterations, the
first down-cycle skipped), tuned (iterations tuned by ``layerbraid.accuracy.IterationTuner`` to
a probed error of 1e-2) and guard (relaxed1 under ``layerbraid.accuracy.BiasGuard``: windows of
10 batches, a stall with an audited error above 0.05 raises every solve's iterations by one).
Every 10th batch, before the optimizer step, the gradients are compared with exact ones
for the same weights and batch (the true relative error, not timed).
"""
import statistics
import time

from bench.harness import DOCS, generate, launch, parser, pick, provenance, spread

OUT = DOCS / "attention"
WORKER = "accuracy"  # bench/workers/accuracy.py
DEPTHS = pick([8, 16, 32], [8])
SEEDS = pick([0, 1], [0])
MODES = pick(["serial", "exact", "relaxed1", "fixed", "tuned", "guard"],
             ["serial", "relaxed1", "guard"])
BATCHES, LOG_EVERY = pick(60, 4), pick(10, 2)
TARGET = 1e-2
TAIL = pick(10, 2)  # the batches whose mean loss is a run's final loss


def main(argv=None):
    generate(OUT, measure, report, parser(__doc__), argv)


def measure(args=None):
    t0 = time.time()
    runs = []
    for depth in DEPTHS:
        for seed in SEEDS:
            print(f"--- transformer, {depth} layers, seed {seed}", flush=True)
            rows = launch(WORKER, 2, f"transformer{depth}", ",".join(MODES), 1, LOG_EVERY,
                          TARGET, BATCHES, 0, "", seed, echo=False, timeout=4 * 3600)
            runs.append({"depth": depth, "seed": seed, "rows": rows})
    return {**provenance(), "seconds": time.time() - t0, "batches": BATCHES,
            "log_every": LOG_EVERY, "modes": MODES, "runs": runs}


def _rows(run, mode, kind):
    return [r for r in run["rows"] if r.get("mode") == mode and r["kind"] == kind]


def summarize(data):
    """{(depth, mode): {"final": [per seed], "accuracy": [...], "errors": [every logged
    batch's true error], "seconds": [...], "curve": [per seed: losses], "guard": [events]}}."""
    out = {}
    for run in data["runs"]:
        for mode in data["modes"]:
            epoch = _rows(run, mode, "epoch")
            if not epoch:
                continue
            e = epoch[-1]
            s = out.setdefault((run["depth"], mode), {"final": [], "accuracy": [], "errors": [],
                                                      "seconds": [], "curve": [], "guard": []})
            losses = e["batch_losses"]
            s["final"].append(statistics.mean(losses[-TAIL:]))
            s["accuracy"].append(e["test_accuracy"])
            s["seconds"].append(e["seconds"])
            s["curve"].append(losses)
            s["errors"] += [r["grad_error"] for r in _rows(run, mode, "batch")]
            s["guard"] += _rows(run, mode, "guard")
    return out


def report(data):
    s = summarize(data)
    lines = ["# MGRIT on attention", "",
             (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             f"Measured on commit {data['commit']}, {data['date']}, {data['machine']} "
             f"({data['batches']} batches per run, {len(SEEDS)} seed(s), "
             f"{data['seconds']:.0f} s in all).", "",
             f"Final loss: the mean training loss of a run's last {TAIL} batches; each cell "
             "gives the mean over the seeds [min-max].  True gradient error: median [min-max] "
             "over every logged batch of every seed.  Seconds: the whole run's training time "
             "(audits and probes of the log not timed; the tuner's and the guard's own work "
             "timed, as in training).", ""]
    findings = []
    for depth in sorted({d for d, _ in s}):
        serial = s.get((depth, "serial"))
        lines += [f"## {depth} layers", "",
                  "| mode | final loss | minus serial's | test accuracy | true gradient error | "
                  "seconds | guard's actions |", "|---|---|---|---|---|---|---|"]
        for mode in data["modes"]:
            r = s.get((depth, mode))
            if r is None:
                continue
            gap = ([a - b for a, b in zip(r["final"], serial["final"])]
                   if serial and mode != "serial" else None)
            errors = spread(r["errors"], ".1e") if r["errors"] else "-"
            actions = ", ".join(f"{g['action']} at {g['batch']}" for g in r["guard"]) or "-"
            lines.append(f"| {mode} | {_cell(r['final'], '.3f')} | "
                         f"{_cell(gap, '+.3f') if gap else '-'} | "
                         f"{_cell([100 * a for a in r['accuracy']], '.2f')}% | {errors} | "
                         f"{_cell(r['seconds'], '.0f')} | {actions} |")
        lines.append("")
        findings += _findings(depth, s)
    lines += ["## Findings", ""] + findings
    _plot(s, OUT.with_suffix(".png"))
    lines += ["", f"![training curves]({OUT.with_suffix('.png').name})"]
    return lines


def _cell(values, fmt):
    mean = statistics.mean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def _findings(depth, s):
    """Computed from the rows: where each mode trains like serial (its final loss within the
    spread of the seeds around serial's, or within 0.05 where one seed ran), and what the guard
    did against the cheap setting it starts from."""
    serial = s.get((depth, "serial"))
    if not serial:
        return []
    band = max(max(serial["final"]) - min(serial["final"]), 0.05)
    like, unlike = [], []
    for mode in ("exact", "relaxed1", "fixed", "tuned", "guard"):
        r = s.get((depth, mode))
        if r is None:
            continue
        gap = statistics.mean(a - b for a, b in zip(r["final"], serial["final"]))
        (like if gap <= band else unlike).append(f"{mode} ({gap:+.3f})")
    out = [f"- {depth} layers: final loss within {band:.3f} of serial's (the seeds' spread, "
           f"at least 0.05): {', '.join(like) or 'none'}; further: {', '.join(unlike) or 'none'}."]
    guard, cheap = s.get((depth, "guard")), s.get((depth, "relaxed1"))
    if guard and cheap:
        acted = [g for g in guard["guard"] if g["action"] != "kept"]
        out.append(f"- {depth} layers, the guard: {len(guard['guard'])} stall(s) seen, "
                   f"{len(acted)} escalation(s); final loss {statistics.mean(guard['final']):.3f} "
                   f"against relaxed1's {statistics.mean(cheap['final']):.3f} and serial's "
                   f"{statistics.mean(serial['final']):.3f}.")
    return out


def _plot(s, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({d for d, _ in s})
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 3.6), squeeze=False)
    for ax, depth in zip(axes[0], depths):
        for (d, mode), r in sorted(s.items()):
            if d != depth:
                continue
            curves = r["curve"]
            n = min(len(c) for c in curves)
            mean = [statistics.mean(c[k] for c in curves) for k in range(n)]
            line, = ax.plot(range(n), _smooth(mean), label=mode, lw=1.2)
            if len(curves) > 1:
                lo = _smooth([min(c[k] for c in curves) for k in range(n)])
                hi = _smooth([max(c[k] for c in curves) for k in range(n)])
                ax.fill_between(range(n), lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(f"{depth} layers")
        ax.set_xlabel("batch")
        ax.set_ylabel("training loss (5-batch mean)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _smooth(values, k=5):
    return [statistics.mean(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


if __name__ == "__main__":
    main()
