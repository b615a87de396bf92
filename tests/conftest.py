import os
import sys

# `tolerances` and the shared helpers are imported by name from the test files.
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture
def short_timeout():
    """A 2 s stall timeout for the test, restored afterwards (stall scenarios)."""
    import layerbraid

    old = layerbraid.launch.timeout()
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
