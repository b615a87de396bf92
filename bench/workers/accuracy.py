"""Training with the true gradient error measured on the side (a worker of bench/accuracy.py,
run under mpiexec; prints JSON lines).

    accuracy.py EXAMPLE MODE EPOCHS LOG_EVERY [TARGET [MAX_BATCHES [AUDIT_EVERY [GAMMA]]]]

EXAMPLE: mnist (examples/mnist.py's network and defaults), volumes3d (examples/volumes3d.py's),
sequence (examples/sequence_classification.py's GRU on MNIST rows) or convchain (mnist's network
with 24 steps over T = 2, a deeper ReLU conv chain than any example's default).
MODE: serial (plain PyTorch, one rank), fixed (the example's MGRIT settings: 2 forward / 1
adjoint iteration), warm (fixed, with warm starts), warm1 (warm starts at 1 forward / 1
adjoint iteration), adaptive (target_error=TARGET, at most 10
iterations per solve), adaptive_warm (adaptive, with warm starts), smooth (fixed, the loss
plus GAMMA times the depth-smoothness penalty).  Every LOG_EVERY batches, before the optimizer
step, the layer-parallel
gradients are compared with those of a serial copy with the same weights on the same batch.
Every AUDIT_EVERY batches (default 50; 0: never) ``layerbraid.audit_gradients`` measures the
true error too and calibrates the estimate (Note [calibrated estimate]); the batches logged in
between judge the calibrated estimate, which saw only the audits before them.
"""
import sys
from bench import harness


def setup(example, mode, target):
    import torch
    from mpi4py import MPI

    import layerbraid

    comm = MPI.COMM_WORLD
    serial = mode == "serial"
    lp_comm = MPI.COMM_SELF if serial else comm
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

        def build(f, b, warm, target=None):
            return MNISTNet(lp_comm, steps, 8, t_final, f, b, warm, target)
    elif example == "sequence":
        Classifier = harness.example("sequence_classification").Classifier
        from torch import nn

        from layerbraid.nn import LayerParallelGRU

        train = (train[0].reshape(-1, 28, 28), train[1])
        test = (test[0].reshape(-1, 28, 28), test[1])
        lr, opt = 2e-3, "adam"

        def build(f, b, warm, target=None):
            rnn = nn.GRU(28, 32, batch_first=True) if serial else \
                LayerParallelGRU(28, 32, comm=comm, forward_options=f, backward_options=b,
                                 target_error=target)
            model = Classifier(rnn, 32, 10)
            if not serial:
                with torch.no_grad():
                    for p in model.head.parameters():
                        p.copy_(comm.bcast(p.detach(), root=0))
            return model
    else:
        volumes3d = harness.example("volumes3d")
        VolumeNet, make_volumes = volumes3d.VolumeNet, volumes3d.make_volumes

        train = make_volumes(1024, 16, 0)
        test = make_volumes(256, 16, 1)
        fwd = layerbraid.MGRITOptions(max_levels=3, cfactor=2, max_iters=2, nrelax=0, tol=0.0,
                                      skip_first_downcycle=True)
        batch, lr, opt = 16, 0.01, "adam"
        spatial = layerbraid.SpatialCoarsening(levels=[1, 2], mode="branch")

        def build(f, b, warm, target=None):
            return VolumeNet(lp_comm, 16, 4, f, b, spatial, warm, target)
    bwd = fwd.__class__(**{**fwd.__dict__, "max_iters": 1})
    torch.manual_seed(0)
    if mode.startswith("smooth"):
        model = build(fwd, bwd, False)
    elif mode.startswith("adaptive"):
        cap = fwd.__class__(**{**fwd.__dict__, "max_iters": 10})
        model = build(cap, cap, mode == "adaptive_warm", target)
    elif mode == "warm1":
        model = build(fwd.__class__(**{**fwd.__dict__, "max_iters": 1}), bwd, True)
    else:
        model = build(fwd, bwd, mode == "warm")
    if serial and hasattr(model, "to_serial"):
        model = model.to_serial()
    return comm, model, train, test, batch, lr, opt


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


def main():
    import json
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import layerbraid
    from layerbraid.data import LayerParallelLoader

    example, mode, epochs, log_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    target = float(sys.argv[5]) if len(sys.argv) > 5 else None
    max_batches = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    audit_every = int(sys.argv[7]) if len(sys.argv) > 7 else 50
    gamma = float(sys.argv[8]) if len(sys.argv) > 8 and mode.startswith("smooth") else 0.0
    torch.set_num_threads(1)
    comm, model, train, test, batch, lr, opt_name = setup(example, mode, target)
    serial = mode == "serial"
    rank = comm.rank
    params = model.parameters()
    opt = torch.optim.Adam(params, lr=lr) if opt_name == "adam" else \
        torch.optim.SGD(params, lr=lr, momentum=0.9)
    from mpi4py import MPI

    loader = LayerParallelLoader(TensorDataset(*train), batch,
                                 comm=MPI.COMM_SELF if serial else comm, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seconds, losses = 0.0, []
        for b, (xb, yb) in enumerate(loader):
            if max_batches is not None and b >= max_batches:
                break
            t0 = time.perf_counter()
            opt.zero_grad()

            def objective():
                loss = F.cross_entropy(model(xb), yb)
                return loss, loss + gamma * model.depth_smoothness() if gamma else loss

            loss, total = objective()
            total.backward()
            seconds += time.perf_counter() - t0
            if not serial and audit_every and b % audit_every == 0:
                a = layerbraid.audit_gradients(model, lambda: objective()[1])
                if rank == 0:
                    print(json.dumps(dict(kind="audit", epoch=epoch + 1, batch=b,
                                          grad_error=a.error, estimate=a.estimate,
                                          raw_estimate=a.raw_estimate,
                                          calibrated=a.calibrated, seconds=a.seconds)),
                          flush=True)
            elif not serial and b % log_every == 0:
                f, g = _last_stats(model)
                a = layerbraid.audit_gradients(model, lambda: objective()[1], calibrate=False)
                if rank == 0:
                    print(json.dumps(dict(kind="batch", epoch=epoch + 1, batch=b,
                                          grad_error=a.error, estimate=a.estimate,
                                          raw_estimate=a.raw_estimate,
                                          calibration=a.calibration, calibrated=a.calibrated,
                                          it_fwd=f.iterations, it_bwd=g.iterations)), flush=True)
            t0 = time.perf_counter()
            opt.step()
            seconds += time.perf_counter() - t0
            losses.append(loss.item())
        model.eval()
        correct = 0
        with torch.no_grad():
            for k in range(0, len(test[0]), 500):
                out = model(test[0][k:k + 500])
                correct += int((out.argmax(1) == test[1][k:k + 500]).sum())
        model.train()
        if rank == 0:
            print(json.dumps(dict(kind="epoch", epoch=epoch + 1, seconds=seconds,
                                  batches=len(losses), loss=sum(losses) / len(losses),
                                  test_accuracy=correct / len(test[0]))), flush=True)


if __name__ == "__main__":
    main()
