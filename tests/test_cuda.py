"""The GPU path: models, states and gradients on a CUDA device, every MPI message staged through
host memory (MPI is not assumed CUDA-aware), on 1 to 4 ranks sharing the machine's GPUs (rank r
takes GPU r % count, as the examples do).  The 2-rank tests run again under torchrun: with gloo
(CUDA states staged through the host) and, given two GPUs, with NCCL (states stay on the GPU).  Each test compares with the serial network on the
same device, or with the same layer-parallel run on the CPU.  Skipped where no GPU is present."""
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import LayerParallelModule, MGRITOptions, ProcessGrid, SpatialCoarsening
from layerbraid.nn import ConvBlock, LayerParallelGRU, LayerParallelLSTM, LPBatchNorm2d
from nets import ODEResNet, assert_gradients_match, batch
from tolerances import CONVERGED, ROUNDOFF
from transports import WORLD

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONVERGE = dict(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=40, tol=1e-13,
                nrelax=1)


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


def gpu():
    """This rank's GPU."""
    return torch.device("cuda", WORLD.rank % torch.cuda.device_count())


def on(dev, *tensors):
    return tuple(t.to(dev) for t in tensors)


def loss_and_grads(model, x, y):
    """(output, input gradient) after a cross-entropy backward through ``model``."""
    xp = x.clone().requires_grad_(True)
    out = model(xp)
    F.cross_entropy(out, y).backward()
    return out.detach(), xp.grad


def assert_same_gradients(model, serial, tol):
    """Every parameter gradient the rank holds, on its GPU in float64, against the serial
    copy's."""
    for _, p in model.named_parameters():
        assert p.grad is None or (p.grad.device == gpu() and p.grad.dtype == torch.float64)
    assert_gradients_match(model, serial, tol, WORLD)


@pytest.mark.parallel([1, 2, 3])
def test_one_level_on_the_gpu_equals_serial_to_roundoff():
    for n in (4, 9):  # 9: steps that do not divide evenly over the ranks
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=n).to(gpu())
        serial = model.to_serial()
        x, y = on(gpu(), *batch())
        out, gx = loss_and_grads(model, x, y)
        ref, gs = loss_and_grads(serial, x, y)
        assert out.device == gpu() and out.dtype == torch.float64
        torch.testing.assert_close(out, ref, rtol=ROUNDOFF, atol=ROUNDOFF)
        if WORLD.rank == 0:
            torch.testing.assert_close(gx, gs, rtol=ROUNDOFF, atol=ROUNDOFF)
        assert_same_gradients(model, serial, ROUNDOFF)


@pytest.mark.parallel([2])
def test_a_model_moved_to_the_gpu_after_solving_on_the_cpu_solves_there():
    """Rank 1 receives its first state before it makes one: it must land on the model's new
    device, not on the one of the earlier solves."""
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=6)
    x, y = batch()
    loss_and_grads(model, x, y)
    model.to(gpu())
    model.zero_grad()
    serial = model.to_serial()
    x, y = on(gpu(), x, y)
    out, _ = loss_and_grads(model, x, y)
    ref, _ = loss_and_grads(serial, x, y)
    assert out.device == gpu()
    torch.testing.assert_close(out, ref, rtol=ROUNDOFF, atol=ROUNDOFF)
    assert_same_gradients(model, serial, ROUNDOFF)


@pytest.mark.parallel([1, 3])
def test_three_levels_on_the_gpu_converge_to_serial():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=12, forward_options=MGRITOptions(**CONVERGE),
                      backward_options=MGRITOptions(**CONVERGE)).to(gpu())
    serial = model.to_serial()
    x, y = on(gpu(), *batch())
    out, _ = loss_and_grads(model, x, y)
    ref, _ = loss_and_grads(serial, x, y)
    torch.testing.assert_close(out, ref, rtol=CONVERGED, atol=CONVERGED)
    assert_same_gradients(model, serial, CONVERGED)
    assert model.forward_stats.residual_norms[-1] < 1e-13
    assert model.backward_stats.residual_norms[-1] < 1e-13


