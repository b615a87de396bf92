"""Gradient audits: the true error of a layer-parallel gradient, measured in training.

The accuracy tools of layer-parallel training: ``audit_gradients`` (the true error, against
exact solves), ``probe_gradients`` (the change with one more iteration), ``IterationTuner``
(iterations aimed with the probe) and ``BiasGuard`` (better solves where a stalled loss meets a
large audited error), in the modules audit, probe, tuner and guard.
"""

from .audit import ROUNDOFF_EPSILONS, GradientAudit, audit_due, audit_gradients
from .guard import BiasGuard, GuardEvent
from .probe import GradientProbe, probe_gradients
from .tuner import IterationTuner, Tuning

__all__ = [
    "ROUNDOFF_EPSILONS",
    "BiasGuard",
    "GradientAudit",
    "GuardEvent",
    "GradientProbe",
    "IterationTuner",
    "Tuning",
    "audit_due",
    "audit_gradients",
    "probe_gradients",
]
