"""Checkpoints: any model with layer-parallel parts, any rank count, atomic, checked, never
executed."""
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid.checkpoint import CheckpointError, _encode, read_checkpoint
from layerbraid.nn import ConvBlock
from nets import ODEResNet, batch
from transports import WORLD

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def shared_dir():
    return WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None)


class Stage(layerbraid.LayerParallelModule):
    def __init__(self, comm, steps, channels, open_layer, close_layer, output):
        super().__init__(num_steps=steps, comm=comm, output=output)
        self.channels, self.open, self.close = channels, open_layer, close_layer

    def step_layer(self, index):
        return ConvBlock(self.channels)


def staged(comm):
    """Two layer-parallel stages and a head that runs on every rank."""
    s1 = Stage(comm, 4, 3, nn.Conv2d(1, 3, 3, padding=1), None, "next")
    s2 = Stage(comm, 4, 6, nn.Conv2d(3, 6, 3, stride=2, padding=1),
               nn.Sequential(nn.Flatten(), nn.Linear(6 * 4 * 4, 5)), "all")
    return nn.Sequential(s1, s2, nn.Tanh(), nn.Linear(5, 3))


def step(model, opt, seed):
    opt.zero_grad()
    x, y = batch(seed=seed)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_a_staged_model_saved_on_many_ranks_resumes_on_one():
    torch.manual_seed(0)
    model = staged(WORLD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step(model, opt, 0)
    path = os.path.join(shared_dir(), "staged.ckpt")
    layerbraid.save_checkpoint(model, path, opt, extra={"epoch": 1, "note": "x"})
    ref = [step(model, opt, k) for k in (1, 2)]
    if WORLD.rank == 0:
        torch.manual_seed(7)
        alone = staged(MPI.COMM_SELF)
        opt2 = torch.optim.Adam(alone.parameters(), lr=0.5)
        assert layerbraid.load_checkpoint(alone, path, opt2) == {"epoch": 1, "note": "x"}
        losses = [step(alone, opt2, k) for k in (1, 2)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-10,
                                   atol=1e-10)
    WORLD.Barrier()


def _tensors_in(obj):
    if torch.is_tensor(obj):
        return 1
    if isinstance(obj, dict):
        return sum(_tensors_in(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_in(v) for v in obj)
    return 0


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2, 3])
def test_the_saved_tensors_travel_on_the_wire_not_in_a_pickle(monkeypatch):
    """Saving gathers every rank's share to the first: the layout as a pickle without a single
    tensor, the tensors as one message per rank; the file then resumes on one rank."""
    pickled = []
    real = type(WORLD).gather_obj

    def watched(self, obj, root, what):
        pickled.append(_tensors_in(obj))
        return real(self, obj, root, what)

    monkeypatch.setattr(type(WORLD), "gather_obj", watched)
    torch.manual_seed(0)
    model = staged(WORLD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step(model, opt, 0)
    path = os.path.join(shared_dir(), "wire.ckpt")
    layerbraid.save_checkpoint(model, path, opt)
    assert pickled and not any(pickled), pickled
    monkeypatch.undo()
    ref = step(model, opt, 1)
    if WORLD.rank == 0:
        alone = staged(MPI.COMM_SELF)
        opt2 = torch.optim.Adam(alone.parameters(), lr=0.5)
        layerbraid.load_checkpoint(alone, path, opt2)
        torch.testing.assert_close(torch.tensor(step(alone, opt2, 1)), torch.tensor(ref),
                                   rtol=1e-10, atol=1e-10)
    WORLD.Barrier()


def test_a_plain_module_round_trips(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    layerbraid.save_checkpoint(model, tmp_path / "m.ckpt", opt, extra=[1, 2.5, None])
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt2 = torch.optim.SGD(other.parameters(), lr=0.3)
    assert layerbraid.load_checkpoint(other, tmp_path / "m.ckpt", opt2) == [1, 2.5, None]
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    assert opt2.state_dict()["state"][0]["momentum_buffer"].equal(
        opt.state_dict()["state"][0]["momentum_buffer"])


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    bomb = _RunsCode()
    bomb.marker = marker
    model = ODEResNet(MPI.COMM_SELF, num_steps=2)
    # With a valid header and checksum: the payload itself must not be unpickled into code.
    (tmp_path / "a.ckpt").write_bytes(_encode({"format": "layerbraid-checkpoint-2",
                                               "model": {}, "extra": bomb}))
    with pytest.raises(CheckpointError, match="a.ckpt holds something other than tensors"):
        model.load_checkpoint(tmp_path / "a.ckpt")
    # A plain torch.save / pickle file (what older checkpoints and attackers write).
    with open(tmp_path / "b.ckpt", "wb") as f:
        pickle.dump({"model": bomb}, f)
    with pytest.raises(CheckpointError, match="b.ckpt is not a layerbraid checkpoint"):
        model.load_checkpoint(tmp_path / "b.ckpt")
    assert not marker.exists()


@pytest.mark.parallel([1, 2])
def test_bad_files_are_clear_errors_naming_the_file_on_every_rank():
    d = shared_dir()
    model = ODEResNet(WORLD, num_steps=4)
    good = os.path.join(d, "good.ckpt")
    model.save_checkpoint(good, extra={"epoch": 1})
    data = Path(good).read_bytes()
    cases = {"empty.ckpt": (b"", "is empty"),
             "truncated.ckpt": (data[:len(data) // 2], "corrupt or truncated"),
             "header.ckpt": (data[:30], "truncated"),
             "random.ckpt": (os.urandom(4096), "is not a layerbraid checkpoint"),
             "flipped.ckpt": (data[:-200] + bytes(b ^ 0xFF for b in data[-200:-136])
                              + data[-136:], "SHA-256")}
    if WORLD.rank == 0:
        for name, (content, _) in cases.items():
            Path(d, name).write_bytes(content)
    WORLD.Barrier()
    for name, (_, why) in cases.items():
        with pytest.raises(CheckpointError, match=why) as info:
            model.load_checkpoint(os.path.join(d, name))
        assert name in str(info.value)
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*missing.ckpt"):
        model.load_checkpoint(os.path.join(d, "missing.ckpt"))
    other = ODEResNet(WORLD, num_steps=6)
    with pytest.raises(ValueError, match="network of 4 steps; this model has num_steps=6"):
        other.load_checkpoint(good)


def test_a_failed_write_leaves_the_old_checkpoint_and_no_litter(tmp_path, monkeypatch):
    model = ODEResNet(MPI.COMM_SELF, num_steps=2)
    path = tmp_path / "c.ckpt"
    model.save_checkpoint(path, extra={"epoch": 1})

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match=r"writing checkpoint .*c\.ckpt failed: No space"):
        model.save_checkpoint(path, extra={"epoch": 2})
    monkeypatch.undo()
    assert read_checkpoint(path)["extra"] == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_sigkill_during_a_save_never_loses_the_checkpoint(tmp_path):
    """A process killed at any moment of a save leaves the old file or the new one."""
    path = tmp_path / "k.ckpt"
    code = ("import sys, torch, layerbraid; from torch import nn\n"
            "m = nn.Linear(2, 2)\n"
            "for k in range(1000):\n"
            "    layerbraid.save_checkpoint(m, sys.argv[1], extra={'k': k, 'big': "
            "torch.zeros(8_000_000)})\n"
            "    print(k, flush=True)\n")
    for delay in (0.0, 0.05, 0.2):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                                text=True)
        first = proc.stdout.readline()  # a save has finished: a checkpoint exists
        assert first.strip().isdigit(), first
        time.sleep(delay)  # then kill it somewhere in the following saves
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = read_checkpoint(path)
        assert ckpt["extra"]["big"].shape == (8_000_000,) and ckpt["extra"]["k"] >= 0


def test_only_regular_files_are_read(tmp_path):
    """A link to a device (here /dev/zero, which never ends) is refused before any read."""
    link = tmp_path / "zero.ckpt"
    link.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="zero.ckpt is not a regular file"):
        read_checkpoint(link)


def test_a_killed_saves_temporary_file_is_listed_by_a_load_and_removed_by_the_next_save(
        tmp_path):
    model = ODEResNet(MPI.COMM_SELF, num_steps=2)
    path = tmp_path / "c.ckpt"
    model.save_checkpoint(path)
    stale = tmp_path / ".c.ckpt.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    with pytest.warns(UserWarning, match=r"1 temporary file\(s\) of a save that did not "
                                         r"finish \(\.c\.ckpt\.k1ll3d\.tmp\)") as caught:
        model.load_checkpoint(path)
    assert caught[0].filename == __file__  # the user's line, not layerbraid's
    model.save_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_optimizer_state_that_does_not_fit_is_refused_and_nothing_changes(tmp_path):
    torch.manual_seed(0)
    model = ODEResNet(MPI.COMM_SELF, num_steps=2)
    x, y = batch(n=4)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(x), y).backward()
    sgd.step()
    path = tmp_path / "sgd.ckpt"
    model.save_checkpoint(path, sgd)
    bare = tmp_path / "bare.ckpt"
    model.save_checkpoint(bare)

    other = ODEResNet(MPI.COMM_SELF, num_steps=2)
    adam = torch.optim.Adam(other.parameters(), lr=0.1)
    F.cross_entropy(other(x), y).backward()
    adam.step()
    before_model = {k: v.clone() for k, v in other.state_dict().items()}
    before_opt = repr(adam.state_dict())
    with pytest.raises(CheckpointError, match=r"sgd.ckpt holds the state of a SGD optimizer, "
                                              r"not of this Adam"):
        other.load_checkpoint(path, adam)
    with pytest.raises(CheckpointError, match=r"bare.ckpt holds no optimizer state"):
        other.load_checkpoint(bare, adam)
    assert repr(adam.state_dict()) == before_opt
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before_model.items())
    adam.step()  # still usable
    fresh = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other.load_checkpoint(path, fresh)  # the right kind loads
    assert len(fresh.state) == len(sgd.state)
