"""Training in several modes side by side, with the true gradient error measured on the side
(a worker of bench/accuracy.py, run under mpiexec on 2 ranks; prints JSON lines).

    accuracy.py EXAMPLE MODES EPOCHS LOG_EVERY [TARGET [MAX_BATCHES [AUDIT_EVERY [PENALTIES [SEED]]]]]

EXAMPLE: mnist (examples/mnist.py's network and defaults), volumes3d (examples/volumes3d.py's),
sequence (examples/sequence_classification.py's GRU on MNIST rows), convchain (mnist's network
with 24 steps over T = 2, a deeper ReLU conv chain than any example's default) or transformerN
(examples/transformer.py's byte-level GPT with N layers, its defaults otherwise; 2 levels,
cfactor 4).
MODES: a comma-separated list of: serial (plain PyTorch, on rank 0 alone), exact (one MGRIT
level: sequential stepping across the ranks), fixed (the example's hierarchy at 2 forward / 1
adjoint iteration, the first down-cycle skipped), relaxed (fixed, the first down-cycle relaxed),
relaxed1 (1 forward / 1 adjoint iteration, the first down-cycle relaxed), warm (fixed, with
warm starts), warm1 (warm starts at 1 forward / 1 adjoint iteration), adaptive (target_error=TARGET, at most 10 iterations per solve),
adaptive_warm (adaptive, with warm starts), smooth and smooth3 (fixed, the loss plus the
depth-smoothness penalty times the weight PENALTIES gives the mode, "smooth=0.1,smooth3=0.3"),
serial_smooth and serial_smooth3 (plain PyTorch on rank 0 alone, with the penalty of smooth and
smooth3), tuned (iterations tuned to TARGET by ``layerbraid.accuracy.IterationTuner``,
aiming the probe at TARGET / 2 (its default margin), probing every TUNE_EVERY batches and
climbing within a batch whose probe is above that aim, from 2 forward / 1 adjoint iteration,
the first down-cycle skipped; the tuner's time is part of the batch's, as it is part of
training), tuned_warm (tuned, with warm starts), guard (relaxed1 under
``layerbraid.accuracy.BiasGuard``: windows of GUARD_WINDOW batches, an audited error above 0.05
at a stall raises the iterations; its audits are part of the batch's time, as in training).

Every mode trains its own model from the same initial weights on the same batches, the modes
taking turns batch by batch (the order rotating by one each batch, every timed part starting
at a barrier), so that their times are paired: each batch's time in a mode is measured within a
few seconds of plain PyTorch's on the same batch, under the same load.  The timed part of a batch
is zero_grad, the forward, the backward and the optimizer step.  Every LOG_EVERY batches, before
the optimizer step, the layer-parallel gradients are compared with exact ones for the same
weights and batch (``layerbraid.accuracy.audit_gradients(..., calibrate=False)``); at the batches that
``layerbraid.accuracy.audit_due(batch, AUDIT_EVERY)`` names (AUDIT_EVERY default 50; 0: never; batches
counted over the whole run) an audit measures the true error and calibrates the estimate
(Note [calibrated estimate]); the batches logged in between judge the calibrated estimate,
which saw only the audits before them, and ``layerbraid.accuracy.probe_gradients`` measures the
gradients' change with one more iteration (Note [gradient probe]) beside them.  Audits and
probes are not timed.  Every row printed names its
mode; an epoch's row carries each batch's time.
"""
import sys
from bench import harness

TUNE_EVERY = 20  # the tuned modes probe every this many batches (the examples' default)
GUARD_WINDOW = 10  # the guard mode's window of batches


