"""Checkpoints of any model that holds layer-parallel parts: one file, any number of ranks.

The file holds the serial network's ``state_dict`` (every layer, whichever rank owned it), the
optimizer's per-parameter state keyed by parameter name, its hyper-parameters, and ``extra``.

Note [checkpoint file]: ``LAYERBRAID-CHECKPOINT 1\\n`` + the SHA-256 of the payload in hex +
``\\n`` + the payload, which is ``torch.save`` of plain containers and tensors only.  Saving
writes a temporary file in the target's directory, fsyncs it, renames it over the target and
fsyncs the directory: a crash at any moment leaves the old checkpoint or the new one, never a
torn file.  Loading checks the header and the checksum before unpickling, and unpickles with
``weights_only=True``, so a file can neither run code nor load silently corrupted.
"""

import hashlib
import io
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ._engine.parts import sharded_parts
from ._engine.warn import warn

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "resume", "CheckpointError"]

_MAGIC = b"LAYERBRAID-CHECKPOINT 1\n"
_FORMAT = "layerbraid-checkpoint-2"


class CheckpointError(ValueError):
    """A file that is not a readable layerbraid checkpoint; the message names the file."""


# ---------------------------------------------------------------- which rank holds what
def _parts(model: Any) -> Any:
    """[(prefix, layer-parallel module)], outermost first, and the layer communicator."""
    parts = sharded_parts(model)
    comm = parts[0][1].comm if parts else None
    for _, m in parts[1:]:
        if m.comm.Get_size() != parts[0][1].comm.Get_size():
            raise ValueError("a checkpoint needs every layer-parallel part on one layer group")
    return parts, comm


def _under(key: str, prefix: str) -> bool:
    return prefix == "" or key.startswith(prefix + ".")


def _strip(key: str, prefix: str) -> str:
    return key if prefix == "" else key[len(prefix) + 1 :]


def _local_keys(model: Any, keys: Sequence[str], parts: Sequence[Any], rank: int) -> list[str]:
    """The keys of ``keys`` whose value this rank holds: a layer-parallel part's on the rank
    that owns them, everything else (replicated on every rank) on the first rank."""
    out = []
    for k in keys:
        owner = next((m for prefix, m in parts if _under(k, prefix)), None)
        prefix = next((p for p, m in parts if m is owner), None)
        if owner is None:
            if rank == 0:
                out.append(k)
        elif prefix is not None and owner._holds_key(_strip(k, prefix)):
            out.append(k)
    return out


def _world(model: Any, comm: Any) -> tuple[bool, Any]:
    """(writer?, the communicator to wait on): one rank of the whole job writes."""
    parts, _ = _parts(model)
    grid = parts[0][1]._grid if parts else None
    if grid is not None:
        return grid.world.Get_rank() == 0, grid.world
    if comm is not None:
        return comm.Get_rank() == 0, comm
    return True, None


