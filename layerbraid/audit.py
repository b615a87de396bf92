"""Gradient audits: the true error of a layer-parallel gradient, measured in training.

Note [calibrated estimate]: a gradient's error estimate from the residuals (Note [error
estimate], stats.py) assumes steps that neither amplify nor damp errors, and measures the error
of the last state only; on trained networks it was seen off by up to a few hundred times either
way.  An audit computes the exact gradient for the same batch and weights (one-level solves:
sequential stepping across the ranks) and the true relative error of the approximate one.  The
ratio ``true / raw estimate`` changes slowly as a network trains, so the model keeps the
geometric mean of the last ``history`` audits' ratios as its calibration ``k``: from then on
every solve's ``SolveStats.error_estimate`` is ``k`` times its raw estimate, and adaptive
iterations (``target_error``) aim with the calibrated number.  Audits that measure an error at
round-off (at most 10 machine epsilons of the gradients' dtype) leave the calibration as it is:
converged float32 solves were measured at relative gradient errors up to about 2 epsilons,
while the ratio of errors a few times above that was as steady as at larger ones.

Note [audit schedule]: the ratio moves most in the first batches of training, as the weights
leave their initialization (a network at its initialization has nearly identity steps, which
the raw estimate assumes), and slowly afterwards.  So ``audit_due`` audits the batches 0, 1, 2,
4, 8, ... below ``every`` (a handful of extra audits, once), then every ``every``-th batch: the
calibration follows the network out of its initialization instead of keeping the first audit's
ratio for ``every`` batches.

Note [gradient probe]: an iterate's error is what further iterations remove.  If the solves
shrink the gradients' error by a factor q per iteration, one more iteration changes the
gradients by between (1 - q) and (1 + q) times their error, so the change estimates the error
within a factor 1 / (1 - q) (within 3x for q <= 2/3), measured in the gradients themselves:
it needs neither the residual estimate's assumption of steps that neither amplify nor damp nor
a calibration.  ``probe_gradients`` re-solves the batch with one iteration more in each
multilevel solve: without warm starts from the same cold guess, so that the first iterations
repeat the batch's and the change is that of one iteration, ``g_{k+1} - g_k``; with warm starts
from the batch's own solution, for k + 1 iterations more (``g_{2k+1} - g_k``, closer still to
the error).  It cannot see an error that iterations do not reduce (q near 1: a stalled solve,
whose SolveStats.contraction is near 1).  Its cost is one layer-parallel forward and backward at
k + 1 iterations: about (k + 1) / k times a training batch's solves, where an audit's exact
solve steps the whole network in sequence.

Note [tuned iterations]: adaptive iterations aimed with the probe, the estimate that holds
where the residuals' does not (docs/accuracy.md).  At the probe's batches (``audit_due``'s
schedule) ``IterationTuner`` probes the batch: the change with one iteration more in every
solve estimates the error at the counts the batch ran.  The tuner aims below the target, at
``target / margin`` (the aim; margin 2 by default): the counts it settles at met the aim at a
probe, but the network keeps training between probes and its error drifts, so the margin is
the room for that drift (and for the probe's own factor against the truth) before the error
crosses the target, paid for with an iteration more where the probe lies between the aim and
the target.  Below, a probe "meets" the aim when it is at most the aim.  Above the aim, the
tuner climbs within the batch: it has the gradients at k + 1 iterations (the probe's), solves
the batch again at k + 2 and compares (``g_{k+2} - g_{k+1}``, the estimate at k + 1), and so
on, one iteration more each time, until a change meets the aim or every count is at
``max_iterations``; the counts become the fewest whose change met the aim, and the batch
trains on the climb's last solve (one iteration further still, and already paid for), whose
solve statistics and warm-start states become the model's as well, so that an audit of the
batch, its logged iterations and the next warm start describe the gradients it trains on.
An earlier version climbed one count per batch, probing every batch until a probe met the
aim; the batches of such a climb trained on gradients that had not met it (on the GRU of
docs/accuracy.md, its first three batches, whose true error was 0.2-0.95 while the counts
climbed from 2/1 to 8/7).  At a probe that meets the aim, the tuner solves the batch once more
with one iteration fewer in every solve that runs more than one, from the cold guess, and
compares with the batch's gradients: that change is the probe the lower counts would get
(``g_k - g_{k-1}``), so if it meets the aim the counts go down by one; with warm starts it is
an upper bound where they help (a cold solve at k - 1 iterations, which the batch's own
solution cannot measure).  A climb does not try one fewer (that count has just failed); the
next probe does.  So the counts settle at the fewest whose probed error meets the aim and
follow the network as it trains.  Between probes every solve runs exactly its count (no
stopping rule).  The cost per probed batch: the probe, about (k + 1) / k times the batch's
solves, and at most one more solve at k - 1 iterations; a climb of j counts costs j solves
more, at k + 2, ..., k + j + 1 iterations.
"""

