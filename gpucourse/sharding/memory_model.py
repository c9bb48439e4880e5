"""Where data parallelism's memory goes, and what each ZeRO stage removes — on paper and measured.

Mixed-precision training with Adam keeps, per parameter (Ψ parameters in all):

* the fp16/bf16 **parameters** — 2 bytes, 2Ψ,
* their fp16/bf16 **gradients** — 2 bytes, 2Ψ,
* the **optimizer state** — an fp32 master copy of the parameters, Adam's momentum and variance:
  4 + 4 + 4 = 12 bytes, KΨ with K = 12.

DDP keeps all of it on every rank: (2 + 2 + K)Ψ = 16Ψ. ZeRO (Rajbhandari et al., 2020) shards it
over the N data-parallel ranks, one more kind of state per stage:

| stage | sharded | bytes per device |
|---|---|---|
| 0 (DDP) | nothing | (2 + 2 + K)Ψ |
| 1 | optimizer state | 4Ψ + KΨ/N |
| 2 | + gradients | 2Ψ + (2 + K)Ψ/N |
| 3 | + parameters | (2 + 2 + K)Ψ/N |

:func:`zero_memory` is that table; :func:`measure_step_memory` measures the same parts for one
real training step on this rank, with the meters of chapters 02 and 07.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data_parallel import MemoryTracker
from ..runtime import in_kernel, validate

__all__ = [
    "RankMemory",
    "measure_step_memory",
    "plot_zero_memory",
    "zero_memory",
    "zero_memory_parts",
    "zero_memory_widget",
]


def zero_memory_parts(num_params: int, world_size: int, stage: int, *, k: int = 12) -> dict[str, float]:
    """:func:`zero_memory` split into ``parameters``, ``gradients`` and ``optimizer state`` bytes.

    Example::

        >>> zero_memory_parts(1000, 4, 2)
        {'parameters': 2000.0, 'gradients': 500.0, 'optimizer state': 3000.0}
    """
    validate.check_int("num_params", num_params, 0)
    validate.check_int("world_size", world_size, 1)
    validate.check_choice("stage", stage, (0, 1, 2, 3))
    validate.check_number("k", k, 0)
    psi, n = num_params, world_size
    return {"parameters": 2 * psi / (n if stage >= 3 else 1),     # fp16 weights, 2 bytes each
            "gradients": 2 * psi / (n if stage >= 2 else 1),      # fp16 gradients
            "optimizer state": k * psi / (n if stage >= 1 else 1)}  # fp32 master + Adam's m, v


def zero_memory(num_params: int, world_size: int, stage: int, *, k: int = 12) -> int:
    """Bytes of model states per device for mixed-precision Adam, per the ZeRO paper.

    ``stage`` 0 is plain data parallelism (DDP): ``(2 + 2 + k)Ψ``. Stage 1 shards the optimizer
    state (``4Ψ + kΨ/N``), stage 2 also the gradients (``2Ψ + (2 + k)Ψ/N``), stage 3 also the
    parameters (``(2 + 2 + k)Ψ/N``). Activations and temporary buffers are not included.

    Args:
        num_params: Ψ, the number of parameters of the model.
        world_size: N, the number of data-parallel ranks the states are sharded over.
        stage: 0 (DDP), 1, 2 or 3.
        k: bytes of optimizer state per parameter: 12 for mixed-precision Adam (fp32 master
            weights, momentum and variance), 8 for fp32 Adam (the weights are the parameters).

    Returns:
        bytes per device, rounded up to a whole byte.

    Example::

        >>> psi, n = 7_500_000_000, 64                   # the paper's Figure 1
        >>> [round(zero_memory(psi, n, s) / 1e9, 1) for s in range(4)]
        [120.0, 31.4, 16.6, 1.9]

    .. warning::
        Stage 3 looks free on paper, but every layer's full parameters must be gathered
        (all-gather) before its forward *and* again before its backward: 1.5× DDP's traffic, and
        the largest layer's full parameters must still fit on one device.
    """
    parts = zero_memory_parts(num_params, world_size, stage, k=k)       # checks the arguments
    if isinstance(k, int):        # exact: count in units of 1/N byte, then round up once
        n = world_size
        units = (2 * num_params * (1 if stage >= 3 else n) + 2 * num_params * (1 if stage >= 2 else n)
                 + k * num_params * (1 if stage >= 1 else n))
        return -(-units // n)
    return math.ceil(sum(parts.values()))


# --- measured: the same parts for one real step on this rank -------------------------------------

@dataclass
class RankMemory:
    """Bytes this rank holds for one training step, by kind (see :func:`measure_step_memory`)."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: what :func:`zero_memory` predicts."""
        return self.parameters + self.gradients + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer state": self.optimizer_state, "activations": self.activations}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t     # FSDP2's DTensor: this rank's shard
            s = t.untyped_storage()
            key = (s.data_ptr(), s.nbytes())
            if key not in seen:
                seen.add(key)
                total += s.nbytes()
    return total


