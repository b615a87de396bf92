"""The cross-rank handshake of a layer-parallel forward, as typed values and fixed-size records.

A forward of ``LayerParallelModule`` agrees on two things across its layer group:

- at the start, the input: the first rank's open layer made the chain's initial state (its
  shape, dtype and device, or an error), every rank's batch has the first rank's fingerprint,
  and every rank runs the same settings (:func:`agree_on_input`);
- at the end, the close layer's status on the last rank: an output of some shape and dtype,
  a non-finite output, or an error (:func:`share_close_report`).

Each is one collective of a fixed-size int64 record per rank (plus the neighbours' arrival
check before the first): no pickle on the hot path.  Only a failure sends text, in a second
round that every rank knows to join from the record: the open or close layer's error message,
or every rank's settings when their digests differ (to name the setting that differs).
"""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._comm.base import check_same_settings as _check_same_settings
from ..errors import RemoteRankError

__all__ = [
    "MAX_DIMS",
    "CloseReport",
    "CloseStatus",
    "Fingerprint",
    "InputMeta",
    "Opened",
    "agree_on_input",
    "agree_on_settings",
    "check_input",
    "share_close_report",
]

MAX_DIMS = 16  # a record holds shapes of up to this many dimensions

# Every dtype torch has, in one order on every rank (the same torch on every rank).
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta", "hpu", "xla", "mtia", "privateuseone")


@dataclass(frozen=True)
class InputMeta:
    """The chain's initial state as the first rank's open layer made it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Opened:
    """What the first rank got from its open layer: the state and its metadata, or the error
    it raised (with the shape of the input that caused it)."""

    meta: InputMeta | None = None
    error: BaseException | None = None
    input_shape: tuple[int, ...] = ()
    state: torch.Tensor | None = None  # the state itself (stays on the first rank)


@dataclass(frozen=True)
class Fingerprint:
    """(shape, dtype, sum, position-weighted sum) of an input batch.  The weights (1, 2, ...)
    over the samples make a reordered batch differ; a different batch differs in both sums."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    total: float
    weighted: float

    @classmethod
    def of(cls, x: Any) -> Fingerprint | None:
        """The fingerprint of ``x``; None for what is not a batch (None, a 0-d placeholder)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        with torch.no_grad():
            rows = x.detach().reshape(len(x), -1) if x.numel() else x.new_zeros(len(x), 0)
            per_sample = rows.to(torch.float64).sum(1)
            pos = torch.arange(1, x.shape[0] + 1, dtype=torch.float64, device=per_sample.device)
            total, weighted = float(per_sample.sum()), float((per_sample * pos).sum())
        return cls(tuple(x.shape), x.dtype, total, weighted)

    def matches(self, other: Fingerprint) -> bool:
        """Equal, up to the summation order's round-off (ranks on other devices)."""
        if self.shape != other.shape or self.dtype != other.dtype:
            return False
        scale = 1e-9 * max(1, int(np.prod(self.shape)))
        pairs = ((self.total, other.total), (self.weighted, other.weighted))
        # equal, both NaN, or round-off apart
        return all(
            u == v or (u != u and v != v) or abs(u - v) <= 1e-7 * (abs(u) + abs(v)) + scale
            for u, v in pairs
        )


class CloseStatus(enum.IntEnum):
    """What the last rank's close layer did with the chain's output."""

    OK = 0
    NONFINITE = 1
    ERROR = 2


@dataclass(frozen=True)
class CloseReport:
    """The close layer's status, and the shape and dtype of its output (OK, NONFINITE) or the
    text of its error (ERROR)."""

    status: CloseStatus
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    message: str = ""


