"""Traces: busy fraction (CPU time / wall time per worker) and the timeline plot."""

import time

import pytest

import gpucourse as gc


def test_busy_fraction_sums_per_worker():
    t = gc.Trace("x")
    t.add(gc.ChunkRecord(0, 0, 0.0, 1.0, 1.0))
    t.add(gc.ChunkRecord(1, 1, 0.0, 2.0, 0.5))
    t.add(gc.ChunkRecord(2, 0, 1.0, 2.0, 0.0))
    assert t.busy_fraction() == {0: 0.5, 1: 0.25}
    assert t.wall == 2.0 and len(t) == 3 and repr(t) == "Trace('x', 3 chunks)"


def test_sleeping_workers_are_idle_and_computing_ones_busy():
    idle, busy = gc.Trace(), gc.Trace()
    gc.parallel_map(time.sleep, [0.05, 0.05], workers=2, trace=idle)
    gc.parallel_map(gc.python_work, [200_000], workers=1, backend="serial", trace=busy)
    # CPU time / wall time: a sleeping worker uses ~0 CPU; a computing one uses as much as the
    # (possibly busy) machine gives it, so compare the two instead of demanding a full core
    idle_max = max(idle.busy_fraction().values())
    assert idle_max < 0.2
    assert busy.busy_fraction()[0] > 3 * idle_max + 0.1


def test_empty_trace_and_bad_records():
    with pytest.raises(ValueError, match="is empty"):
        gc.Trace("nothing").busy_fraction()
    with pytest.raises(TypeError, match="expected a ChunkRecord"):
        gc.Trace().add((0, 0, 0.0, 1.0, 1.0))
    with pytest.raises(TypeError, match="name must be a str"):
        gc.Trace(3)


def test_plot_timelines_one_row_per_worker_of_each_trace():
    import matplotlib
    matplotlib.use("Agg")
    a, b = gc.Trace("serial"), gc.Trace("threads")
    gc.parallel_map(abs, range(4), backend="serial", trace=a)
    gc.parallel_map(abs, range(4), workers=2, num_chunks=4, trace=b)
    ax = gc.plot_timelines([a, b], title="t")
    assert [x.get_text() for x in ax.get_yticklabels()] == [
        "serial · worker 0", "threads · worker 0", "threads · worker 1"]
    assert len(ax.patches) == 2 * (len(a) + len(b))          # a pale and a solid bar per chunk
    with pytest.raises(TypeError, match="list of Trace"):
        gc.plot_timelines([])
