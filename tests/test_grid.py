"""Data parallel x layer parallel (ProcessGrid)."""
import pytest
import torch
from mpi4py import MPI

from layerbraid import ProcessGrid
from nets import ODEResNet, train
from transports import WORLD



@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


@pytest.mark.parallel([3])
def test_a_grid_that_does_not_fit_is_a_clear_error_on_every_rank():
    with pytest.raises(ValueError, match="data_parallel=2 does not divide the 3 ranks"):
        ProcessGrid(WORLD, data_parallel=2)
    with pytest.raises(ValueError, match="data_parallel must be an int >= 1, got 0"):
        ProcessGrid(WORLD, data_parallel=0)


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_grid_layout():
    g = ProcessGrid(WORLD, data_parallel=2)
    assert (g.layer_size, g.data_size) == (2, 2)
    assert (g.layer_rank, g.data_rank) == (WORLD.rank % 2, WORLD.rank // 2)
    assert g.layer_comm.Get_size() == 2 and g.data_comm.Get_size() == 2
    # the data group holds the ranks at the same place of every layer group
    assert sorted(g.data_comm.allgather(WORLD.rank)) == [WORLD.rank % 2, WORLD.rank % 2 + 2]


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([4])
def test_two_by_two_training_matches_one_by_four_and_serial():
    torch.manual_seed(0)
    grid = ProcessGrid(WORLD, data_parallel=2)
    dp = ODEResNet(grid, num_steps=6)
    torch.manual_seed(0)
    lp = ODEResNet(WORLD, num_steps=6)
    serial = lp.to_serial()
    train(dp, 4, grid.data_rank, 2)
    train(lp, 4)
    train(serial, 4)
    ref = serial.state_dict()
    for model in (dp, lp):
        for name, p in model.state_dict().items():
            if name.startswith("layers.") or (name.startswith("open.") and model.comm.rank == 0) \
                    or (name.startswith("close.") and model.comm.rank == model.comm.size - 1):
                torch.testing.assert_close(p, ref[name], rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{name}: {m}")