import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from ._comm import allreduce_floats
from ._parts import (
    ExactSolve,
    ProbeSolve,
    TunedSolve,
    counted_parameters,
    layer_parallel_parts,
)

__all__ = [
    "GradientAudit",
    "GradientProbe",
    "IterationTuner",
    "Tuning",
    "audit_gradients",
    "audit_due",
    "probe_gradients",
]

ROUNDOFF_EPSILONS = 10  # an audit's error at or below this many epsilons is round-off


@dataclass
class GradientAudit:
    """What one audit measured (the same on every rank of the layer group).

    Attributes:
        error: the true relative 2-norm error of all parameter gradients, as the backward left
            them, against the exact gradients of the same batch and weights.
        estimate: ``gradient_error_estimate`` for those gradients (calibrated by the earlier
            audits), summed over the model's layer-parallel parts; None if a part had none.
        raw_estimate: the same from the residuals alone.
        calibration: the calibration in force after this audit (Note [calibrated estimate]).
        calibrated: whether ``estimate`` was calibrated by earlier audits (the first audit
            sees the raw estimate).
        seconds: the audit's time: an exact forward and backward of the batch, about what
            plain PyTorch takes for them, plus the gradient comparison.
    """

    error: float
    estimate: Optional[float]
    raw_estimate: Optional[float]
    calibration: float
    calibrated: bool
    seconds: float

    @property
    def ratio(self) -> Optional[float]:
        """``estimate / error`` (1 is a perfect estimate); None where either is missing or 0."""
        if not self.estimate or not self.error:
            return None
        return self.estimate / self.error


@dataclass
class GradientProbe:
    """What one probe measured (the same on every rank of the layer group).

    Attributes:
        change: the relative 2-norm change of all parameter gradients, ``|g' - g| / |g'|``,
            where ``g`` are the gradients the last backward left and ``g'`` those of the same
            batch and weights with every multilevel solve iterated further (Note [gradient
            probe]): the probe's estimate of ``g``'s true relative error.  0.0 where every
            part solves exactly.
        iterations: per layer-parallel part, the (forward, adjoint) iterations the probe ran;
            None for a part that solves exactly (it is not probed).
        seconds: the probe's time: a layer-parallel forward and backward of the batch at those
            iterations, plus the comparison.
    """

    change: float
    iterations: list
    seconds: float


