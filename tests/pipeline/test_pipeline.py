"""GPipe in one process equals the unsplit model; schedules are valid and have the ideal bubble."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpucourse as gc


def _random_model(seed, n_layers, width):
    g = torch.Generator().manual_seed(seed)
    widths = [width] + [int(w) for w in torch.randint(2, 9, (n_layers,), generator=g)]
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n_layers=st.integers(1, 5), batch=st.integers(1, 13),
       data=st.data())
def test_gpipe_outputs_and_gradients_equal_the_unsplit_model(seed, n_layers, batch, data):
    model = _random_model(seed, n_layers, 5)
    reference = _random_model(seed, n_layers, 5)
    num_stages = data.draw(st.integers(1, len(model)))
    chunks = data.draw(st.integers(1, batch))                # batch need not divide by chunks
    pipe = gc.GPipe.from_sequential(model, num_stages, chunks)
    x = torch.randn(batch, 5, generator=torch.Generator().manual_seed(seed))
    target = torch.randn(batch, model[-2].out_features)
    out, ref = pipe(x), reference(x)
    torch.testing.assert_close(out, ref)
    nn.functional.mse_loss(out, target).backward()
    nn.functional.mse_loss(ref, target).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_gpipe_input_gradient_and_virtual_devices():
    model = _random_model(3, 4, 5)
    pipe = gc.GPipe([s.to("cpu") for s in gc.split_sequential(model, 3)], chunks=4)
    x = torch.randn(9, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    pipe(x).sum().backward()
    model(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("make, err, match", [
    (lambda m: gc.GPipe.from_sequential(m, 9, 2), ValueError, "cannot cut 8 layers into 9 stages"),
    (lambda m: gc.GPipe.from_sequential(m, 2, 0), ValueError, "chunks must be >= 1"),
    (lambda m: gc.GPipe.from_sequential(m, 2, 2.0), TypeError, "chunks must be an int"),
    (lambda m: gc.GPipe([], 2), ValueError, "at least one stage"),
    (lambda m: gc.GPipe(m, 2), TypeError, "list of modules"),
    (lambda m: gc.GPipe([m, "x"], 2), TypeError, "stage 1 must be an nn.Module"),
])
def test_gpipe_rejects_bad_arguments(make, err, match):
    with pytest.raises(err, match=match):
        make(_random_model(0, 4, 5))


def test_gpipe_rejects_a_batch_smaller_than_chunks():
    pipe = gc.GPipe.from_sequential(_random_model(0, 2, 5), 2, chunks=4)
    with pytest.raises(ValueError, match="a batch of 3 samples cannot be cut into 4 micro-batches"):
        pipe(torch.randn(3, 5))


def test_gpipe_warns_about_batchnorm():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="BatchNorm"):
        gc.GPipe.from_sequential(model, 2, chunks=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc.GPipe.from_sequential(model, 2, chunks=1)


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 40), chunks=st.integers(1, 40))
def test_split_and_merge_microbatches(batch, chunks):
    x = torch.randn(batch, 3)
    if chunks > batch:
        with pytest.raises(ValueError, match="cannot be cut"):
            gc.split_microbatches(x, chunks)
        return
    parts = gc.split_microbatches(x, chunks)
    sizes = [len(p) for p in parts]
    assert len(parts) == chunks and max(sizes) - min(sizes) <= 1
    assert sizes == gc.pipeline.pipeline_parallel.microbatch_sizes(batch, chunks)
    assert torch.equal(gc.merge_microbatches(parts), x)


def test_clock_cycles_cover_every_task_once_in_dependency_order():
    for m, p in [(1, 1), (4, 2), (3, 5), (8, 4)]:
        ticks = gc.clock_cycles(m, p)
        assert len(ticks) == m + p - 1
        when = {task: k for k, tick in enumerate(ticks) for task in tick}
        assert sorted(when) == [(i, s) for i in range(m) for s in range(p)]
        for (i, s), k in when.items():
            if s > 0:
                assert when[(i, s - 1)] < k           # stage s-1 finished micro-batch i earlier


# --- schedules -------------------------------------------------------------------------------

def test_bubble_fraction_formula_and_errors():
    assert gc.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert gc.bubble_fraction(1, 1) == 0.0
    with pytest.raises(ValueError, match="num_microbatches must be >= 1, got 0"):
        gc.bubble_fraction(2, 0)
    with pytest.raises(TypeError, match="num_stages must be an int"):
        gc.bubble_fraction(2.0, 4)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), tb=st.sampled_from([1.0, 2.0, 3.0]))
def test_schedules_simulate_to_the_ideal_bubble(p, m, tb):
    for make in (gc.gpipe_schedule, gc.one_f_one_b_schedule):
        sched = make(p, m)
        assert sched.num_stages == p and sched.num_microbatches == m
        timeline = sched.simulate(forward_time=1.0, backward_time=tb)
        assert timeline.makespan == pytest.approx((m + p - 1) * (1.0 + tb))
        assert timeline.bubble() == pytest.approx(gc.bubble_fraction(p, m))
        # dependencies hold: F on stage s after F on s-1, B on s after B on s+1
        end = {(e.stage, e.kind, e.microbatch): e.end for e in timeline.events}
        for e in timeline.events:
            if e.kind == "F" and e.stage > 0:
                assert e.start >= end[(e.stage - 1, "F", e.microbatch)]
            if e.kind == "B" and e.stage < p - 1:
                assert e.start >= end[(e.stage + 1, "B", e.microbatch)]
    assert gc.gpipe_schedule(p, m).peak_in_flight() == [m] * p
    assert gc.one_f_one_b_schedule(p, m).peak_in_flight() == [min(p - s, m) for s in range(p)]


def test_communication_time_lengthens_the_ideal_schedule():
    t0 = gc.gpipe_schedule(3, 4).simulate(1, 2)
    t1 = gc.gpipe_schedule(3, 4).simulate(1, 2, comm_time=0.5)
    assert t1.makespan == pytest.approx(t0.makespan + 2 * 2 * 0.5)   # (p-1) hops, there and back
    assert t1.bubble() > t0.bubble()


def test_invalid_schedules_are_rejected():
    F, B = (lambda i: gc.PipelineOp("F", i)), (lambda i: gc.PipelineOp("B", i))
    with pytest.raises(ValueError, match="B0 before F0"):
        gc.PipelineSchedule("bad", [[B(0), F(0)]])
    with pytest.raises(ValueError, match="missing"):
        gc.PipelineSchedule("bad", [[F(0), F(1), B(0), B(1)], [F(0), B(0)]])
    with pytest.raises(ValueError, match="twice"):
        gc.PipelineSchedule("bad", [[F(0), F(0), B(0)]])
    with pytest.raises(ValueError, match="kind must be"):
        gc.PipelineOp("X", 0)
    # stage 0 wants B1 first, stage 1 wants to do B0 first: fine; but this one waits forever
    deadlock = gc.PipelineSchedule("deadlock", [[F(0), B(0), F(1), B(1)], [F(1), F(0), B(0), B(1)]])
    with pytest.raises(ValueError, match="deadlocks"):
        deadlock.simulate()


def test_timeline_text_and_measured_shift():
    text = gc.one_f_one_b_schedule(2, 2).simulate().to_text()
    assert text.splitlines() == ["stage 0 | F0 F1 .. B0 .. B1", "stage 1 | .. F0 B0 F1 B1 .."]
    events = [gc.TimelineEvent(0, "F", 0, 10.0, 11.0), gc.TimelineEvent(1, "F", 0, 11.5, 12.0)]
    tl = gc.Timeline.from_measured(events, 2)
    assert tl.events[0].start == 0.0 and tl.makespan == pytest.approx(2.0)
    assert tl.stage_bubbles() == pytest.approx([0.5, 0.75])
    assert tl.overlap() == 0.0
    assert gc.gpipe_schedule(2, 3).simulate().overlap() == pytest.approx(4.0)   # F1 F2 B0 B1


def test_timeline_plot_draws_one_bar_per_event():
    import matplotlib

    matplotlib.use("Agg")
    ax = gc.gpipe_schedule(2, 3).simulate(1, 2).plot()
    assert len(ax.patches) == 12


def test_parallel_grid():
    grid = gc.ParallelGrid(dp_size=3, pp_size=2)
    assert [grid.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(grid.rank(*grid.coords(r)) == r for r in range(6))
    assert grid.pipeline_ranks(2) == [2, 5] and grid.data_parallel_ranks(1) == [3, 4, 5]
    with pytest.raises(ValueError, match=r"Invalid rank 6, rank should be in the interval \[0, 5\]"):
        grid.coords(6)
    with pytest.raises(ValueError, match="dp_size must be >= 1, got 0"):
        gc.ParallelGrid(0, 2)


def test_saved_activation_meter_counts_and_releases():
    lin = nn.Linear(50, 50, bias=False)
    x = torch.randn(20, 50)
    with gc.SavedActivationMeter(ignore=lin.parameters()) as meter:
        y1 = torch.relu(lin(x))           # saves x (Linear) and relu's output, not the weight
        first = meter.current
        assert first == 2 * 20 * 50 * 4
        y2 = torch.relu(lin(x))           # x again: counted once; a second relu output
        assert meter.current == first + 20 * 50 * 4
        (y1.sum() + y2.sum()).backward()
    assert meter.current == 0 and meter.peak == first + 20 * 50 * 4
