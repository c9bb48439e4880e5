"""Throughput and arithmetic intensity: the counts, the roofline bound, and real measurements."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 4096))
def test_matmul_intensity_grows_linearly_and_add_is_constant(n):
    assert gc.arithmetic_intensity("matmul", n) == pytest.approx(n / 6)
    assert gc.arithmetic_intensity("matmul", n, torch.bfloat16) == pytest.approx(n / 3)
    assert gc.arithmetic_intensity("add", n) == pytest.approx(1 / 12)


def test_flop_counts_match_the_definition():
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    # (3,5) @ (5,4): 3*4 outputs, each 5 multiplies and 5 adds
    assert gc.matmul_flops(3, 4, 5) == 3 * 4 * 5 * 2 == (a @ b).numel() * a.shape[1] * 2
    assert gc.op_cost("matmul", 10, torch.float64) == (2000, 3 * 100 * 8)


@settings(max_examples=100, deadline=None)
@given(i=st.floats(0, 1e4), peak=st.floats(1, 1e5), bw=st.floats(1, 1e4))
def test_roofline_is_the_lower_of_the_two_limits(i, peak, bw):
    r = gc.roofline(i, peak, bw)
    assert r <= peak and r <= i * bw + 1e-9
    assert r == pytest.approx(min(peak, i * bw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_throughput_reports_consistent_rates(dtype):
    pts = gc.measure_throughput("matmul", [16, 64], dtype=dtype, repeats=2, min_time=1e-3)
    for p, n in zip(pts, [16, 64]):
        assert (p.op, p.size, p.device) == ("matmul", n, "cpu")
        assert p.dtype == str(dtype).removeprefix("torch.")
        assert p.flops == gc.matmul_flops(n) and p.seconds > 0
        assert p.gflops == pytest.approx(p.flops / p.seconds / 1e9)
        assert p.intensity == pytest.approx(gc.arithmetic_intensity("matmul", n, dtype))
        assert p.gbytes_per_s == pytest.approx(p.gflops / p.intensity)


@pytest.mark.cuda
def test_measure_throughput_on_cuda():
    (p,) = gc.measure_throughput("matmul", [256], device="cuda", repeats=2)
    assert p.device.startswith("cuda") and p.gflops > 0


@pytest.mark.parametrize("call, exc, msg", [
    (lambda: gc.op_cost("conv", 4), ValueError, "op must be one of"),
    (lambda: gc.op_cost("add", 0), ValueError, "size must be >= 1, got 0"),
    (lambda: gc.op_cost("add", 4, torch.int32), TypeError, "floating-point"),
    (lambda: gc.matmul_flops(4, 0), ValueError, "m must be >= 1, got 0"),
    (lambda: gc.roofline(1.0, 0, 10), ValueError, "peak_gflops must be a number > 0"),
    (lambda: gc.roofline(-1.0, 1, 10), ValueError, "intensity must be >= 0"),
    (lambda: gc.measure_throughput("add", [8], repeats=0), ValueError, "repeats must be"),
])
def test_bad_arguments_are_named(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_plots_draw_the_points_and_the_roof():
    import matplotlib
    matplotlib.use("Agg")
    pts = gc.measure_throughput("add", [256, 4096], repeats=1, min_time=1e-4)
    ax = gc.plot_roofline({"add": pts}, roofs={"cpu": (100.0, 10.0)})
    roof, points = ax.get_lines()
    x, y = roof.get_data()
    np.testing.assert_allclose(y, gc.roofline(x, 100.0, 10.0))
    np.testing.assert_allclose(points.get_ydata(), [p.gflops for p in pts])
    ax = gc.plot_throughput({"add": pts})
    np.testing.assert_allclose(ax.get_lines()[0].get_xdata(), [256, 4096])
    with pytest.raises(TypeError, match="non-empty dict"):
        gc.plot_throughput({})
