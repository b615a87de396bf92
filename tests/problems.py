"""Model problems with their sequential references, shared by the MGRIT tests."""
import numpy as np


def dahlquist_step(u, t0, t1, level):
    """Backward Euler for u' = -u: XBraid's test problem."""
    return u / (1.0 + (t1 - t0))


def dahlquist_init(t):
    return np.array(1.0 if t == 0.0 else 0.456)


def nonlinear_step(u, t0, t1, level):
    """Forward Euler for u' = sin(u) - 0.5 u on a vector state (a stand-in for a ResNet layer)."""
    return u + (t1 - t0) * (np.sin(u) - 0.5 * u)


def nonlinear_init(t, size=5):
    rng = np.random.default_rng(0)
    return rng.standard_normal(size) if t == 0.0 else np.zeros(size)


_OSC = np.array([[0.0, 3.0], [-3.0, -0.1]])


def oscillator_step(u, t0, t1, level):
    """A stiff-ish rotation that coarse steps capture badly, so MGRIT converges slowly and the
    error left after k iterations shows which points are already exact."""
    return u + (t1 - t0) * np.tanh(_OSC @ u)


def oscillator_init(t):
    return np.array([1.0, 0.5]) if t == 0.0 else np.zeros(2)


def heat_matrix(nx):
    """Backward-Euler-ready 1D Laplacian (Dirichlet), grid spacing 1/(nx+1)."""
    h = 1.0 / (nx + 1)
    return (np.diag(-2.0 * np.ones(nx)) + np.diag(np.ones(nx - 1), 1)
            + np.diag(np.ones(nx - 1), -1)) / h**2


def heat_step_factory(nx):
    A = heat_matrix(nx)
    eye = np.eye(nx)

    def step(u, t0, t1, level):
        return np.linalg.solve(eye - (t1 - t0) * A, u)
    return step


def heat_init_factory(nx):
    x = np.linspace(0, 1, nx + 2)[1:-1]

    def init(t):
        return np.sin(np.pi * x) + 0.5 * np.sin(7 * np.pi * x) if t == 0.0 else np.zeros(nx)
    return init


def sequential(step, init, num_steps, t_start, t_stop):
    """The serial reference: u_i = step(u_{i-1}) on the fine grid."""
    u = [init(t_start)]
    for i in range(1, num_steps + 1):
        t0 = t_start + (t_stop - t_start) * (i - 1) / num_steps
        t1 = t_start + (t_stop - t_start) * i / num_steps
        u.append(step(u[-1], t0, t1, 0))
    return u
