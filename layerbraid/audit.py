"""Deprecated alias of :mod:`layerbraid.accuracy` (the audit, the probe and the tuner now live
in layerbraid/accuracy/), kept for one release."""

import warnings

from .accuracy import (  # noqa: F401
    ROUNDOFF_EPSILONS,
    GradientAudit,
    GradientProbe,
    IterationTuner,
    Tuning,
    audit_due,
    audit_gradients,
    probe_gradients,
)

warnings.warn(
    "layerbraid.audit is deprecated: import layerbraid.accuracy", DeprecationWarning, stacklevel=2
)