def setup(example, seed=0):
    """(comm, build, train, test, batch size, learning rate, optimizer name), where
    ``build(mode, target)`` makes the model of one mode, from the same initial weights in
    every mode (drawn with ``seed``)."""
    import torch
    from mpi4py import MPI

    import layerbraid

    comm = MPI.COMM_WORLD
    if example in ("mnist", "convchain", "sequence"):
        from layerbraid.data import load_mnist

        data = load_mnist(None)
        train = (data["train_x"], data["train_y"])
        test = (data["test_x"], data["test_y"])
        fwd = layerbraid.MGRITOptions(max_levels=2, cfactor=4, max_iters=2, nrelax=0, tol=0.0,
                                      skip_first_downcycle=True)
        batch, lr, opt = 64, 0.05, "sgd"
    if example in ("mnist", "convchain"):
        MNISTNet = harness.example("mnist").MNISTNet

        steps, t_final = (8, 1.0) if example == "mnist" else (24, 2.0)

        def make(lp_comm, serial, f, b, warm, target=None):
            return MNISTNet(lp_comm, steps, 8, t_final, f, b, warm, target)
    elif example == "sequence":
        Classifier = harness.example("sequence_classification").Classifier
        from torch import nn

        from layerbraid.nn import LayerParallelGRU

        train = (train[0].reshape(-1, 28, 28), train[1])
        test = (test[0].reshape(-1, 28, 28), test[1])
        lr, opt = 2e-3, "adam"

        def make(lp_comm, serial, f, b, warm, target=None):
            rnn = nn.GRU(28, 32, batch_first=True) if serial else \
                LayerParallelGRU(28, 32, comm=lp_comm, forward_options=f, backward_options=b,
                                 target_error=target)
            model = Classifier(rnn, 32, 10)
            if not serial:
                with torch.no_grad():
                    for p in model.head.parameters():
                        p.copy_(lp_comm.bcast(p.detach(), root=0))
            return model
    elif example.startswith("transformer"):
        gpt = harness.example("transformer")
        steps = int(example.removeprefix("transformer"))
        data = gpt.windows(gpt.standard_library_text(2_000_000), 64)
        train = (data["train_x"], data["train_y"])
        test = (data["test_x"][:1000], data["test_y"][:1000])
        fwd = layerbraid.MGRITOptions(max_levels=2, cfactor=4, max_iters=2, nrelax=0, tol=0.0,
                                      skip_first_downcycle=True)
        batch, lr, opt = 32, 3e-3, "adam"

        def make(lp_comm, serial, f, b, warm, target=None):
            return gpt.TinyGPT(lp_comm, steps, 64, 4, 64, float(steps), f, b, warm, target)
    else:
        volumes3d = harness.example("volumes3d")
        VolumeNet, make_volumes = volumes3d.VolumeNet, volumes3d.make_volumes

        train = make_volumes(1024, 16, 0)
        test = make_volumes(256, 16, 1)
        fwd = layerbraid.MGRITOptions(max_levels=3, cfactor=2, max_iters=2, nrelax=0, tol=0.0,
                                      skip_first_downcycle=True)
        batch, lr, opt = 16, 0.01, "adam"
        spatial = layerbraid.SpatialCoarsening(levels=[1, 2], mode="branch")

        def make(lp_comm, serial, f, b, warm, target=None):
            return VolumeNet(lp_comm, 16, 4, f, b, spatial, warm, target)
    bwd = fwd.__class__(**{**fwd.__dict__, "max_iters": 1})

    def build(mode, target):
        serial = mode.startswith("serial")
        lp_comm = MPI.COMM_SELF if serial else comm
        torch.manual_seed(seed)
        if mode.startswith("smooth"):
            model = make(lp_comm, serial, fwd, bwd, False)
        elif mode.startswith("adaptive"):
            cap = fwd.__class__(**{**fwd.__dict__, "max_iters": 10})
            model = make(lp_comm, serial, cap, cap, mode == "adaptive_warm", target)
        elif mode == "exact":  # one level: sequential stepping across the ranks
            one = fwd.__class__(**{**fwd.__dict__, "max_levels": 1})
            model = make(lp_comm, serial, one, one, False)
        elif mode == "relaxed":  # cold, 2/1, the first down-cycle relaxed (as a warm solve's)
            model = make(lp_comm, serial,
                         *(o.__class__(**{**o.__dict__, "skip_first_downcycle": False})
                           for o in (fwd, bwd)), False)
        elif mode in ("relaxed1", "guard"):  # cold, 1/1, the first down-cycle relaxed
            relaxed = fwd.__class__(**{**fwd.__dict__, "max_iters": 1,
                                       "skip_first_downcycle": False})
            model = make(lp_comm, serial, relaxed, relaxed, False)
        elif mode == "warm1":
            model = make(lp_comm, serial, fwd.__class__(**{**fwd.__dict__, "max_iters": 1}), bwd,
                         True)
        else:  # fixed, warm, tuned, tuned_warm: from 2/1 iterations
            model = make(lp_comm, serial, fwd, bwd, mode in ("warm", "tuned_warm"))
        if serial and hasattr(model, "to_serial"):
            model = model.to_serial()
        return model

    return comm, build, train, test, batch, lr, opt


