"""The forward's cross-rank handshake as a unit, without a model: its records carry shapes,
dtypes, devices, fingerprints and settings exactly; every failure is raised on every rank, the
same error; a rank that never arrives is reported, not waited for."""

import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

from layerbraid import StallError
from layerbraid._comm.world import resolve
from layerbraid._engine import handshake as hs
from layerbraid.errors import RemoteRankError

WORLD = resolve(MPI.COMM_WORLD)  # the transport the internals take
SELF = resolve(MPI.COMM_SELF)
SETTINGS = {"warm_start": False, "target_error": None, "output": "all", "levels": (2, 1)}


def opened(x=None):
    x = torch.randn(4, 3, 5, dtype=torch.float64) if x is None else x
    return hs.Opened(hs.InputMeta(tuple(x.shape), x.dtype, x.device), state=x)


# ---------------------------------------------------------------- one rank: the records
@pytest.mark.parametrize(
    "shape, dtype",
    [((4, 3, 5), torch.float64), ((2,), torch.float32), ((1, 2, 3, 4, 5, 6), torch.bfloat16),
     (tuple(range(1, 17)), torch.int64), ((0, 7), torch.complex128)],
)
def test_an_opening_record_carries_meta_and_fingerprint_exactly(shape, dtype):
    meta = hs.InputMeta(shape, dtype, torch.device("cpu"))
    fp = hs.Fingerprint(shape, dtype, 1.0 / 3.0, -math.pi * 1e300)
    r = hs._opening_record(hs.Opened(meta), fp, 12345)
    assert r.dtype == np.int64 and r.size == hs._OPEN_LEN
    assert hs._meta_of(r) == meta
    assert hs._fingerprint_of(r) == fp  # floats by their bits: exact
    assert r[-1] == 12345


def test_a_record_keeps_a_nan_fingerprint_and_a_cuda_device_index():
    meta = hs.InputMeta((3,), torch.float16, torch.device("cuda", 3))
    r = hs._opening_record(hs.Opened(meta), hs.Fingerprint((3,), torch.float16, math.nan, 2.0), 0)
    assert hs._meta_of(r).device == torch.device("cuda", 3)
    fp = hs._fingerprint_of(r)
    assert math.isnan(fp.total) and fp.matches(fp)  # NaN matches NaN, as before


def test_a_record_without_fingerprint_or_meta_says_so():
    r = hs._opening_record(None, None, 7)
    assert r[0] == hs._NONE and hs._fingerprint_of(r) is None


def test_fingerprints_tell_a_reordered_or_different_batch_and_forgive_round_off():
    x = torch.randn(8, 5, dtype=torch.float64)
    fp = hs.Fingerprint.of(x)
    assert fp.matches(hs.Fingerprint.of(x.clone()))
    assert not fp.matches(hs.Fingerprint.of(x.flip(0)))
    assert not fp.matches(hs.Fingerprint.of(x + 1e-3))
    assert not fp.matches(hs.Fingerprint.of(x.float()))
    close = hs.Fingerprint(fp.shape, fp.dtype, fp.total * (1 + 1e-12), fp.weighted)
    assert fp.matches(close)
    assert hs.Fingerprint.of(None) is None and hs.Fingerprint.of(torch.zeros(())) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_input_check_passes_huge_finite_values_and_counts_nan_and_inf(dtype):
    """The check sums the batch first; a sum that overflows on finite values is not a
    non-finite input (the elementwise check decides), and every NaN and Inf is counted."""
    big = torch.full((4, 3), torch.finfo(dtype).max, dtype=dtype)
    hs.check_input(big, True)  # its sum is Inf, its values finite
    hs.check_input(torch.cat([big, -big]), True)
    bad = big.clone()
    bad[0, 0], bad[2, 1], bad[3, 2] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(ValueError, match=r"the input holds 3 NaN or Inf value\(s\) "
                                         r"\(shape \(4, 3\)\)"):
        hs.check_input(bad, True)
    hs.check_input(bad, False)  # check_finite=False: not looked at
    hs.check_input(torch.tensor([[1, 2]]), True)  # integers cannot be non-finite


def test_the_settings_digest_is_stable_and_tells_settings_apart():
    assert hs.settings_digest(SETTINGS) == hs.settings_digest(dict(SETTINGS))
    assert hs.settings_digest(SETTINGS) != hs.settings_digest({**SETTINGS, "levels": (2, 2)})
    assert 0 <= hs.settings_digest(SETTINGS) < 2**63


def test_an_unknown_device_type_is_a_clear_error():
    with pytest.raises(ValueError, match="device type 'nowhere'"):
        hs._device_code(type("D", (), {"type": "nowhere", "index": None})())


def test_on_one_rank_the_handshake_is_local():
    o = opened()
    assert hs.agree_on_input(SELF, o, None, SETTINGS) == o.meta
    with pytest.raises(KeyError, match="boom"):
        hs.agree_on_input(SELF, hs.Opened(error=KeyError("boom")), None, SETTINGS)
    report = hs.CloseReport(hs.CloseStatus.OK, (4, 10), torch.float32)
    assert hs.share_close_report(SELF, report, 0) is report


