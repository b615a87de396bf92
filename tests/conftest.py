import os
import sys

# `tolerances` and the shared helpers are imported by name from the test files.
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _ranks_as_marked(request):
    """Every multi-rank test runs on the number of ranks its ``parallel`` marker names: a test
    must not pass on one rank because its launch silently did not happen.  (The launching
    process itself, of one rank, only starts the job: mpi-pytest replaces the test there.)"""
    marker = request.node.get_closest_marker("parallel")
    if marker is None:
        yield
        return
    from mpi4py import MPI

    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "_nprocs" in callspec.params:
        wanted = callspec.params["_nprocs"]
    else:
        wanted = marker.args[0] if marker.args else marker.kwargs.get("nprocs", 3)
        wanted = wanted[0] if isinstance(wanted, (list, tuple)) else wanted
    from transports import WORLD

    size = WORLD.Get_size()  # MPI's, or torch.distributed's under torchrun
    child = os.environ.get("_PYTEST_MPI_CHILD_PROCESS") is not None
    if wanted > 1 and not child and size == 1:
        yield  # the launcher: the test itself runs in the job it starts
        return
    assert size == wanted, f"marked for {wanted} rank(s), running on {size}"
    if size > 1 and not child and request.node.get_closest_marker("shared_job") is None:
        # Under an outer `mpiexec -n N pytest` (`make test`) the tests share one job: an error
        # test may leave a message in flight that a later test would receive.
        pytest.fail("this test runs only in a job of its own (`pytest` starts one for it): it "
                    "is not marked shared_job")
    yield


@pytest.fixture
def short_timeout():
    """A 2 s stall timeout for the test, restored afterwards (stall scenarios)."""
    import layerbraid

    old = layerbraid._comm.timeouts.timeout()
    layerbraid.set_timeout(2)
    yield 2
    layerbraid.set_timeout(old)


@pytest.fixture
def float64():
    """Run a test with torch's default dtype float64 (exact comparisons)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under torchrun (`make test` runs the both_transports tests there) every process is a
    one-rank MPI job: mpi-pytest would start an mpiexec job per test.  Its markers stay (they
    select the tests of this rank count); its per-test launch and MPI barrier are turned off,
    and the tests run on torch.distributed (tests/transports.py)."""
    from layerbraid._comm.dist import launched_by_torchrun

    if launched_by_torchrun():
        import pytest_mpi.plugin

        pytest_mpi.plugin._plugin_in_use = False
