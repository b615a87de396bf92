"""Communication between ranks: the transport interface and the algorithms written once on it
(base), its MPI and torch.distributed backends (mpi, dist), one wire for tensors (wire), the
polled waits (waits), the stall timeout (timeouts), and the choice of transport (world)."""
