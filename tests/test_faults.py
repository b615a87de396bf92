"""Faults on one rank end every rank with their cause: no hang, no silent wrong answer."""
import re
import time

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import layerbraid
from layerbraid import LayerParallelModule, MGRITOptions, RemoteRankError
from layerbraid.tools import drill
from layerbraid.nn import ConvBlock, LayerParallelGRU
from nets import ODEResNet, batch

WORLD = MPI.COMM_WORLD
LAST = WORLD.size - 1


@pytest.fixture(autouse=True)
def _all_float64(float64):
    pass


class FailingClose(nn.Module):
    def forward(self, x):
        if WORLD.rank == LAST:
            raise ZeroDivisionError("the close layer broke")
        return x


@pytest.mark.parallel([1, 3])
def test_a_close_layer_that_raises_ends_every_rank_with_its_cause():
    model = ODEResNet(WORLD, num_steps=6)
    model.close = FailingClose()
    x, _ = batch()
    if WORLD.rank == LAST:
        with pytest.raises(ZeroDivisionError, match="the close layer broke"):
            model(x)
    else:
        with pytest.raises(RemoteRankError, match="close layer failed on rank .*ZeroDivision") \
                as info:
            model(x)
        assert info.value.rank == LAST


class BadSteps(LayerParallelModule):
    def __init__(self, comm, what):
        super().__init__(num_steps=6, comm=comm)
        self.what = what

    def step_layer(self, index):
        if index == 5:  # owned by the last rank
            if self.what == "raise":
                raise KeyError("no layer 5")
            return None
        return nn.Linear(4, 4)


@pytest.mark.parallel([1, 3])
def test_step_layer_failing_on_one_rank_is_an_error_on_every_rank():
    for what, error, text in [("raise", KeyError, "no layer 5"),
                              ("none", TypeError, "step_layer.5. must return")]:
        if WORLD.rank == LAST:
            with pytest.raises(error, match=text):
                BadSteps(WORLD, what)
        else:
            with pytest.raises(RemoteRankError, match=f"building the step layers failed on "
                                                      f"rank {LAST}: .*{text}"):
                BadSteps(WORLD, what)


@pytest.mark.parallel([1, 3])
def test_non_finite_outputs_and_gradients_are_errors_on_every_rank_with_one_level():
    model = ODEResNet(WORLD, num_steps=6)  # one level: no residual check
    x, y = batch()
    with pytest.raises(ValueError, match=r"the input holds 384 NaN or Inf value\(s\)"):
        model(x * float("inf"))  # bad input is named before any step runs
    weight = model.open.weight.detach().clone()
    with torch.no_grad():
        model.open.weight.mul_(1e300)
    with pytest.raises(FloatingPointError, match="non-finite output"):
        model(x * 1e10)  # finite, but the layers overflow
    with torch.no_grad():
        model.open.weight.copy_(weight)
    out = model(x)
    with pytest.raises(FloatingPointError, match="non-finite gradients"):
        (out.sum() * float("nan")).backward()
    model.check_finite = False
    assert not torch.isfinite(model(x * float("nan"))).all()


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward of layer 0 broke")


class BackwardBreaks(ODEResNet):
    def step_layer(self, index):
        block = ConvBlock(self.channels)
        if index == 0:
            return nn.Sequential(block, _Apply(FailsInBackward))
        return block


class _Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


@pytest.mark.parallel([2, 3])
def test_backward_errors_name_the_real_rank():
    model = BackwardBreaks(WORLD, num_steps=6)
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    if WORLD.rank == 0:
        with pytest.raises(ArithmeticError, match="backward of layer 0 broke") as info:
            loss.backward()
        assert "raised on rank 0" in " ".join(getattr(info.value, "__notes__", []))
    else:
        with pytest.raises(RemoteRankError, match="failed on rank 0; rank "
                                                  f"{WORLD.rank} stopped") as info:
            loss.backward()
        assert info.value.rank == 0