# ---------------------------------------------------------------- the input's checks
def check_input(x: Any, check_finite: bool) -> None:
    """Raises ValueError for a batch the forward cannot take: empty, or (with check_finite)
    holding NaN or Inf."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return
    if x.shape[0] == 0:
        raise ValueError(f"the batch is empty: an input of shape {tuple(x.shape)}")
    if check_finite and x.is_floating_point() and not _finite(x.detach()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"the input holds {bad} NaN or Inf value(s) (shape {tuple(x.shape)}): "
            "bad input, before any step ran (check_finite=False turns this check off)"
        )


def _finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: NaN and Inf survive a sum, so one sum decides
    when it is finite (a read of the batch, no mask as large as it); a sum that is not (which a
    sum of huge finite values can be too) goes to the elementwise check."""
    with torch.no_grad():
        return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def settings_digest(settings: dict[str, Any]) -> int:
    """A 63-bit digest of ``settings`` (their repr: numbers, flags, tuples and None print the
    same on every rank)."""
    digest = hashlib.blake2b(repr(settings).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


# ---------------------------------------------------------------- records
# Note [handshake records]: one int64 record per rank.  A shape is its number of dimensions
# and MAX_DIMS slots; a dtype or device type is its index in a table every rank builds alike;
# a float travels as its bit pattern (exact, NaN included).
def _put_shape(record: np.ndarray, at: int, shape: tuple[int, ...]) -> int:
    record[at] = len(shape)
    dims = shape[:MAX_DIMS]
    record[at + 1 : at + 1 + len(dims)] = dims
    return at + 1 + MAX_DIMS


def _get_shape(record: np.ndarray, at: int) -> tuple[int, ...]:
    return tuple(int(d) for d in record[at + 1 : at + 1 + min(int(record[at]), MAX_DIMS)])


def _bits(value: float) -> int:
    return int(np.array([value], dtype=np.float64).view(np.int64)[0])


def _float(bits: int) -> float:
    return float(np.array([bits], dtype=np.int64).view(np.float64)[0])


def _device_code(device: torch.device) -> tuple[int, int]:
    if device.type not in _DEVICE_TYPES:
        raise ValueError(f"layerbraid cannot run a chain on device type {device.type!r}")
    return _DEVICE_TYPES.index(device.type), -1 if device.index is None else device.index


# The opening record: kind, shape, dtype, device type and index; the fingerprint (present,
# shape, dtype, two sums); the settings' digest.
_NONE, _META, _ERROR = 0, 1, 2
_SHAPE = 1 + MAX_DIMS
_OPEN_LEN = 1 + _SHAPE + 3 + 1 + _SHAPE + 3 + 1


def _opening_record(
    opened: Opened | None, fingerprint: Fingerprint | None, digest: int
) -> np.ndarray:
    r = np.zeros(_OPEN_LEN, dtype=np.int64)
    at = 1
    if opened is not None and opened.error is not None:
        r[0] = _ERROR
        at = _put_shape(r, at, opened.input_shape)
        at += 3
    elif opened is not None and opened.meta is not None:
        r[0] = _META
        at = _put_shape(r, at, opened.meta.shape)
        r[at] = _DTYPE_CODE[opened.meta.dtype]
        r[at + 1 : at + 3] = _device_code(opened.meta.device)
        at += 3
    else:
        at += _SHAPE + 3
    if fingerprint is not None:
        r[at] = 1
        at = _put_shape(r, at + 1, fingerprint.shape)
        r[at] = _DTYPE_CODE[fingerprint.dtype]
        r[at + 1], r[at + 2] = _bits(fingerprint.total), _bits(fingerprint.weighted)
        at += 3
    else:
        at += 1 + _SHAPE + 3
    r[at] = digest
    return r


def _meta_of(r: np.ndarray) -> InputMeta:
    at = 1 + _SHAPE
    kind, index = _DEVICE_TYPES[int(r[at + 1])], int(r[at + 2])
    device = torch.device(kind) if index < 0 else torch.device(kind, index)
    return InputMeta(_get_shape(r, 1), _DTYPES[int(r[at])], device)


def _fingerprint_of(r: np.ndarray) -> Fingerprint | None:
    at = 1 + _SHAPE + 3
    if not r[at]:
        return None
    at += 1
    shape = _get_shape(r, at)
    at += _SHAPE
    return Fingerprint(shape, _DTYPES[int(r[at])], _float(r[at + 1]), _float(r[at + 2]))


# ---------------------------------------------------------------- the collectives
def agree_on_input(
    comm: Any,
    opened: Opened | None,
    fingerprint: Fingerprint | None,
    settings: dict[str, Any],
) -> InputMeta:
    """The first rank's :class:`InputMeta` on every rank of ``comm`` (collective; ``opened`` is
    given on rank 0, None elsewhere).  Raises on every rank, the same error: the first rank's
    open-layer error (its own exception there, ValueError elsewhere), then settings that
    differ, then a rank whose fingerprint is not the first rank's (ranks with no fingerprint
    are not checked)."""
    first = comm.Get_rank() == 0
    if comm.Get_size() == 1:
        assert opened is not None
        if opened.error is not None:
            raise opened.error
        assert opened.meta is not None
        return opened.meta
    comm.arrive("the forward of model(x)")
    records = comm.allgather_ints(
        _opening_record(opened if first else None, fingerprint, settings_digest(settings)),
        "the input's fingerprints in model(x)",
    )
    head = records[0]
    if head[0] == _ERROR:
        error = opened.error if first and opened is not None else None
        text = comm.bcast_obj(
            f"{type(error).__name__}: {error}" if first else None, 0, "open layer's error"
        )
        if error is not None:
            raise error
        raise ValueError(
            f"the layer-parallel forward failed on rank 0, where the input of "
            f"shape {_get_shape(head, 1)} went through the open layer: {text}"
        )
    if len(set(records[:, -1].tolist())) > 1:  # the settings differ: name them
        _check_same_settings(comm.allgather_obj(settings, "the settings of model(x)"))
    ref = _fingerprint_of(head)
    if ref is not None:
        theirs = [(r, _fingerprint_of(rec)) for r, rec in enumerate(records[1:], 1)]
        bad = [(r, fp) for r, fp in theirs if fp is not None and not fp.matches(ref)]
        if bad:
            _raise_different_inputs(bad, ref)
    return _meta_of(head)


def agree_on_settings(comm: Any, settings: dict[str, Any], where: str, what: str) -> None:
    """Raises the same ValueError on every rank of ``comm`` when the ranks' ``settings``
    differ, naming the setting (collective: the neighbours' arrival at ``where``, then one
    allgather of the settings' digest; the settings themselves only when the digests differ)."""
    if comm.Get_size() == 1:
        return
    comm.arrive(where)
    digests = comm.allgather_ints(np.array([settings_digest(settings)], dtype=np.int64), what)
    if len(set(digests[:, 0].tolist())) > 1:
        _check_same_settings(comm.allgather_obj(settings, what))


def _raise_different_inputs(bad: list[tuple[int, Fingerprint]], ref: Fingerprint) -> None:
    r, fp = bad[0]
    raise ValueError(
        f"layer-parallel ranks were given different inputs: rank {r} got shape "
        f"{fp.shape} (fingerprint {fp.total:.6g}, {fp.weighted:.6g}), rank 0 got shape "
        f"{ref.shape} (fingerprint {ref.total:.6g}, {ref.weighted:.6g}); {len(bad)} rank(s) "
        f"differ: {[b[0] for b in bad]}.  Every rank of a layer group must be fed the same "
        "batch (the first rank reads the input, the last the labels): use "
        "layerbraid.data.LayerParallelLoader, or seed every rank's shuffling alike. "
        "(check_inputs=False turns this check off.)"
    )


_CLOSE_LEN = 1 + _SHAPE + 1


def share_close_report(comm: Any, report: CloseReport | None, root: int) -> CloseReport:
    """``root``'s :class:`CloseReport` on every rank of ``comm`` (collective; ``report`` is
    given on ``root``)."""
    if comm.Get_size() == 1:
        assert report is not None
        return report
    is_root = comm.Get_rank() == root
    r = np.zeros(_CLOSE_LEN, dtype=np.int64)
    if is_root:
        assert report is not None
        r[0] = int(report.status)
        _put_shape(r, 1, report.shape)
        r[-1] = -1 if report.dtype is None else _DTYPE_CODE[report.dtype]
    r = comm.bcast_ints(r, root, "close layer's status at the end of model(x)")
    status = CloseStatus(int(r[0]))
    if status is CloseStatus.ERROR:
        mine = report.message if report is not None else None
        text = comm.bcast_obj(mine, root, "close layer's error")
        return CloseReport(status, message=text)
    return CloseReport(status, _get_shape(r, 1), _DTYPES[int(r[-1])])


def raise_for_close(report: CloseReport, error: BaseException | None, root: int) -> None:
    """Raises what a failed close layer means on every rank: its own exception on ``root``
    (``error``), RemoteRankError elsewhere; FloatingPointError for a non-finite output."""
    if report.status is CloseStatus.ERROR:
        if error is not None:
            raise error
        raise RemoteRankError(f"the close layer failed on rank {root}: {report.message}", root)
    if report.status is CloseStatus.NONFINITE:
        raise FloatingPointError(
            f"the layer-parallel forward produced a non-finite output (NaN or Inf) on rank "
            f"{root}, shape {report.shape}: the input, the weights or the steps "
            "overflowed (check_finite=False turns this check off)"
        )
