"""Chapter 03's memory plot: every legend entry's marker stays inside the legend's frame."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import gpucourse as gc  # noqa: E402


@pytest.mark.parametrize("devices, gpu0_bsz", [(2, None), (3, 4), (4, 0)])
def test_legend_handles_inside_legend_frame(devices, gpu0_bsz):
    torch.manual_seed(devices)
    model = gc.Net()
    x, y = torch.randn(12, 3, 32, 32), torch.randint(0, 10, (12,))
    report = gc.dp_step_memory(model, x, y, [torch.device("cpu", i) for i in range(devices)],
                               gpu0_bsz=gpu0_bsz,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9))
    ax = gc.plot_memory(report, title="t")
    fig = ax.figure
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legend = ax.get_legend()
        frame = legend.get_frame().get_window_extent(renderer)
        labels = [t.get_text() for t in legend.get_texts()]
        assert "measured peak" in labels
        handles = legend.legend_handles
        assert len(handles) == len(labels)
        for label, handle in zip(labels, handles):
            box = handle.get_window_extent(renderer)
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, \
                f"legend marker of {label!r} {box} sticks out of the legend frame {frame}"
        # the peak marks still sit at the measured peaks, one per device
        peaks = [c for c in ax.collections if c.get_label() == "measured peak"]
        assert len(peaks) == 1
        scale = 2**20 if max(report.peak) >= 2**20 else 2**10
        ys = sorted(seg[0][1] for seg in peaks[0].get_segments())
        assert ys == pytest.approx(sorted(p / scale for p in report.peak))
    finally:
        plt.close(fig)
