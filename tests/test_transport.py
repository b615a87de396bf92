"""Tensors between ranks as buffers: every dtype arrives bit-exact, in rank order."""
import pytest
import torch
from mpi4py import MPI

import layerbraid

from transports import WORLD

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.complex64, torch.int64,
          torch.uint8, torch.bool]


def make(dtype, shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    return (x * 50).to(dtype) if not dtype.is_complex else torch.complex(x, -x).to(dtype)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([1, 3])
def test_buffers_carry_every_dtype_exactly():
    for dtype in DTYPES:
        check(dtype)


def check(dtype):
    rank, size = WORLD.rank, WORLD.size
    ref = make(dtype, (3, 4), 0)
    got = WORLD.bcast_tensor(ref if rank == 0 else None, (3, 4), dtype, "cpu", 0)
    assert got.dtype == dtype and torch.equal(got, ref)
    mine = [make(dtype, (2,), rank), make(dtype, (), rank + 10)]
    WORLD.bcast_into(mine)
    assert torch.equal(mine[0], make(dtype, (2,), 0)) and torch.equal(mine[1], make(dtype, (), 10))
    rows = WORLD.allgather_rows(make(dtype, (rank + 1, 2), rank))  # uneven blocks
    assert torch.equal(rows, torch.cat([make(dtype, (r + 1, 2), r) for r in range(size)]))
    if size > 1:
        if rank == 0:
            WORLD.send_tensor(ref[:, ::2], size - 1, 5)  # not contiguous
        if rank == size - 1:
            assert torch.equal(WORLD.recv_tensor((3, 2), dtype, "cpu", 0, 5), ref[:, ::2])


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own job")
def test_the_core_over_cuda_aware_mpi_mode_equals_serial():
    """LAYERBRAID_CUDA_AWARE_MPI=1 routes the core's messages through the MPI transport
    (Note [CUDA-aware MPI] in layerbraid/_comm/mpi.py).  Here, with CPU states (MPI takes host
    buffers whatever it is), the tests of one level equal to serial and of converged MGRIT run
    through that path on 3 ranks; only the handing of device pointers to MPI is left to a
    machine with a CUDA-aware MPI."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA", "_PYTEST_MPI"))}
    env["LAYERBRAID_CUDA_AWARE_MPI"] = "1"
    cmd = ["mpiexec", "-n", "3", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-m", "both_transports and parallel[3]", "tests/test_module.py", "tests/test_rnn.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]


def test_the_wire_packs_mixed_dtypes_and_unpacks_them_exactly():
    """A list of tensors of mixed dtypes (the layout of a step's state: float weights, an int64
    counter, a bool mask) round-trips through one byte tensor, misaligned offsets included."""
    from layerbraid._comm.wire import nbytes, pack, unpack

    tensors = [make(torch.float64, (3,), 0), make(torch.bool, (1,), 1),
               make(torch.float32, (2, 2), 2), make(torch.int64, (), 3),
               make(torch.bfloat16, (5,), 4), make(torch.complex64, (2,), 5)]
    flat = pack(tensors, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == nbytes(tensors)
    for got, want in zip(unpack(flat, tensors), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="do not hold"):
        unpack(flat[:-1], tensors)


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2])
def test_the_step_weights_fetch_moves_tensors_only(monkeypatch):
    """The copies of the step layers that coarse steps inject are refreshed from their owners
    with no numpy on the way (under NCCL, no copy through host memory): torch.Tensor.numpy
    raises while they move, over a torch.distributed group.  (Under MPI, the host buffers
    handed to mpi4py are numpy views by design: the MPI path is not checked here.)"""
    from layerbraid._comm.dist import DistComm
    from nets import ODEResNet

    if not isinstance(WORLD, DistComm):
        pytest.skip("a torch.distributed group (torchrun) carries the check")
    torch.manual_seed(0)
    # rank 1 owns steps 5-9; its coarse step from point 4 injects step 4's layer, rank 0's
    options = layerbraid.MGRITOptions(max_levels=2, cfactor=4)
    model = ODEResNet(WORLD, num_steps=10, forward_options=options)
    steps = model._step_layers
    assert steps.plan.recvs if WORLD.rank == 1 else steps.plan.sends  # something moves
    for copy in steps.copies.values():
        for p in copy.parameters():
            p.data.zero_()

    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor went through numpy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    steps.exchange()
    monkeypatch.undo()
    serial = model.to_serial()  # collective: every step's weights, from their owners
    for i, copy in steps.copies.items():
        for got, want in zip(copy.state_dict().values(), serial.layers[i].state_dict().values()):
            assert torch.equal(got, want), i


@pytest.mark.shared_job
@pytest.mark.both_transports
@pytest.mark.parallel([2])
def test_the_core_sleeps_in_gloo_block_and_solves_as_when_it_spins(monkeypatch):
    """Over a torch.distributed group the MGRIT core's waits sleep in the transport's block
    (gloo's completions are reported by threads that a core spinning through its test
    callback starves), and the solve, gradients included, is bit for bit the one it gives
    when it spins instead: a wait changes when the core tests, never what it computes."""
    from layerbraid._comm.dist import DistComm
    from nets import ODEResNet, batch

    if not isinstance(WORLD, DistComm):
        pytest.skip("the core calls MPI itself under mpiexec: no block callback")
    options = layerbraid.MGRITOptions(max_levels=2, cfactor=2, max_iters=2, tol=0.0)
    x, y = batch(n=6)

    def solve():
        torch.manual_seed(0)
        model = ODEResNet(WORLD, num_steps=8, forward_options=options,
                          backward_options=options, microbatches=2).double()
        out = model(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.free()
        assert grads  # this rank's step layers, at least
        return [out.detach(), *grads]

    slept = []
    real = DistComm._block

    def counted(self, pending, seconds):
        did = real(self, pending, seconds)
        slept.append(did)
        return did

    monkeypatch.setattr(DistComm, "_block", counted)
    sleeping = solve()
    assert any(slept), "the core never slept in the transport's block"
    monkeypatch.setattr(DistComm, "_block", lambda self, pending, seconds: False)
    spinning = solve()
    for a, b in zip(sleeping, spinning):
        assert torch.equal(a, b)


def test_a_wait_that_gives_up_keeps_its_posted_receive_and_buffer(short_timeout):
    """A receive whose message never came stalls the wait; its request (which holds its
    buffer) is kept, so that a late sender's message lands in live memory instead of freed
    memory (in a 2-rank stall test, freed memory crashed the process at exit about every
    other run)."""
    from layerbraid._comm import base
    from layerbraid._comm.mpi import MPIComm

    comm = MPIComm(MPI.COMM_SELF.Dup(), owned=True)
    try:
        buf = torch.zeros(4, dtype=torch.uint8)
        work = comm._start_p2p(False, buf, 0, 7777)
        kept = len(base._ABANDONED)
        with pytest.raises(layerbraid.StallError, match="a message nobody sends"):
            comm.wait([work], "a message nobody sends")
        assert base._ABANDONED[kept:] == [work]
        # the late message still lands, in the buffer kept alive
        comm.comm.Send([torch.full((4,), 9, dtype=torch.uint8).numpy(), MPI.BYTE], dest=0,
                       tag=7777)
        work.request.Wait()
        assert buf.tolist() == [9] * 4
        base._ABANDONED.remove(work)
    finally:
        comm.Free()


def test_a_wait_that_can_block_sleeps_on_the_event_and_keeps_its_deadline(short_timeout):
    """The poll's ``block`` (gloo's point-to-point waits, whose completion a thread reports):
    the poll waits on it instead of spinning, in slices no longer than its 50 ms check, still
    reads the exit notices and still stalls at the deadline."""
    import threading
    import time

    from layerbraid._comm.waits import poll
    from layerbraid.errors import StallError

    ended, checks, slices = threading.Event(), [], []

    def block(seconds):
        slices.append(seconds)
        return ended.wait(seconds) or True

    threading.Timer(0.3, ended.set).start()
    t0 = time.perf_counter()
    poll(ended.is_set, lambda: checks.append(1), "a message", 0, block)
    assert 0.25 < time.perf_counter() - t0 < 1.0
    assert max(slices) <= 0.05 + 1e-9 and 3 <= len(checks) <= 8
    never = threading.Event()
    with pytest.raises(StallError, match="stalled: rank 0 waited 2 s for a message"):
        poll(never.is_set, lambda: None, "a message", 0, lambda s: never.wait(s) or True)


def test_a_poll_counts_the_cpu_it_spends_waiting_and_none_for_a_wait_it_never_makes():
    """wait_cpu_seconds: a poll that spins for 0.2 s adds that CPU to it (a rank's CPU time
    less its waiting is its work's, which the pipelining report's emulated rows predict
    from); one whose first test succeeds adds nothing."""
    import time

    from layerbraid._comm import waits

    before = waits.wait_cpu_seconds()
    waits.poll(lambda: True, lambda: None, "nothing", 0)
    assert waits.wait_cpu_seconds() == before
    end = time.perf_counter() + 0.2
    waits.poll(lambda: time.perf_counter() > end, lambda: None, "a spin", 0)
    assert waits.wait_cpu_seconds() - before > 0.05


@pytest.mark.shared_job
@pytest.mark.parallel([2])
def test_the_core_counts_the_cpu_its_waits_spend():
    """plan.wait_cpu_seconds (with the core's mgrit_wait_cpu_seconds): rank 1 of a 2-level
    solve waits in the core for rank 0, whose steps each sleep 50 ms, polling (under mpiexec
    waits spin, then yield or nap); that CPU is counted on rank 1, and no more than the time
    it waited."""
    import time

    from layerbraid.plan import wait_cpu_seconds
    from nets import ODEResNet, batch

    if WORLD.native_mpi() is None:
        pytest.skip("the core calls MPI itself under mpiexec")
    options = layerbraid.MGRITOptions(max_levels=2, cfactor=2, max_iters=1)
    model = ODEResNet(WORLD, num_steps=8, forward_options=options).double()
    x, _ = batch(n=4)
    model(x)  # warm
    if WORLD.rank == 0:
        for layer in model.modules():
            if isinstance(layer, layerbraid.nn.ConvBlock):
                layer.register_forward_hook(lambda *args: time.sleep(0.05))
    before, t0 = wait_cpu_seconds(), time.perf_counter()
    model(x)
    waited, took = wait_cpu_seconds() - before, time.perf_counter() - t0
    model.free()
    if WORLD.rank == 1:
        assert 0 < waited < took, (waited, took)


def test_gloo_waiter_threads_are_reused_and_grow_with_the_waits():
    """Each gloo point-to-point Work is waited on by a daemon thread that a finished wait
    hands back: as many threads as works waited on at once, none per message after that."""
    import threading
    import time

    from layerbraid._comm import dist

    class Work:
        def __init__(self):
            self.go = threading.Event()

        def wait(self):
            self.go.wait()

    pool = dist._Waiters()
    before = threading.active_count()
    works = [Work() for _ in range(3)]
    tasks = [dist._Threaded(w, pool) for w in works]
    assert threading.active_count() == before + 3  # three waits at once: three threads
    for w, t in zip(works, tasks):
        w.go.set()
        assert t.ended.wait(5)
    deadline = time.monotonic() + 5
    while pool.idle < 3 and time.monotonic() < deadline:  # each hands itself back
        time.sleep(0.01)
    again = Work()
    task = dist._Threaded(again, pool)
    again.go.set()
    assert task.ended.wait(5) and threading.active_count() == before + 3  # reused


def test_a_finished_gloo_work_is_freed_a_few_messages_later():
    """The poll that sees a gloo Work finished keeps it among the last few finished ones
    instead of freeing it at once (gloo's destructor waited for its own thread: 1.9 ms a message
    on a rank with one core); the oldest goes as another finishes, so they hold no more than a
    few messages' buffers."""
    import weakref

    from layerbraid._comm import dist

    class Work:
        def wait(self):
            pass

    pool = dist._Waiters()
    works = [Work() for _ in range(dist._RETIRED.maxlen + 1)]
    alive = [weakref.ref(w) for w in works]
    tasks = [dist._Threaded(w, pool) for w in works]
    del works
    first = tasks[0]
    assert first.ended.wait(5) and first.is_completed() and first.is_completed()
    assert first.work is None and alive[0]() is not None  # kept, once
    for t in tasks[1:-1]:
        assert t.ended.wait(5) and t.is_completed()
    assert alive[0]() is not None
    assert tasks[-1].ended.wait(5) and tasks[-1].is_completed()
    assert alive[0]() is None and all(a() is not None for a in alive[1:])


class _Wire:
    """Two in-process ends of a point-to-point layer: a receive takes the oldest message sent
    to it from its peer, and raises where the message is larger than its buffer (gloo and MPI
    take a shorter one)."""

    def __init__(self):
        self.queues = {0: [], 1: []}  # messages to each end, oldest first
        self.sent = 0

    def end(self, rank, oversized):
        from layerbraid._comm.stream import StateStream

        wire = self

        class End(StateStream):
            device = torch.device("cpu")
            oversized_receives = oversized

            def __init__(self):
                self._stream_init()

            def _start_p2p(self, send, t, peer, tag):
                if send:
                    wire.sent += 1
                    wire.queues[peer].append(t.reshape(-1).view(torch.uint8).clone())
                    return {"done": True}
                return {"done": False, "buf": t.reshape(-1).view(torch.uint8), "me": rank}

            def _done(self, work, what=""):
                if not work["done"] and wire.queues[work["me"]]:
                    msg = wire.queues[work["me"]].pop(0)
                    if msg.numel() > work["buf"].numel():
                        raise RuntimeError("a message larger than its receive")
                    work["buf"][: msg.numel()] = msg
                    work["done"] = True
                return work["done"]

        return End()


@pytest.mark.parametrize("oversized", [True, False])
def test_a_state_stream_sends_a_state_in_one_message_where_it_fits(oversized):
    """Where receives may be larger than their messages, a state and its record travel as one
    message while they fit the stream's capacity (64 KiB at first); a larger one goes as its
    record and then its body, and raises both ends' capacity alike, after which one of its
    size goes inline.  Elsewhere (NCCL) every state takes two messages.  The states arrive
    bit for bit, poisoned ones and those of another tag that come first included."""
    wire = _Wire()
    a, b = wire.end(0, oversized), wire.end(1, oversized)
    small, big = torch.arange(1000, dtype=torch.uint8), torch.arange(100_000).to(torch.uint8)
    sends = [(5, 0, b"s", small), (5, 0, b"big", big), (6, 0, b"agn", big),
             (5, 1, b"", None), (7, 0, b"empty", small[:0])]
    per_state = []
    for tag, flag, head, payload in sends:
        before = wire.sent
        a.isend_state(1, tag, flag, head, payload)
        per_state.append(wire.sent - before)
    if oversized:
        assert per_state == [1, 2, 1, 1, 1]
    else:
        assert per_state == [2, 2, 2, 1, 2]

    def take(tag):  # polled, as the core polls: a record's body is posted after it
        for _ in range(10):
            got = b.try_recv_state(0, tag)
            if got is not None:
                return got
        raise AssertionError(f"no state of tag {tag}")

    flag, head, payload = take(6)  # the state of tag 6 came after two of tag 5: they are kept
    assert (flag, head) == (0, b"agn") and torch.equal(payload, big)
    flag, head, payload = take(5)
    assert (flag, head) == (0, b"s") and torch.equal(payload, small)
    flag, head, payload = take(5)
    assert (flag, head) == (0, b"big") and torch.equal(payload, big)
    assert take(5) == (1, b"", None)
    flag, head, payload = take(7)
    assert (flag, head, payload.numel()) == (0, b"empty", 0)
    assert all(b.try_recv_state(0, 5) is None for _ in range(3))


def test_a_state_stream_carries_float64_states_whole_through_inline_records():
    """States as the core sends them (layerbraid's header and payload): a small one inline
    (copied out of its receive), a large one first in two messages, then inline as a view of
    its receive; every one arrives equal, float64 and its shape."""
    from layerbraid._engine.states import _from_parts, _header, _payload

    wire = _Wire()
    a, b = wire.end(0, True), wire.end(1, True)
    for shape in [(3, 5), (20000,), (20000,), (7, 3)]:
        x = torch.randn(shape, dtype=torch.float64)
        a.isend_state(1, 5, 0, _header(x), _payload(x))
        got = next(g for g in (b.try_recv_state(0, 5) for _ in range(5)) if g is not None)
        assert torch.equal(_from_parts(got[1], got[2], None), x), shape
    assert wire.sent == 5  # the first large state took two messages, the others one
