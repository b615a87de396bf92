"""What a layer-parallel part of a model is, and which of its gradients a rank counts."""

__all__ = []


def layer_parallel_parts(model):
    """The layer-parallel modules inside ``model`` (itself included)."""
    return [m for m in model.modules() if hasattr(m, "_counted_parameters")]


def sharded_parts(model):
    """[(name, module)] of the layer-parallel parts of ``model`` whose state is spread over the
    ranks (each rank holds its own step layers: ``_holds_key``), outermost first.  A
    layer-parallel RNN holds every weight on every rank, so it is not one: a checkpoint saves
    it as any replicated module."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "_holds_key")]


def counted_parameters(model):
    """``(comm, params)``: the layer group's communicator (None if the model holds no
    layer-parallel part) and the parameters of ``model`` whose gradients this rank counts, so
    that a sum over the ranks counts every gradient of the whole network once: a step layer on
    the rank that owns it, the open layer on the first rank, the close layer on the last,
    weights shared over the layer group on the first, and parameters outside any layer-parallel
    part (e.g. a head run on every rank) on the first."""
    parts = layer_parallel_parts(model)
    comms = {id(m.comm): m.comm for m in parts}
    if len(comms) > 1 and len({c.Get_size() for c in comms.values()}) > 1:
        raise ValueError("the layer-parallel parts of the model must all be on one layer group")
    comm = next(iter(comms.values())) if comms else None
    rank = comm.Get_rank() if comm is not None else 0
    inside, counted = set(), set()
    for m in parts:
        inside.update(id(p) for p in m.parameters())
        counted.update(id(p) for p in m._counted_parameters())
    params = [
        p for p in model.parameters() if id(p) in counted or (id(p) not in inside and rank == 0)
    ]
    return comm, params


class FreedOnExit:
    """``with obj:`` calls ``obj.free()`` at the end of the block (models, RNNs, grids)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
        return False
