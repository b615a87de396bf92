"""Every numerical tolerance the tests use, in one place."""

# Exact cases: one level, or MGRIT run to convergence, compared in float64.
ROUNDOFF = 1e-12
# MGRIT run to a residual tolerance far below the answer's scale.
CONVERGED = 1e-9
# XBraid agreement: "to four significant digits".
XBRAID_RTOL = 5e-5
# float32 layer-parallel versus serial
FLOAT32 = 1e-5

# The error estimate of a solve (Note [error estimate] in layerbraid/stats.py) is within this
# factor of the true relative error of its last state, measured against serial.
ESTIMATE_FACTOR = 2.5
