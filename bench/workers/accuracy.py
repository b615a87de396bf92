"""Training with the true gradient error measured on the side (a worker of bench/accuracy.py,
run under mpiexec; prints JSON lines).

    accuracy.py EXAMPLE MODE EPOCHS LOG_EVERY [TARGET [MAX_BATCHES]]

EXAMPLE: mnist (examples/mnist.py's network and defaults) or volumes3d (examples/volumes3d.py's).
MODE: serial (plain PyTorch, one rank), fixed (the example's MGRIT settings: 2 forward / 1
adjoint iteration), warm (fixed, with warm starts), adaptive (target_error=TARGET, at most 10
iterations per solve), adaptive_warm (adaptive, with warm starts).  Every LOG_EVERY batches, before the optimizer step, the layer-parallel
gradients are compared with those of a serial copy with the same weights on the same batch.
"""
import sys
from pathlib import Path

# The examples this worker trains are imported by their file names.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def setup(example, mode, target):
    import torch
    from mpi4py import MPI

    import layerbraid

    comm = MPI.COMM_WORLD
    serial = mode == "serial"
    lp_comm = MPI.COMM_SELF if serial else comm
    if example == "mnist":
        from mnist import MNISTNet

        from layerbraid.data import load_mnist

        data = load_mnist(None)
        train = (data["train_x"], data["train_y"])
        test = (data["test_x"], data["test_y"])
        fwd = layerbraid.MGRITOptions(max_levels=2, cfactor=4, max_iters=2, nrelax=0, tol=0.0,
                                      skip_first_downcycle=True)
        batch, lr, opt = 64, 0.05, "sgd"

        def build(f, b, warm, target=None):
            return MNISTNet(lp_comm, 8, 8, 1.0, f, b, warm, target)
    else:
        from volumes3d import VolumeNet, make_volumes

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
    if mode.startswith("adaptive"):
        cap = fwd.__class__(**{**fwd.__dict__, "max_iters": 10})
        model = build(cap, cap, mode == "adaptive_warm", target)
    else:
        model = build(fwd, bwd, mode == "warm")
    if serial:
        model = model.to_serial()
    return comm, model, train, test, batch, lr, opt


def grad_error(model, xb, yb):
    """The relative 2-norm error of all parameter gradients against a serial copy (collective)."""
    import torch.nn.functional as F

    serial = model.to_serial()
    serial.zero_grad()
    F.cross_entropy(serial(xb), yb).backward()
    ref = dict(serial.named_parameters())
    num = den = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue  # held on another rank (open layer on the first, close on the last)
        q = ref[name].grad
        num += float((p.grad - q).pow(2).sum())
        den += float(q.pow(2).sum())
    comm = model.comm
    num, den = comm.allreduce(num), comm.allreduce(den)
    return (num / den) ** 0.5


def main():
    import json
    import time

    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from layerbraid.data import LayerParallelLoader

    example, mode, epochs, log_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    target = float(sys.argv[5]) if len(sys.argv) > 5 else None
    max_batches = int(sys.argv[6]) if len(sys.argv) > 6 else None
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
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            seconds += time.perf_counter() - t0
            if not serial and b % log_every == 0:
                err = grad_error(model, xb, yb)
                f, g = model.forward_stats, model.backward_stats
                if rank == 0:
                    print(json.dumps(dict(kind="batch", epoch=epoch + 1, batch=b,
                                          grad_error=err, est_fwd=f.error_estimate,
                                          est_bwd=g.error_estimate, it_fwd=f.iterations,
                                          it_bwd=g.iterations)), flush=True)
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
