"""Every numerical tolerance the tests use, in one place."""

# Exact cases: one level, or MGRIT run to convergence, compared in float64.
ROUNDOFF = 1e-12
# MGRIT run to a residual tolerance far below the answer's scale.
CONVERGED = 1e-9
# XBraid agreement: "to four significant digits".
XBRAID_RTOL = 5e-5
# float32 layer-parallel versus serial
FLOAT32 = 1e-5

# The raw error estimate of a solve (Note [error estimate] in layerbraid/stats.py) on a
# near-identity chain at initialization: at least the true relative error of its last state,
# measured against serial, and at most this factor above it (seen: 1.7-3.4).
RAW_ESTIMATE_FACTOR = 4.0
# What a calibrated gradient-error estimate (Note [calibrated estimate] in layerbraid/accuracy/audit.py)
# must meet in training: within this factor of the true error, either way.
CALIBRATED_FACTOR = 3.0
