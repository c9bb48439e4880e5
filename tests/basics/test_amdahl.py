"""Amdahl and Gustafson: the formulas, their inverse, and the fit of a serial fraction."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpucourse as gc

fractions = st.floats(0.0, 1.0)
workers = st.integers(1, 10**6)


@settings(max_examples=200, deadline=None)
@given(s=fractions, n=workers)
def test_amdahl_is_bounded_by_n_and_by_one_over_s(s, n):
    S = gc.amdahl_speedup(s, n)
    assert 1.0 - 1e-12 <= S <= n * (1 + 1e-12)
    if s > 0:
        assert S <= 1.0 / s * (1 + 1e-12)
    assert S == pytest.approx(1.0 / (s + (1.0 - s) / n))


@settings(max_examples=100, deadline=None)
@given(s=fractions, n=st.integers(1, 1000))
def test_amdahl_grows_with_workers_and_gustafson_is_linear(s, n):
    assert gc.amdahl_speedup(s, n + 1) >= gc.amdahl_speedup(s, n) - 1e-12
    assert gc.gustafson_speedup(s, n + 1) - gc.gustafson_speedup(s, n) == pytest.approx(1.0 - s)
    assert gc.gustafson_speedup(s, 1) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(s=fractions, n=st.integers(2, 4096))
def test_karp_flatt_inverts_amdahl(s, n):
    assert gc.karp_flatt(gc.amdahl_speedup(s, n), n) == pytest.approx(s, abs=1e-9)


def test_array_inputs_broadcast():
    n = np.array([1, 2, 4, 8])
    np.testing.assert_allclose(gc.amdahl_speedup(0.5, n), 1 / (0.5 + 0.5 / n))
    np.testing.assert_allclose(gc.gustafson_speedup(np.array([0.0, 1.0]), 8), [8.0, 1.0])
    assert isinstance(gc.amdahl_speedup(0.1, 4), float)


@settings(max_examples=100, deadline=None)
@given(s=st.floats(0.0, 0.95), counts=st.lists(st.integers(1, 64), min_size=1, max_size=6))
def test_fit_recovers_the_serial_fraction_of_exact_data(s, counts):
    counts = sorted(set(counts) | {2})
    speedups = [gc.amdahl_speedup(s, n) for n in counts]
    assert gc.fit_serial_fraction(counts, speedups) == pytest.approx(s, abs=1e-9)


def test_fit_is_close_on_noisy_data_and_ignores_one_worker():
    rng = np.random.default_rng(0)
    n = np.array([1, 2, 4, 8, 16])
    measured = gc.amdahl_speedup(0.2, n) * rng.normal(1.0, 0.02, size=n.size)
    assert gc.fit_serial_fraction(n, measured) == pytest.approx(0.2, abs=0.02)
    assert gc.fit_serial_fraction([1, 2], [123.0, 1.6]) == gc.fit_serial_fraction([2], [1.6])


def test_fit_clips_to_the_unit_interval():
    assert gc.fit_serial_fraction([2, 4], [2.5, 5.0]) == 0.0     # super-linear: clipped at 0
    assert gc.fit_serial_fraction([2], [0.4]) == 1.0             # slower than serial: clipped at 1


@pytest.mark.parametrize("call, msg", [
    (lambda: gc.amdahl_speedup(1.5, 2), r"serial_fraction must be in \[0, 1\], got 1.5"),
    (lambda: gc.amdahl_speedup(0.1, 0), "workers must be >= 1, got 0"),
    (lambda: gc.gustafson_speedup(-0.1, 2), "serial_fraction must be in"),
    (lambda: gc.karp_flatt(2.0, 1), "workers must be > 1"),
    (lambda: gc.karp_flatt(0.0, 2), "speedup must be > 0"),
    (lambda: gc.fit_serial_fraction([1, 1], [1.0, 1.0]), "more than one worker"),
    (lambda: gc.fit_serial_fraction([2, 4], [1.5]), "same length"),
    (lambda: gc.fit_serial_fraction([2], [-1.0]), "speedups must be > 0"),
])
def test_bad_arguments_are_named(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


def test_measure_scaling_times_every_count():
    calls = []
    timings = gc.measure_scaling(calls.append, [1, 3], repeats=2, warmup=1)
    assert sorted(timings) == [1, 3] and calls == [1, 1, 1, 3, 3, 3]
    assert timings[1].name == "1 worker" and len(timings[3].times) == 2
    with pytest.raises(ValueError, match=r"worker count in \[0\] must be >= 1, got 0"):
        gc.measure_scaling(calls.append, [0])


def test_plot_amdahl_draws_curves_fit_and_points():
    import matplotlib
    matplotlib.use("Agg")
    ax = gc.plot_amdahl([0.0, 0.1, 0.5], max_workers=32, measured={1: 1.0, 2: 1.7}, fitted=0.15,
                        gustafson=True)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["ideal (s = 0)", "Amdahl s = 0.1 (max 10x)", "Gustafson s = 0.1",
                      "Amdahl s = 0.5 (max 2x)", "Gustafson s = 0.5", "fit: s = 0.15", "measured"]
    x, y = ax.get_lines()[1].get_data()
    np.testing.assert_allclose(y, gc.amdahl_speedup(0.1, x))


def test_widget_is_a_view_over_the_formulas():
    import matplotlib
    matplotlib.use("Agg")
    w = gc.amdahl_widget(0.05, 16, max_workers=256)
    s_slider, n_slider, _ = w.children
    assert 1 in n_slider.options and 256 in n_slider.options and 16 in n_slider.options
    s_slider.value, n_slider.value = 0.25, 8
    expected_a, expected_g = gc.amdahl_speedup(0.25, 8), gc.gustafson_speedup(0.25, 8)
    assert w.summary.startswith(f"s = 0.250, n = 8: Amdahl {expected_a:.2f}x, "
                                f"Gustafson {expected_g:.2f}x")
    with pytest.raises(ValueError, match=r"workers must be an int in \[1, 64\]"):
        gc.amdahl_widget(0.1, 100, max_workers=64)
