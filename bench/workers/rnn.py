"""Layer-parallel GRU vs nn.GRU on one sequence length; args: seq levels (a worker of bench/bench_rnn.py, run under mpiexec; prints JSON lines)."""


def main():
    import json, sys, time, statistics
    import torch
    from mpi4py import MPI
    from layerbraid import MGRITOptions
    from layerbraid.nn import LayerParallelGRU
    torch.set_num_threads(1)
    seq, levels = int(sys.argv[1]), int(sys.argv[2])
    comm = MPI.COMM_WORLD
    o = lambda it: MGRITOptions(max_levels=levels, cfactor=4, max_iters=it, nrelax=0, tol=0.0,
                                skip_first_downcycle=True)
    torch.manual_seed(0)
    gru = LayerParallelGRU(16, 64, comm=comm, forward_options=o(2), backward_options=o(1))
    ref = torch.nn.GRU(16, 64, batch_first=True)
    ref.load_state_dict(gru.state_dict())
    x = torch.randn(32, seq, 16)
    def once(net):
        net.zero_grad()
        out, _ = net(x)
        out.pow(2).mean().backward()
        return out
    lp, se = [], []
    for k in range(4):
        comm.Barrier(); t0 = time.perf_counter(); out = once(gru)
        t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if comm.rank == 0:
            t1 = time.perf_counter(); ref_out = once(ref); s = time.perf_counter() - t1
        comm.Barrier()
        if k:
            lp.append(t)
            if comm.rank == 0: se.append(s)
    if comm.rank == 0:
        err = float((out - ref_out).norm() / ref_out.norm())
        num = sum(float((p.grad - q.grad).pow(2).sum()) for p, q in zip(gru.parameters(), ref.parameters()))
        den = sum(float(q.grad.pow(2).sum()) for q in ref.parameters())
        print(json.dumps(dict(seq=seq, ranks=comm.size, levels=levels, seconds=statistics.median(lp),
                              gru_seconds=statistics.median(se), err_output=err,
                              err_param_grad=(num / den) ** 0.5)))


if __name__ == "__main__":
    main()