def two_one(cfactor):
    """2 forward / 1 adjoint iteration on 2 levels, the first down-cycle skipped: far from
    converged, as training runs."""
    def opts(iters):
        return MGRITOptions(max_levels=2, cfactor=cfactor, max_iters=iters, nrelax=0, tol=0.0,
                            skip_first_downcycle=True)
    return dict(forward_options=opts(2), backward_options=opts(1))


@pytest.mark.parallel([2, 3])
def test_few_iterations_on_the_gpu_do_what_they_do_on_the_cpu():
    """2 forward / 1 adjoint iteration, the first down-cycle skipped (far from converged): the
    same arithmetic on either device, to round-off, in the output and every gradient."""
    runs = []
    for dev in (torch.device("cpu"), gpu()):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=16, **two_one(4)).to(dev)
        x, y = on(dev, *batch())
        out, _ = loss_and_grads(model, x, y)
        runs.append((out.cpu(), [p.grad.cpu() for p in model.parameters() if p.grad is not None],
                     model.forward_stats.iterations, model.backward_stats.iterations))
    (o1, g1, f1, b1), (o2, g2, f2, b2) = runs
    assert (f1, b1) == (f2, b2) == (2, 1)
    torch.manual_seed(0)
    serial = ODEResNet(WORLD, num_steps=16).to_serial()
    assert (o1 - serial(batch()[0]).detach()).abs().max() > 1e-6  # not converged
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    assert len(g1) == len(g2) > 0
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("cls, ref_cls", [(LayerParallelGRU, nn.GRU),
                                          (LayerParallelLSTM, nn.LSTM)])
def test_rnns_on_the_gpu_equal_torch_rnns(cls, ref_cls):
    for opts, tol in ((None, ROUNDOFF), (MGRITOptions(**CONVERGE), CONVERGED)):
        torch.manual_seed(0)
        model = cls(3, 5, num_layers=2, comm=WORLD, forward_options=opts,
                    backward_options=opts).to(gpu())
        ref = ref_cls(3, 5, num_layers=2, batch_first=True).to(gpu())
        ref.load_state_dict(model.state_dict())
        x = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(1)).to(gpu())
        results = []
        for net in (model, ref):
            xx = x.clone().requires_grad_(True)
            out, _ = net(xx)
            (out * torch.linspace(-1, 1, 16, device=gpu()).view(1, 16, 1)).pow(2).sum().backward()
            results.append((out.detach(), xx.grad, [p.grad for p in net.parameters()]))
        (o1, gx1, gp1), (o2, gx2, gp2) = results
        assert o1.device == gpu()
        torch.testing.assert_close(o1, o2, rtol=tol, atol=tol)
        torch.testing.assert_close(gx1, gx2, rtol=tol, atol=tol)
        for a, b in zip(gp1, gp2):
            assert a.device == gpu()
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("cls, ref_cls", [(LayerParallelGRU, nn.GRU),
                                          (LayerParallelLSTM, nn.LSTM)])
def test_rnn_weights_on_the_gpu_are_one_cudnn_buffer_per_layer(cls, ref_cls):
    """Note [cuDNN weights]: after .to(gpu) each layer's parameters are views into one buffer
    (cuDNN then neither copies them on every call nor warns that it does), still the same
    Parameter objects; an optimizer made before the move trains them like torch's RNN, with
    no warning about the weights' layout; a change of dtype lays them out again."""
    torch.manual_seed(0)
    model = cls(3, 5, num_layers=2, comm=WORLD)
    params = list(model.parameters())
    model.to(gpu())
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref = ref_cls(3, 5, num_layers=2, batch_first=True).to(gpu())
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)

    def one_buffer_per_layer():
        assert all(a is b for a, b in zip(model.parameters(), params))
        for k in range(2):
            layer = model._layer_params(k)
            assert len({p.untyped_storage().data_ptr() for p in layer}) == 1, k
            assert all(p.is_cuda for p in layer)
        assert model._layer_params(0)[0].untyped_storage().data_ptr() != \
            model._layer_params(1)[0].untyped_storage().data_ptr()

    one_buffer_per_layer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(step)).to(gpu())
            outs = []
            for net, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                out, _ = net(x)
                out.pow(2).sum().backward()
                o.step()
                outs.append(out.detach())
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-10)
    assert not [str(w.message) for w in caught if "contiguous" in str(w.message)]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    one_buffer_per_layer()
    model.float()
    one_buffer_per_layer()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.cpu()  # on the CPU: the parameters are plain tensors again, and it still runs
    out, _ = model(torch.randn(4, 16, 3, dtype=torch.float32))
    assert out.device.type == "cpu" and all(not p.is_cuda for p in model.parameters())