# ---------------------------------------------------------------- two ranks
@pytest.mark.shared_job
@pytest.mark.parallel([2, 3])
def test_every_rank_gets_the_first_ranks_meta():
    x = torch.randn(4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    o = opened(x)
    meta = hs.agree_on_input(WORLD, o if WORLD.rank == 0 else None, hs.Fingerprint.of(x), SETTINGS)
    assert meta == o.meta
    last = WORLD.size - 1
    report = hs.CloseReport(hs.CloseStatus.OK, (4, 10), torch.float32)
    got = hs.share_close_report(WORLD, report if WORLD.rank == last else None, last)
    assert got == report
    hs.raise_for_close(got, None, last)  # nothing to raise


@pytest.mark.parallel([2])
def test_different_batches_are_the_same_error_on_every_rank():
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x if WORLD.rank == 0 else x.flip(0)
    with pytest.raises(ValueError, match=r"rank 1 got shape \(4, 3\).*differ: \[1\]"):
        hs.agree_on_input(WORLD, opened(x) if WORLD.rank == 0 else None,
                          hs.Fingerprint.of(mine), SETTINGS)


@pytest.mark.parallel([2])
def test_settings_that_differ_are_named_on_every_rank():
    theirs = dict(SETTINGS, output="next") if WORLD.rank == 1 else SETTINGS
    with pytest.raises(ValueError, match="disagree on output: rank 0 has 'all', rank 1 has 'next'"):
        hs.agree_on_input(WORLD, opened() if WORLD.rank == 0 else None, None, theirs)


@pytest.mark.parallel([2])
def test_an_open_layer_error_is_raised_on_every_rank():
    if WORLD.rank == 0:
        with pytest.raises(KeyError, match="no such layer"):
            hs.agree_on_input(WORLD, hs.Opened(error=KeyError("no such layer"),
                                               input_shape=(4, 7)), None, SETTINGS)
    else:
        with pytest.raises(ValueError, match=r"failed on rank 0, where the input of shape "
                                             r"\(4, 7\) went through the open layer: KeyError"):
            hs.agree_on_input(WORLD, None, None, SETTINGS)


@pytest.mark.parallel([2])
def test_a_close_layer_error_and_a_nonfinite_output_reach_every_rank():
    last = WORLD.size - 1
    error = RuntimeError("bad close")
    report = hs.CloseReport(hs.CloseStatus.ERROR, message="RuntimeError: bad close")
    got = hs.share_close_report(WORLD, report if WORLD.rank == last else None, last)
    if WORLD.rank == last:
        with pytest.raises(RuntimeError, match="bad close"):
            hs.raise_for_close(got, error, last)
    else:
        with pytest.raises(RemoteRankError, match="close layer failed on rank 1: RuntimeError"):
            hs.raise_for_close(got, None, last)
    report = hs.CloseReport(hs.CloseStatus.NONFINITE, (2, 3), torch.float64)
    got = hs.share_close_report(WORLD, report if WORLD.rank == last else None, last)
    with pytest.raises(FloatingPointError, match=r"non-finite output .* on rank 1, shape \(2, 3\)"):
        hs.raise_for_close(got, None, last)


@pytest.mark.parallel([2])
def test_a_rank_that_never_opens_the_forward_is_reported(short_timeout):
    """Rank 1 stops before the handshake: rank 0 raises StallError naming rank 1."""
    if WORLD.rank == 0:
        with pytest.raises(StallError, match="rank 1 to reach the forward of model"):
            hs.agree_on_input(WORLD, opened(), None, SETTINGS)


@pytest.mark.parallel([2])
def test_a_rank_that_never_joins_the_close_report_is_reported(short_timeout):
    """The last rank stops before its close report: rank 0 raises StallError after the
    timeout, naming what it waited for, instead of waiting forever."""
    if WORLD.rank == 0:
        with pytest.raises(StallError, match="rank 1's close layer's status"):
            hs.share_close_report(WORLD, None, 1)


@pytest.mark.parallel([2])
def test_settings_alone_are_agreed_by_digest_and_named_when_they_differ():
    hs.agree_on_settings(WORLD, SETTINGS, "a check", "the settings")  # alike: nothing raised
    theirs = dict(SETTINGS, warm_start=True) if WORLD.rank == 1 else SETTINGS
    with pytest.raises(ValueError, match="disagree on warm_start: rank 0 has False, rank 1 has "
                                         "True"):
        hs.agree_on_settings(WORLD, theirs, "a check", "the settings")


@pytest.mark.parallel([2])
def test_a_rank_that_never_agrees_on_settings_is_reported(short_timeout):
    if WORLD.rank == 0:
        with pytest.raises(StallError, match="rank 1 to reach an RNN's forward"):
            hs.agree_on_settings(WORLD, SETTINGS, "an RNN's forward", "the settings")
