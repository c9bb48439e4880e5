"""Profiler traces read back: synthetic traces with known answers, and a real 2-rank DDP trace."""

import itertools
import json

import matplotlib
import pytest
import torch

import gpucourse as gc

matplotlib.use("Agg")
BACKWARD = "autograd::engine::evaluate_function: AddmmBackward0"


def _write(tmp_path, events, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": [dict(ph="X", **e) for e in events]}))
    return path


def _random_step(rng, offset):
    """A step: backward [b0, b1) and buckets with random launches/durations; the expected hidden time."""
    b0 = offset + rng.uniform(0, 10)
    b1 = b0 + rng.uniform(20, 100)
    events = [{"name": f"ProfilerStep#{offset}", "tid": 1, "ts": offset, "dur": 400}]
    total = hidden = 0.0
    launch, launches = b0, []
    for k in range(int(rng.integers(1, 5))):
        launch = launch + rng.uniform(1, 40)
        launches.append(launch)
        start, end = launch + rng.uniform(0, 5), launch + rng.uniform(6, 60)
        events += [{"name": "c10d::allreduce_", "tid": 1, "ts": launch, "dur": 0.5},
                   {"name": "gloo:all_reduce", "tid": 2 + k % 2, "ts": start, "dur": end - start,
                        "args": {"Input Dims": [[10 * (k + 1)]], "Input type": ["float"]}}]
        total += end - launch
        hidden += max(0.0, min(end, b1) - max(launch, b0))
    # backward ops between the launches (a launch happens between ops, after a gradient is ready)
    cuts = [b0] + [t for t in launches if t < b1 - 1] + [b1]
    for lo, hi in itertools.pairwise(cuts):
        lo = lo if lo == b0 else lo + 0.6
        events.append({"name": BACKWARD, "tid": 1, "ts": lo, "dur": hi - lo})
    return events, total, hidden


@pytest.mark.parametrize("seed", range(5))
def test_hidden_fraction_matches_interval_arithmetic(tmp_path, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    events, totals, hiddens = [], 0.0, 0.0
    for s in range(3):
        e, t, h = _random_step(rng, 1000 * s)
        events += e
        totals, hiddens = totals + t, hiddens + h
    path = _write(tmp_path, events)
    steps = gc.step_traces(path)
    assert len(steps) == 3
    report = gc.allreduce_overlap(path)
    assert report.hidden_fraction == pytest.approx(hiddens / totals, rel=1e-6)
    per_step = [gc.hidden_fraction(t) for t in steps]
    assert all(0.0 <= f <= 1.0 for f in per_step)
    assert report.buckets[0].nbytes == 40


def test_launch_inside_last_backward_op_ends_backward(tmp_path):
    # DDP's hook launches the last bucket inside the AccumulateGrad event: backward ends at the launch
    events = [{"name": BACKWARD, "tid": 1, "ts": 0, "dur": 100}, {"name": "c10d::allreduce_", "tid": 1, "ts": 60, "dur": 40},
              {"name": "gloo:all_reduce", "tid": 2, "ts": 61, "dur": 50}]
    t = gc.step_traces(_write(tmp_path, events))[0]
    assert t.backward_end == pytest.approx(60e-6)
    assert gc.hidden_fraction(t) == 0.0


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        gc.read_trace_events(tmp_path / "missing.json")
    path = _write(tmp_path, [{"name": BACKWARD, "tid": 1, "ts": 0, "dur": 10}])
    with pytest.raises(ValueError, match="no DDP step"):
        gc.allreduce_overlap(path)
    with pytest.raises(ValueError, match="step must be in"):
        gc.trace_timeline(path, step=3)
    with pytest.raises(TypeError):
        gc.hidden_fraction("not a trace")


def _profile(rank, world_size, folder, cap):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    path = f"{folder}/rank{rank}_{cap}.json"
    gc.profile_ddp_steps(gc.MLP(64, 512, 512, 512, 10), x, y, path, bucket_cap_mb=cap, warmup=2, steps=2)
    return path


def test_real_ddp_trace_buckets_and_bytes(tmp_path):
    model = gc.MLP(64, 512, 512, 512, 10)
    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    small = gc.launch(_profile, 2, args=(str(tmp_path), 0.5), timeout=120)
    huge = gc.launch(_profile, 2, args=(str(tmp_path), 1000.0), timeout=120)
    for path in small + huge:
        report = gc.allreduce_overlap(path)
        assert report.bytes_per_step == total_bytes          # every gradient all-reduced once per step
        assert report.steps == 2
    assert len(gc.allreduce_overlap(small[0]).buckets) > 1
    assert len(gc.allreduce_overlap(huge[0]).buckets) == 1
    # one huge bucket is launched only when backward's last gradient is ready: nothing hidden
    assert gc.allreduce_overlap(huge[0]).hidden_fraction < 0.05
    axes = gc.trace_timeline(small)
    assert len(axes) == 2 and axes[0].get_yticklabels()[-1].get_text() == "backward"
