"""Number formats derived from bit widths, checked against torch.finfo and against real casts."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_limits_equal_torch_finfo_and_real_casts(dtype):
    f = gc.float_format(dtype)
    info = torch.finfo(dtype)
    assert f.bits == info.bits
    assert f.max == info.max
    assert f.smallest_normal == info.tiny == info.smallest_normal
    assert f.eps == info.eps
    # the smallest subnormal is the next number after 0, and half of it rounds to 0
    zero, one = torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)
    assert torch.nextafter(zero, one).item() == f.smallest_subnormal
    assert torch.tensor(f.smallest_subnormal / 2, dtype=torch.float64).to(dtype).item() == 0.0
    # max is finite; the next step up overflows to inf
    assert torch.tensor(f.max, dtype=torch.float64).to(dtype).item() == f.max
    assert torch.isinf(torch.nextafter(torch.tensor(f.max, dtype=dtype), torch.tensor(float("inf"), dtype=dtype)))
    # eps is the gap after 1
    assert torch.nextafter(one, 2 * one).item() - 1.0 == f.eps


@pytest.mark.parametrize("e, m, expected_max", [(5, 2, 57344.0), (4, 3, 240.0), (8, 7, torch.finfo(torch.bfloat16).max)])
def test_custom_layouts(e, m, expected_max):
    # fp8 e5m2 is IEEE-like (57344 = torch.finfo(float8_e5m2).max); IEEE e4m3 would have 240
    assert gc.FloatFormat("x", e, m).max == expected_max


@pytest.mark.parametrize("bad, error", [(dict(exponent_bits=0, mantissa_bits=3), ValueError),
                                        (dict(exponent_bits=1, mantissa_bits=3), ValueError),
                                        (dict(exponent_bits=5, mantissa_bits=2.0), TypeError),
                                        (dict(exponent_bits=True, mantissa_bits=3), TypeError)])
def test_float_format_rejects_bad_widths(bad, error):
    with pytest.raises(error, match="bits must be"):
        gc.FloatFormat("x", **bad)


def test_float_format_rejects_unknown_dtypes():
    with pytest.raises(ValueError, match="no bit layout known for torch.int32; allowed"):
        gc.float_format(torch.int32)
    with pytest.raises(TypeError, match="torch.dtype"):
        gc.float_format("float16")


def _decode(fields, f):
    """Value of sign/exponent/mantissa bits by the IEEE formula (normal and subnormal)."""
    s, e, m = int(fields.sign), int(fields.exponent, 2), int(fields.mantissa, 2)
    frac = m / 2 ** f.mantissa_bits
    if e == 0:
        return (-1) ** s * frac * 2.0 ** (1 - f.bias)
    return (-1) ** s * (1 + frac) * 2.0 ** (e - f.bias)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(x=finite)
def test_bit_fields_match_struct_and_numpy(x):
    fp32 = gc.bit_fields(x, torch.float32)
    assert str(fp32).replace(" ", "") == format(struct.unpack(">I", struct.pack(">f", x))[0], "032b")
    fp16 = gc.bit_fields(x, torch.float16)
    with np.errstate(over="ignore"):
        ref16 = np.array([x], dtype=np.float32).astype(np.float16)
    assert str(fp16).replace(" ", "") == format(int(ref16.view(np.uint16)[0]), "016b")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        fields = gc.bit_fields(x, dtype)
        if int(fields.exponent, 2) != 2 ** gc.float_format(dtype).exponent_bits - 1:   # not inf
            assert _decode(fields, gc.float_format(dtype)) == fields.value


def test_bit_fields_examples_and_errors():
    assert str(gc.bit_fields(65504.0, torch.float16)) == "0 11110 1111111111"
    assert str(gc.bit_fields(70000.0, torch.float16)) == "0 11111 0000000000"            # inf
    assert gc.bit_fields(2.0**-24, torch.float16).exponent == "00000"                        # subnormal
    assert gc.bit_fields(0.1, torch.float16).value == 0.0999755859375
    with pytest.raises(TypeError, match="Python int or float"):
        gc.bit_fields(torch.tensor(1.0), torch.float16)


def _tensors():
    exps = st.lists(st.floats(-60, 20), min_size=1, max_size=200)
    return exps.map(lambda e: torch.tensor(e, dtype=torch.float64).exp2()
                    * torch.where(torch.rand(len(e)) < 0.5, -1.0, 1.0).double())


@settings(max_examples=100, deadline=None)
@given(t=_tensors(), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_cast_report_counts_like_a_direct_cast(t, dtype):
    t = t.float() if dtype != torch.float32 else t
    r = gc.cast_report(t, dtype)
    c = t.to(dtype).double()
    tiny = torch.finfo(dtype).tiny
    assert r.total == t.numel()
    assert r.underflow == sum(1 for a, b in zip(t.tolist(), c.tolist()) if a != 0 and b == 0)
    assert r.overflow == int(torch.isinf(c).sum())
    assert r.subnormal == sum(1 for b in c.tolist() if 0 < abs(b) < tiny)
    assert gc.underflow_fraction(t, dtype) == r.underflow / r.total


def test_cast_report_ignores_zeros_and_nonfinite():
    t = torch.tensor([0.0, float("inf"), float("nan"), 1e-10, 1.0])
    r = gc.cast_report(t, torch.float16)
    assert (r.total, r.underflow) == (2, 1)
    assert gc.cast_report(torch.zeros(3), torch.float16).underflow_fraction == 0.0
    assert "flushed to 0" in str(r)
    with pytest.raises(TypeError, match="floating-point"):
        gc.cast_report(torch.arange(3), torch.float16)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10**6), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_lost_update_fraction_is_the_share_of_unchanged_weights(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(500, generator=g)
    u = torch.randn(500, generator=g) * torch.logspace(-6, 0, 500)
    wd = w.to(dtype)
    expected = float(((wd + u.to(dtype)) == wd).float().mean())
    assert gc.lost_update_fraction(w, u, dtype) == pytest.approx(expected)
    assert gc.lost_update_fraction(w.double(), u.double(), torch.float64) == 0.0


def test_lost_update_fraction_checks_shapes():
    with pytest.raises(ValueError, match="same shape"):
        gc.lost_update_fraction(torch.ones(3), torch.ones(4), torch.float16)


def test_format_table_lists_every_format():
    table = gc.format_table()
    assert [line.split()[0] for line in table.splitlines()[1:]] == ["fp32", "fp16", "bf16"]
    assert "6.550e+04" in table


def test_plots_draw(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    ax = gc.plot_log2_histogram({"a": torch.randn(100) * 1e-6, "b": torch.randn(100)}, torch.float16)
    assert len(ax.patches) > 0 and len(ax.lines) == 3
    ax = gc.plot_ranges([torch.float16])
    assert len(ax.patches) == 2
