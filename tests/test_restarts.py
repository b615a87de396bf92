"""A job that torchrun restarts after a rank was killed resumes from its last checkpoint and ends
where an uninterrupted run ends (tests/restart_job.py); the loader's position in between."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from layerbraid.data import LayerParallelLoader

HERE = Path(__file__).resolve().parent


def _torchrun(out, kill_at, restarts):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", str(restarts), str(HERE / "restart_job.py"), str(out),
           str(kill_at)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "_PYTEST_MPI"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=HERE, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path):
    """torchrun --max-restarts 1, 2 processes: rank 1 is SIGKILLed before batch 5; both start
    again at batch 4, the last checkpoint, with the optimizer's momentum and the loader's
    position, and end with the uninterrupted run's weights (float64, exact: to the bit here,
    asserted to round-off)."""
    rc, plain_log = _torchrun(tmp_path / "plain.pt", -1, 0)
    assert rc == 0, plain_log[-3000:]
    rc, log = _torchrun(tmp_path / "killed.pt", 5, 1)
    assert rc == 0, log[-3000:]
    lines = log.splitlines()
    assert "rank 1 is killed before batch 5" in lines, log[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} attempt 1 starts at batch 4" in lines, log[-3000:]
        assert f"rank {rank} finished 9 batches" in lines, log[-3000:]
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "killed.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-12, atol=1e-12, msg=k)


def _loader(seed=3):
    data = TensorDataset(torch.arange(20.0))
    return LayerParallelLoader(data, 3, comm=None, seed=seed)


def test_the_loader_continues_after_its_saved_position():
    loader = _loader()
    whole = [b[0].tolist() for _ in range(2) for b in loader]  # two epochs, 7 batches each
    loader = _loader()
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 3
    again = _loader()
    again.load_state_dict(state)
    rest = [b[0].tolist() for b in again] + [b[0].tolist() for b in again]
    assert seen + rest == whole


def test_a_position_at_the_end_of_an_epoch_goes_on_with_the_next():
    loader = _loader()
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    state = loader.state_dict()
    assert state["batches"] == len(loader) == len(first)
    again = _loader()
    again.load_state_dict({"epoch": 0, "batches": len(first), "seed": state["seed"]})
    assert [b[0].tolist() for b in again] == second


def test_a_position_from_another_seed_is_refused_naming_both():
    with pytest.raises(ValueError, match="shuffling seed 3; this loader has seed 4"):
        _loader(seed=4).load_state_dict(_loader(seed=3).state_dict())
