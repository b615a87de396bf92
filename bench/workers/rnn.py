"""Layer-parallel GRU or LSTM vs nn.GRU / nn.LSTM on one sequence length; args: seq levels
[cell [path]], cell gru (default) or lstm, path fused (default) or per-step (a worker of
bench/rnn.py, run under mpiexec; prints JSON lines)."""


REPEATS = 7  # timed runs after one warm-up; the machine's noise needs more than three


def main():
    import json
    import statistics
    import sys
    import time

    import torch
    from mpi4py import MPI

    from bench.harness import steady_allocator
    from layerbraid import MGRITOptions
    from layerbraid.nn import LayerParallelGRU, LayerParallelLSTM

    steady_allocator()  # as every worker that times plain PyTorch beside a layer-parallel run
    torch.set_num_threads(1)
    seq, levels = int(sys.argv[1]), int(sys.argv[2])
    cell = sys.argv[3] if len(sys.argv) > 3 else "gru"
    path = sys.argv[4] if len(sys.argv) > 4 else "fused"
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else REPEATS
    comm = MPI.COMM_WORLD

    def o(it):
        return MGRITOptions(max_levels=levels, cfactor=4, max_iters=it, nrelax=0, tol=0.0,
                            skip_first_downcycle=True)

    torch.manual_seed(0)
    lp_cls, ref_cls = {"gru": (LayerParallelGRU, torch.nn.GRU),
                       "lstm": (LayerParallelLSTM, torch.nn.LSTM)}[cell]
    net = lp_cls(16, 64, comm=comm, forward_options=o(2), backward_options=o(1),
                 fused=path == "fused")
    ref = ref_cls(16, 64, batch_first=True)
    ref.load_state_dict(net.state_dict())
    x = torch.randn(32, seq, 16)

    def once(m):
        m.zero_grad()
        out, _ = m(x)
        out.pow(2).mean().backward()
        return out

    lp, se = [], []
    for k in range(1 + repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        out = once(net)
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if comm.rank == 0:
            t1 = time.perf_counter()
            ref_out = once(ref)
            s = time.perf_counter() - t1
        comm.Barrier()
        if k:
            lp.append(t)
            if comm.rank == 0:
                se.append(s)
    if comm.rank == 0:
        err = float((out - ref_out).detach().norm() / ref_out.detach().norm())
        num = sum(float((p.grad - q.grad).pow(2).sum())
                  for p, q in zip(net.parameters(), ref.parameters()))
        den = sum(float(q.grad.pow(2).sum()) for q in ref.parameters())
        print(json.dumps(dict(seq=seq, ranks=comm.size, levels=levels, cell=cell, path=path,
                              seconds=statistics.median(lp), ref_seconds=statistics.median(se),
                              times=lp, ref_times=se,
                              err_output=err, err_param_grad=(num / den) ** 0.5)))


if __name__ == "__main__":
    main()