class VolumeNet(LayerParallelModule):
    def __init__(self, comm, **kw):
        super().__init__(num_steps=8, t_final=1.0, comm=comm, **kw)
        self.open = nn.Conv3d(1, 2, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(2 * 8 ** 3, 3))

    def step_layer(self, index):
        return ConvBlock(2, dims=3)


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("mode", ["state", "branch"])
def test_spatial_coarsening_on_the_gpu_converges_to_serial(mode):
    opts = MGRITOptions(skip_first_downcycle=False, max_levels=3, cfactor=2, max_iters=12,
                        tol=1e-12, nrelax=1)
    torch.manual_seed(0)
    model = VolumeNet(WORLD, forward_options=opts, backward_options=opts,
                      spatial=SpatialCoarsening(levels=[1, 2], mode=mode)).to(gpu())
    serial = model.to_serial()
    x = torch.randn(3, 1, 8, 8, 8).to(gpu())
    y = torch.tensor([0, 1, 2], device=gpu())
    out, _ = loss_and_grads(model, x, y)
    ref, _ = loss_and_grads(serial, x, y)
    torch.testing.assert_close(out, ref, rtol=CONVERGED, atol=CONVERGED)
    assert_same_gradients(model, serial, CONVERGED)


class BNNet(LayerParallelModule):
    def __init__(self, comm, sync_comm=None, **kw):
        self._sync = sync_comm  # read by step_layer, which runs in __init__
        super().__init__(num_steps=6, comm=comm, **kw)
        self.open = nn.Conv2d(1, 3, 3, padding=1)
        self.close = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))

    def step_layer(self, index):
        return nn.Sequential(ConvBlock(3), LPBatchNorm2d(3, sync_comm=self._sync))


@pytest.mark.parallel([1, 3])
def test_batch_norm_on_the_gpu_equals_serial_batch_norm():
    torch.manual_seed(0)
    model = BNNet(WORLD).to(gpu())
    serial = model.to_serial()
    for k in range(3):
        x, y = on(gpu(), *batch(seed=k))
        model.zero_grad()
        serial.zero_grad()
        out, _ = loss_and_grads(model, x, y)
        ref, _ = loss_and_grads(serial, x, y)
        torch.testing.assert_close(out, ref, rtol=ROUNDOFF, atol=ROUNDOFF)
        assert_same_gradients(model, serial, ROUNDOFF)
        for i, layer in model.owned_steps():
            for b, c in zip(layer.buffers(), serial.layers[i].buffers()):
                assert b.device == gpu()
                torch.testing.assert_close(b, c, rtol=ROUNDOFF, atol=ROUNDOFF)


def _train(model, dev, steps, data_rank=0, data_size=1):
    """SGD with momentum on fixed batches of 8, each data group its shard."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(steps):
        x, y = batch(n=8, seed=k)
        idx = torch.randperm(8, generator=torch.Generator().manual_seed(k))
        idx = idx.tensor_split(data_size)[data_rank]
        opt.zero_grad()
        F.cross_entropy(model(x[idx].to(dev)), y[idx].to(dev)).backward()
        opt.step()
    return opt


@pytest.mark.parallel([4])
def test_data_and_layer_parallel_on_the_gpu_train_like_serial():
    """A 2 x 2 ProcessGrid, with layer-parallel batch norm synchronized over the data groups:
    the gradient averaging and the statistics' reduction are staged through host memory too."""
    torch.manual_seed(0)
    grid = ProcessGrid(WORLD, data_parallel=2)
    dp = BNNet(grid, sync_comm=grid.data_comm).to(gpu())
    serial = dp.to_serial()
    _train(dp, gpu(), 3, grid.data_rank, 2)
    _train(serial, gpu(), 3)
    ref = serial.state_dict()
    for name, p in dp.state_dict().items():
        if name.startswith("layers.") or (name.startswith("open.") and grid.layer_rank == 0) \
                or (name.startswith("close.") and grid.layer_rank == grid.layer_size - 1):
            assert p.device == gpu()
            torch.testing.assert_close(p, ref[name], rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"{name}: {m}")


