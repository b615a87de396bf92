"""Gradient audits: the true error of a layer-parallel gradient, measured in training.

The accuracy tools of layer-parallel training: ``audit_gradients`` (the true error, against
exact solves), ``probe_gradients`` (the change with one more iteration) and ``IterationTuner``
(iterations aimed with the probe), in the modules audit, probe and tuner.
"""

from .audit import ROUNDOFF_EPSILONS, GradientAudit, audit_due, audit_gradients
from .probe import GradientProbe, probe_gradients
from .tuner import IterationTuner, Tuning

__all__ = [
    "ROUNDOFF_EPSILONS",
    "GradientAudit",
    "GradientProbe",
    "IterationTuner",
    "Tuning",
    "audit_due",
    "audit_gradients",
    "probe_gradients",
]
