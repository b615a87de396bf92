"""The cost of a forward's cross-rank handshake, alone: the pickled protocol layerbraid used
until the handshake became fixed-size records, beside the records (layerbraid._engine.handshake), in
interleaved rounds on the same ranks, with a real model's settings and an MNIST-sized batch.

    mpiexec -n 2 python -m bench.workers.handshake [--rounds 2000]

Prints one JSON line on rank 0: per protocol, the microseconds of one forward's handshake
(the opening and the close report) as min, quartiles and max over rounds.
"""

import argparse
import json
import time

import numpy as np
import torch
import layerbraid
from layerbraid.launch import world
from layerbraid._comm.base import check_same_settings
from layerbraid._engine import handshake as hs
from layerbraid.nn import ConvBlock


class _Net(layerbraid.LayerParallelModule):
    def __init__(self, comm):
        super().__init__(num_steps=8, comm=comm)
        self.open = torch.nn.Conv2d(1, 8, 3, padding=1)

    def step_layer(self, index):
        return ConvBlock(8)


def pickled(comm, x, meta, report, settings):
    """The protocol before fixed-size records: the neighbours' arrival, an allgather of
    pickled (meta, fingerprint, settings), a broadcast of the pickled close status."""
    first, last = comm.rank == 0, comm.size - 1
    comm.arrive("the forward of model(x)")
    fp = hs.Fingerprint.of(x)
    mine = (tuple(fp.shape), str(fp.dtype), fp.total, fp.weighted)
    meta_t = (meta.shape, meta.dtype, str(meta.device)) if first else None
    gathered = comm.allgather_obj((meta_t, mine, settings), "the input's fingerprints")
    check_same_settings([g[2] for g in gathered])
    status = ("ok", report.shape, report.dtype) if comm.rank == last else None
    comm.bcast_obj(status, last, "close layer's status")


def records(comm, x, meta, report, settings):
    """The handshake as layerbraid runs it now."""
    last = comm.size - 1
    opened = hs.Opened(meta) if comm.rank == 0 else None
    hs.agree_on_input(comm, opened, hs.Fingerprint.of(x), settings)
    hs.share_close_report(comm, report if comm.rank == last else None, last)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = world()  # MPI's COMM_WORLD, as the transport layerbraid runs on
    model = _Net(comm)
    settings = model._settings()
    x = torch.randn(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    meta = hs.InputMeta((64, 8, 28, 28), torch.float32, torch.device("cpu"))
    report = hs.CloseReport(hs.CloseStatus.OK, (64, 10), torch.float32)
    protocols = {"pickled": pickled, "records": records}
    times = {name: [] for name in protocols}
    for _ in range(50):  # warm-up
        for fn in protocols.values():
            fn(comm, x, meta, report, settings)
    for _ in range(args.rounds):
        for name, fn in protocols.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn(comm, x, meta, report, settings)
            times[name].append(time.perf_counter() - t0)
    if comm.rank == 0:  # rank 0 waits for the last rank's report: its time covers the round
        out = {"ranks": comm.size, "rounds": args.rounds}
        for name, t in times.items():
            q = np.percentile(np.array(t) * 1e6, [0, 25, 50, 75, 100])
            out[name] = {k: round(float(v), 1) for k, v in zip(("min", "q1", "median", "q3",
                                                                   "max"), q)}
        print(json.dumps(out), flush=True)
    model.free()


if __name__ == "__main__":
    main()
