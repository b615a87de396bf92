"""Using layerbraid as a PyTorch user would: batches that agree across ranks, global gradient
clipping, a plain serial export, the launch check and the abort on an uncaught exception."""
import copy
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import TensorDataset

import layerbraid
from layerbraid import LayerParallelModule, ProcessGrid
from layerbraid.data import LayerParallelLoader
from layerbraid.nn import ConvBlock, LayerParallelGRU, LPBatchNorm2d
from nets import ODEResNet, batch
from tolerances import ROUNDOFF
from transports import WORLD

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def _dataset(n=21):
    return TensorDataset(torch.arange(n, dtype=torch.float64).view(n, 1), torch.arange(n))


# ---------------------------------------------------------------- the loader
@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_loader_gives_every_rank_the_same_shuffled_batches():
    loader = LayerParallelLoader(_dataset(), 4, comm=WORLD)  # seed drawn on rank 0
    epochs = [[yb.tolist() for _, yb in loader] for _ in range(2)]
    assert epochs[0] != epochs[1], "the epoch must advance by itself"
    assert sorted(sum(epochs[0], [])) == list(range(21))
    everyone = WORLD.allgather(epochs)
    assert all(e == epochs for e in everyone)
    loader.set_epoch(0)
    assert [yb.tolist() for _, yb in loader] == epochs[0]


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([4])
def test_loader_shards_across_data_groups_and_agrees_within_a_layer_group():
    grid = ProcessGrid(WORLD, data_parallel=2)
    loader = LayerParallelLoader(_dataset(20), 3, comm=grid, seed=5)
    mine = [yb.tolist() for _, yb in loader]
    groups = WORLD.allgather((grid.data_rank, mine))
    by_group = {}
    for d, m in groups:
        assert by_group.setdefault(d, m) == m  # the same in a layer group
    a, b = sum(by_group[0], []), sum(by_group[1], [])
    assert not set(a) & set(b) and sorted(a + b) == list(range(20))


@pytest.mark.parallel([2])
def test_loader_seeds_that_differ_are_a_clear_error_on_every_rank():
    with pytest.raises(ValueError, match=r"different loader seeds \[0, 1\]"):
        LayerParallelLoader(_dataset(), 4, comm=WORLD, seed=WORLD.rank)
    with pytest.raises(ValueError, match="chooses its own sampler"):
        LayerParallelLoader(_dataset(), 4, comm=WORLD, sampler=range(3))


# ---------------------------------------------------------------- the input check
@pytest.mark.parallel([2, 3])
def test_different_inputs_on_the_ranks_are_a_clear_error_on_every_rank():
    model = ODEResNet(WORLD, num_steps=6)
    x, _ = batch(seed=WORLD.rank)  # what an unseeded shuffled DataLoader does
    with pytest.raises(ValueError, match="ranks were given different inputs: rank 1 got"):
        model(x)
    x0, _ = batch(seed=0)
    with pytest.raises(ValueError, match="different inputs"):  # the same batch, reordered
        model(x0.flip(0) if WORLD.rank == 1 else x0)
    with pytest.raises(ValueError, match=r"rank 1 got shape \(5, 1, 8, 8\)"):
        model(x0[:5] if WORLD.rank == 1 else x0)
    out = model(x0)  # the same batch everywhere, and placeholders off the first rank, pass
    torch.testing.assert_close(model(x0 if WORLD.rank == 0 else torch.zeros(())), out)
    model.check_inputs = False
    model(x)


@pytest.mark.parallel([2])
def test_a_plain_shuffled_dataloader_is_caught_and_the_layer_parallel_loader_trains():
    """The README's loop with a DataLoader that shuffles differently on each rank."""
    x, y = batch(n=32, seed=3)
    torch.manual_seed(100 + WORLD.rank)  # each rank its own shuffling, as without a seed
    model = ODEResNet(WORLD, num_steps=4)
    plain = torch.utils.data.DataLoader(TensorDataset(x, y), 8, shuffle=True)
    with pytest.raises(ValueError, match="LayerParallelLoader"):
        for xb, yb in plain:
            F.cross_entropy(model(xb), yb).backward()
    torch.manual_seed(100 + WORLD.rank)
    model = ODEResNet(WORLD, num_steps=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = last = None
    for epoch in range(5):
        for xb, yb in LayerParallelLoader(TensorDataset(x, y), 8, comm=model, seed=1):
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            first = loss.item() if first is None else first
            last = loss.item()
    assert last < first


# ---------------------------------------------------------------- clip_grad_norm_
def _serial_clip(serial, x, y, max_norm, norm_type):
    serial.zero_grad()
    F.cross_entropy(serial(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(serial.parameters(), max_norm, norm_type)
    return total, dict(serial.named_parameters())


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_clip_grad_norm_is_global_and_clips_as_serial():
    for norm_type in (2.0, 1.0, float("inf")):  # one job for the three
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=6)
        serial = model.to_serial()
        x, y = batch()
        ref_total, ref = _serial_clip(serial, x, y, 0.1, norm_type)
        F.cross_entropy(model(x), y).backward()
        total = layerbraid.clip_grad_norm_(model, 0.1, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=ROUNDOFF, atol=ROUNDOFF)
        assert WORLD.allgather(total.item()) == [total.item()] * WORLD.size
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, ref[name].grad, rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([4])
def test_clip_grad_norm_under_data_parallelism_equals_serial_on_the_whole_batch():
    grid = ProcessGrid(WORLD, data_parallel=2)
    torch.manual_seed(0)
    model = ODEResNet(grid, num_steps=4)
    serial = model.to_serial()
    x, y = batch(n=8)
    ref_total, ref = _serial_clip(serial, x, y, 0.05, 2.0)
    part = slice(4 * grid.data_rank, 4 * grid.data_rank + 4)
    F.cross_entropy(model(x[part]), y[part]).backward()
    total = layerbraid.clip_grad_norm_(model, 0.05)
    torch.testing.assert_close(total, ref_total, rtol=ROUNDOFF, atol=ROUNDOFF)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=ROUNDOFF, atol=ROUNDOFF)


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_clip_grad_norm_counts_shared_rnn_weights_once():
    torch.manual_seed(0)
    gru = LayerParallelGRU(3, 4, comm=WORLD)
    head = nn.Linear(4, 2)  # outside the layer-parallel part, run on every rank
    ref_gru, ref_head = nn.GRU(3, 4, batch_first=True), copy.deepcopy(head)
    ref_gru.load_state_dict(gru.state_dict())
    x = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1))
    head(gru(x)[0][:, -1]).square().sum().backward()
    ref_head(ref_gru(x)[0][:, -1]).square().sum().backward()
    model, ref = nn.ModuleList([gru, head]), nn.ModuleList([ref_gru, ref_head])
    total = layerbraid.clip_grad_norm_(model, 0.01)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.testing.assert_close(total, ref_total, rtol=ROUNDOFF, atol=ROUNDOFF)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=ROUNDOFF, atol=ROUNDOFF)


