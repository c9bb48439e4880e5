"""The arguments of a pipeline run, checked in the parent before any process starts."""

from __future__ import annotations

import torch
from torch import nn

from .model_split import split_sequential
from .pipeline_parallel import make_schedule
from .schedule import PipelineSchedule
from ..runtime import check_int

__all__ = ["check_pipeline_args"]


def check_pipeline_args(model: nn.Sequential, inputs: torch.Tensor, targets: torch.Tensor, *,
                        num_stages: int, schedule, chunks: int, steps: int = 1, dp_size: int = 1,
                        balance=None) -> PipelineSchedule:
    """Check a pipeline's arguments before any process starts; return the schedule.

    :func:`~gpucourse.run_pipeline` calls it in the parent (so a mistake is a ``ValueError``/``TypeError``
    there, not a failure in every rank) and :func:`~gpucourse.train_pipeline` in each rank.

    Args:
        model: the whole model (``model_fn()``), an ``nn.Sequential``.
        inputs, targets: the batch and its labels (same length).
        num_stages: pipeline stages; at most the number of layers.
        schedule: ``"gpipe"``, ``"1f1b"`` or a :class:`~gpucourse.PipelineSchedule` of that size.
        chunks: micro-batches per batch, ``1 <= chunks <= `` each pipeline's share of the batch.
        steps: SGD steps, >= 1.
        dp_size: pipelines side by side, >= 1.
        balance: layers per stage, or ``None``.

    Example::

        >>> import gpucourse as gc
        >>> x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        >>> sched = check_pipeline_args(gc.MLP(4, 8, 2), x, y, num_stages=2, schedule="gpipe", chunks=3)
        >>> sched.name, sched.num_stages, sched.num_microbatches
        ('GPipe', 2, 3)
        >>> check_pipeline_args(gc.MLP(4, 8, 2), x, y, num_stages=4, schedule="gpipe", chunks=3)
        Traceback (most recent call last):
        ...
        ValueError: num_stages=4: cannot cut 3 layers into 4 stages: every stage needs at least one layer

    .. warning::
        It checks the arguments, not the model: a layer whose input shape does not fit the previous
        layer's output still fails inside the ranks.
    """
    check_int("num_stages", num_stages, 1)
    check_int("dp_size", dp_size, 1)
    check_int("steps", steps, 1)
    check_int("chunks", chunks, 1, hint=" (the number of micro-batches)")
    for name, value in (("inputs", inputs), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
    if len(inputs) != len(targets):
        raise ValueError(f"inputs has {len(inputs)} samples but targets has {len(targets)}")
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model_fn() must return an nn.Sequential (a chain of layers), got "
                        f"{type(model).__name__}")
    try:
        split_sequential(model, num_stages, balance=balance)
    except ValueError as e:
        raise ValueError(f"num_stages={num_stages}" + (f", balance={list(balance)}" if balance is not None
                                                       else "") + f": {e}") from None
    if balance is not None and len(list(balance)) != num_stages:
        raise ValueError(f"balance {list(balance)} has {len(list(balance))} stages, but num_stages is "
                         f"{num_stages}")
    share = len(inputs) // dp_size          # the smallest pipeline's batch
    if share < chunks:
        per = f" ({dp_size} pipelines get {share} or more each)" if dp_size > 1 else ""
        raise ValueError(f"a batch of {len(inputs)} samples{per} cannot be cut into chunks={chunks} "
                         f"micro-batches; use chunks <= {share} or a larger batch")
    return make_schedule(schedule, num_stages, chunks)