@pytest.mark.parallel([2, 3])
def test_deferred_parameter_gradients_that_fail_end_every_rank_with_their_cause(monkeypatch):
    """With one level every rank but the first computes its parameter gradients in the
    adjoint's idle callback, before the allreduce that ends the solve (Note [deferred parameter
    gradients] in layerbraid/_engine/layer_steps.py): a failure there is the original error on its
    rank and an error naming that rank on every other, within seconds."""
    from layerbraid._engine import layer_steps as _layer_steps

    real = _layer_steps._LayerSteps._deferred_parameter_grads

    def broken(run):
        if WORLD.rank == 1 and run.own.deferred:
            raise ArithmeticError("the deferred parameter gradients broke")
        real(run)

    monkeypatch.setattr(_layer_steps._LayerSteps, "_deferred_parameter_grads",
                        staticmethod(broken))
    one = MGRITOptions(max_levels=1)
    model = ODEResNet(WORLD, num_steps=6, forward_options=one, backward_options=one)
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    t0 = time.perf_counter()
    if WORLD.rank == 1:
        with pytest.raises(ArithmeticError, match="the deferred parameter gradients broke"):
            loss.backward()
    else:
        with pytest.raises(RemoteRankError, match=f"failed on rank 1; rank {WORLD.rank} "
                                                  "stopped") as info:
            loss.backward()
        assert info.value.rank == 1
    assert time.perf_counter() - t0 < 10


@pytest.mark.parallel([1, 2])
def test_small_misuses_are_clear_errors():
    model = ODEResNet(WORLD, num_steps=4)
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="set model.retain_graphs = True"):
        loss.backward()
    model.retain_graphs = True
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    loss.backward()  # the same forward again: the same gradients
    for a, p in zip(first, [p for p in model.parameters() if p.grad is not None]):
        torch.testing.assert_close(p.grad, a, rtol=0, atol=0)
    with pytest.raises(ValueError, match="t_final must be a finite number > 0, got inf"):
        NoneStep(num_steps=4, t_final=float("inf"), comm=WORLD)
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator .* got str"):
        NoneStep(num_steps=4, comm="world")


class ReturnsNone(nn.Module):
    def forward(self, x):
        return None


class NoneStep(LayerParallelModule):
    def step_layer(self, index):
        return ReturnsNone() if index == 2 else nn.Linear(3, 3)


@pytest.mark.parallel([1, 2])
def test_a_step_that_returns_none_names_its_index():
    model = NoneStep(num_steps=4, comm=WORLD)
    with pytest.raises((TypeError, RemoteRankError), match="step layer 2 returned NoneType"):
        model(torch.ones(2, 3))


def test_models_free_their_communicators():
    """MPICH allows about 2,000 communicators per process: 2,100 models must not run out."""
    opts = MGRITOptions(max_levels=1)
    for k in range(1050):
        with ODEResNet(WORLD, num_steps=2, forward_options=opts) as model:
            pass
        gru = LayerParallelGRU(2, 2, comm=WORLD)
        gru(torch.ones(1, 2, 2))
        gru.free()
    with pytest.raises(RuntimeError, match="was freed"):
        model(batch()[0])
    layerbraid.ProcessGrid(WORLD).free()


# ---------------------------------------------------------------- whole jobs
# The scenarios where rank 1 raises before loader/clip/checkpoint/resume end through the same abort
# hook as "forward" and "backward": bench/reliability.py runs them, the suite does not.
SUITE = sorted(set(drill.SCENARIOS) - {"loader", "clip", "checkpoint", "resume"})


# Scenarios where one rank raises and the others learn it as RemoteRankError
RELAYED = {"forward", "backward", "close-layer", "step-layer", "rnn", "grid", "from-serial",
           "chain"}