# ---------------------------------------------------------------- saving
def save_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    optimizer: Optional[torch.optim.Optimizer] = None,
    extra: Any = None,
    loader: Any = None,
) -> None:
    """Writes ``model``'s checkpoint to ``path`` (collective over the job).

    Args:
        model: a ``LayerParallelModule``, an ``nn.Module`` holding such parts (for instance
            stages of a staged network), or a plain module.
        path: the file; written atomically (see Note [checkpoint file]).
        optimizer: optional ``torch.optim`` optimizer over ``model.parameters()``.
        extra: tensors and plain containers (dict, list, str, numbers, None), e.g. the epoch.
        loader: a ``layerbraid.data.LayerParallelLoader`` whose position (epoch, batches) is
            saved too, so that a resumed run continues with the next batch.
    """
    parts, comm = _parts(model)
    rank = comm.Get_rank() if comm is not None else 0
    state = model.state_dict()
    # on their devices: they travel on the transport's (Note [checkpoint gather])
    mine = {k: state[k].detach() for k in _local_keys(model, list(state), parts, rank)}
    names = {id(p): k for k, p in model.named_parameters()}
    local_params = set(_local_keys(model, list(names.values()), parts, rank))
    opt_state = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if name in local_params and p in optimizer.state:
                    opt_state[name] = {
                        k: (v.detach() if torch.is_tensor(v) else v)
                        for k, v in optimizer.state[p].items()
                    }
    if comm is not None and comm.Get_size() > 1:
        gathered = _gather(comm, mine, opt_state, f"the state to save in {path}")
    else:
        gathered = [(mine, opt_state)]
    writer, world = _world(model, comm)
    error = None
    if writer:
        try:
            full, merged = {}, {}
            for m, o in gathered:
                full.update({k: v.cpu() for k, v in m.items()})
                merged.update({n: {k: _on_cpu(v) for k, v in s.items()} for n, s in o.items()})
            ckpt = {"format": _FORMAT, "model": full, "extra": extra}
            if loader is not None:
                ckpt["loader"] = loader.state_dict()
            for _, m in parts[:1]:
                ckpt["num_steps"], ckpt["t_final"] = m.num_steps, m.t_final
            if optimizer is not None:
                ckpt["optimizer"] = {
                    "type": type(optimizer).__name__,
                    "state": merged,
                    "param_groups": [
                        {k: v for k, v in g.items() if k != "params"}
                        for g in optimizer.param_groups
                    ],
                }
            _write_atomic(path, _encode(ckpt))
        except Exception as exc:  # every rank learns of it below
            error = exc
    if world is not None and world.Get_size() > 1:
        world.raise_on_every_rank(error, f"writing the checkpoint {path}")
    if error is not None:
        raise error


# Note [checkpoint gather]: the first rank writes the file, so every rank's share of the state
# comes to it: the structure (keys, the optimizer's plain values, each tensor's shape and dtype)
# as a small pickle, and the tensors themselves on the wire (Transport.exchange: one message per
# rank, on the transport's device, so a GPU's tensors move as they move in training, not
# through pickle).
_CHECKPOINT_TAG = 7620


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in the message of its rank: its index, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _gather(
    comm: Any, mine: dict[str, torch.Tensor], opt_state: dict[str, dict[str, Any]], what: str
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every rank's (state, optimizer state) on rank 0, in rank order (Note [checkpoint
    gather]); an empty list elsewhere."""
    tensors: list[torch.Tensor] = []

    def slot(v: Any) -> Any:
        if not torch.is_tensor(v):
            return v
        tensors.append(v.detach())
        return _Slot(len(tensors) - 1, tuple(v.shape), v.dtype)

    layout = (
        {k: slot(v) for k, v in mine.items()},
        {name: {k: slot(v) for k, v in s.items()} for name, s in opt_state.items()},
    )
    layouts = comm.gather_obj(layout, 0, f"{what} (its layout)")
    if comm.Get_rank() != 0:
        comm.exchange({0: tensors} if tensors else {}, {}, _CHECKPOINT_TAG, what)
        return []
    assert layouts is not None
    slots = {r: _slots(lay) for r, lay in enumerate(layouts) if r != 0}
    wanted = {
        r: [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in ss]
        for r, ss in slots.items()
        if ss
    }
    got = comm.exchange({}, wanted, _CHECKPOINT_TAG, what)
    out = [(mine, opt_state)]
    for r in range(1, len(layouts)):
        values = [t.clone() for t in got.get(r, [])]

        def fill(v: Any, values: list[torch.Tensor] = values) -> Any:
            return values[v.index] if isinstance(v, _Slot) else v

        state, opt = layouts[r]
        out.append(
            (
                {k: fill(v) for k, v in state.items()},
                {name: {k: fill(v) for k, v in s.items()} for name, s in opt.items()},
            )
        )
    return out


def _on_cpu(v: Any) -> Any:
    return v.cpu() if torch.is_tensor(v) else v


def _slots(layout: tuple[dict[str, Any], dict[str, dict[str, Any]]]) -> list[_Slot]:
    """The tensors of one rank's layout, in the order of its message."""
    state, opt = layout
    found = [v for v in state.values() if isinstance(v, _Slot)]
    found += [v for s in opt.values() for v in s.values() if isinstance(v, _Slot)]
    return sorted(found, key=lambda s: s.index)