def _last_stats(model):
    """(forward, backward) SolveStats of the model's first layer-parallel part (an RNN's: its
    last layer's)."""
    for m in model.modules():
        f, b = getattr(m, "forward_stats", None), getattr(m, "backward_stats", None)
        if isinstance(f, list):
            return f[-1], b[0]  # the adjoint runs the last layer first
        if f is not None:
            return f, b
    raise ValueError("no layer-parallel part")


def _raw_solves(model):
    """{"raw_fwd": ..., "raw_bwd": ...}: the forward's and the adjoint's raw error estimates of
    the last batch, each summed over the model's layer-parallel parts and their solves (the
    gradient's raw estimate combines the two, Note [adaptive iterations]); None where a solve
    measured none."""
    out = {}
    for key, attr in (("raw_fwd", "forward_stats"), ("raw_bwd", "backward_stats")):
        values = []
        for m in model.modules():
            if hasattr(m, "_counted_parameters"):
                stats = getattr(m, attr, None)
                stats = stats if isinstance(stats, list) else [stats]
                values += [getattr(s, "raw_error_estimate", None) for s in stats]
        out[key] = None if not values or None in values else sum(values)
    return out


def main():
    import json
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import layerbraid
    from layerbraid.data import LayerParallelLoader

    example, modes = sys.argv[1], sys.argv[2].split(",")
    epochs, log_every = int(sys.argv[3]), int(sys.argv[4])
    target = float(sys.argv[5]) if len(sys.argv) > 5 else None
    max_batches = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    audit_every = int(sys.argv[7]) if len(sys.argv) > 7 else 50
    penalties = {m: float(g) for m, g in (kv.split("=") for kv in sys.argv[8].split(",") if kv)} \
        if len(sys.argv) > 8 else {}
    seed = int(sys.argv[9]) if len(sys.argv) > 9 else 0
    torch.set_num_threads(1)
    comm, build, train, test, batch, lr, opt_name = setup(example, seed)
    rank = comm.rank
    # serial trains on rank 0 alone (plain PyTorch on one core); the other rank waits for it at
    # the next barrier, as it would for anything else that runs on one rank
    runs = [m for m in modes if not m.startswith("serial") or rank == 0]
    models = {m: build(m, target) for m in modes}
    opts = {m: torch.optim.Adam(models[m].parameters(), lr=lr) if opt_name == "adam" else
            torch.optim.SGD(models[m].parameters(), lr=lr, momentum=0.9) for m in modes}
    gamma = {m: penalties.get(m.removeprefix("serial_"), 0.0) for m in modes}
    tuners = {m: layerbraid.accuracy.IterationTuner(models[m], target, every=TUNE_EVERY)
              for m in modes if m.startswith("tuned")}
    guards = {m: layerbraid.accuracy.BiasGuard(models[m], window=GUARD_WINDOW, log=None)
              for m in modes if m == "guard"}

    def emit(row):
        if rank == 0:
            print(json.dumps(row), flush=True)

    # every rank reads the same batches (the layer group's loader); serial uses them too
    loader = LayerParallelLoader(TensorDataset(*train), batch, comm=comm, seed=seed)
    per_epoch = len(loader) if max_batches is None else min(len(loader), max_batches)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        times, losses = {m: [] for m in modes}, {m: [] for m in modes}
        for b, (xb, yb) in enumerate(loader):
            if max_batches is not None and b >= max_batches:
                break
            turn = b % len(modes)
            for m in modes[turn:] + modes[:turn]:
                model, opt = models[m], opts[m]

                def objective():
                    loss = F.cross_entropy(model(xb), yb)
                    return loss, loss + gamma[m] * model.depth_smoothness() if gamma[m] else loss

                comm.Barrier()
                if m not in runs:
                    continue
                t0 = time.perf_counter()
                opt.zero_grad()
                loss, total = objective()
                total.backward()
                tuning = (tuners[m](lambda: objective()[1], epoch * per_epoch + b)
                          if m in tuners else None)
                event = (guards[m](loss, epoch * per_epoch + b, lambda: objective()[1])
                         if m in guards else None)
                seconds = time.perf_counter() - t0
                if event is not None:
                    emit(dict(kind="guard", mode=m, epoch=epoch + 1, batch=b,
                              before=event.before, now=event.now, error=event.error,
                              action=event.action, iterations=event.iterations,
                              seconds=event.seconds))
                if tuning is not None:
                    emit(dict(kind="tuning", mode=m, epoch=epoch + 1, batch=b,
                              change=tuning.change, lower_change=tuning.lower_change,
                              ran=tuning.ran, iterations=tuning.iterations,
                              climb=tuning.climb, aim=tuning.aim, seconds=tuning.seconds))
                serial = m.startswith("serial")
                if not serial and layerbraid.accuracy.audit_due(epoch * per_epoch + b, audit_every):
                    solves = _raw_solves(model)
                    a = layerbraid.accuracy.audit_gradients(model, lambda: objective()[1])
                    emit(dict(kind="audit", mode=m, epoch=epoch + 1, batch=b,
                              grad_error=a.error, estimate=a.estimate,
                              raw_estimate=a.raw_estimate, calibrated=a.calibrated,
                              seconds=a.seconds, **solves))
                elif not serial and b % log_every == 0:
                    f, g = _last_stats(model)
                    solves = _raw_solves(model)
                    a = layerbraid.accuracy.audit_gradients(model, lambda: objective()[1], calibrate=False)
                    p = layerbraid.accuracy.probe_gradients(model, lambda: objective()[1])
                    emit(dict(kind="batch", mode=m, epoch=epoch + 1, batch=b,
                              grad_error=a.error, estimate=a.estimate,
                              raw_estimate=a.raw_estimate, calibration=a.calibration,
                              calibrated=a.calibrated, it_fwd=f.iterations, it_bwd=g.iterations,
                              probe=p.change, probe_seconds=p.seconds,
                              audit_seconds=a.seconds, **solves))
                t0 = time.perf_counter()
                opt.step()
                times[m].append(seconds + time.perf_counter() - t0)
                losses[m].append(loss.item())
        for m in modes:
            if m not in runs:
                continue
            model = models[m]
            model.eval()
            correct = 0
            with torch.no_grad():
                for k in range(0, len(test[0]), 500):
                    out = model(test[0][k:k + 500])
                    correct += int((out.argmax(1) == test[1][k:k + 500]).sum())
            model.train()
            # a label per sample, or per position (the transformer's next bytes)
            emit(dict(kind="epoch", mode=m, epoch=epoch + 1, seconds=sum(times[m]),
                      batch_seconds=times[m], batches=len(losses[m]),
                      batch_losses=losses[m], loss=sum(losses[m]) / len(losses[m]),
                      test_accuracy=correct / test[1].numel()))


if __name__ == "__main__":
    main()
