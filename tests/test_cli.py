"""The --lp-* flags (layerbraid.cli) and the examples' own command line (examples/common.py)
beside them, as the examples parse them."""
import argparse
import sys
from pathlib import Path

import pytest

from layerbraid import MGRITOptions, cli

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import common  # noqa: E402  (examples/common.py, as the examples import it)


def parser():
    p = argparse.ArgumentParser(prog="train")
    common.add_training_arguments(p)
    cli.add_lp_arguments(p)
    return p


def test_defaults_give_valid_options():
    args = common.parse_args(parser(), [])
    fwd, bwd = cli.mgrit_options(args)
    assert isinstance(fwd, MGRITOptions) and fwd.max_levels == 2 and fwd.cfactor == 4
    assert fwd.max_iters == 2 and bwd.max_iters == 1 and fwd.nrelax == 0
    assert fwd.skip_first_downcycle and fwd.cycle == "V"


def test_per_level_values_and_switches():
    args = common.parse_args(parser(), [
        "--lp-levels", "3", "--lp-cfactor", "4", "2", "--lp-relax", "F", "FCF", "--lp-cycle", "F",
        "--no-lp-skip-downcycle", "--lp-fwd-iters", "5", "--lp-bwd-iters", "3", "--lp-tol", "1e-8",
        "--steps", "32", "--channels", "4", "--t-final", "2.5", "--batch-size", "10",
        "--optimizer", "adam", "--lp-warm-start", "--lp-target-error", "1e-2"])
    fwd, bwd = cli.mgrit_options(args)
    assert fwd.cfactor == (4, 2) and fwd.nrelax == (0, 1) and fwd.cycle == "F"
    assert not fwd.skip_first_downcycle and fwd.max_iters == 5 and bwd.max_iters == 3
    assert fwd.tol == 1e-8 and args.steps == 32 and args.t_final == 2.5 and args.lp_warm_start
    assert args.lp_target_error == 1e-2


def test_tuned_iterations_probe_every_twenty_batches_unless_told():
    assert common.parse_args(parser(), ["--lp-tune-error", "1e-2"]).lp_probe_every == 20
    args = common.parse_args(parser(), ["--lp-tune-error", "1e-2", "--lp-probe-every", "4"])
    assert args.lp_tune_error == 1e-2 and args.lp_probe_every == 4
    assert common.parse_args(parser(), []).lp_tune_error is None
    # no flag: the training loop decides (every 20th batch where MGRIT runs several levels)
    assert common.parse_args(parser(), []).lp_probe_every is None
    assert common.parse_args(parser(), ["--lp-probe-every", "0"]).lp_probe_every == 0
    assert args.lp_tune_margin == 2.0
    assert common.parse_args(parser(), ["--lp-tune-margin", "1"]).lp_tune_margin == 1.0


