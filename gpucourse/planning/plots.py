"""Pictures of a plan: memory and time bars of the top configurations, and an explorer over ``plan``."""

from __future__ import annotations

from ..runtime import check_int, in_kernel
from .cluster_spec import ClusterSpec
from .model_spec import ModelSpec
from .predict import Plan, plan

__all__ = ["plot_plan", "plan_widget"]

_MEM = (("params", "#4c72b0"), ("grads", "#dd8452"), ("optimizer", "#55a868"), ("activations", "#c44e52"))
_TIME = (("compute", "#4c72b0"), ("dp", "#8172b3"), ("tp", "#dd8452"), ("pp", "#937860"), ("cp", "#da8bc3"),
         ("ep", "#8c8c8c"), ("bubble", "#ccb974"))


def plot_plan(result: Plan, n: int = 5, *, memory_limit: float | None = None, axes=None):
    """Two panels for the ``n`` fastest configurations of ``result``: GiB per device by kind, and
    seconds per step by term.

    Example::

        >>> import matplotlib; matplotlib.use("Agg")
        >>> p = plan(ModelSpec.preset("llama3-8b"), ClusterSpec.preset("h100-sxm-8"), global_batch=8, top=3)
        >>> axes = plot_plan(p, 3)
        >>> [ax.get_xlabel() for ax in axes]
        ['GiB per device', 'seconds per step']
    """
    import matplotlib.pyplot as plt

    check_int("n", n, 1)
    rows = result.ranked[:n][::-1]                    # fastest on top
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 0.45 * max(len(rows), 1) + 1.4), sharey=True)
    labels = [str(p.config) for p in rows]
    for ax, parts, get, unit, scale in ((axes[0], _MEM, lambda p: p.memory.as_dict(), "GiB per device", 2 ** 30),
                                        (axes[1], _TIME, lambda p: p.time.as_dict(), "seconds per step", 1)):
        left = [0.0] * len(rows)
        for name, color in parts:
            values = [get(p)[name] / scale for p in rows]
            ax.barh(labels, values, left=left, color=color, label=name)
            left = [a + b for a, b in zip(left, values)]
        ax.set_xlabel(unit)
        ax.legend(fontsize=7, loc="lower right")
    if memory_limit:
        axes[0].axvline(memory_limit / 2 ** 30, color="k", ls="--", lw=1)
    if not rows:
        axes[0].set_title("nothing fits")
    return axes


def plan_widget(model: str = "llama3-70b", cluster: str = "h100-sxm-8", nodes: int = 8, global_batch: int = 64,
                top: int = 5):
    """Model preset, cluster preset, node count, global batch → :func:`plan`'s top configurations,
    drawn by :func:`plot_plan`. A thin view: every number comes from ``plan``.

    Returns an ``ipywidgets.VBox`` whose ``.update(model, cluster, nodes, global_batch)`` recomputes
    the plan, redraws, and returns it (usable without a browser).

    Example::

        >>> view = plan_widget("llama3-8b", "h100-sxm-8", nodes=1, global_batch=8, top=3)
        >>> view.update("llama3-8b", "h100-sxm-8", 1, 8).best().fits
        True
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    m = widgets.Dropdown(options=ModelSpec.preset_names(), value=model, description="model")
    c = widgets.Dropdown(options=ClusterSpec.preset_names(), value=cluster, description="cluster")
    n = widgets.IntSlider(value=nodes, min=1, max=128, description="nodes", continuous_update=False)
    b = widgets.IntText(value=global_batch, description="global batch")
    text, out = widgets.HTML(), widgets.Output()

    def update(model_name=None, cluster_name=None, num_nodes=None, batch=None) -> Plan:
        spec = ModelSpec.preset(model_name or m.value)
        cl = ClusterSpec.preset(cluster_name or c.value, nodes=num_nodes or n.value)
        result = plan(spec, cl, global_batch=batch or b.value, top=top, max_cp=8)
        with out:
            if in_kernel():
                out.clear_output(wait=True)
            fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * top + 1.4), sharey=True)
            plot_plan(result, top, memory_limit=cl.memory_bytes, axes=axes)
            fig.suptitle(f"{spec.name} on {cl.devices} × {cl.name}, {batch or b.value} sequences of {spec.seq}")
            plt.show()
            plt.close(fig)
        text.value = (f"<pre>{result.table(top)}\n{len(result.rejected)} of {result.considered} configurations "
                      f"rejected</pre>")
        return result

    for w in (m, c, n, b):
        w.observe(lambda _: update(), names="value")
    box = widgets.VBox([widgets.HBox([m, c]), widgets.HBox([n, b]), text, out])
    box.update = update
    update()                                          # the explorer is never an empty frame
    return box