def _optimizer_params(optimizer) -> list:
    """The tensors an optimizer steps: its parameter groups' and those of the optimizers it wraps —
    a ZeroOptimizer's local optimizer holds the rank's slice, whose gradient is all a ZeRO-2 rank
    keeps (``.optimizer``), torch's ZeroRedundancyOptimizer's its local part (``.optim``), and a
    wrapper stepping several as one lists them in ``.optimizers``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    inner = [getattr(optimizer, name, None) for name in ("optimizer", "optim")]
    for o in [o for o in inner if o is not None and o is not optimizer] + list(getattr(optimizer, "optimizers", ())):
        params += _optimizer_params(o)
    return params


def _optimizer_state_tensors(optimizer) -> list:
    inner = getattr(optimizer, "optim", optimizer)       # torch's ZeroRedundancyOptimizer: its local part
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_step_memory(model: torch.nn.Module, optimizer, inputs: torch.Tensor, target: torch.Tensor,
                        loss_fn=F.mse_loss) -> RankMemory:
    """Run one training step on this rank and count the bytes it holds, by kind.

    * **parameters** — storages of ``model.parameters()`` and the optimizer's parameters (a
      ZeRO-1/2 rank: the whole flat buffer; a ZeRO-3 rank: its shards);
    * **gradients** — storages of their ``.grad`` right after ``optimizer.step()``;
    * **optimizer state** — the tensors in ``optimizer.state`` (for torch's
      ``ZeroRedundancyOptimizer``, its local optimizer's);
    * **activations** — bytes the forward leaves alive for the backward, and **peak** — the
      highest live bytes during the step, both counted by chapter 02's ``gc.MemoryTracker`` (new
      storages since the step started, so parameters gathered and freed again show up in ``peak``).

    Storages are counted once however many tensors view them. The step ends with
    ``optimizer.zero_grad()``.

    Args:
        model: the (possibly wrapped) model; called as ``model(inputs)``.
        optimizer: a ``torch.optim`` optimizer, a :class:`gpucourse.ZeroOptimizer`, or torch's
            ``ZeroRedundancyOptimizer``.
        inputs, target: this rank's batch; ``loss_fn(model(inputs), target)`` is the loss.

    Example::

        >>> from torch import nn
        >>> model = nn.Linear(100, 10)                          # 1010 fp32 parameters
        >>> opt = torch.optim.Adam(model.parameters())
        >>> m = measure_step_memory(model, opt, torch.randn(8, 100), torch.randn(8, 10))
        >>> m.parameters, m.gradients, m.optimizer_state   # 4 + 4 + 8 bytes per parameter (+ Adam's step)
        (4040, 4040, 8088)

    .. warning::
        On CPU the tracker sees tensors created by PyTorch operators only (not scratch space inside
        a kernel); on CUDA it reads ``torch.cuda.memory_allocated``. Either way it counts *this*
        process: run it on every rank.
    """
    validate.check_type("model", model, torch.nn.Module, "an nn.Module")
    validate.check_tensor("inputs", inputs)
    validate.check_tensor("target", target)
    params = list(model.parameters()) + _optimizer_params(optimizer)
    device = inputs.device if inputs.device.type == "cuda" else "cpu:0"
    with MemoryTracker([device]) as tracker:
        loss = loss_fn(model(inputs), target)
        activations = _settled_live(tracker)                    # what the forward keeps for backward
        loss.backward()
        optimizer.step()
        grads = _storage_bytes(p.grad for p in params if p.grad is not None)
        peak = next(iter(tracker.peak().values()))
    state = _storage_bytes(_optimizer_state_tensors(optimizer))
    optimizer.zero_grad()
    return RankMemory(parameters=_storage_bytes(params), gradients=grads, optimizer_state=state,
                      activations=activations, peak=peak)


def _settled_live(tracker, *, polls: int = 20, interval_s: float = 0.005) -> int:
    """Live bytes once in-flight communication buffers are gone.

    A collective's ``wait()`` can return while the communication library's own thread still holds
    a buffer for a few milliseconds (seen with gloo: +1 KiB in about 1 of 6 tensor-parallel steps,
    gone 50 ms later). Such a buffer is not kept for the backward, so poll until two readings agree.
    """
    live = next(iter(tracker.live().values()))
    for _ in range(polls):
        time.sleep(interval_s)
        again = next(iter(tracker.live().values()))
        if again == live:
            break
        live = again
    return live


# --- a picture and a widget: thin views over zero_memory_parts ------------------------------------

_COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868"}


def plot_zero_memory(num_params: int, world_size: int, *, k: int = 12, ax=None):
    """Stacked bars: bytes per device of stages 0-3 for ``num_params`` on ``world_size`` ranks (GB).

    Example::

        >>> import matplotlib; matplotlib.use("Agg")
        >>> ax = plot_zero_memory(7_500_000_000, 64)
        >>> [t.get_text() for t in ax.get_xticklabels()]
        ['DDP', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3']
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.2))
    parts = [zero_memory_parts(num_params, world_size, s, k=k) for s in range(4)]
    labels = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    bottom = [0.0] * 4
    for part, color in _COLORS.items():
        values = [p[part] / 1e9 for p in parts]
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{num_params / 1e9:g} B parameters, {world_size} ranks, K = {k}")
    ax.legend(fontsize=8)
    return ax