def audit_due(batch: int, every: int) -> bool:
    """Whether training batch ``batch`` (counted from 0 over the whole run, not per epoch)
    is one to audit when auditing every ``every`` batches: the batches 0, 1, 2, 4, 8, ...
    below ``every``, then every ``every``-th (Note [audit schedule]).  ``every`` 0 audits none.
    """
    for name, v in (("batch", batch), ("every", every)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if every == 0:
        return False
    return batch % every == 0 or (batch < every and batch & (batch - 1) == 0)


def audit_gradients(model, closure, *, history: int = 3, calibrate: bool = True) -> GradientAudit:
    """Measures the true error of the gradients the last backward left, and calibrates the
    model's error estimate with it (Note [calibrated estimate]).

    Call it after ``loss.backward()`` and before ``optimizer.step()``, with a ``closure`` that
    computes the same batch's loss again (``lambda: F.cross_entropy(model(x), y)``), on every
    rank of the layer group (collective).  The closure runs once with every layer-parallel
    part of ``model`` solving exactly, and its backward gives the exact gradients; then the
    gradients, the buffers (batch-norm statistics) and the solve statistics are put back as they
    were: training goes on as if no audit had run.  It costs one exact forward and backward of
    the batch (``GradientAudit.seconds``).

    The comparison assumes the gradients hold this batch's alone (``zero_grad()`` before its
    forward) and that the closure's forward repeats the batch's: layers that draw random numbers
    (dropout) draw new ones, and their noise then counts as error.

    Args:
        model: an ``nn.Module`` that is, or contains, layer-parallel modules.
        closure: computes the batch's loss from ``model`` (no backward, no optimizer step).
        history: how many of the latest audits the calibration averages.
        calibrate: False measures only, leaving the calibration as it is.

    Returns:
        A :class:`GradientAudit`, the same on every rank.
    """
    if not isinstance(history, int) or isinstance(history, bool) or history < 1:
        raise ValueError(f"history must be an int >= 1, got {history!r}")
    if not isinstance(calibrate, bool):
        raise ValueError(f"calibrate must be True or False, got {calibrate!r}")
    parts = _parts(model, "audit_gradients")
    comm, counted = counted_parameters(model)
    t0 = time.perf_counter()
    raw = _sum_or_none(p._raw_gradient_error_estimate() for p in parts)
    estimate = _sum_or_none(p.gradient_error_estimate() for p in parts)

    kept: list = []

    def exactly(on):
        _switch_modes(parts, [ExactSolve()] * len(parts) if on else None, kept)

    exact = _gradients_with(model, parts, closure, exactly)
    num, den, eps = _difference(counted, exact)
    if comm is not None and comm.Get_size() > 1:
        num, den = allreduce_floats(comm, [num, den], "sum", "a gradient audit")
        (eps,) = allreduce_floats(comm, [eps], "max", "a gradient audit")
    # the same on every rank, bit for bit: each rank's adaptive stopping rule uses it
    error = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    calibrated = bool(parts[0].audit_ratios)
    if calibrate:
        calibration = _calibrate(parts, error, raw, eps, history)
    else:
        calibration = _calibration(parts[0].audit_ratios)
    return GradientAudit(error, estimate, raw, calibration, calibrated, time.perf_counter() - t0)


def probe_gradients(model, closure) -> GradientProbe:
    """Measures how much the gradients the last backward left change when every layer-parallel
    solve of the batch iterates further (Note [gradient probe]): an estimate of their error that
    needs no exact solve and no calibration.

    Call it where ``audit_gradients`` is called (after ``loss.backward()``, before
    ``optimizer.step()``, on every rank of the layer group, with a ``closure`` that computes the
    same batch's loss again).  The closure runs once with each part's solves at one iteration
    more than the batch's last solves ran, from the same cold guess or, with warm starts, from
    the batch's own solution; then the gradients, the buffers, the solve statistics and the
    warm-start states are as they were.  It costs one layer-parallel forward and backward of the
    batch at those iterations (``GradientProbe.seconds``).

    Returns:
        A :class:`GradientProbe`, the same on every rank.
    """
    return _probe(model, closure)[0]


def _probe(model, closure):
    """``probe_gradients``, the probe's gradients ({id(p): gradient}) and what its solves
    left per part (``_solve_at``)."""
    parts = _parts(model, "probe_gradients")
    probed = [
        None if its is None else (its[0] + 1, its[1] + 1) for its in (_iterations(p) for p in parts)
    ]
    t0 = time.perf_counter()
    more, left = _solve_at(model, parts, closure, probed)
    now = {id(p): p.grad for p in model.parameters()}
    change = _relative_change(model, now, more, "a gradient probe")
    return GradientProbe(change, probed, time.perf_counter() - t0), more, left


@dataclass
class Tuning:
    """What ``IterationTuner`` measured and did at one probed batch (the same on every rank).

    Attributes:
        change: the probe at the counts the batch ran (``GradientProbe.change``): the estimate
            of its gradients' relative error.  Above ``aim`` the tuner climbed (``climb``).
        lower_change: the gradients' relative change with one iteration fewer in every solve
            that runs more than one (from the cold guess): the error estimate at the lower
            counts; None where the tuner did not try them (``change`` above the aim, or no
            solve above one iteration).
        ran: per layer-parallel part, the (forward, adjoint) iterations of the batch; None for
            a part that solves exactly.
        iterations: per part, the counts from the next batch on.
        seconds: the tuner's time at this batch (the probe, the climb's solves and the lower
            solve).
        aim: the probed error the tuner held the counts to (``target / margin``).
        climb: where ``change`` is above the aim, the error estimates of the counts the tuner
            climbed through: the j-th (from 0) is the gradients' change from ``ran`` + j + 1
            to ``ran`` + j + 2 iterations in every solve (capped at ``max_iterations``), the
            estimate at ``ran`` + j + 1.  It stops at the first that meets the aim (those
            counts are ``iterations``) or where every count is at ``max_iterations``; the
            batch trains on the gradients of its last solve.  Empty where the probe met the
            aim.
    """

    change: float
    lower_change: Optional[float]
    ran: list
    iterations: list
    seconds: float
    aim: float
    climb: list = field(default_factory=list)


class IterationTuner:
    """Adaptive iterations aimed with the gradient probe (Note [tuned iterations]): every
    layer-parallel solve of ``model`` runs a fixed number of iterations, which the tuner moves
    to the fewest whose probed gradient error is at most the aim, ``target / margin`` (down by
    one at a probe, up as far as a climb within the batch takes them), so that the true error
    stays below ``target`` between probes.

    Call it at every batch, after ``loss.backward()`` and before ``optimizer.step()``, on every
    rank of the layer group, with the batch's closure (as for ``probe_gradients``) and the
    batch's index counted over the whole run: ``tuner(lambda: loss_fn(model(x), y), batch)``.
    It probes (collective) at the batches ``audit_due(batch, every)`` names and returns a
    :class:`Tuning`; at the others it returns None at no cost.  The buffers it finds are the
    ones it leaves, and so are the gradients and solve statistics where the probe meets the
    aim; above it, the tuner climbs within the batch, and the batch's gradients, solve
    statistics and warm-start states are replaced by those of the climb's last solve (closer
    to the truth, and already paid for).  The counts change from the next batch on.

    Args:
        model: a layer-parallel module or a model holding some; their solves must not use
            ``target_error`` (the residuals' adaptive iterations), which this replaces.
        target: the relative gradient error to stay below, in (0, 1), e.g. 1e-2.
        every: probe every ``every``-th batch (and the batches 0, 1, 2, 4, ... below it).
        max_iterations: the most iterations any solve is given.
        margin: the tuner aims at ``target / margin`` (>= 1; 1 aims at the target itself).
    """

    def __init__(
        self,
        model,
        target: float,
        *,
        every: int = 20,
        max_iterations: int = 10,
        margin: float = 2.0,
    ):
        from ._chain import _check_target

        self.parts = _parts(model, "IterationTuner")
        if target is None:
            raise ValueError("IterationTuner's target must be a number in (0, 1), got None")
        self.target = _check_target(target)
        for name, v in (("every", every), ("max_iterations", max_iterations)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"IterationTuner's {name} must be an int >= 1, got {v!r}")
        for part in self.parts:
            if part.target_error is not None:
                raise ValueError(
                    f"IterationTuner replaces target_error, but a part of the model "
                    f"has target_error={part.target_error!r}: build it without"
                )
        if (
            isinstance(margin, bool)
            or not isinstance(margin, (int, float))
            or not math.isfinite(margin)
            or margin < 1
        ):
            raise ValueError(f"IterationTuner's margin must be a number >= 1, got {margin!r}")
        self.model, self.every, self.max_iterations = model, every, max_iterations
        self.margin = float(margin)
        self.history: list[Tuning] = []  # every Tuning so far

    @property
    def aim(self):
        """The probed error the tuner holds the counts to: ``target / margin``."""
        return self.target / self.margin

    @property
    def iterations(self):
        """Per part, the (forward, adjoint) iterations the next batch runs; None for a part
        whose solves are exact or that the tuner has not set yet (before its first probe)."""
        return [_tuned_counts(p) for p in self.parts]

    def __call__(self, closure, batch: int) -> Optional[Tuning]:
        if not audit_due(batch, self.every):
            return None
        t0 = time.perf_counter()
        model, parts, aim = self.model, self.parts, self.aim
        ran = [_iterations(p) for p in parts]
        probe, grads, left = _probe(model, closure)
        change, lower_change, counts, climb = probe.change, None, ran, []
        if change > aim:  # climb: the probe's counts, then one more, until a change meets it
            counts = self._up(ran)
            while True:
                higher = self._up(counts)
                if higher == counts:  # every count at max_iterations: nothing to compare with
                    break
                more, more_left = _solve_at(model, parts, closure, higher)
                climb.append(_relative_change(model, grads, more, "an iteration tuner"))
                grads, left = more, more_left  # trained on: the furthest solved
                if climb[-1] <= aim:  # the counts' own error estimate meets the aim
                    break
                counts = higher
            for p in model.parameters():
                p.grad = grads[id(p)]
            for part, its, solved in zip(parts, counts, left):
                if its is not None:
                    _adopt(part, solved)
        else:
            lower = [None if its is None else tuple(max(k - 1, 1) for k in its) for its in ran]
            if lower != ran:
                now = {id(p): p.grad for p in model.parameters()}
                fewer, _ = _solve_at(model, parts, closure, lower, cold=True)
                lower_change = _relative_change(model, fewer, now, "an iteration tuner")
                if lower_change <= aim:
                    counts = lower
        for part, its in zip(parts, counts):
            part.solve_mode = None if its is None else TunedSolve(*its)
        tuning = Tuning(
            change, lower_change, ran, list(counts), time.perf_counter() - t0, aim, climb
        )
        self.history.append(tuning)
        return tuning

    def _up(self, counts):
        """``counts`` with every count one higher, at most ``max_iterations``."""
        return [
            None if its is None else tuple(min(k + 1, self.max_iterations) for k in its)
            for its in counts
        ]


def _solve_at(model, parts, closure, counts, cold=False):
    """The parameter gradients ({id(p): gradient}) of ``closure``'s loss with every part's
    solves running ``counts`` iterations (None: the part solves as it does), from the cold
    guess or, without ``cold``, from the guesses its next solves would start from (a
    probe's); and per part, what those solves left (``_solved``).  The model is left as it
    was (``_gradients_with``)."""
    left, kept = [], []

    def at(on):
        modes = [None if its is None else ProbeSolve(its[0], its[1], cold) for its in counts]
        _switch_modes(parts, modes if on else None, kept)

    def keep():
        left.extend(None if its is None else _solved(part, its) for part, its in zip(parts, counts))

    return _gradients_with(model, parts, closure, at, after=keep), left


def _switch_modes(parts, modes, kept):
    """Puts ``modes`` (one per part; None: leave the part's as it is) in force for one batch,
    keeping the parts' own (the tuner's counts) in ``kept``; ``modes=None`` restores them."""
    if modes is None:
        for part, mode in zip(parts, kept):
            part.solve_mode = mode
        kept.clear()
        return
    kept[:] = [part.solve_mode for part in parts]
    for part, mode in zip(parts, modes):
        if mode is not None:
            part.solve_mode = mode


def _tuned_counts(part):
    """The (forward, adjoint) iterations a tuner set on ``part``, or None."""
    mode = part.solve_mode
    return (mode.forward, mode.adjoint) if isinstance(mode, TunedSolve) else None


def _solved(part, counts):
    """What the part's solves at ``counts`` iterations (a probe's, just run) left."""
    return part._solved(counts)


def _adopt(part, solved):
    """Makes the solves that ``_solved`` described the part's own, as if the batch had run
    them: a tuner that trains a batch on a probe's gradients keeps the statistics (with the
    part's calibration) and the warm-start states that go with them, so that what an audit,
    the iteration log and the next warm start see describes the gradients trained on."""
    part._adopt(solved, _calibrated)


def _calibrated(stats, k):
    """``stats`` with its error estimate calibrated by ``k`` (a probe's solver has none)."""
    if stats.raw_error_estimate is None or not stats.iterations:
        return stats
    return replace(stats, error_estimate=k * stats.raw_error_estimate)


def _relative_change(model, old, new, what):
    """``|new - old| / |new|`` over all parameter gradients ({id(p): gradient} each; None is
    0), the same on every rank (collective for ``what``)."""
    comm, counted = counted_parameters(model)
    num = den = 0.0
    with torch.no_grad():
        for p in counted:
            o, n = old[id(p)], new[id(p)]
            if o is None and n is None:
                continue
            o = torch.zeros_like(n) if o is None else o
            n = torch.zeros_like(o) if n is None else n
            num += float((n - o).double().pow(2).sum())
            den += float(n.double().pow(2).sum())
    if comm is not None and comm.Get_size() > 1:
        num, den = allreduce_floats(comm, [num, den], "sum", what)
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def _parts(model, who):
    parts = layer_parallel_parts(model)
    if not parts:
        raise ValueError(f"{who} needs a model that holds layer-parallel modules")
    return parts


def _iterations(part):
    """(forward, adjoint) iterations of the part's last solves (the most over an RNN's
    layers); None for a part whose solves are exact (one level)."""
    fwd, bwd = part.forward_stats, part.backward_stats
    fwd, bwd = (s if isinstance(s, list) else [s] for s in (fwd, bwd))
    if not fwd or not bwd or any(s is None or not s.seconds for s in fwd + bwd):
        raise ValueError(
            "probe_gradients needs a backward first: it probes the gradients "
            "that the last backward left"
        )
    its = max(s.iterations for s in fwd), max(s.iterations for s in bwd)
    return None if its == (0, 0) else its  # one level: no iterations


def _gradients_with(model, parts, closure, mode, after=None):
    """The parameter gradients of ``closure``'s loss with ``mode(True)`` in force ({id(p):
    gradient}); ``after()``, if given, runs right after its backward; afterwards the gradients,
    the buffers and the parts' solve statistics are put back as they were, and
    ``mode(False)``."""
    params = list(model.parameters())
    approx = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    stats = [(p, p._save_stats()) for p in parts]
    try:
        for p in params:
            p.grad = None
        mode(True)
        try:
            loss = closure()
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(
                    f"the closure must return the loss, a 0-d tensor; got "
                    f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
                )
            loss.backward()
            if after is not None:
                after()
        finally:
            mode(False)
        return {id(p): p.grad for p in params}
    finally:
        for p, g in zip(params, approx):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for part, saved in stats:
            part._restore_stats(saved)


def _difference(counted, other):
    """(sum |g - other|^2, sum |other|^2, the largest machine epsilon of their dtypes) over
    this rank's counted parameters."""
    num = den = eps = 0.0
    with torch.no_grad():
        for p in counted:
            g, ref = p.grad, other[id(p)]
            if ref is None and g is None:
                continue
            if ref is None:
                ref = torch.zeros_like(g)
            diff = ref if g is None else g - ref
            num += float(diff.double().pow(2).sum())
            den += float(ref.double().pow(2).sum())
            eps = max(eps, torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0)
    return num, den, eps


def _calibration(ratios):
    """The geometric mean of the ratios, 1 without any."""
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 1.0


def _sum_or_none(values):
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def _calibrate(parts, error, raw, eps, history):
    """Adds this audit's ratio to the parts' history and sets their calibration (Note
    [calibrated estimate]); returns it."""
    ratios = parts[0].audit_ratios
    if raw and math.isfinite(error) and error > ROUNDOFF_EPSILONS * eps:
        ratios.append(error / raw)
        del ratios[:-history]
    calibration = _calibration(ratios)
    for part in parts:
        part.audit_ratios[:] = ratios
        part._set_calibration(calibration)
    return calibration
