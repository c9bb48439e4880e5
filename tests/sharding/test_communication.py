"""Bytes and α-β time per step of each ZeRO stage; the measured ring phases run and agree in kind."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpucourse as gc


@given(n=st.floats(0, 1e12), p=st.integers(1, 1024))
def test_volume(n, p):
    ddp = gc.zero_comm_bytes(n, p, 0)
    assert ddp == pytest.approx(gc.ring_all_reduce_bytes(n, p))            # chapter 05's all-reduce
    assert gc.zero_comm_bytes(n, p, 1) == gc.zero_comm_bytes(n, p, 2) == ddp
    assert gc.zero_comm_bytes(n, p, 3) == pytest.approx(1.5 * ddp)


@given(n=st.floats(0, 1e10), p=st.integers(1, 64), alpha=st.floats(0, 1e-3), beta=st.floats(0, 1e-6))
def test_time_matches_chapter_05_for_ddp(n, p, alpha, beta):
    assert gc.zero_comm_time(n, p, 0, alpha, beta) == pytest.approx(gc.ring_all_reduce_time(n, p, alpha, beta))
    assert gc.zero_comm_time(n, p, 3, alpha, beta) == pytest.approx(1.5 * gc.zero_comm_time(n, p, 1, alpha, beta))


def test_bad_input():
    with pytest.raises(ValueError, match="stage"):
        gc.zero_comm_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        gc.zero_comm_bytes(10, 0, 1)
    with pytest.raises(ValueError, match="world_size"):
        gc.measure_zero_comm(100, world_size=1)


def test_measure_runs():
    t = gc.measure_zero_comm(1000, world_size=3, repeats=1)      # 1000 does not divide by 3: padded
    assert sorted(t) == [0, 1, 3] and all(v > 0 for v in t.values())


def test_plot_and_widget_are_views_of_zero_memory():
    import matplotlib

    matplotlib.use("Agg")
    ax = gc.plot_zero_memory(10**9, 8)
    heights = [sum(p.get_height() for p in ax.patches if p.get_x() < i < p.get_x() + 1) for i in range(4)]
    expected = [gc.zero_memory(10**9, 8, s) / 1e9 for s in range(4)]
    assert heights == pytest.approx(expected, rel=1e-6)
    view = gc.zero_memory_widget()
    assert view.update(70, 8, 12) == [gc.zero_memory(70 * 10**9, 8, s) for s in range(4)]