def _encode(ckpt: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    payload = buf.getvalue()
    return _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _temp_files(path: Any) -> list[Any]:
    """Temporary files a save of ``path`` leaves only when its process dies mid-write."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        return sorted(p for p in directory.glob(f".{path.name}.*.tmp") if p.is_file())
    except OSError:
        return []


def _write_atomic(path: Any, data: bytes) -> None:
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    for stale in _temp_files(path):  # left by a save that was killed: never a checkpoint
        try:
            stale.unlink()
        except OSError:
            pass
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write checkpoint {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):  # ENOSPC, EDQUOT, EIO...: say which file
            raise OSError(
                exc.errno, f"writing checkpoint {path} failed: {exc.strerror or exc}"
            ) from exc
        raise
    try:  # the rename itself is durable once the directory is synced
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ---------------------------------------------------------------- loading
def read_checkpoint(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The checkpoint's contents (plain containers and tensors), checked: raises
    :class:`CheckpointError` naming the file and what is wrong with it."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):  # a device, a pipe: no size, maybe no end
                raise CheckpointError(f"checkpoint {path} is not a regular file")
            data = f.read(info.st_size)  # never more than the file held when opened
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    except MemoryError as exc:
        raise CheckpointError(
            f"checkpoint {path} ({info.st_size} bytes) does not fit in this process's memory"
        ) from exc
    stale = _temp_files(path)
    if stale:
        warn(
            f"beside checkpoint {path} lie {len(stale)} temporary file(s) of a save "
            f"that did not finish ({', '.join(p.name for p in stale[:3])}); the next "
            "save removes them"
        )
    if not data:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): its write did not finish")
    if not data.startswith(_MAGIC):
        hint = ""
        if data[:2] == b"PK" or data[:1] == b"\x80":  # a torch.save file (zip or pickle)
            hint = (
                ": it looks like a torch.save file; a plain state_dict loads with "
                "model.load_state_dict(torch.load(path, weights_only=True)) on every rank"
            )
        raise CheckpointError(
            f"{path} is not a layerbraid checkpoint (it does not start with "
            f"{_MAGIC.strip().decode()!r}; {len(data)} bytes){hint}"
        )
    rest = data[len(_MAGIC) :]
    digest, sep, payload = rest.partition(b"\n")
    if not sep or len(digest) != 64:
        raise CheckpointError(f"checkpoint {path} is truncated: its header is incomplete")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated: the SHA-256 of its "
            f"{len(payload)}-byte payload does not match the one stored in it"
        )
    try:
        ckpt = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} holds something other than tensors and plain "
            f"containers, which layerbraid does not load: {exc}"
        ) from exc
    if not isinstance(ckpt, dict) or ckpt.get("format") != _FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has an unknown format "
            f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt)}"
        )
    return ckpt


def load_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    optimizer: Optional[torch.optim.Optimizer] = None,
    loader: Any = None,
) -> Any:
    """Resumes ``model`` (and ``optimizer``, and ``loader``'s position where the file holds one)
    from :func:`save_checkpoint`'s file on any number of ranks; returns its ``extra``.  Each
    rank reads the file and keeps what it holds."""
    ckpt = read_checkpoint(path)
    # checked before anything is loaded: a mismatch leaves the model and the optimizer as
    # they were
    opt_state = None if optimizer is None else _optimizer_state(model, optimizer, ckpt, path)
    parts, _ = _parts(model)
    for _, m in parts[:1]:
        if ckpt.get("num_steps") is not None and ckpt["num_steps"] != m.num_steps:
            raise ValueError(
                f"{path} holds a network of {ckpt['num_steps']} steps; this model "
                f"has num_steps={m.num_steps}"
            )
    full = ckpt["model"]
    for prefix, m in parts:
        try:
            m.load_state_dict({_strip(k, prefix): v for k, v in full.items() if _under(k, prefix)})
        except RuntimeError as exc:
            raise CheckpointError(f"{path} does not match this model: {exc}") from exc
    if not any(p == "" for p, _ in parts):
        rest = {k: v for k, v in full.items() if not any(_under(k, p) for p, _ in parts)}
        result = model.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if not any(_under(k, p) for p, _ in parts)]
        if missing or result.unexpected_keys:
            raise CheckpointError(
                f"{path} does not match this model: missing {missing[:5]}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
    if opt_state is not None and optimizer is not None:  # (there is a state only for one)
        optimizer.load_state_dict(opt_state)
    if loader is not None and ckpt.get("loader") is not None:
        loader.load_state_dict(ckpt["loader"])
    for _, m in parts:  # every data group loaded the same weights (Note [replica check])
        averager = m.__dict__.get("_averager")
        if averager is not None and averager.replicas is not None:
            averager.replicas.check("the load of a checkpoint")
    return ckpt.get("extra")


def _optimizer_state(model: Any, optimizer: Any, ckpt: dict[str, Any], path: Any) -> Any:
    """The state dict to load into ``optimizer``, checked against it (CheckpointError
    otherwise); nothing is modified here."""
    saved_opt = ckpt.get("optimizer")
    if saved_opt is None:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (it was saved without "
            "an optimizer): load it with optimizer=None, or save the "
            "optimizer with it"
        )
    kind = saved_opt.get("type")
    if kind is not None and kind != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {path} holds the state of a {kind} optimizer, not of "
            f"this {type(optimizer).__name__}"
        )
    if len(saved_opt["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {path} holds {len(saved_opt['param_groups'])} "
            f"optimizer parameter group(s); this optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    names = {id(p): k for k, p in model.named_parameters()}
    saved = saved_opt["state"]
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for pid, p in enumerate(flat):
        name = names.get(id(p))
        if name is not None and name in saved:
            state[pid] = {
                k: (v.to(p.device) if torch.is_tensor(v) and v.dim() > 0 else v)
                for k, v in saved[name].items()
            }
    for pid, values in state.items():
        p = flat[pid]
        for k, v in values.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                raise CheckpointError(
                    f"checkpoint {path}: the optimizer state {k!r} of {names[id(p)]} has "
                    f"shape {tuple(v.shape)}, the parameter {tuple(p.shape)}"
                )
    groups = [
        {**s, "params": g["params"]}
        for g, s in zip(optimizer.state_dict()["param_groups"], saved_opt["param_groups"])
    ]
    return {"state": state, "param_groups": groups}


def resume(
    model: nn.Module,
    path: Union[str, os.PathLike],
    optimizer: Optional[torch.optim.Optimizer] = None,
    loader: Any = None,
) -> Any:
    """The first call of a script that checkpoints to ``path`` as it trains: where ``path``
    holds a checkpoint (the job was restarted, e.g. by ``torchrun --max-restarts``, or by hand
    on any number of ranks), loads it into ``model``, ``optimizer`` and ``loader``'s position
    as :func:`load_checkpoint` does and returns its ``extra``; where there is none, a fresh
    start, returns None and changes nothing.  Collective: the first rank looks, every rank
    follows its answer."""
    parts, comm = _parts(model)
    _, world = _world(model, comm)
    here = os.path.exists(path)
    if world is not None and world.Get_size() > 1:
        here = world.bcast_obj(here, 0, f"whether {os.fspath(path)} exists")
    if not here:
        return None
    return load_checkpoint(model, path, optimizer, loader)
