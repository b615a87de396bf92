"""layerbraid against pipeline parallelism (torch.distributed.pipelining), side by side.

    python -m bench.vs_pipelining      (writes docs/vs_pipelining.md and .json)

One job per launcher and batch, 2 processes, every system of bench/workers/vs_pipelining.py in
it, interleaved round by round: under torchrun (torch.distributed, gloo), plain PyTorch,
torch.distributed.pipelining's GPipe and 1F1B schedules and layerbraid; under mpiexec (MPI),
plain PyTorch and layerbraid (pipelining needs torch.distributed).  The network: 64 steps
``x + dt * relu(conv2(relu(conv1 x)))`` of 8 channels at 28x28 between a 3x3 convolution in and
a linear layer out, float32, MSE loss, SGD, one thread per process.
"""
import statistics
import time

from bench.harness import DOCS, SAME_LEGEND, generate, launch, parser, pick, provenance, speedup

OUT = DOCS / "vs_pipelining.md"
WORKER = "vs_pipelining"  # bench/workers/vs_pipelining.py

LABELS = {
    "plain": "plain PyTorch, 1 process",
    "gpipe": "pipelining, GPipe, {m} microbatches",
    "1f1b": "pipelining, 1F1B, {m} microbatches",
    "lp": "layerbraid exact, {m} microbatch(es)",
    "lp-mgrit": "layerbraid, 2 MGRIT levels, 1/1 iterations",
}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=pick(20, 2), help="interleaved rounds per job")
    p.add_argument("--batches", type=int, nargs="+", default=pick([50, 10], [10]))
    p.add_argument("--microbatches", type=int, nargs="+", default=pick([2, 5, 10], [2]))
    generate(OUT, measure, report, p, argv)


def measure(a):
    t0 = time.time()
    jobs = []
    for batch in a.batches:
        for torchrun in (True, False):  # torch.distributed (gloo), then MPI
            args = ["--batch", batch, "--rounds", a.rounds, "--steps", pick(64, 16),
                    "--microbatches", *a.microbatches]
            kind = {"launcher": "torchrun"} if torchrun else {}
            if not torchrun:  # pipelining needs torch.distributed
                args += ["--systems", "plain", "lp", "lp-mgrit"]
            jobs.append(launch(WORKER, 2, *args, cores_per_rank=1, **kind)[-1])
    return {**provenance(), "rounds": a.rounds, "seconds": time.time() - t0, "jobs": jobs}


def _label(name):
    family, _, m = name.rpartition("-") if name[-1].isdigit() else (name, "", "")
    return LABELS[family].format(m=m)


def predicted(job, name):
    """The planner's seconds per batch for a row (layerbraid.plan.predict_pipeline, with the
    step costs the job measured at the row's microbatch size), or None for a row it does not
    model this way (the MGRIT row: bench/plan_validation.py validates those)."""
    from layerbraid.plan import Costs, predict_pipeline

    family, _, m = name.rpartition("-")
    if name == "plain" or name == "lp-mgrit" or family not in ("gpipe", "1f1b", "lp"):
        return None
    c = job["costs"]
    step, vjp_param = c["busy"][m]
    alone = c["alone"]
    costs = Costs(step, vjp_param, vjp_param, message_bytes=c["message_bytes"] * job["batch"]
                  / int(m), latency=50e-6, bandwidth=1e9)
    serial = job["steps"] * (alone[0] + alone[1])
    schedule = "1f1b" if family == "1f1b" else "gpipe"
    return predict_pipeline(job["steps"], job["ranks"], int(m), costs, schedule,
                            serial).seconds


def report(data):
    lines = ["# layerbraid against pipeline parallelism", "",
             (__doc__ or "").split("\n\n", 1)[1].strip(), "",
             f"Measured on commit {data['commit']}, {data['date']}, {data['machine']} "
             f"({data['rounds']} rounds per job, {data['seconds']:.0f} s in all).", "",
             "Speedup = plain PyTorch's time / the system's time of the same round (> 1 is "
             "faster), median [min-max] over the rounds; ms per batch likewise (the slowest "
             "process's).  Gradient error: relative, against the serial network's at the "
             "initial weights.  Peak saved MiB: the most bytes the autograd graphs held for the "
             "backward at once, per process (rank 0 / rank 1).  Predicted: the planner's "
             "time (`layerbraid.plan.predict_pipeline`, the bubble model of GPipe and 1F1B "
             "schedules) from a step's forward and VJP seconds that the job measured at the "
             "row's microbatch size with both processes measuring at once; measured / "
             "predicted compares it with the row's median.  " + SAME_LEGEND, ""]
    ratios = []
    best = {}
    for job in data["jobs"]:
        plain = job["times"]["plain"]
        lines += [f"## Batch {job['batch']}, {job['ranks']} processes, "
                  f"{job['transport']}", "",
                  "| system | ms per batch | speedup | gradient error | peak saved MiB "
                  "| predicted ms | measured / predicted |",
                  "|---|---|---|---|---|---|---|"]
        for name, times in job["times"].items():
            med = statistics.median(times)
            cell = speedup(plain, times)[3] if name != "plain" else "1.00"
            peaks = " / ".join(f"{b / 2**20:.0f}" for b in job["peak_bytes"][name])
            guess = predicted(job, name)
            model = "- | -"
            if guess is not None:
                model = f"{1e3 * guess:.0f} | {med / guess:.2f}"
                ratios.append(med / guess)
            lines.append(f"| {_label(name)} | {spread(times)} | {cell} | "
                         f"{job['errors'][name]:.1e} | {peaks} | {model} |")
            exact = name.startswith("lp-") and name != "lp-mgrit"
            family = name.split("-")[0]
            kind = "pipelining" if family in ("gpipe", "1f1b") else "layerbraid" if exact else None
            if kind:
                key = (job["batch"], job["transport"], kind)
                if key not in best or med < best[key][1]:
                    best[key] = (name, med)
        lines.append("")
    lines += ["## Findings", ""]
    for job in data["jobs"]:
        key = (job["batch"], job["transport"])
        lp, pp = best.get((*key, "layerbraid")), best.get((*key, "pipelining"))
        if lp and pp:
            ratio = pp[1] / lp[1]
            lines.append(f"- Batch {key[0]}, {key[1]}: layerbraid's fastest exact row "
                         f"({_label(lp[0])}, {1e3 * lp[1]:.0f} ms) against the fastest "
                         f"pipelining row ({_label(pp[0])}, {1e3 * pp[1]:.0f} ms): "
                         f"{ratio:.2f}x its speed (> 1: layerbraid faster), medians.")
    if ratios:
        lines.append(f"- The planner's pipeline model: measured / predicted "
                     f"{min(ratios):.2f} to {max(ratios):.2f} over the {len(ratios)} modelled "
                     f"rows ({sum(abs(r - 1) <= 0.15 for r in ratios)} within 15%).")
    return lines


def spread(times):
    v = sorted(1e3 * t for t in times)
    return f"{statistics.median(v):.0f} [{v[0]:.0f}-{v[-1]:.0f}]"


if __name__ == "__main__":
    main()
