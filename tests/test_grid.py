"""Data parallel x layer parallel (ProcessGrid)."""
import time
import warnings

import pytest
import torch

import layerbraid
from layerbraid import ProcessGrid, RemoteRankError
from layerbraid.errors import ReplicaMismatchError
from layerbraid.grid import fingerprints
from nets import ODEResNet, batch, train
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


def _grid_model(every, mismatch="raise", steps=4):
    grid = ProcessGrid(WORLD, data_parallel=2, check_replicas_every=every,
                       on_replica_mismatch=mismatch)
    torch.manual_seed(0)
    return grid, ODEResNet(grid, num_steps=steps)


def _backward(model, seed=0):
    x, y = batch(n=4, seed=seed)
    torch.nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([4])
def test_replicas_updated_alike_pass_the_check_every_backward():
    grid, model = _grid_model(every=1)
    assert train(model, 3, data_rank=grid.data_rank, data_size=2)  # no error: equal updates


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([4])
def test_different_learning_rates_end_training_on_every_rank_naming_the_groups():
    """The user's bug of a learning rate computed from the rank: at the check's backward every
    rank raises ReplicaMismatchError naming data group 1, a parameter and the backward."""
    grid, model = _grid_model(every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (1 + grid.data_rank))
    _backward(model)
    opt.step()
    opt.zero_grad()
    with pytest.raises(ReplicaMismatchError) as info:
        _backward(model, seed=1)
    err = info.value
    assert err.groups == [1] and err.backward == 2, str(err)
    assert "data group(s) [1]" in str(err) and err.parameter in str(err)
    assert dict(model.named_parameters())[err.parameter] is not None


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([4])
def test_one_differing_copy_is_named_there_and_reported_to_every_rank():
    """Rank 2 (data group 1, layer rank 0) nudges one weight by 1e-12: the ranks of layer rank
    0 raise ReplicaMismatchError naming it; those of layer rank 1, whose copies agree, a
    RemoteRankError naming the rank that found it."""
    grid, model = _grid_model(every=1)
    name = "layers.0.conv1.weight"  # step 0's: layer rank 0's first
    p = dict(model.named_parameters()).get(name)
    if WORLD.rank == 2:
        with torch.no_grad():
            p.view(-1)[3] += 1e-12
    with pytest.raises((ReplicaMismatchError, RemoteRankError)) as info:
        _backward(model)
    if grid.layer_rank == 0:
        assert isinstance(info.value, ReplicaMismatchError) and info.value.parameter == name
    else:
        assert isinstance(info.value, RemoteRankError) and "data group(s) [1]" in str(info.value)
        assert name in str(info.value)


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_on_mismatch_broadcast_restores_data_group_0s_copies_with_a_warning():
    grid, model = _grid_model(every=1, mismatch="broadcast")
    p = next(p for n, p in model.named_parameters() if n.startswith("layers."))
    if grid.data_rank == 1:
        with torch.no_grad():
            p.mul_(1.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _backward(model)
    rows = grid.data_comm.allgather_rows(fingerprints([p]).reshape(1, -1))
    assert torch.equal(rows[0], rows[1])
    if grid.layer_rank == 0:
        assert any("replaced by data group 0's" in str(w.message) for w in seen)


@pytest.mark.parametrize("bad, words", [
    ({"check_replicas_every": -1}, "check_replicas_every must be an int >= 0, got -1"),
    ({"on_replica_mismatch": "ignore"}, "on_replica_mismatch must be 'raise' or 'broadcast'"),
])
def test_bad_replica_check_arguments_name_the_value(bad, words):
    with pytest.raises(ValueError, match=words):
        ProcessGrid(WORLD, **bad)


def test_fingerprints_tell_a_changed_or_swapped_element_and_ignore_the_device_order():
    t = torch.randn(1000, dtype=torch.float64)
    base = fingerprints([t])
    nudged, swapped = t.clone(), t.clone()
    nudged[500] = torch.nextafter(nudged[500], torch.tensor(10.0, dtype=torch.float64))
    swapped[[1, 2]] = swapped[[2, 1]]
    assert not torch.equal(base, fingerprints([nudged]))
    assert not torch.equal(base, fingerprints([swapped]))
    assert torch.equal(base, fingerprints([t.clone()]))
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        assert fingerprints([t.to(dtype)]).shape == (2,)


@pytest.mark.parallel([4])
def test_a_rank_that_skips_the_checkpoint_load_stalls_the_replica_check(short_timeout, tmp_path):
    """Loading a checkpoint ends with the replica check, a collective over the grid: rank 3
    never loads, and the other ranks raise StallError naming the check within the timeout."""
    layerbraid.set_timeout(120)
    grid, model = _grid_model(every=0)
    path = WORLD.bcast(str(tmp_path / "ckpt.pt"), root=0)
    layerbraid.save_checkpoint(model, path)
    layerbraid.set_timeout(short_timeout)
    if WORLD.rank == 3:
        time.sleep(short_timeout + 3)  # still running when the others give up
        return
    with pytest.raises(layerbraid.StallError, match="fingerprints|the replica check"):
        layerbraid.load_checkpoint(model, path)


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_a_transfer_between_depths_ends_with_the_replica_check():
    """interpolate sets the fine network's weights on each data group from its own coarse copy:
    copies that agree pass, a coarse copy that differs on data group 1 is named at the end of
    the transfer on every rank."""
    from layerbraid import depth

    grid = ProcessGrid(WORLD, data_parallel=2)
    torch.manual_seed(0)
    coarse, fine = ODEResNet(grid, num_steps=4), ODEResNet(grid, num_steps=8)
    depth.interpolate(coarse, fine)  # equal copies: nothing raised
    if grid.data_rank == 1:
        with torch.no_grad():
            next(p for n, p in coarse.named_parameters() if n.startswith("layers.")).add_(1.0)
    with pytest.raises((ReplicaMismatchError, RemoteRankError),
                       match="the end of interpolate \\(linear\\)"):
        depth.interpolate(coarse, fine)
