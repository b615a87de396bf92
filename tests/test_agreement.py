"""Ranks that disagree are told, on every rank: settings that change a solve, training mode,
step layers whose layout differs from their owner's, messages of the wrong size; and the
communication layer's calls move what they say.  (A rank that never arrives at a collective is
in layerbraid.tools.drill: stall-* and exit-* scenarios.)"""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from layerbraid import MGRITOptions
from layerbraid.errors import RemoteRankError
from nets import ODEResNet, batch
from transports import WORLD as TRANSPORT

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def model(steps=4, **kw):
    torch.manual_seed(0)
    return ODEResNet(WORLD, num_steps=steps, **kw)


@pytest.mark.parallel([2])
@pytest.mark.parametrize("name, change, text", [
    ("target_error", lambda m: setattr(m._chain, "target_error", 1e-3), "target_error"),
    ("eval", lambda m: m.eval(), "training mode"),
    ("warm_start", lambda m: setattr(m._chain, "warm_start", True), "warm_start"),
    ("check_finite", lambda m: setattr(m, "check_finite", False), "check_finite"),
    ("output", lambda m: setattr(m, "output", "next"), "output"),
])
def test_settings_that_differ_across_ranks_are_an_error_on_every_rank(name, change, text):
    """One rank changes a setting the others do not: the forward raises the same ValueError
    on every rank, naming the setting and both values, before any step runs."""
    assert WORLD.Get_size() == 2
    m = model()
    x, y = batch(n=4)
    if WORLD.rank == 1:
        change(m)
    with pytest.raises(ValueError, match=f"the layer-parallel ranks disagree on {text}.*rank 0 "
                                         "has .*, rank 1 has"):
        m(x)
    m.free()


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_the_same_settings_everywhere_train_as_before():
    assert WORLD.Get_size() == 2
    m = model()
    m.eval()  # on every rank: fine
    x, y = batch(n=4)
    with torch.no_grad():
        m(x)
    m.train()
    F.cross_entropy(m(x), y).backward()
    m.free()


class OtherWidthOnRankOne(ODEResNet):
    """Step 2 (of 6: owned by rank 0, copied by rank 1 for its coarse step, which with cfactor
    2 goes from fine point 2 to 4 and injects layer 2) has other parameters on rank 1: the
    copy could not hold the owner's bytes."""

    def step_layer(self, index):
        if WORLD.rank == 1 and index == 2:
            return nn.Sequential(nn.Conv2d(self.channels, self.channels, 1),
                                 nn.Conv2d(self.channels, self.channels, 1))
        return super().step_layer(index)


@pytest.mark.parallel([2])
def test_a_step_layer_built_differently_on_another_rank_is_an_error_on_every_rank():
    assert WORLD.Get_size() == 2
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"step_layer\(2\) built a different layer on rank 1 "
                                         r"than on rank 0, which owns step 2: state names"):
        OtherWidthOnRankOne(WORLD, num_steps=6,
                            forward_options=MGRITOptions(max_levels=2, cfactor=2))


@pytest.mark.parallel([2])
def test_a_message_of_the_wrong_size_is_named():
    """A received message shorter than its buffer (MPI accepts it silently) is an error."""
    assert WORLD.Get_size() == 2
    if WORLD.rank == 0:
        TRANSPORT.send_tensor(torch.zeros(3, dtype=torch.float64), 1, 99)
    else:
        with pytest.raises(RemoteRankError, match="came with 24 bytes where 40 were expected"):
            TRANSPORT.recv_tensor((5,), torch.float64, "cpu", 0, 99, "a test tensor")


@pytest.mark.shared_job
@pytest.mark.parallel([1, 3])
def test_python_values_move_in_rank_order():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    assert size in (1, 2, 3)
    mine = {"rank": rank, "pad": "x" * (100 * rank)}
    assert TRANSPORT.allgather_obj(mine, "t") == \
        [{"rank": r, "pad": "x" * (100 * r)} for r in range(size)]
    got = TRANSPORT.gather_obj(mine, size - 1, "t")
    assert got == ([{"rank": r, "pad": "x" * (100 * r)} for r in range(size)]
                   if rank == size - 1 else None)
    assert TRANSPORT.bcast_obj(("from", rank), size - 1, "t") == ("from", size - 1)
    assert TRANSPORT.first_rank_where(rank >= 1, "t") == (1 if size > 1 else None)


@pytest.mark.parallel([2])
def test_an_error_on_one_rank_is_raised_on_every_rank():
    assert WORLD.Get_size() == 2
    error = KeyError("only here") if WORLD.rank == 1 else None
    if WORLD.rank == 1:
        with pytest.raises(KeyError, match="only here"):
            TRANSPORT.raise_on_every_rank(error, "a test")
    else:
        with pytest.raises(RemoteRankError, match="a test failed on rank 1: KeyError"):
            TRANSPORT.raise_on_every_rank(error, "a test")
    TRANSPORT.raise_on_every_rank(None, "a test")  # nothing when no rank failed


@pytest.mark.parallel([2])
def test_a_layer_parallel_rnn_checks_its_settings_and_input_across_ranks():
    from layerbraid.nn import LayerParallelGRU

    assert WORLD.Get_size() == 2
    torch.manual_seed(0)
    gru = LayerParallelGRU(3, 4, comm=WORLD, target_error=1e-2 if WORLD.rank == 0 else None)
    with pytest.raises(ValueError, match="disagree on target_error: rank 0 has 0.01, rank 1 "
                                         "has None"):
        gru(torch.ones(2, 6, 3))
    gru.target_error = None
    for chain in gru._chains.values():
        chain.target_error = None
    with pytest.raises(ValueError, match="disagree on the input's shape"):
        gru(torch.ones(2, 6 + WORLD.rank, 3))
    gru.free()
