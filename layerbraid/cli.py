"""The ``--lp-*`` flags of layer-parallel training, for the examples and your own scripts.

    parser = argparse.ArgumentParser()
    ...                                             # the script's own flags
    layerbraid.cli.add_lp_arguments(parser)
    args = parser.parse_args()
    layerbraid.cli.check_lp_arguments(parser, args)  # clear errors before any training starts
    forward, backward = layerbraid.cli.mgrit_options(args)

Every rank parses the same argv, so a bad value stops every rank with the same message.  The
examples' own flags (data, training, output, checkpoints) are examples/common.py's.
"""

import argparse
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

from .options import MGRITOptions

__all__ = [
    "add_depth_arguments",
    "add_lp_arguments",
    "depth_schedule",
    "check_lp_arguments",
    "check_lp_launch",
    "mgrit_options",
    "auto_levels",
    "positive_int",
    "nonneg_int",
    "positive_float",
    "nonneg_float",
    "int_at_least",
]


def _number(
    convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str
) -> Callable[[str], Any]:
    """An argparse type: convert the text, then check it, naming the bad value."""

    def parse(text: str) -> Any:
        try:
            v = convert(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_finite = float("inf")
_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_microbatch_count = _number(
    lambda t: "auto" if t == "auto" else int(t),
    lambda v: v == "auto" or v >= 1,
    "a positive integer or auto",
)
_nonneg_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: 0 < v < _finite, "a positive number")
_nonneg_float = _number(float, lambda v: 0 <= v < _finite, "a number >= 0")
_fraction = _number(float, lambda v: 0 < v < 1, "a number between 0 and 1")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= minimum, else a one-line error naming the value."""
    return _number(int, lambda v: v >= minimum, f"an integer >= {minimum}")


# Public argparse types for scripts' own flags (one-line errors that name the bad value).
positive_int, nonneg_int = _positive_int, _nonneg_int
positive_float, nonneg_float = _positive_float, _nonneg_float


def _cfactor(text: str) -> int:
    v = _positive_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"a coarsening factor must be at least 2, got {text!r}")
    return v


def _levels(text: str) -> Any:
    if text == "auto":
        return text
    return _positive_int(text)


_DEFAULT = MGRITOptions()


# Note [flag lists]: add_lp_arguments (and examples/common.py's add_training_arguments) is one
# flat list of add_argument calls, in the order --help prints them.  They run past 60 lines,
# and are read (and extended) more easily as one list than split into groups of functions.
def add_lp_arguments(
    parser: argparse.ArgumentParser,
    *,
    levels: Union[int, str] = _DEFAULT.max_levels,
    cfactor: Union[int, Sequence[int]] = _DEFAULT.cfactor,
    fwd_iters: int = 2,
    bwd_iters: int = 1,
    relax: str = "FCF" if _DEFAULT.nrelax else "F",
    skip: bool = _DEFAULT.skip_first_downcycle,
    audit_every: int = 50,
    microbatches: Union[int, str, None] = None,
) -> argparse._ArgumentGroup:
    """Adds the ``--lp-*`` MGRIT flags.  The defaults are MGRITOptions' (levels, cfactor,
    relaxation, skip, cycle), with 2 forward / 1 adjoint iterations and no residual tolerance;
    a script may change them.  ``--lp-microbatches`` is added where the script gives its
    default (and passes it to its model's ``microbatches``)."""
    g = parser.add_argument_group("layer-parallel MGRIT")
    g.add_argument(
        "--lp-levels",
        type=_levels,
        default=levels,
        metavar="L",
        help="MGRIT levels; 1 = exact sequential stepping across ranks; auto = the "
        "levels (1-4) whose schedule the planner predicts fastest on this many "
        f"ranks with these flags (default {levels})",
    )
    g.add_argument(
        "--lp-cfactor",
        type=_cfactor,
        nargs="+",
        default=[cfactor],
        metavar="CF",
        help="coarsening factor, or one per coarsened level (levels - 1 values) "
        f"(default {cfactor})",
    )
    g.add_argument(
        "--lp-fwd-iters",
        type=_positive_int,
        default=fwd_iters,
        metavar="N",
        help=f"most MGRIT iterations of the forward solve (default {fwd_iters})",
    )
    g.add_argument(
        "--lp-bwd-iters",
        type=_positive_int,
        default=bwd_iters,
        metavar="N",
        help=f"most MGRIT iterations of the adjoint solve (default {bwd_iters})",
    )
    g.add_argument(
        "--lp-tol",
        type=_nonneg_float,
        default=0.0,
        metavar="TOL",
        help="stop a solve early when its residual norm is below TOL; 0 = always run "
        "the set iterations (default 0)",
    )
    g.add_argument(
        "--lp-relax",
        choices=["F", "FCF"],
        nargs="+",
        default=[relax],
        help=f"relaxation, or one per coarsened level (default {relax})",
    )
    g.add_argument(
        "--lp-skip-downcycle",
        action=argparse.BooleanOptionalAction,
        default=skip,
        help=f"skip the work of the first down-cycle (default: {'on' if skip else 'off'})",
    )
    g.add_argument(
        "--lp-cycle",
        choices=["V", "F"],
        default=_DEFAULT.cycle,
        help=f"cycle type (default {_DEFAULT.cycle})",
    )
    g.add_argument(
        "--lp-warm-start",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="start each solve from the previous batch's states (default: off)",
    )
    g.add_argument(
        "--lp-target-error",
        type=_fraction,
        default=None,
        metavar="E",
        help="adaptive iterations: each solve iterates until its estimated relative "
        "error meets its share of E (e.g. 1e-2), at most --lp-fwd-iters / "
        "--lp-bwd-iters times (raise those, e.g. to 10); default: off",
    )
    g.add_argument(
        "--lp-bias-guard",
        type=_nonneg_int,
        default=0,
        metavar="W",
        help="watch the loss in windows of W batches: where it stalls (falls by less than "
        "1%% from one window to the next) and an audit finds a gradient error above "
        "--lp-bias-guard-error, raise every solve's iterations by one, and past 10, "
        "switch to exact solves, logged as it happens (layerbraid.accuracy.BiasGuard); "
        "0: off (default)",
    )
    g.add_argument(
        "--lp-bias-guard-error",
        type=_fraction,
        default=0.05,
        metavar="E",
        help="with --lp-bias-guard, the audited relative gradient error above which a "
        "stall is put down to the gradients (default 0.05)",
    )
    g.add_argument(
        "--lp-tune-error",
        type=_fraction,
        default=None,
        metavar="E",
        help="adaptive iterations aimed with the gradient probe, to keep the true "
        "gradient error below E: at --lp-probe-every's batches (default 20 with "
        "this flag), probe the gradients and move every solve's iterations "
        "to the fewest whose probed error is at most E / --lp-tune-margin: "
        "down by one, or up within the batch until one more iteration changes "
        "the gradients by no more than that (layerbraid.accuracy.IterationTuner); "
        "starts at --lp-fwd-iters / "
        "--lp-bwd-iters, at most 10; default: off",
    )
    g.add_argument(
        "--lp-tune-margin",
        type=_number(float, lambda v: 1 <= v < _finite, "a number >= 1"),
        default=2.0,
        metavar="M",
        help="with --lp-tune-error E, aim the probed error at E / M, room for the "
        "error to drift between probes (default 2; 1 aims at E itself)",
    )
    if microbatches is not None:
        g.add_argument(
            "--lp-microbatches",
            type=_microbatch_count,
            default=microbatches,
            metavar="M",
            help="pipeline each batch through the ranks in M microbatches, so that the ranks "
            "step different microbatches at once (the exact path, and every sweep of MGRIT); "
            "the gradients equal the whole batch's to round-off (MGRIT's at the same "
            "iterations); auto = the count measured fastest on the first batch, among those "
            "the planner predicts near its best (layerbraid.plan.choose_microbatches) "
            f"(default {microbatches})",
        )
    g.add_argument(
        "--lp-smoothness",
        type=_nonneg_float,
        default=0.0,
        metavar="GAMMA",
        help="add GAMMA times the depth-smoothness penalty (the squared change of "
        "the weights from layer to layer, LayerParallelModule.depth_smoothness) "
        "to the loss, which keeps MGRIT's coarse steps close to the fine ones "
        "as the network trains; the serial network gets the same (default 0)",
    )
    g.add_argument(
        "--lp-audit-every",
        type=_nonneg_int,
        default=audit_every,
        metavar="K",
        help="at batches 0, 1, 2, 4, ... below K and then every K-th batch of "
        "the run, compute the exact gradient of the batch as well (one exact "
        "forward and backward) and report the true gradient error; the audits "
        "calibrate the error estimate and adaptive iterations "
        "(layerbraid.accuracy.audit_gradients, layerbraid.accuracy.audit_due); 0 = never "
        f"(default {audit_every})",
    )
    g.add_argument(
        "--lp-probe-every",
        type=_nonneg_int,
        default=None,
        metavar="K",
        help="at the same schedule of batches (0, 1, 2, 4, ... below K, then every "
        "K-th), solve the batch again with one more MGRIT iteration in each "
        "solve and report how much the gradients change: an estimate of their "
        "true error that needs no exact solve and no calibration, at about one "
        "more layer-parallel forward and backward (layerbraid.accuracy.probe_gradients), "
        "the gradient error the epoch lines show; 0 = never, and the epoch "
        "lines show the residuals' calibrated estimate instead (default: 20 "
        "where MGRIT runs more than one level, never with one: it is exact)",
    )
    return g


def add_depth_arguments(
    parser: argparse.ArgumentParser, *, mgopt: bool = True, splines: bool = False
) -> argparse._ArgumentGroup:
    """Adds the ``--lp-nested-*`` flags (nested iteration: train shallower networks first,
    layerbraid.depth); with ``mgopt``, the ``--lp-mgopt-*`` flags (MG/Opt over depths,
    layerbraid.depth.mgopt; for a network that is one layer-parallel module); with ``splines``,
    ``--lp-splines``, ``--lp-spline-degree`` and ``--lp-spline-knots``
    (layerbraid.depth.spline).  Off by default."""
    g = parser.add_argument_group("training over depths, spline steps")
    g.add_argument(
        "--lp-nested-levels",
        type=_positive_int,
        default=1,
        metavar="K",
        help="nested iteration: train the network at --steps / F**(K-1) steps first, "
        "refine it (interpolate its step weights and the optimizer's state) to F times "
        "more steps, train, and so on up to --steps; 1 = off (default 1)",
    )
    g.add_argument(
        "--lp-nested-epochs",
        type=_positive_int,
        nargs="+",
        default=[1],
        metavar="E",
        help="epochs at each shallower depth, one value or one per depth (K - 1 values, "
        "shallowest first), out of --epochs; the rest train at full depth (default 1)",
    )
    g.add_argument(
        "--lp-depth-factor",
        type=int_at_least(2),
        default=2,
        metavar="F",
        help="the factor between the steps of neighbouring depths (default 2)",
    )
    g.add_argument(
        "--lp-depth-interp",
        choices=["linear", "injection"],
        default="linear",
        help="how step weights go from a depth to the next deeper one (default linear)",
    )
    g.add_argument(
        "--lp-nested-freeze",
        action="store_true",
        help="nested iteration: after each refinement, keep the inherited steps (those at "
        "the shallower network's step times) frozen; only the new steps and the layers "
        "around the chain train (default off)",
    )
    if splines:
        g.add_argument(
            "--lp-splines",
            type=_nonneg_int,
            default=0,
            metavar="N",
            help="spline-parameterized steps: the step weights are B-splines in time with N "
            "coefficient sets (at least --lp-spline-degree + 1), whatever the depth; "
            "0 = off, every step its own weights (default 0)",
        )
        g.add_argument(
            "--lp-spline-degree",
            type=int,
            choices=[1, 2, 3],
            default=2,
            help="the splines' degree (default 2)",
        )
        g.add_argument(
            "--lp-spline-knots",
            choices=["clamped", "uniform"],
            default="clamped",
            help="the splines' knots: clamped at the ends, or uniform beyond them as "
            "TorchBraid's SpliNet (default clamped)",
        )
    if not mgopt:
        return g
    g.add_argument(
        "--lp-mgopt-levels",
        type=_positive_int,
        default=1,
        metavar="K",
        help="MG/Opt: each batch a V-cycle over the network at --steps, --steps / F, ... "
        "(K depths), the optimizer on each; 1 = off (default 1)",
    )
    g.add_argument(
        "--lp-mgopt-relax",
        type=_nonneg_int,
        nargs=3,
        default=[1, 1, 2],
        metavar=("PRE", "POST", "COARSE"),
        help="MG/Opt's optimizer steps before and after the coarse correction, and on the "
        "coarsest depth (default 1 1 2)",
    )
    g.add_argument(
        "--lp-mgopt-line-search",
        choices=["backtracking", "alphas", "none", "optimizer"],
        default="backtracking",
        help="how MG/Opt scales the coarse correction (default backtracking)",
    )
    g.add_argument(
        "--lp-mgopt-state",
        choices=["restrict", "keep", "reset"],
        default="reset",
        help="the coarse optimizers' state (momentum, Adam's moments) each batch: reset, "
        "restricted from the finer depth's (which applies the fine momentum again on the "
        "coarse depth), or kept from the coarse depth's own last batch (default reset)",
    )
    return g


def depth_schedule(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``[(steps, epochs)]``, shallowest first: the depths nested iteration trains and the
    epochs at each (one entry, the full depth, when it is off).  Assumes checked flags."""
    k = _flag(args, "lp_nested_levels", 1)
    if k == 1:
        return [(args.steps, args.epochs)]
    f = args.lp_depth_factor
    per = (
        args.lp_nested_epochs * (k - 1)
        if len(args.lp_nested_epochs) == 1
        else args.lp_nested_epochs
    )
    steps = [args.steps // f ** (k - 1 - j) for j in range(k)]
    return list(zip(steps, [*per, args.epochs - sum(per)]))


def _check_depth_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    nested, mg = _flag(args, "lp_nested_levels", 1), _flag(args, "lp_mgopt_levels", 1)
    splines = _flag(args, "lp_splines", 0)
    if splines:
        if splines < args.lp_spline_degree + 1:
            parser.error(
                f"--lp-splines {splines}: degree {args.lp_spline_degree} needs at "
                f"least {args.lp_spline_degree + 1} coefficient sets"
            )
        for flag, bad in (
            ("--serial", _flag(args, "serial", False)),
            ("--lp-mgopt-levels > 1", mg > 1),
            ("--dp-size > 1", _flag(args, "dp_size", 1) > 1),
        ):
            if bad:
                parser.error(f"--lp-splines does not go with {flag} (not supported yet)")
    if _flag(args, "lp_nested_freeze", False) and (
        nested == 1 or mg > 1 or _flag(args, "lp_splines", 0)
    ):
        parser.error(
            "--lp-nested-freeze needs --lp-nested-levels > 1, and neither --lp-mgopt-levels "
            "(MG/Opt's corrections move every step) nor --lp-splines (every step shares the "
            "coefficient sets)"
        )
    if nested == 1 and mg == 1:
        return
    if _flag(args, "serial", False):
        parser.error(
            "--lp-nested-levels and --lp-mgopt-levels train layer-parallel networks: "
            "not with --serial"
        )
    if _flag(args, "resume", None):
        parser.error(
            "--resume does not go with --lp-nested-levels or --lp-mgopt-levels: a "
            "checkpoint holds one depth's network"
        )
    if nested > 1:
        per = args.lp_nested_epochs
        if len(per) not in (1, nested - 1):
            parser.error(
                f"--lp-nested-epochs takes one value or one per shallower depth "
                f"({nested - 1} for --lp-nested-levels {nested}), got "
                f"{' '.join(map(str, per))}"
            )
        total = per[0] * (nested - 1) if len(per) == 1 else sum(per)
        if total >= args.epochs:
            parser.error(
                f"--lp-nested-epochs spends {total} of the {args.epochs} --epochs on "
                "shallower depths: leave at least one for the full depth"
            )
    if mg > 1:
        if _flag(args, "lp_tune_error", None) is not None:
            parser.error(
                "--lp-tune-error does not go with --lp-mgopt-levels: MG/Opt takes "
                "several gradients per batch"
            )
    from .depth import depths  # torch: not at import, so that --help stays quick

    for flag, k in (("--lp-nested-levels", nested), ("--lp-mgopt-levels", mg)):
        try:
            depths(args.steps, k, args.lp_depth_factor)
        except ValueError as exc:
            parser.error(f"{flag} {k}: {exc}")


def _flag(args: argparse.Namespace, name: str, default: Any) -> Any:
    """The value of flag ``name``, or ``default`` where the script's parser lacks it: a script
    may add only some of the groups (``add_lp_arguments``, ``add_training_arguments``)."""
    return vars(args).get(name, default)


def check_lp_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks the parsed ``--lp-*`` flags against each other (and against the script's own
    ``--steps``, ``--epochs``, ``--serial``, ``--dp-size`` and ``--resume`` where it has them);
    a bad combination exits through ``parser.error`` before any training starts.  Sets
    ``--lp-probe-every`` to 20 where ``--lp-tune-error`` is given without it."""
    if _flag(args, "lp_levels", None) == "auto":
        for flag, values in (("--lp-cfactor", args.lp_cfactor), ("--lp-relax", args.lp_relax)):
            if len(values) > 1:
                parser.error(
                    f"--lp-levels auto takes one {flag} value for every level, got "
                    f"{' '.join(map(str, values))}"
                )
    elif "lp_levels" in vars(args):
        coarsened = max(args.lp_levels - 1, 1)
        if len(args.lp_cfactor) not in (1, coarsened):
            parser.error(
                f"--lp-cfactor takes one value or one per coarsened level "
                f"({coarsened} for --lp-levels {args.lp_levels}), got "
                f"{' '.join(map(str, args.lp_cfactor))}"
            )
        if len(args.lp_relax) not in (1, coarsened):
            parser.error(
                f"--lp-relax takes one value or one per coarsened level "
                f"({coarsened} for --lp-levels {args.lp_levels}), got "
                f"{' '.join(args.lp_relax)}"
            )
    if _flag(args, "lp_tune_error", None) is not None:
        if args.lp_target_error is not None:
            parser.error(
                "--lp-tune-error and --lp-target-error are two kinds of adaptive "
                "iterations: give one"
            )
        if not _flag(args, "lp_probe_every", None):
            args.lp_probe_every = 20
        if _flag(args, "lp_bias_guard", 0):
            parser.error("--lp-tune-error and --lp-bias-guard both set the iterations: give one")
    _check_depth_flags(parser, args)


def check_lp_launch(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    steps: Optional[int],
    layer_ranks: int,
    rank: int = 0,
) -> None:
    """Checks the ``--lp-*`` flags against the launch: ``steps`` time steps on ``layer_ranks``
    layer-parallel ranks (over depths, every depth's steps must cover the ranks), and settles
    ``--lp-levels auto`` (the planner's choice, printed on ``rank`` 0).  Every rank computes
    the same answer; errors exit through ``parser.error``."""
    serial = _flag(args, "serial", False)
    for flag in ("--lp-nested-levels", "--lp-mgopt-levels"):
        k = _flag(args, flag[2:].replace("-", "_"), 1)
        if k > 1 and steps is not None:
            from .depth import depths

            try:
                depths(steps, k, args.lp_depth_factor, layer_ranks)
            except ValueError as exc:
                parser.error(f"{flag} {k}: {exc}")
    if _flag(args, "lp_levels", None) == "auto":
        args.lp_levels = 1 if serial or steps is None else auto_levels(args, steps, layer_ranks)
        if rank == 0:
            print(
                f"--lp-levels auto: {args.lp_levels} level(s) for {steps} steps on "
                f"{layer_ranks} layer-parallel rank(s)",
                flush=True,
            )


# The largest hierarchy --lp-levels auto considers.
AUTO_MAX_LEVELS = 4


def auto_levels(args: argparse.Namespace, steps: int, ranks: int) -> int:
    """--lp-levels auto: the levels, 1 to AUTO_MAX_LEVELS, whose forward and adjoint schedules
    with these flags finish first on ``ranks`` ranks as layerbraid.plan replays them, counting
    a step as one unit of time and a VJP as two (three with parameter gradients), messages as
    free; ties go to fewer levels.  Every rank computes the same answer from the same flags: no
    communication.  Measured costs (``python -m layerbraid.tools.plan --measure-conv ...
    --recommend``) can choose better where messages or coarse levels cost differently."""
    from . import plan

    costs = plan.Costs(step_seconds=1.0, vjp_seconds=2.0, latency=0.0)
    best: Optional[tuple[int, float]] = None
    for levels in range(1, AUTO_MAX_LEVELS + 1):
        fwd, bwd = mgrit_options(_with_levels(args, levels))
        seconds = plan.predict(steps, ranks, fwd, bwd, costs).seconds
        if best is None or seconds < best[1]:
            best = (levels, seconds)
    assert best is not None
    return best[0]


def _with_levels(args: argparse.Namespace, levels: Any) -> argparse.Namespace:
    """A copy of the parsed flags with ``--lp-levels levels``."""
    import argparse

    return argparse.Namespace(**{**vars(args), "lp_levels": levels})


def mgrit_options(args: argparse.Namespace) -> tuple[MGRITOptions, MGRITOptions]:
    """(forward, backward) MGRITOptions from parsed ``--lp-*`` flags."""

    def per_level(values: Sequence[Any]) -> Any:
        return values[0] if len(values) == 1 else tuple(values)

    common = dict(
        max_levels=args.lp_levels,
        cfactor=per_level(args.lp_cfactor),
        nrelax=per_level([1 if r == "FCF" else 0 for r in args.lp_relax]),
        tol=args.lp_tol,
        skip_first_downcycle=args.lp_skip_downcycle,
        cycle=args.lp_cycle,
    )
    return (
        MGRITOptions(max_iters=args.lp_fwd_iters, **common),
        MGRITOptions(max_iters=args.lp_bwd_iters, **common),
    )


def model_microbatches(args: argparse.Namespace) -> int:
    """The ``microbatches`` to build a model with from ``--lp-microbatches``: its count, or 1
    while ``auto`` has not chosen yet (:func:`choose_microbatches`)."""
    m = _flag(args, "lp_microbatches", 1)
    return 1 if m == "auto" else int(m)


def choose_microbatches(args: argparse.Namespace, model: Any, x: Any) -> Optional[str]:
    """With ``--lp-microbatches auto``: the fastest microbatch count for batches like ``x``
    (:func:`layerbraid.plan.choose_microbatches`, collective over the model's layer group), set
    on the model and in ``args`` for the networks built later; returns the line to print.  None
    (and nothing done) otherwise; a model that is not layer-parallel keeps one."""
    if _flag(args, "lp_microbatches", 1) != "auto":
        return None
    from .module import LayerParallelModule
    from .plan import choose_microbatches as choose

    if not isinstance(model, LayerParallelModule):
        args.lp_microbatches = 1
        return None
    choice = choose(model, x)
    model.microbatches = args.lp_microbatches = choice.microbatches
    return f"--lp-microbatches auto: {choice.summary()}"
