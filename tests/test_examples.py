"""Short real runs of the examples under mpiexec (and torchrun, where a test says so): the loss
must fall."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_data import make_tiny_imagenet
from tolerances import FLOAT32

ROOT = Path(__file__).resolve().parent.parent


def run(ranks, script, *args, timeout=240, launcher="mpiexec"):
    """``script`` on ``ranks`` ranks under ``launcher`` (mpiexec, or torchrun:
    torch.distributed with gloo); 0 ranks: plain python."""
    cmd = ([sys.executable] if ranks == 0 else ["mpiexec", "-n", str(ranks), sys.executable])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks)]
    cmd += [str(ROOT / "examples" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(out_dir):
    return json.loads((Path(out_dir) / "metrics.json").read_text())


def test_mnist_layer_parallel_on_two_ranks_learns(tmp_path):
    proc = run(2, "mnist.py", "--epochs", 1, "--max-batches", 40, "--test-limit", 1000,
               "--log-interval", 10, "--out-dir", tmp_path, "--lp-levels", 2, "--steps", 8,
               "--checkpoint", tmp_path / "ckpt.pt")
    h = metrics(tmp_path)["history"][0]
    assert h["batches"] == 40
    assert sum(h["last_losses"]) / 5 < 0.6 * sum(h["first_losses"]) / 5
    assert h["test_accuracy"] > 0.6
    # the defaults: 1 forward / 1 adjoint iteration with the first down-cycle relaxed, which on
    # the 8 steps' two C-intervals is exact: the estimates and the audit see round-off only
    assert h["fwd_iters"] == 1 and h["bwd_iters"] == 1
    assert 0 <= h["fwd_error_estimate"] <= h["fwd_error_estimate_max"] < 1e-5
    assert 0 <= h["bwd_error_estimate"] <= h["bwd_error_estimate_max"] < 1e-5
    # two levels: the probe is the gradient error shown, by default at batches 0, 1, 2, 4, 8,
    # 16, then every 20th; the residuals' estimates stay in metrics.json only
    assert [p["batch"] for p in h["probes"]] == [0, 1, 2, 4, 8, 16, 20]
    for p in h["probes"]:
        assert 0 <= p["change"] < 1e-5 and p["iterations"] == [[2, 2]] and p["seconds"] > 0
    assert proc.stdout.count("probes (7): the gradients change by") == 1
    assert proc.stdout.count("(it: MGRIT iterations per batch; probes: how much one more") == 1
    assert "est. error" not in proc.stdout
    # the default audits (every 50 batches, and the batches 1, 2, 4, ... before the 50th) are
    # recorded and printed; errors at float32 round-off leave the calibration as it was
    assert [a["batch"] for a in h["audits"]] == [0, 1, 2, 4, 8, 16, 32]
    for audit in h["audits"]:
        assert 0 <= audit["error"] < 1e-6 and audit["seconds"] > 0
        assert audit["calibration"] == 1.0
    assert proc.stdout.count("audits (7): true gradient error median") == 1
    assert (tmp_path / "training_curve.png").stat().st_size > 1000
    assert "test accuracy" in proc.stdout
    # plain PyTorch trained beside it on the first rank, from the same weights on the same
    # batches: this mode is exact, so the two train alike (float32 round-off apart)
    ref = h["serial_reference"]
    assert abs(ref["train_loss"] - h["train_loss"]) < 1e-4, (ref["train_loss"], h["train_loss"])
    assert abs(ref["test_accuracy"] - h["test_accuracy"]) <= 0.002
    assert len(ref["loss_curve"]) == len(h["loss_curve"])
    assert proc.stdout.count("serial reference (plain PyTorch") == 1
    # after training: 10 batches timed layer-parallel and on the serial copy, in this job
    comparison = metrics(tmp_path)["serial_comparison"]
    assert len(comparison["layer_parallel_seconds"]) == len(comparison["serial_seconds"]) == 10
    pairs = zip(comparison["serial_seconds"], comparison["layer_parallel_seconds"])
    assert comparison["pair_speedups"] == [s / p for s, p in pairs]  # each pair's own ratio
    assert sorted(comparison["pair_speedups"])[5] == comparison["speedup"]
    assert proc.stdout.count("serial PyTorch on one rank") == 1
    # resume on one rank from the two-rank checkpoint, for one more epoch
    run(1, "mnist.py", "--epochs", 2, "--max-batches", 10, "--test-limit", 500, "--steps", 8,
        "--out-dir", tmp_path / "resumed", "--resume", tmp_path / "ckpt.pt")
    hist = metrics(tmp_path / "resumed")["history"]
    assert [e["epoch"] for e in hist] == [1, 2]


def test_mnist_serial_runs(tmp_path):
    run(0, "mnist.py", "--serial", "--epochs", 1, "--max-batches", 20, "--test-limit", 500,
        "--steps", 4, "--out-dir", tmp_path)
    h = metrics(tmp_path)["history"][0]
    assert sum(h["last_losses"]) < sum(h["first_losses"])
    assert metrics(tmp_path)["serial"]


def test_mnist_bad_flag_fails_before_training_on_every_rank(tmp_path):
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(ROOT / "examples" / "mnist.py"),
                           "--lp-levels", "3", "--lp-cfactor", "2", "2", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    # every rank stops; the message and the usage are printed once
    assert proc.stderr.count("--lp-cfactor takes one value or one per coarsened level") == 1
    assert proc.stderr.count("usage:") == 1


def test_a_negative_compare_batches_is_one_error_on_every_rank():
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(ROOT / "examples" / "mnist.py"),
                           "--compare-batches", "-1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--compare-batches must be >= 0, got -1") == 1
    assert "Traceback" not in proc.stderr


def test_a_hierarchy_smaller_than_asked_is_said_in_the_header_and_a_warning(tmp_path):
    proc = run(2, "mnist.py", "--steps", 3, "--lp-levels", 10, "--lp-cfactor", 16,
               "--epochs", 1, "--max-batches", 2, "--test-limit", 100, "--out-dir", tmp_path)
    assert proc.stdout.count("1 MGRIT level(s) (exact) [asked for 10 levels, cfactor [16]]") == 1
    # one warning for both solves, once, though the solvers are built again for the batch
    assert proc.stderr.count("asked for 10 MGRIT levels with cfactor 16 over 3 steps") == 1
    assert "the forward and adjoint solves asked for 10" in proc.stderr
    # one level is exact: no probe by default, whatever was asked
    assert metrics(tmp_path)["history"][0]["probes"] == [] and "probes" not in proc.stdout


def test_a_target_error_the_caps_cannot_reach_is_said_once_per_epoch(tmp_path):
    # 1/1 iterations that skip the first down-cycle (with it relaxed, 1/1 is exact here)
    proc = run(2, "mnist.py", "--lp-levels", 2, "--lp-target-error", "1e-6", "--lp-fwd-iters", 1,
               "--lp-bwd-iters", 1, "--lp-skip-downcycle", "--epochs", 2, "--max-batches", 3, "--test-limit", 100,
               "--out-dir", tmp_path, "--lp-audit-every", 0, "--lp-probe-every", 2)
    assert proc.stdout.count("solves ended above their share of --lp-target-error 1e-06") == 2
    assert "raise them to reach the target" in proc.stdout
    # the estimate the target acts on is shown beside the probes
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and all(line.count("est. error") == 2 for line in lines), lines
    # the probes (batches 0, 1, 2, 4 of the run) are recorded and printed: a real change, as
    # 1/1 iterations that skip the first down-cycle leave a real error
    hist = metrics(tmp_path)["history"]
    assert [[p["batch"] for p in h["probes"]] for h in hist] == [[0, 1, 2], [1]]
    for p in hist[0]["probes"] + hist[1]["probes"]:
        assert p["change"] > 1e-6 and p["seconds"] > 0 and p["iterations"] == [[2, 2]]
    assert proc.stdout.count("probes (3): the gradients change by") == 1
    assert proc.stdout.count("probes (1): the gradients change by") == 1


def test_tuned_iterations_follow_the_probe_and_are_recorded(tmp_path):
    """--lp-tune-error: from 1/1 iterations that skip the first down-cycle (a real error) over
    32 steps (8 C-points), a target below float32 round-off (aimed at a quarter of it by
    --lp-tune-margin 4): the first probed batch climbs within the batch, one iteration more at
    a time, to the counts whose change met the aim or to the cap of 10, and the batches after
    it run those counts; the tunings are recorded as the batches' probes,
    on the schedule of 0, 1, 2, 4, and the epoch line names the counts and the aim."""
    proc = run(2, "mnist.py", "--lp-levels", 2, "--lp-tune-error", "1e-9", "--lp-fwd-iters", 1,
               "--lp-bwd-iters",
               1, "--lp-skip-downcycle", "--steps", 32, "--epochs", 1, "--max-batches", 5,
               "--test-limit", 100,
               "--out-dir", tmp_path, "--lp-audit-every", 0, "--lp-probe-every", 4,
               "--lp-tune-margin", 4)
    hist = metrics(tmp_path)["history"]
    probes = hist[0]["probes"]
    aim = 1e-9 / 4
    assert all(p["aim"] == pytest.approx(aim) for p in probes)
    assert [p["batch"] for p in probes] == [0, 1, 2, 4]
    first = probes[0]
    assert first["iterations"] == [[1, 1]] and first["change"] > aim
    assert first["lower_change"] is None
    k = first["tuned"][0][0]
    assert first["tuned"] == [[k, k]] and 3 <= k <= 10, first  # a climb of more than one
    for before, p in zip(probes, probes[1:]):  # every later batch ran the counts set before
        assert p["iterations"] == before["tuned"]
    assert hist[0]["tune_seconds"] == pytest.approx(sum(p["seconds"] for p in probes))
    assert hist[0]["probe_seconds"] == 0
    last = probes[-1]["tuned"][0]
    assert proc.stdout.count(f"--lp-tune-error set the iterations to {last[0]}/{last[1]} "
                             "(forward/adjoint), aiming the probe at 2.5e-10") == 1


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_dahlquist_converges_to_the_sequential_answer(launcher):
    """The general solver over numpy states on 3 ranks, under MPI and under torch.distributed:
    the same residual history, to the sequential answer."""
    proc = run(3, "dahlquist.py", "--steps", 64, "--levels", 3, launcher=launcher)
    err = float(re.search(r"max \|u - sequential\| = (\S+)", proc.stdout).group(1))
    assert err < 1e-9, proc.stdout
    assert "MGRIT on 3 rank(s)" in proc.stdout


@pytest.mark.parametrize("flag, value, words", [
    ("--levels", "0", "expected a positive integer, got '0'"),
    ("--cfactor", "1", "expected an integer >= 2, got '1'"),
    ("--steps", "1", "expected an integer >= 2, got '1'"),
    ("--dt", "nan", "expected a positive number, got 'nan'")])
def test_dahlquist_bad_flags_are_one_line_errors(flag, value, words):
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable,
                           str(ROOT / "examples" / "dahlquist.py"), flag, value],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(words) == 1 and proc.stderr.count("usage:") == 1
    assert "Traceback" not in proc.stderr


def test_mnist_trains_over_depths(tmp_path):
    """Nested iteration (4 then 8 steps, the inherited steps frozen at 8) and MG/Opt (8 over 4
    steps, two data groups) from the flags, 2 ranks."""
    proc = run(2, "mnist.py", "--epochs", 2, "--max-batches", 30, "--test-limit", 500,
               "--compare-batches", 0, "--lp-nested-levels", 2, "--lp-nested-freeze",
               "--out-dir", tmp_path / "nested")
    hist = metrics(tmp_path / "nested")["history"]
    assert [h["batches"] for h in hist] == [30, 30]
    assert proc.stdout.count("nested iteration: 1 epoch(s) at 4 steps, then 1 epoch(s) at 8") == 1
    assert proc.stdout.count(
        "nested iteration: refined to 8 steps (linear, inherited steps frozen)") == 1
    assert hist[1]["train_loss"] < hist[0]["train_loss"]
    # MG/Opt on two data groups (the layer-parallel cycle: tests/test_mgopt.py)
    proc = run(2, "mnist.py", "--epochs", 1, "--max-batches", 20, "--test-limit", 500,
               "--compare-batches", 0, "--lp-mgopt-levels", 2, "--dp-size", 2,
               "--out-dir", tmp_path / "mgopt")
    h = metrics(tmp_path / "mgopt")["history"][0]
    assert len(h["mgopt_alphas"]) == 20 and h["audits"] == [] and h["probes"] == []
    assert sum(h["last_losses"]) < sum(h["first_losses"])
    assert proc.stdout.count("MG/Opt over 8, 4 steps: 1 / 1 optimizer steps") == 1
    assert "line search backtracking, coarse optimizer state reset" in proc.stdout
    assert re.search(r"MG/Opt: the line search took the coarse correction at \d+ of 20", proc.stdout)
    # spline-parameterized steps, refined in depth with their coefficients
    run(2, "mnist.py", "--epochs", 2, "--max-batches", 20, "--test-limit", 500,
        "--compare-batches", 0, "--lp-nested-levels", 2, "--lp-splines", 3,
        "--lp-spline-degree", 1, "--out-dir", tmp_path / "splines")
    hist = metrics(tmp_path / "splines")["history"]
    assert hist[1]["train_loss"] < hist[0]["train_loss"]


@pytest.mark.parametrize("flags, words", [
    (["--lp-nested-levels", 2, "--lp-nested-epochs", 2, "--epochs", 2],
     "--lp-nested-epochs spends 2 of the 2 --epochs on shallower depths"),
    (["--lp-nested-levels", 3, "--lp-nested-epochs", 1, 1, 1, "--epochs", 5],
     "--lp-nested-epochs takes one value or one per shallower depth (2 for"),
    (["--lp-nested-levels", 3, "--steps", 6, "--epochs", 3],
     "--lp-nested-levels 3: 3 depth levels with factor 2: 3 steps are not a multiple of 2"),
    (["--lp-mgopt-levels", 2, "--serial"], "not with --serial"),
    (["--lp-mgopt-levels", 2, "--lp-tune-error", "0.01"], "--lp-tune-error does not go with"),
    (["--lp-splines", 2, "--lp-spline-degree", 2], "--lp-splines 2: degree 2 needs at least 3"),
    (["--lp-splines", 4, "--lp-mgopt-levels", 2], "--lp-splines does not go with --lp-mgopt"),
    (["--lp-nested-freeze"], "--lp-nested-freeze needs --lp-nested-levels > 1"),
])
def test_depth_flags_are_checked_before_training(flags, words):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "mnist.py"), *map(str, flags)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_nested_iteration_needs_a_step_per_rank_at_every_depth():
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(ROOT / "examples" / "mnist.py"),
                           "--steps", "4", "--lp-nested-levels", "3", "--epochs", "3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stderr.count("the coarsest network would have 1 step(s), fewer than the 2") == 1


def test_tiny_imagenet_on_a_miniature_folder_learns(tmp_path):
    data = tmp_path / "tiny-imagenet-200"
    data.mkdir()
    make_tiny_imagenet(data, classes=3, per_class=8, val_per_class=2)
    run(2, "tiny_imagenet.py", "--data-dir", data, "--epochs", 4, "--batch-size", 8,
        "--steps", 2, "--stages", 2, "--channels", 4, "--lr", 0.02, "--optimizer", "adam",
        "--out-dir", tmp_path / "out", "--log-interval", 1, "--lp-levels", 2)
    hist = metrics(tmp_path / "out")["history"]
    assert len(hist) == 4 and not metrics(tmp_path / "out")["synthetic"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]


def test_tiny_imagenet_refines_every_stage(tmp_path):
    data = tmp_path / "tiny-imagenet-200"
    data.mkdir()
    make_tiny_imagenet(data, classes=3, per_class=8, val_per_class=2)
    proc = run(2, "tiny_imagenet.py", "--data-dir", data, "--epochs", 2, "--batch-size", 8,
               "--steps", 4, "--stages", 2, "--channels", 4, "--out-dir", tmp_path / "out",
               "--lp-nested-levels", 2)
    assert proc.stdout.count("nested iteration: refined to 4 steps") == 1
    assert len(metrics(tmp_path / "out")["history"]) == 2


def test_tiny_imagenet_without_data_says_so(tmp_path):
    def fails(*args):
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_imagenet.py"),
                               *map(str, args)], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr

    assert "ships in no package" in fails()
    assert f"--data-dir {tmp_path}: " in fails("--data-dir", tmp_path)
    assert "--max-per-class: expected a positive integer, got '0'" in fails(
        "--max-per-class", 0)


def test_sequence_classification_layer_parallel_equals_serial_in_exact_mode(tmp_path):
    common = ["--task", "synthetic", "--length", "40", "--epochs", "1", "--max-batches", "25",
              "--test-limit", "300", "--log-interval", "5", "--hidden", "16"]
    run(2, "sequence_classification.py", *common, "--lp-levels", "1", "--out-dir", tmp_path / "lp")
    run(0, "sequence_classification.py", *common, "--serial", "--out-dir", tmp_path / "serial")
    lp, ser = metrics(tmp_path / "lp")["history"][0], metrics(tmp_path / "serial")["history"][0]
    # float32 exact mode: the first losses agree to the bit here and the mean over 25 SGD
    # steps to ~5e-9; FLOAT32 leaves a margin for another machine's summation order
    assert lp["first_losses"] == pytest.approx(ser["first_losses"], rel=FLOAT32)
    assert [t for t, _ in lp["loss_curve"]] == [t for t, _ in ser["loss_curve"]]
    assert [v for _, v in lp["loss_curve"]] == pytest.approx([v for _, v in ser["loss_curve"]],
                                                             rel=FLOAT32)
    assert lp["train_loss"] == pytest.approx(ser["train_loss"], rel=FLOAT32)
    assert sum(lp["last_losses"]) < sum(lp["first_losses"])


def test_sequence_classification_with_auto_levels(tmp_path):
    """--lp-levels auto resolves before training, says what it chose, and trains with it."""
    proc = run(2, "sequence_classification.py", "--task", "synthetic", "--length", "64",
               "--epochs", "1", "--max-batches", "3", "--test-limit", "50", "--hidden", "8",
               "--lp-levels", "auto", "--out-dir", tmp_path)
    assert proc.stdout.count("--lp-levels auto: 3 level(s) for 64 steps on 2") == 1, proc.stdout
    assert metrics(tmp_path)["history"]


def test_volumes3d_with_spatial_coarsening_runs_and_checks_its_flags(tmp_path):
    run(2, "volumes3d.py", "--size", 8, "--steps", 4, "--train-size", 64, "--epochs", 2,
        "--max-batches", 4, "--batch-size", 8, "--lp-levels", 2, "--lp-sc-levels", 1,
        "--test-limit", 32, "--out-dir", tmp_path)
    hist = metrics(tmp_path)["history"]
    assert len(hist) == 2 and all(h["batches"] == 4 for h in hist)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "volumes3d.py"),
                           "--lp-levels", "2", "--lp-sc-levels", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--lp-sc-levels 2: levels 1 to 1" in proc.stderr
    # the default is one level (exact stepping), which has no coarse level to coarsen in space
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "volumes3d.py"),
                           "--lp-sc-levels", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--lp-sc-levels 1: --lp-levels 1 has no coarse level" in \
        proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "volumes3d.py"),
                           "--lp-sc-mode", "coarse"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--lp-sc-mode: invalid choice: 'coarse'" in proc.stderr


# Each example at its own defaults (data aside), a few batches, every batch audited: the
# defaults must give gradients within 1e-2 of exact (each is exact today: one level).
DEFAULTS = {
    "mnist.py": ["--compare-batches", 0],
    "sequence_classification.py": ["--task", "synthetic"],
    "volumes3d.py": [],
    "tiny_imagenet.py": ["--synthetic"],
    "transformer.py": ["--text-bytes", 100_000, "--sample-bytes", 0],
}


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
@pytest.mark.parametrize("script", sorted(DEFAULTS))
def test_each_examples_defaults_give_audited_gradients_within_1e_2(script, launcher, tmp_path):
    run(2, script, *DEFAULTS[script], "--epochs", 1, "--max-batches", 3, "--test-limit", 32,
        "--lp-audit-every", 1, "--out-dir", tmp_path, launcher=launcher)
    audits = metrics(tmp_path)["history"][0]["audits"]
    assert [a["batch"] for a in audits] == [0, 1, 2]
    assert max(a["error"] for a in audits) <= 1e-2, audits


def test_the_transformer_learns_the_next_byte_and_writes_a_sample(tmp_path):
    """The GPT-shaped example on 2 ranks at its defaults (exact), a short run: the loss falls,
    the per-byte test accuracy is better than always guessing the commonest byte (a space,
    about 1 in 5 of this source), the serial reference trained beside it ends where it does,
    and a sample continues the prompt."""
    proc = run(2, "transformer.py", "--text-bytes", 300_000, "--max-batches", 60,
               "--test-limit", 64, "--sample-bytes", 40, "--compare-batches", 3,
               "--out-dir", tmp_path)
    h = metrics(tmp_path)["history"][0]
    assert sum(h["last_losses"]) < 0.8 * sum(h["first_losses"]), h
    assert h["test_accuracy"] > 0.25, h
    serial = h["serial_reference"]
    assert abs(serial["train_loss"] - h["train_loss"]) < 1e-3, (serial, h["train_loss"])
    assert re.search(r"^sample: ['\"]def ", proc.stdout, re.M), proc.stdout[-1000:]
    assert "speedup" in proc.stdout
