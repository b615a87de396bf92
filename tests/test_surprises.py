"""No silent surprises: bad input named as such on every rank, requests that cannot be met
said out loud, a serial copy that keeps the model's dtype, checkpoints that say what they are."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import layerbraid
from layerbraid import CheckpointError, MGRITOptions
from nets import ODEResNet, batch

WORLD = MPI.COMM_WORLD


def model(comm=WORLD, steps=8, **kw):
    torch.manual_seed(0)
    return ODEResNet(comm, num_steps=steps, **kw)


@pytest.mark.parallel([1, 2])
def test_an_empty_batch_is_a_clear_error_on_every_rank():
    assert WORLD.Get_size() in (1, 2)
    m = model()
    x, _ = batch(n=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"the batch is empty: an input of shape \(0, 1, 8, 8\)"):
        m(x[:0])
    m(x)  # and the model still works
    m.free()


@pytest.mark.parallel([1, 2])
def test_non_finite_input_is_named_before_the_solve_on_every_rank():
    assert WORLD.Get_size() in (1, 2)
    m = model()
    x, _ = batch(n=4, dtype=torch.float32)
    x[1, 0, 2, 3] = float("nan")
    x[2, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"the input holds 2 NaN or Inf value\(s\).*bad input"):
        m(x)
    m.check_finite = False  # the check can be switched off
    m.check_inputs = False
    with torch.no_grad():
        assert torch.isnan(m(x)).any()
    m.free()


@pytest.mark.shared_job
@pytest.mark.parallel([1, 2])
def test_to_serial_keeps_the_models_dtype():
    assert WORLD.Get_size() in (1, 2)
    m = model().double()
    serial = m.to_serial()
    assert {p.dtype for p in serial.parameters()} == {torch.float64}
    x, _ = batch(n=4)
    with torch.no_grad():
        torch.testing.assert_close(serial(x), m(x), rtol=1e-12, atol=1e-12)
    # a copy, not the model's own memory
    with torch.no_grad():
        next(serial.parameters()).add_(1.0)
    assert not torch.equal(next(serial.parameters()), m.to_serial().state_dict()["open.weight"])
    m.free()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_serial_keeps_the_models_device():
    m = model(MPI.COMM_SELF).cuda()
    serial = m.to_serial()
    assert {p.device.type for p in serial.parameters()} == {"cuda"}
    x, _ = batch(n=4, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(serial(x.cuda()), m(x.cuda()), rtol=1e-5, atol=1e-6)
    m.free()


def test_a_hierarchy_smaller_than_asked_is_said_once(monkeypatch):
    from layerbraid._engine import chain

    monkeypatch.setattr(chain, "_REDUCED_WARNED", set())  # what earlier tests were told
    asked = MGRITOptions(max_levels=10, cfactor=16)
    with pytest.warns(UserWarning, match=r"the forward and adjoint solves asked for 10 MGRIT "
                                         r"levels with cfactor 16 over 8 steps, but only 1 "
                                         r"level\(s\) form.*exact sequential stepping") as caught:
        m = model(MPI.COMM_SELF, forward_options=asked, backward_options=asked)
        x, y = batch(n=4, dtype=torch.float32)
        F.cross_entropy(m(x), y).backward()  # the solvers are built again for this batch
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__  # the user's line, not layerbraid's or torch's
    assert m.mgrit_levels() == (1, 1)
    m.free()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what forms as asked says nothing
        m = model(MPI.COMM_SELF, forward_options=MGRITOptions(max_levels=2, cfactor=4))
    assert m.mgrit_levels() == (2, 1)
    m.free()


def test_a_target_the_caps_do_not_reach_is_visible_in_the_stats():
    m = model(MPI.COMM_SELF, steps=16, target_error=1e-9,
              forward_options=MGRITOptions(max_iters=1), backward_options=MGRITOptions(max_iters=1))
    x, y = batch(n=4, dtype=torch.float32)
    F.cross_entropy(m(x), y).backward()
    for stats in (m.forward_stats, m.backward_stats):
        assert stats.target is not None and stats.target_met is False
        assert stats.error_estimate > stats.target
    m.free()
    m = model(MPI.COMM_SELF, steps=16)
    F.cross_entropy(m(x), y).backward()
    assert m.forward_stats.target is None and m.forward_stats.target_met is None
    m.free()


def test_checkpoint_errors_name_the_file_and_the_way_out(tmp_path):
    m = model(MPI.COMM_SELF)
    plain = tmp_path / "plain.pt"
    torch.save(m.state_dict(), plain)
    with pytest.raises(CheckpointError, match=r"plain.pt is not a layerbraid checkpoint.*"
                                              r"torch.save file.*model.load_state_dict"):
        layerbraid.load_checkpoint(m, plain)
    m.load_state_dict(torch.load(plain, weights_only=True))  # the way it names works
    other = tmp_path / "other.ckpt"
    wide = model(MPI.COMM_SELF, channels=6)
    layerbraid.save_checkpoint(wide, other)
    with pytest.raises(CheckpointError, match=r"other.ckpt does not match this model"):
        layerbraid.load_checkpoint(m, other)
    m.free()
    wide.free()


def test_flags_and_counts_are_checked_where_they_are_given():
    for name in ("warm_start", "check_finite", "check_inputs"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
            model(MPI.COMM_SELF, **{name: "no"})
    with pytest.raises(ValueError, match=r"num_steps must be an int in 1..2\*\*62, got "
                                         + str(2**63)):
        model(MPI.COMM_SELF, steps=2**63)


def test_a_step_count_too_large_for_memory_fails_cleanly():
    """The level arrays' sizes are overflow-checked (calloc): a clear error, not a crash."""
    with pytest.raises(MemoryError, match="rank 0 is out of memory building level 0"):
        model(MPI.COMM_SELF, steps=2**61)


def test_a_subclass_that_skips_super_init_is_told():
    class Forgetful(layerbraid.LayerParallelModule):
        def __init__(self):
            torch.nn.Module.__init__(self)

        def step_layer(self, index):
            return torch.nn.Identity()

    with pytest.raises(TypeError, match=r"Forgetful.__init__ must call super\(\).__init__"):
        Forgetful()


def test_a_forward_before_the_model_is_built_is_told():
    class Eager(ODEResNet):
        def step_layer(self, index):
            self(torch.zeros(2, 1, 8, 8))  # the model is not built yet
            return super().step_layer(index)

    with pytest.raises(RuntimeError, match=r"model\(x\) was called before Eager finished "
                                           r"building"):
        Eager(MPI.COMM_SELF, num_steps=2)