def plot_zero_stages(world_size: int = 4, *, k: int = 12, axes=None):
    """What each rank holds at each stage: one panel per stage, one row per rank.

    Each row is drawn to scale (2 + 2 + k bytes per parameter): a full-width band where the rank
    keeps all of that kind of state, a ``1/N`` slice at its own offset where it keeps a shard.

    Example::

        >>> import matplotlib; matplotlib.use("Agg")
        >>> axes = plot_zero_stages(4)
        >>> [ax.get_title() for ax in axes]
        ['DDP (stage 0)', 'ZeRO-1', 'ZeRO-2', 'ZeRO-3']
    """
    import matplotlib.pyplot as plt

    validate.check_int("world_size", world_size, 1, maximum=16)
    if axes is None:
        _, axes = plt.subplots(1, 4, figsize=(12, 0.45 * world_size + 1.2), sharey=True)
    widths = {"parameters": 2, "gradients": 2, "optimizer state": k}
    titles = ["DDP (stage 0)", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    for stage, ax in enumerate(axes):
        sharded = {"parameters": stage >= 3, "gradients": stage >= 2, "optimizer state": stage >= 1}
        for rank in range(world_size):
            left = 0.0
            for part, w in widths.items():
                ax.add_patch(plt.Rectangle((left, rank - 0.4), w, 0.8, fill=False, ec="#cccccc"))
                if sharded[part]:
                    ax.add_patch(plt.Rectangle((left + rank * w / world_size, rank - 0.4), w / world_size,
                                               0.8, color=_COLORS[part]))
                else:
                    ax.add_patch(plt.Rectangle((left, rank - 0.4), w, 0.8, color=_COLORS[part]))
                left += w
        ax.set_xlim(0, sum(widths.values()))
        ax.set_ylim(world_size - 0.5, -0.5)
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.set_xticks([])
        ax.set_title(titles[stage])
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    axes[-1].legend(handles, [f"{p} ({w}Ψ)" for p, w in widths.items()], fontsize=7, loc="lower right",
                    bbox_to_anchor=(1.0, 1.12))
    return axes


def zero_memory_widget(num_params: float = 7.5e9, world_size: int = 64):
    """Sliders for model size (billions), ranks and K → :func:`plot_zero_memory`'s bars.

    Returns an ``ipywidgets.VBox`` whose ``.update(billions, world_size, k)`` redraws it (usable
    without a browser) and returns the four :func:`zero_memory` values.

    Example::

        >>> view = zero_memory_widget()
        >>> [round(b / 1e9, 1) for b in view.update(7.5, 64, 12)]
        [120.0, 31.4, 16.6, 1.9]
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    size = widgets.FloatLogSlider(value=num_params / 1e9, base=10, min=-1, max=3, description="params (B)")
    ranks = widgets.IntSlider(value=world_size, min=1, max=1024, description="ranks")
    kslider = widgets.IntSlider(value=12, min=4, max=16, description="K")
    out = widgets.Output()

    def update(billions=None, world_size=None, k=None):
        psi = int((billions if billions is not None else size.value) * 1e9)
        n = world_size if world_size is not None else ranks.value
        kk = k if k is not None else kslider.value
        with out:
            if in_kernel():
                out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(5.5, 3.2))
            plot_zero_memory(psi, n, k=kk, ax=ax)
            plt.show()
            plt.close(fig)
        return [zero_memory(psi, n, s, k=kk) for s in range(4)]

    for w in (size, ranks, kslider):
        w.observe(lambda _: update(), names="value")
    box = widgets.VBox([size, ranks, kslider, out])
    box.update = update
    update()                      # draw the start values: the explorer is never an empty frame
    return box