@pytest.mark.parallel([2])
def test_a_gpu_checkpoint_resumes_on_the_cpu():
    torch.manual_seed(0)
    model = ODEResNet(WORLD, num_steps=6).to(gpu())
    opt = _train(model, gpu(), 2)
    path = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None) + "/ckpt.pt"
    layerbraid.save_checkpoint(model, path, opt, extra={"epoch": 1})
    torch.manual_seed(1)
    cpu = ODEResNet(WORLD, num_steps=6)
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    assert layerbraid.load_checkpoint(cpu, path, cpu_opt) == {"epoch": 1}
    theirs = cpu.state_dict()
    for name, a in model.state_dict().items():  # what this rank holds: its steps, open, close
        if name.startswith("layers.") or (name.startswith("open.") and WORLD.rank == 0) \
                or (name.startswith("close.") and WORLD.rank == WORLD.size - 1):
            assert theirs[name].device.type == "cpu"
            torch.testing.assert_close(a.cpu(), theirs[name], rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")
    WORLD.Barrier()
    if WORLD.rank == 0:
        os.remove(path)


@pytest.mark.parallel([1, 2])
def test_audit_and_probe_on_the_gpu_measure_what_they_measure_on_the_cpu():
    found = []
    for dev in (torch.device("cpu"), gpu()):
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=8, **two_one(2)).to(dev)
        x, y = on(dev, *batch())

        def closure():
            return F.cross_entropy(model(x), y)

        closure().backward()
        audit = layerbraid.accuracy.audit_gradients(model, closure, calibrate=False)
        probe = layerbraid.accuracy.probe_gradients(model, closure)
        found.append((audit.error, probe.change))
    (e1, p1), (e2, p2) = found
    assert e1 > 1e-6 and p1 > 1e-6  # a real error, not round-off
    assert e2 == pytest.approx(e1, rel=1e-8) and p2 == pytest.approx(p1, rel=1e-8)


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
def test_the_mnist_example_trains_on_the_gpu_on_two_ranks(tmp_path):
    cmd = ["mpiexec", "-n", "2", sys.executable, str(ROOT / "examples" / "mnist.py"),
           "--device", "cuda", "--epochs", "1", "--max-batches", "30", "--test-limit", "500",
           "--log-interval", "10", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout


def _torchrun_the_two_rank_tests(backend):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LAYERBRAID_DIST_BACKEND": backend,
           "_PYTEST_MPI_CHILD_PROCESS": "1"}  # run the tests here, not in an mpiexec job
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "parallel[2]",
           str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
def test_the_two_rank_gpu_tests_pass_under_torchrun_with_gloo():
    """Two processes sharing the GPU(s) over gloo: every CUDA state and gradient staged through
    the host (Note [device-resident messages] in layerbraid/_comm/dist.py)."""
    _torchrun_the_two_rank_tests("gloo")


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per process")
def test_the_two_rank_gpu_tests_pass_under_torchrun_with_nccl():
    """Two processes, one GPU each, over NCCL: states, tensors and gradient buckets never leave
    the GPU."""
    _torchrun_the_two_rank_tests("nccl")


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
def test_the_mnist_example_trains_on_the_gpu_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / "mnist.py"), "--device", "cuda", "--epochs", "1",
           "--max-batches", "30", "--test-limit", "500", "--out-dir", str(tmp_path)]
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1",
                               "LAYERBRAID_DIST_BACKEND": backend})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