# ---------------------------------------------------------------- to_serial
class BNNet(LayerParallelModule):
    def __init__(self, grid):
        super().__init__(num_steps=4, comm=grid)
        self.sync_comm = grid.data_comm
        self.open = nn.Conv2d(1, 3, 3, padding=1)
        self.close = nn.Sequential(LPBatchNorm2d(3, sync_comm=grid.data_comm), nn.Flatten(),
                                   nn.Linear(3 * 8 * 8, 2))

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3, sync_comm=self.sync_comm))


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2])
def test_to_serial_is_a_plain_picklable_module_with_plain_batch_norms():
    grid = ProcessGrid(WORLD, data_parallel=2)  # batch statistics synced over 2 data groups
    model = BNNet(grid)
    x, _ = batch(n=4)
    model(x[2 * grid.data_rank:2 * grid.data_rank + 2])  # running statistics move
    serial = model.to_serial()
    kinds = {type(m) for m in serial.modules()}
    assert nn.BatchNorm2d in kinds and not any(issubclass(k, LPBatchNorm2d) for k in kinds)
    buf = io.BytesIO()
    torch.save(serial, buf)
    buf.seek(0)
    copies = [torch.load(buf, weights_only=False), copy.deepcopy(serial),
              pickle.loads(pickle.dumps(serial))]
    serial.eval()
    ref = serial(x)
    for c in copies:
        c.eval()
        torch.testing.assert_close(c(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(serial.close[0].running_mean,
                               model.to_serial().close[0].running_mean)
    if WORLD.rank == 0:  # a collective inside would hang here: only one rank runs it
        serial.train()
        serial(x).sum().backward()
    WORLD.Barrier()


# ---------------------------------------------------------------- launch and faults
def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPIR_CVAR_CH", "HYDRA", "_PYTEST_MPI"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.parametrize("var,who", [("WORLD_SIZE", "torchrun"), ("PMI_SIZE", "PMI")])
def test_a_launch_that_promises_more_ranks_than_mpi_has_is_a_clear_error(var, who):
    code = ("import sys; sys.path.insert(0, %r); from mpi4py import MPI; from nets import "
            "ODEResNet; ODEResNet(MPI.COMM_WORLD)" % str(HERE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_env(**{var: "2"}))
    assert proc.returncode != 0
    assert who in proc.stderr and "MPI world has 1 rank" in proc.stderr and "mpiexec -n 2" in \
        proc.stderr, proc.stderr[-2000:]


def test_the_abort_hook_can_be_switched_off():
    code = ("import layerbraid, sys; layerbraid.launch.abort_on_exception(False); "
            "layerbraid.launch._enter(); assert sys.excepthook is sys.__excepthook__")
    proc = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_wait_sleep_follows_the_ranks_per_core(monkeypatch):
    """More ranks on the node than cores: long waits sleep (Note [polled waits]); else they
    yield; LAYERBRAID_WAIT_SLEEP overrides, and a bad value names itself."""
    from layerbraid._comm.timeouts import wait_sleep

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LAYERBRAID_WAIT_SLEEP", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.setenv("MPI_LOCALNRANKS", str(cores))
    assert wait_sleep() == 0.0
    monkeypatch.setenv("MPI_LOCALNRANKS", str(cores + 1))
    assert wait_sleep() > 0
    monkeypatch.setenv("LAYERBRAID_WAIT_SLEEP", "0")
    assert wait_sleep() == 0.0
    monkeypatch.setenv("LAYERBRAID_WAIT_SLEEP", "0.5")
    with pytest.raises(ValueError, match="LAYERBRAID_WAIT_SLEEP.*.0.5."):
        wait_sleep()
