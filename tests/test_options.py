import pytest

from layerbraid import MGRITOptions


def test_defaults_are_valid_and_frozen():
    o = MGRITOptions()
    with pytest.raises(Exception):
        o.max_levels = 3
    assert o.cfactors() == (4,) and o.nrelaxes() == (0,) and o.skip_first_downcycle


def test_defaults_are_the_command_lines_and_the_planners():
    """One set of defaults: the CLI takes its own from MGRITOptions."""
    import argparse

    from layerbraid import cli

    parser = argparse.ArgumentParser()
    cli.add_lp_arguments(parser)
    fwd, bwd = cli.mgrit_options(parser.parse_args([]))
    o = MGRITOptions()
    for opts in (fwd, bwd):
        assert (opts.max_levels, opts.cfactor, opts.nrelax, opts.skip_first_downcycle,
                opts.cycle) == (o.max_levels, o.cfactor, o.nrelax, o.skip_first_downcycle,
                                o.cycle)


def test_per_level_values():
    o = MGRITOptions(max_levels=3, cfactor=[4, 2], nrelax=(0, 1))
    assert o.cfactor == (4, 2) and o.nrelax == (0, 1)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_levels=0), ["max_levels", "0"]),
    (dict(max_levels=2.0), ["max_levels", "2.0"]),
    (dict(cfactor=1), ["cfactor", "1"]),
    (dict(cfactor=True), ["cfactor", "True"]),
    (dict(max_levels=3, cfactor=(4,)), ["cfactor", "(4,)"]),
    (dict(max_levels=3, cfactor=(4, 1)), ["cfactor[1]", "1"]),
    (dict(max_iters=0), ["max_iters", "0"]),
    (dict(tol=-1.0), ["tol", "-1.0"]),
    (dict(tol=float("nan")), ["tol", "nan"]),
    (dict(rtol=-0.5), ["rtol", "-0.5"]),
    (dict(rtol=float("inf")), ["rtol", "inf"]),
    (dict(nrelax=-1), ["nrelax", "-1"]),
    (dict(cycle="W"), ["cycle", "'W'"]),
    (dict(min_coarse=0), ["min_coarse", "0"]),
    (dict(skip_first_downcycle=1), ["skip_first_downcycle", "1"]),
    (dict(final_fc_relax="yes"), ["final_fc_relax", "'yes'"]),
    # values the C core's ints cannot hold are named here, not as an OverflowError later
    (dict(cfactor=2**40), ["cfactor", "2..2147483647", str(2**40)]),
    (dict(max_levels=3, cfactor=(2, 2**31)), ["cfactor[1]", str(2**31)]),
    (dict(max_iters=2**40), ["max_iters", str(2**40)]),
    (dict(nrelax=2**40), ["nrelax", str(2**40)]),
    (dict(min_coarse=2**40), ["min_coarse", str(2**40)]),
])
def test_bad_values_name_field_and_value(kwargs, words):
    with pytest.raises(ValueError) as info:
        MGRITOptions(**kwargs)
    for w in words:
        assert w in str(info.value)
