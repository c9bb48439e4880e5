"""Per-device memory accounting, checked against sizes computed by hand."""

import pytest
import torch
from torch import nn

import gpucourse as gc
from gpucourse.data_parallel.device_workers import device_context, run_on_devices

F32 = 4


def test_tracker_counts_live_and_peak_per_thread_device():
    with gc.MemoryTracker(["cpu:0", "cpu:1", "cpu:2"]) as mt:
        a = torch.empty(100)                                  # this thread: cpu:0
        results = run_on_devices(lambda n: torch.empty(n), [(10,), (20,)],
                                 [torch.device("cpu", 1), torch.device("cpu", 2)])
        view = a[:10]                                         # a view allocates nothing
        del a
        assert mt.live() == {"cpu:0": 100 * F32, "cpu:1": 10 * F32, "cpu:2": 20 * F32}
        del view
        results.pop()
        assert mt.live() == {"cpu:0": 0, "cpu:1": 10 * F32, "cpu:2": 0}
        assert mt.peak() == {"cpu:0": 100 * F32, "cpu:1": 10 * F32, "cpu:2": 20 * F32}
        mt.reset_peak()
        assert mt.peak() == mt.live()


def test_tracker_ignores_what_existed_before_and_in_place_updates():
    x = torch.zeros(50)
    with gc.MemoryTracker(["cpu:0"]) as mt:
        x.add_(1)
        y = x.view(5, 10)
        with device_context("cpu:0"):
            z = x + 1
        assert mt.live() == {"cpu:0": 50 * F32}
    del y, z


def test_tracker_cannot_be_entered_twice():
    mt = gc.MemoryTracker(["cpu:0"])
    with mt, pytest.raises(RuntimeError, match="already active"):
        with mt:
            pass


def test_dp_step_memory_matches_hand_computed_sizes():
    """Linear(16 -> 8, no bias), batch 6 on two virtual devices, rows 3 + 3."""
    torch.manual_seed(0)
    model = nn.Linear(16, 8, bias=False)
    x, y = torch.randn(6, 16), torch.randint(0, 8, (6,))
    opt = torch.optim.Adam(model.parameters())
    r = gc.dp_step_memory(model, x, y, ["cpu:0", "cpu:1"], optimizer=opt)
    weight = 8 * 16 * F32
    assert r.chunk_sizes == [3, 3]
    assert r.parts["parameters"] == [weight, 0]
    assert r.parts["gradients"] == [weight, 0]
    assert r.parts["optimizer state"][0] >= 2 * weight and r.parts["optimizer state"][1] == 0  # exp_avg, exp_avg_sq
    assert r.parts["batch"] == [x.nbytes + y.nbytes, 0]
    assert r.parts["input chunk"] == [0, 3 * 16 * F32]        # device 0's chunk is a view
    assert r.parts["replica"] == [0, weight]                  # device 0's replica shares storage
    assert r.parts["activations"] == [3 * 8 * F32, 3 * 8 * F32]     # each replica's (3, 8) output
    assert r.parts["outputs + loss"][1] == 0
    assert r.parts["outputs + loss"][0] >= 6 * 8 * F32        # the gathered (6, 8) logits + the loss
    assert r.peak[0] > r.peak[1]
    assert all(p >= r.total(i) - r.parts["gradients"][i] for i, p in enumerate(r.peak))


def test_balancing_moves_activations_off_device_0():
    torch.manual_seed(0)
    model = gc.Net()
    x, y = torch.randn(24, 3, 32, 32), torch.randint(0, 10, (24,))
    devs = gc.virtual_devices(3)
    even = gc.dp_step_memory(model, x, y, devs)
    balanced = gc.dp_step_memory(model, x, y, devs, gpu0_bsz=4)
    idle = gc.dp_step_memory(model, x, y, devs, gpu0_bsz=0)
    assert even.chunk_sizes == [8, 8, 8] and balanced.chunk_sizes == [4, 10, 10]
    assert balanced.parts["activations"][0] < even.parts["activations"][0]
    assert balanced.parts["activations"][1] > even.parts["activations"][1]
    assert idle.parts["activations"][0] == 0 and idle.parts["replica"][0] == 0
    # activations scale with the rows a device computes
    per_row = even.parts["activations"][1] / 8
    assert balanced.parts["activations"][1] == pytest.approx(10 * per_row, rel=0.01)
    text = str(balanced)
    assert "measured peak" in text and "rows of the batch" in text


def test_plot_memory_and_timeline_draw():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = nn.Linear(4, 2)
    r = gc.dp_step_memory(model, torch.randn(4, 4), torch.randint(0, 2, (4,)), ["cpu:0", "cpu:1"])
    ax = gc.plot_memory(r, title="t")
    assert len(ax.patches) > 0
    with gc.record_timeline() as tl:
        gc.DataParallel(model, ["cpu:0", "cpu:1"])(torch.randn(4, 4)).sum().backward()
    ax = gc.plot_timeline(tl)
    assert len(ax.patches) == len(tl.spans)
    plt.close("all")


def test_tracker_is_thread_safe_under_concurrent_frees():
    with gc.MemoryTracker(["cpu:0", "cpu:1"]) as mt:
        def churn():
            for _ in range(200):
                torch.empty(64)
        run_on_devices(churn, [(), ()], [torch.device("cpu", 0), torch.device("cpu", 1)])
        assert max(mt.peak().values()) > 0
    assert mt.live() == {"cpu:0": 0, "cpu:1": 0}


@pytest.mark.cuda
def test_tracker_on_cuda_reads_the_allocator():
    with gc.MemoryTracker(["cuda:0"]) as mt:
        x = torch.empty(2**20, device="cuda")
        assert mt.live()["cuda:0"] >= x.nbytes
    assert mt.peak()["cuda:0"] >= x.nbytes


def test_memory_explorer_is_a_thin_view_that_updates_without_a_browser():
    import matplotlib
    matplotlib.use("Agg")

    view = gc.memory_explorer(model=nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), max_batch=8,
                              max_devices=3, sample_shape=(3, 2, 2), num_classes=3)
    report = view.update(batch=7, gpu0_bsz=1, devices=3)
    assert report.chunk_sizes == gc.balanced_chunk_sizes(7, 1, 3) == [1, 3, 3]
    batch, gpu0, devices = view.children[:3]
    batch.value = 4                                  # the sliders drive the same update
    assert gpu0.max == 4 and gpu0.value <= 4
