"""Activation recomputation (checkpointing): keep a block's input, redo its forward in backward.

Sharding removes the model states from each rank, but not the **activations**: everything the
forward saves for the backward grows with batch and depth. ``torch.utils.checkpoint.checkpoint``
runs a block without saving its insides — only its input is kept — and runs the block's forward
again during the backward, just before its gradients are needed:

* memory: a block of ``Linear(d, 4d) → GELU → Linear(4d, d)`` saves ``d + 4d + 4d`` values per
  row; checkpointed it keeps only its input, ``d`` — about 1/9;
* time: one more forward of the block, about a third of its forward + backward.

:func:`residual_mlp` builds such a stack of blocks, :class:`CheckpointedSequential` runs chosen
blocks under checkpoint (``use_reentrant=False``, the recommended form), and
:func:`recompute_sweep` measures activation bytes and step time for each choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data_parallel import MemoryTracker
from ..runtime import validate

__all__ = [
    "CheckpointedSequential",
    "MLPBlock",
    "RecomputePoint",
    "activation_bytes",
    "recompute_sweep",
    "residual_mlp",
]


class MLPBlock(nn.Module):
    """``x + Linear(4d, d)(GELU(Linear(d, 4d)(x)))``: a transformer's MLP block with its residual."""

    def __init__(self, width: int, expansion: int = 4):
        super().__init__()
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)

    def forward(self, x):                           # (B, d) -> (B, d)
        return x + self.down(F.gelu(self.up(x)))    # saves x (B, d), up(x) (B, 4d), gelu (B, 4d)


def residual_mlp(width: int, depth: int, *, expansion: int = 4, seed: int = 0) -> nn.Sequential:
    """``depth`` :class:`MLPBlock` s of ``width`` in an ``nn.Sequential`` (seeded).

    Example::

        >>> model = residual_mlp(8, 3)
        >>> len(model), sum(p.numel() for p in model.parameters())   # 3 x (8·32 + 32 + 32·8 + 8)
        (3, 1656)
    """
    validate.check_int("width", width, 1)
    validate.check_int("depth", depth, 1)
    validate.check_int("expansion", expansion, 1)
    torch.manual_seed(seed)
    return nn.Sequential(*[MLPBlock(width, expansion) for _ in range(depth)])


class CheckpointedSequential(nn.Module):
    """Run an ``nn.Sequential``'s blocks in order, the chosen ones under activation checkpointing.

    Args:
        blocks: the ``nn.Sequential`` (its parameters are shared, not copied).
        checkpointed: indices of the blocks to recompute in backward (any iterable of ints).

    Example::

        >>> _ = torch.manual_seed(0)
        >>> blocks = residual_mlp(16, 4)
        >>> x = torch.randn(2, 16, requires_grad=True)
        >>> out = CheckpointedSequential(blocks, checkpointed=[0, 2])(x)
        >>> torch.equal(out, blocks(x))               # same values; only what is saved differs
        True

    .. warning::
        A recomputed block must compute the same thing twice: dropout draws new random numbers
        unless the RNG state is restored (``checkpoint`` does it by default,
        ``preserve_rng_state=True``), and a block that changes state in forward (BatchNorm's
        running statistics) updates it twice.
    """

    def __init__(self, blocks: nn.Sequential, checkpointed=()):
        super().__init__()
        validate.check_type("blocks", blocks, nn.Sequential, "an nn.Sequential")
        chosen = sorted(set(checkpointed))
        for i in chosen:
            validate.check_int("checkpointed block index", i, 0, maximum=len(blocks) - 1)
        self.blocks, self.checkpointed = blocks, chosen

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i in self.checkpointed and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)   # keeps x only; redoes block in backward
            else:
                x = block(x)
        return x


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward of ``model(x).square().mean()`` leaves alive for the backward (measured).

    Counted with chapter 02's ``gc.MemoryTracker``: storages created during the forward and still
    alive before ``backward()`` (the loss included), on this process.

    Example::

        >>> blocks = residual_mlp(16, 2)
        >>> x = torch.randn(4, 16)
        >>> activation_bytes(blocks, x) > activation_bytes(CheckpointedSequential(blocks, [0, 1]), x)
        True
    """
    with MemoryTracker(["cpu:0"]) as tracker:
        loss = model(x).square().mean()
        held = tracker.live()["cpu:0"]
        loss.backward()
    return held


@dataclass
class RecomputePoint:
    """One row of :func:`recompute_sweep`."""

    checkpointed: list[int]
    activation_bytes: int
    step_time: float


def recompute_sweep(blocks: nn.Sequential, x: torch.Tensor, choices, *,
                    repeats: int = 5) -> list[RecomputePoint]:
    """Measure activation bytes and step time (forward + backward + SGD) for each set of checkpointed blocks.

    Args:
        blocks: the model, an ``nn.Sequential`` of blocks.
        x: the batch.
        choices: a list of index lists, e.g. ``[[], list(range(0, n, 2)), list(range(n))]``.
        repeats: timed steps per choice (median), after one warm-up; the choices are timed in
            rotating order.

    Example::

        >>> blocks = residual_mlp(16, 4)
        >>> rows = recompute_sweep(blocks, torch.randn(8, 16), [[], [0, 1, 2, 3]], repeats=1)
        >>> rows[1].activation_bytes < rows[0].activation_bytes
        True

    .. warning::
        Step times are noisy on a shared machine: compare the rows of one sweep, as ratios.
    """
    validate.check_type("blocks", blocks, nn.Sequential, "an nn.Sequential")
    validate.check_int("repeats", repeats, 1)
    choices = [list(c) for c in choices]
    models = [CheckpointedSequential(blocks, c) for c in choices]
    opt = torch.optim.SGD(blocks.parameters(), lr=0.0)       # lr 0: every step sees the same weights

    def step(model):
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    held = [activation_bytes(m, x) for m in models]
    opt.zero_grad()
    times = [[] for _ in models]
    for m in models:
        step(m)                                               # warm-up
    for r in range(repeats):
        order = list(range(len(models)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            times[i].append(step(models[i]))
    return [RecomputePoint(c, h, sorted(t)[len(t) // 2]) for c, h, t in zip(choices, held, times)]