@pytest.mark.parametrize("argv, words", [
    (["--lp-levels", "0"], ["--lp-levels", "'0'"]),
    (["--lp-cfactor", "1"], ["--lp-cfactor", "at least 2", "'1'"]),
    (["--lp-levels", "3", "--lp-cfactor", "2", "2", "2"], ["--lp-cfactor", "2 2 2"]),
    (["--lp-levels", "2", "--lp-relax", "F", "FCF"], ["--lp-relax", "F FCF"]),
    (["--lp-relax", "X"], ["--lp-relax", "'X'"]),
    (["--lp-tol", "-1"], ["--lp-tol", "'-1'"]),
    (["--lp-cycle", "W"], ["--lp-cycle", "'W'"]),
    (["--lp-target-error", "0"], ["--lp-target-error", "'0'"]),
    (["--lp-target-error", "2"], ["--lp-target-error", "'2'"]),
    (["--lp-tune-error", "1"], ["--lp-tune-error", "'1'"]),
    (["--lp-tune-margin", "0.5"], ["--lp-tune-margin", "'0.5'"]),
    (["--lp-tune-error", "1e-2", "--lp-target-error", "1e-2"], ["--lp-tune-error",
                                                               "--lp-target-error"]),
    (["--steps", "0"], ["--steps", "'0'"]),
    (["--lr", "nan"], ["--lr", "'nan'"]),
    (["--batch-size", "ten"], ["--batch-size", "'ten'"]),
    (["--resume", "/no/such/file.pt"], ["--resume", "/no/such/file.pt"]),
    (["--lp-levels", "many"], ["--lp-levels", "'many'"]),
    (["--lp-levels", "auto", "--lp-cfactor", "4", "2"], ["--lp-levels auto", "--lp-cfactor",
                                                         "4 2"]),
])
def test_bad_values_stop_with_a_message_naming_flag_and_value(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        common.parse_args(parser(), argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--lp-levels", "--lp-cfactor", "--lp-fwd-iters", "--lp-bwd-iters", "--lp-tol",
                 "--lp-relax", "--lp-skip-downcycle", "--lp-cycle", "--lp-target-error",
                 "--lp-tune-error", "--lp-tune-margin", "--lp-probe-every",
                 "--steps", "--channels",
                 "--t-final", "--batch-size", "--epochs", "--lr", "--optimizer", "--seed",
                 "--device", "--serial", "--max-batches", "--data-dir", "--checkpoint",
                 "--resume", "--log-interval"):
        assert flag in out
    assert "default" in out


class _Ranks:
    """A stand-in communicator of a given size (check_run reads only its size and rank)."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank


@pytest.mark.parametrize("argv, ranks, steps, words", [
    (["--serial"], 2, None, ["--serial trains in one process"]),
    (["--steps", "2"], 4, None, ["--steps 2", "(4)"]),
    (["--batch-size", "3", "--dp-size", "2"], 1, None, ["--batch-size 3", "--dp-size 2"]),
    ([], 4, 3, ["--length 3", "(4)"]),
    (["--device", "cuda"], 1, None, ["--device cuda", "CUDA is not available"]),
])
def test_check_run_names_the_flag_against_the_launch(argv, ranks, steps, words, capsys):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    args = parser().parse_args(argv)
    with pytest.raises(SystemExit):
        common.check_run(parser(), args, _Ranks(ranks), steps=steps, steps_flag="--length" if steps
                      else "--steps")
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err


def test_check_run_accepts_a_good_launch():
    args = parser().parse_args(["--steps", "4"])
    assert common.check_run(parser(), args, _Ranks(4, 3)).device == "cpu"


def test_auto_levels_take_the_planners_fastest_schedule(capsys):
    """--lp-levels auto: one rank runs exact; on more, the levels whose schedule the planner
    replays fastest (unit step costs), the same on every rank, said once by rank 0."""
    from layerbraid import plan

    args = common.check_run(parser(), common.parse_args(parser(), ["--lp-levels", "auto", "--steps",
                                                              "64"]), _Ranks(1))
    assert args.lp_levels == 1
    for steps, ranks in ((64, 4), (256, 16)):
        argv = ["--lp-levels", "auto", "--steps", str(steps), "--lp-cfactor", "4"]
        chosen = {common.check_run(parser(), common.parse_args(parser(), argv),
                                _Ranks(ranks, r)).lp_levels for r in range(ranks)}
        assert len(chosen) == 1
        costs = plan.Costs(step_seconds=1.0, vjp_seconds=2.0, latency=0.0)
        times = {lv: plan.predict(steps, ranks, *cli.mgrit_options(common.parse_args(
            parser(), ["--lp-levels", str(lv), "--lp-cfactor", "4"])), costs).seconds
            for lv in range(1, cli.AUTO_MAX_LEVELS + 1)}
        assert chosen == {min(times, key=lambda lv: (times[lv], lv))}
        assert chosen != {1}  # 4-16 ranks: a hierarchy beats sequential stepping
    out = capsys.readouterr().out
    assert out.count("--lp-levels auto:") == 3  # rank 0 of each launch


def test_microbatches_are_a_flag_where_the_script_takes_them(capsys):
    p = argparse.ArgumentParser(prog="train")
    cli.add_lp_arguments(p, microbatches=1)
    assert p.parse_args([]).lp_microbatches == 1
    assert p.parse_args(["--lp-microbatches", "4"]).lp_microbatches == 4
    auto = p.parse_args(["--lp-microbatches", "auto"])
    assert auto.lp_microbatches == "auto" and cli.model_microbatches(auto) == 1
    assert cli.model_microbatches(p.parse_args(["--lp-microbatches", "3"])) == 3
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            p.parse_args(["--lp-microbatches", bad])
        assert f"a positive integer or auto, got {bad!r}" in capsys.readouterr().err
    # a script that gives no default has no such flag: it would not pass it to its model
    assert "lp_microbatches" not in vars(common.parse_args(parser(), []))


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_auto_microbatches_choose_once_and_set_the_model_and_the_flag():
    import torch
    from nets import ODEResNet, batch
    from transports import WORLD

    p = argparse.ArgumentParser(prog="train")
    cli.add_lp_arguments(p, microbatches="auto")
    args = p.parse_args([])
    model = ODEResNet(WORLD, num_steps=8, microbatches=cli.model_microbatches(args))
    x = batch(n=8, dtype=torch.float32)[0]
    line = cli.choose_microbatches(args, model, x)
    assert line.startswith("--lp-microbatches auto: microbatches ")
    assert args.lp_microbatches == model.microbatches in (1, 2, 4, 8)
    assert WORLD.allgather(model.microbatches) == [model.microbatches] * WORLD.size
    assert cli.choose_microbatches(args, model, x) is None  # chosen: nothing more to do
    plain = p.parse_args([])
    assert cli.choose_microbatches(plain, torch.nn.Linear(2, 2), x) is None
    assert plain.lp_microbatches == 1  # not layer-parallel: one
