"""Communication between ranks: the polled waits and collectives (mpi), tensors
between ranks (transport), the stall timeout (timeouts)."""
