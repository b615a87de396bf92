"""The GPU check: one command for a machine with a CUDA device, about 6 minutes on one GPU.

    python -m bench.gpu            (docs/vs_pipelining.md's section "gpu", and its raw data)
    python -m bench.gpu --report   (rewrites that section from the last run's raw data)

1. The CUDA tests (tests/test_cuda.py): one process, then its multi-rank tests in one mpiexec
   job per rank count, as ``make test`` runs them; their pass/fail counts go in the section.
2. The 2-process rows of docs/vs_pipelining.md on the GPU (bench/workers/vs_pipelining.py with
   ``--device cuda``: rank r on GPU r % count, so both processes share a one-GPU machine's GPU):
   under mpiexec, plain PyTorch (one process) and layerbraid exact in 1, 2 and 5 microbatches
   (every message staged through host memory); under torchrun, torch.distributed.pipelining's
   GPipe and 1F1B in 2 and 5 microbatches, where its transport carries CUDA tensors between two
   processes (gloo; a row that cannot run says why, as the job reported it).

The section names the device and the commit; speedups are plain PyTorch's time over the row's in
the same job, median [min-max] over the rounds.
"""
import re
import statistics
import subprocess
import sys
import time

from bench.harness import (DOCS, launch, load_raw, mpiexec, parser, provenance, save_data,
                           write_section)

OUT = DOCS / "vs_pipelining.md"
RAW_NAME = DOCS / "vs_pipelining_gpu.md"  # its raw data: runs/reports/vs_pipelining_gpu.json
BATCH, ROUNDS, MICROBATCHES = 50, 10, ["2", "5"]
TEST_LIMIT = 240  # seconds for each pytest job


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--report", action="store_true",
                   help="rewrite the section from the last run's raw data")
    a = p.parse_args(argv)
    data = load_raw(RAW_NAME) if a.report else measure()
    if not a.report:
        save_data(RAW_NAME, data)
    write_section(OUT, "gpu", section(data))


def measure():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA device: torch.cuda.is_available() is False")
    t0 = time.time()
    tests = run_tests()
    common = ["--batch", BATCH, "--rounds", ROUNDS, "--warmup", 2, "--device", "cuda",
              "--microbatches", *MICROBATCHES]
    jobs = {
        "MPI": launch("vs_pipelining", 2, *common, "--systems", "plain", "lp", echo=False),
        "torch.distributed (gloo)": launch("vs_pipelining", 2, *common, "--systems", "plain",
                                           "gpipe", "1f1b", echo=False, launcher="torchrun"),
    }
    return {**provenance(), "device": torch.cuda.get_device_name(0),
            "gpus": torch.cuda.device_count(), "tests": tests,
            "jobs": {k: v[-1] for k, v in jobs.items()}, "seconds": time.time() - t0}


def run_tests():
    """[(what ran, its summary line, exit code)]: the CUDA tests as ``make test`` runs them
    (each job through harness.mpiexec; one process first, as a singleton job)."""
    py = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    runs = [("one process", 1, "not shared_job or parallel[1]")]
    runs += [(f"{n} ranks, mpiexec", n, f"shared_job and parallel[{n}]") for n in (2, 3, 4)]
    out = []
    for what, ranks, marks in runs:
        try:
            proc = mpiexec(ranks, [*py, "-m", marks], timeout=TEST_LIMIT, check=False)
            text, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired:
            text, code = f"timed out after {TEST_LIMIT} s", -1
        lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|"
                                                             r"deselected)|timed out", ln)]
        out.append((what, lines[-1].strip("= ") if lines else text[-300:], code))
        print(f"--- tests/test_cuda.py, {what}: {out[-1][1]}", flush=True)
    return out


def spread(times):
    ms = sorted(1000 * t for t in times)
    return f"{statistics.median(ms):.1f} [{ms[0]:.1f}-{ms[-1]:.1f}]"


def section(data):
    lines = ["## On a GPU", "",
             f"`python -m bench.gpu` on commit {data['commit']}, {data['date']}: "
             f"{data['device']} ({data['gpus']} GPU(s)), {data['machine']}; "
             f"{data['seconds']:.0f} s.  Both processes of a job share GPU 0 when there is one; "
             "layerbraid's messages are staged through host memory under MPI.", "",
             "| tests/test_cuda.py | result | exit code |", "|---|---|---|"]
    lines += [f"| {what} | {summary} | {code} |" for what, summary, code in data["tests"]]
    lines += ["", f"Batch {BATCH}, {ROUNDS} rounds per job; speedup = plain PyTorch's time "
              "(one process, same job) / the row's, per round.", "",
              "| transport | system | ms per batch | speedup | gradient error |",
              "|---|---|---|---|---|"]
    for transport, job in data["jobs"].items():
        plain = job["times"].get("plain")
        for name, times in job["times"].items():
            speed = "-"
            if plain:
                ratios = sorted(p / t for p, t in zip(plain, times))
                speed = f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            lines.append(f"| {transport} | {name} | {spread(times)} | {speed} | "
                         f"{job['errors'][name]:.1e} |")
        for name, why in job.get("failed", {}).items():
            lines.append(f"| {transport} | {name} | not run: {why} | - | - |")
    return lines


if __name__ == "__main__":
    main()
