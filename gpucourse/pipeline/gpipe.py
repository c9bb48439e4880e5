"""GPipe: pipeline parallelism with micro-batches, in one process.

Split the model into stages on different devices (:mod:`gpucourse.model_split`) and one batch
flows through them one stage at a time — every other device idles. GPipe (Huang et al., 2019)
cuts the batch into ``chunks`` *micro-batches* and lets them follow each other through the stages:
while stage 1 works on micro-batch 0, stage 0 already works on micro-batch 1.

1) :func:`split_microbatches` — ``chunks`` pieces of the batch (sizes differ by at most one);
2) :func:`clock_cycles` — at clock ``k`` stage ``s`` works on micro-batch ``k - s`` (the "fill–drain"
   diagonal); the tasks of one clock are independent and can run at the same time;
3) :func:`merge_microbatches` — concatenate the outputs back into one batch.

Because every sample still meets exactly the same layers, outputs *and gradients* equal the unsplit
model's: autograd records the micro-batch graph and ``loss.backward()`` on the merged output runs
the backwards in reverse, which is GPipe's drain.

In one process the stages take turns; the overlap becomes real when every stage has a device that
computes asynchronously (CUDA launches return at once, so ``cuda:0`` and ``cuda:1`` really work at the
same time) or its own process (:func:`gpucourse.train_pipeline`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from .model_split import split_sequential
from ..runtime import check_int

__all__ = ["GPipe", "split_microbatches", "merge_microbatches", "clock_cycles"]


def split_microbatches(batch: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    """Cut ``batch`` along dim 0 into ``chunks`` micro-batches whose sizes differ by at most one.

    Args:
        batch: a tensor whose first dimension is the batch.
        chunks: number of micro-batches, ``1 <= chunks <= len(batch)``.

    Example::

        >>> [len(mb) for mb in split_microbatches(torch.zeros(10, 3), 4)]
        [3, 3, 2, 2]
        >>> split_microbatches(torch.zeros(3, 2), 4)
        Traceback (most recent call last):
        ...
        ValueError: a batch of 3 samples cannot be cut into 4 micro-batches; use chunks <= 3

    .. warning::
        Micro-batches are views of ``batch``, not copies: modifying one in place modifies the batch.
    """
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch must be a tensor, got {type(batch).__name__}")
    check_int("chunks", chunks, 1, hint=" (the number of micro-batches)")
    if batch.dim() == 0 or batch.shape[0] < chunks:
        size = batch.shape[0] if batch.dim() else 0
        raise ValueError(f"a batch of {size} samples cannot be cut into {chunks} micro-batches; "
                         f"use chunks <= {size}")
    return list(torch.tensor_split(batch, chunks, dim=0))


def merge_microbatches(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate micro-batch outputs back into one batch (the inverse of :func:`split_microbatches`).

    Args:
        outputs: the micro-batch outputs, in micro-batch order.

    Example::

        >>> x = torch.arange(10.).reshape(5, 2)
        >>> torch.equal(merge_microbatches(split_microbatches(x, 2)), x)
        True

    .. warning::
        The order matters: a pipeline that finishes micro-batches out of order must put them back
        in order, or outputs no longer line up with the labels.
    """
    if len(outputs) == 0:
        raise ValueError("no micro-batch outputs to merge")
    return torch.cat(list(outputs), dim=0)


def clock_cycles(num_microbatches: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """GPipe's forward order: for each clock tick, the ``(microbatch, stage)`` tasks that can run.

    At clock ``k`` stage ``s`` processes micro-batch ``k - s``; there are ``m + p - 1`` clocks.

    Args:
        num_microbatches: ``m``.
        num_stages: ``p``.

    Example::

        >>> for tick in clock_cycles(3, 2):
        ...     print(tick)
        [(0, 0)]
        [(1, 0), (0, 1)]
        [(2, 0), (1, 1)]
        [(2, 1)]

    .. warning::
        Only ``m`` of the ``m + p - 1`` clocks keep a stage busy: the first ``p - 1`` ticks fill
        the pipeline, the last ``p - 1`` drain it — the bubble.
    """
    for name, value in (("num_microbatches", num_microbatches), ("num_stages", num_stages)):
        check_int(name, value, 1)
    return [[(k - s, s) for s in range(num_stages) if 0 <= k - s < num_microbatches]
            for k in range(num_microbatches + num_stages - 1)]


def _device_of(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


class GPipe(nn.Module):
    """Micro-batched pipeline over ``stages``: same outputs and gradients as the unsplit model.

    Args:
        stages: the model's parts in order (e.g. ``split_sequential(model, 2)``); each stays on the
            device its parameters are on, and activations are moved there.
        chunks: micro-batches per batch. Every batch must have at least ``chunks`` samples; it need
            not be divisible by ``chunks``.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> pipe = GPipe(split_sequential(model, 2), chunks=3)
        >>> x = torch.randn(7, 4)                        # 7 samples -> micro-batches of 3, 2, 2
        >>> torch.allclose(pipe(x), model(x))
        True
        >>> GPipe.from_sequential(model, num_stages=6, chunks=2)
        Traceback (most recent call last):
        ...
        ValueError: cannot cut 5 layers into 6 stages: every stage needs at least one layer

    .. warning::
        BatchNorm breaks the equivalence: in training mode it normalises each *micro-batch* with
        that micro-batch's statistics. Use LayerNorm/GroupNorm in pipelined models (or a deferred
        BatchNorm that accumulates statistics over the whole batch, as torchgpipe does).
    """

    def __init__(self, stages: Sequence[nn.Module], chunks: int):
        super().__init__()
        if isinstance(stages, nn.Module) and not isinstance(stages, nn.ModuleList):
            raise TypeError("stages must be a list of modules, one per stage; to cut a model use "
                            "GPipe.from_sequential(model, num_stages, chunks)")
        stages = list(stages)
        if len(stages) < 1:
            raise ValueError("GPipe needs at least one stage")
        for i, stage in enumerate(stages):
            if not isinstance(stage, nn.Module):
                raise TypeError(f"stage {i} must be an nn.Module, got {type(stage).__name__}")
        check_int("chunks", chunks, 1, hint=" (the number of micro-batches)")
        if chunks > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                              for stage in stages for m in stage.modules()):
            warnings.warn("GPipe with BatchNorm: in training mode each micro-batch is normalised "
                          "with its own statistics, so results differ from the unsplit model. "
                          "Use LayerNorm/GroupNorm, or chunks=1.", stacklevel=2)
        self.stages = nn.ModuleList(stages)
        self.chunks = chunks

    @classmethod
    def from_sequential(cls, model: nn.Sequential, num_stages: int, chunks: int,
                        **split_kwargs) -> "GPipe":
        """Cut ``model`` with :func:`~gpucourse.split_sequential` and pipeline the stages."""
        return cls(split_sequential(model, num_stages, **split_kwargs), chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        devices = [_device_of(stage) for stage in self.stages]
        acts = split_microbatches(x, self.chunks)             # acts[i]: where micro-batch i is now
        for tick in clock_cycles(len(acts), len(self.stages)):
            for i, s in tick:                                  # independent: could run concurrently
                acts[i] = self.stages[s](acts[i].to(devices[s]))
        return merge_microbatches(acts)