@pytest.fixture(scope="module")
def drill_jobs(request):
    """The drill's result of (scenario, launcher), for every pair this session selected: run
    two jobs at a time, the first time one is asked for (a job is mostly start-up and a
    stall's timeout, not work; one at a time, the 46 jobs took about 5 minutes)."""
    from concurrent.futures import ThreadPoolExecutor

    name = "test_a_fault_ends_every_rank_of_the_job_with_its_cause"
    wanted = [(item.callspec.params["scenario"], item.callspec.params["launcher"])
              for item in request.session.items
              if getattr(item, "originalname", None) == name]
    with ThreadPoolExecutor(2) as pool:
        jobs = {key: pool.submit(drill.run, key[0], launcher=key[1]) for key in wanted}
        return {key: job.result() for key, job in jobs.items()}


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
@pytest.mark.parametrize("scenario", SUITE)
def test_a_fault_ends_every_rank_of_the_job_with_its_cause(scenario, launcher, drill_jobs):
    """Each scenario of layerbraid.tools.drill on 2 ranks (timeout 3 s), under mpiexec (MPI) and
    under torchrun (torch.distributed, gloo): the job ends (no hang: the wall-time limit kills
    it otherwise), nonzero, soon after the fault; the rank the scenario names printed the cause
    (the faulty rank for a fault it raises itself, the other rank where a collective caught
    it); no rank finished as if nothing happened."""
    result = drill_jobs[(scenario, launcher)]
    out = result["output"][-3000:]
    assert not result["hung"], out
    assert result["seconds"] is not None, out
    assert result["rc"] != 0, out
    assert not drill.problems(scenario, result, 60), (drill.problems(scenario, result, 60),
                                                      result["cause_on"], result["faulty"],
                                                      result["outputs"], result["job"])
    where = drill.SCENARIOS[scenario][2]
    if where == "waiting":  # caught by the other rank, in the collective the scenario names
        other = 1 - result["faulty"]
        assert other in result["cause_on"], result["outputs"]
    if scenario in RELAYED:  # the traceback once, where it was raised; elsewhere one line
        for rank, text in result["outputs"].items():
            if rank != result["faulty"]:
                relayed = re.findall(r"^RemoteRankError on rank \d", text, re.M)
                assert "Traceback" not in text and len(relayed) <= 1, text
    if scenario == "exit-forward":  # a failure status: the exiting rank said so
        assert "is exiting" in result["outputs"][result["faulty"]], result["outputs"]
    # loaded 2-core machine: the stall itself takes the timeout, the teardown a few seconds
    assert result["seconds"] < drill.TIMEOUT + 10, f"{result['seconds']:.1f} s"


# ---------------------------------------------------------------- the rendezvous
def _launch_alone(env_extra, timeout_s):
    """``layerbraid.launch.world()`` in a process of its own, with ``env_extra`` over an environment
    free of the launcher's variables: (return code, stderr, seconds)."""
    import os
    import socket
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI", "MPI_LOCAL",
                                "MASTER_", "TORCHELASTIC", "LOCAL_RANK", "GROUP_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update({k: v.replace("PORT", str(port)) for k, v in env_extra.items()})
    t0 = time.perf_counter()
    code = "from layerbraid.launch import world; print(world().size)"
    proc = subprocess.run([sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own processes")
@pytest.mark.parametrize("rank, came", [("0", "1 of 2 processes arrived"),
                                        ("1", "could not reach the store that rank 0 hosts")])
def test_a_rendezvous_whose_peer_never_comes_ends_within_the_timeout(rank, came):
    rc, _, err, seconds = _launch_alone(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "PORT", "RANK": rank, "WORLD_SIZE": "2",
         "LAYERBRAID_TIMEOUT": "3"}, 120)
    assert rc != 0 and seconds < 3 + 10 + 5, (rc, seconds, err[-2000:])  # + interpreter start
    last = err.strip().splitlines()[-1]
    assert last.startswith("layerbraid.errors.StallError: stalled: rank " + rank), err[-2000:]
    assert "torch.distributed rendezvous at 127.0.0.1:" in last and "(WORLD_SIZE=2)" in last
    assert came in last and "LAYERBRAID_TIMEOUT" in last


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own processes")
def test_the_same_process_without_a_launcher_runs_alone():
    rc, out, err, _ = _launch_alone({}, 120)
    assert rc == 0 and out.strip() == "1", err[-2000:]
