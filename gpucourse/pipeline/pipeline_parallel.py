"""A real pipeline across processes: one stage per process, GPipe or 1F1B, timestamps recorded.

Every rank

1) builds the whole model with ``model_fn()`` (same seed, same weights everywhere) and keeps only
   its stage (a model too big for one device would build only its own stage);
2) for each step runs its stage's list of operations from the schedule
   (:mod:`gpucourse.pipeline.schedule`) — :func:`pipeline_step`, below: receive an activation,
   forward, send it on; receive a gradient, backward, send the input's gradient back;
3) with ``dp_size > 1`` (a 2-D grid, :class:`~gpucourse.ParallelGrid`) all-reduces its gradients
   with the same stage of the other pipelines;
4) updates its own parameters with SGD.

Steps 1, 3 and 4 are the drivers in :mod:`gpucourse.pipeline.training` (:func:`~gpucourse.train_pipeline`
per rank, :func:`~gpucourse.run_pipeline` from the parent); the transport (send/recv, receives
posted ahead) is :mod:`gpucourse.pipeline.communication`; the timeline and meters are
:mod:`gpucourse.pipeline.step_recorder`.

The last stage weights each micro-batch's (mean) loss by its share of the batch, so the gradients —
and the parameters after a step — equal those of the whole model trained on the whole batch in one
process (:func:`~gpucourse.train_sequential`), whatever the schedule and however the batch divides.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .communication import PipelineComm, ReceiveAhead, agree_with_neighbours
from .gpipe import split_microbatches
from .schedule import PipelineSchedule, gpipe_schedule, one_f_one_b_schedule
from .step_recorder import StepRecorder
from ..runtime import check_int

__all__ = ["pipeline_step", "make_schedule", "microbatch_sizes", "boundary_shapes"]

_SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def pipeline_step(stage: nn.Module, schedule: PipelineSchedule, comm: PipelineComm, *,
                  batch_size: int, in_shape: tuple = (), out_shape: tuple = (),
                  inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                  loss_fn: Callable = F.cross_entropy, total_samples: int | None = None,
                  dtype: torch.dtype = torch.float32,
                  clock: Callable[[], float] = time.perf_counter,
                  check_neighbours: bool = True, measure_activations: bool = True) -> dict:
    """Forward and backward of one batch on this process's stage, in the schedule's order.

    Args:
        stage: this process's part of the model.
        schedule: the operations of every stage; this process runs ``schedule.ops[comm.stage]``.
        comm: the transport to the neighbouring stages.
        batch_size: samples in this pipeline's batch (every stage must know the micro-batch sizes).
        in_shape: per-sample shape of this stage's input (needed unless it is the first stage).
        out_shape: per-sample shape of its output (needed unless it is the last stage).
        inputs: the batch (first stage only).
        targets: the labels (last stage only).
        loss_fn: a loss that *averages* over its batch (``reduction="mean"``).
        total_samples: the size of the batch the gradients should be averaged over (default
            ``batch_size``; larger with data parallelism).
        dtype: dtype of activations and gradients on the wire.
        clock: the time source for the recorded events.
        check_neighbours: first exchange what this stage was told with its neighbours and raise
            on a mismatch (one small message each way, about a millisecond on loopback gloo).
            Every stage must pass the same value; a training loop that calls ``pipeline_step``
            with the same arguments every step needs it only on the first
            (:func:`train_pipeline` does that).
        measure_activations: count the bytes autograd saves (:class:`~gpucourse.SavedActivationMeter`);
            its Python hook on every saved tensor costs a few per cent of the compute, so turn it
            off when only the speed matters (``peak_activation_bytes`` is then ``None``).

    Returns:
        ``{"events": [TimelineEvent, ...], "loss": float or None (last stage),``
        ``"peak_in_flight": int, "peak_activation_bytes": int or None}`` (bytes autograd saved for
        the backward, parameters not counted). Gradients are accumulated in ``stage``'s parameters.

    Receives are posted ahead — as many as the stage can have micro-batches in flight, plus one —
    so a neighbour's message lands in its buffer the moment it is sent
    (:class:`~gpucourse.pipeline.communication.ReceiveAhead`); the timeline and the meters are
    recorded by a :class:`~gpucourse.pipeline.step_recorder.StepRecorder`.

    Example (two processes; :func:`train_pipeline` wraps exactly this)::

        >>> import gpucourse as gc
        >>> def one_step(rank, world_size):
        ...     stages = gc.split_sequential(gc.MLP(4, 8, 3), 2)       # Linear+ReLU | Linear
        ...     x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        ...     out = pipeline_step(stages[rank], gc.gpipe_schedule(2, 3), PipelineComm(),
        ...                         batch_size=6, in_shape=(8,) if rank else (4,), out_shape=(8,),
        ...                         inputs=x if rank == 0 else None, targets=y if rank == 1 else None)
        ...     return [f"{e.kind}{e.microbatch}" for e in out["events"]], out["peak_in_flight"]
        >>> gc.launch(one_step, 2)
        [(['F0', 'F1', 'F2', 'B0', 'B1', 'B2'], 3), (['F0', 'F1', 'F2', 'B0', 'B1', 'B2'], 3)]

    Raises:
        RuntimeError: when a neighbouring stage was given another schedule, number of
            micro-batches, batch size, dtype or boundary shape (checked with one small message
            each way before any activation moves).

    .. warning::
        Every stage must run the same schedule. Mismatches in what the stages were *told* are
        caught; a neighbour that never calls ``pipeline_step`` still leaves this stage waiting until
        the launch timeout.
    """
    s, m = comm.stage, schedule.num_microbatches
    sizes = _check_step_args(schedule, comm, batch_size, inputs, targets)
    total = total_samples or batch_size
    if check_neighbours:   # one small message each way: a mismatched pipeline fails now, not hangs
        agree_with_neighbours(comm, schedule, batch_size=batch_size, total_samples=total,
                              in_shape=in_shape, out_shape=out_shape, dtype=dtype)
    xs = split_microbatches(inputs, m) if comm.is_first else None     # m × (b_i, *in_shape)
    ts = split_microbatches(targets, m) if comm.is_last else None
    inbox = ReceiveAhead(comm, schedule.ops[s], sizes, in_shape, out_shape, dtype,
                         window=schedule.peak_in_flight()[s] + 1).start()
    rec = StepRecorder(s, clock, comm.device, stage if measure_activations else None)
    saved: dict[int, tuple] = {}       # micro-batch -> (stage input, stage output or loss)
    loss_sum = 0.0
    with rec:
        for op in schedule.ops[s]:
            i = op.microbatch
            if op.kind == "F":
                # 1) input: a slice of the batch, or the previous stage's activation
                x = xs[i] if comm.is_first else inbox.forward(i).requires_grad_()
                # 2) forward; the last stage weights the micro-batch's mean loss by its share,
                #    so the sum over micro-batches is the whole batch's mean
                with rec.compute("F", i):
                    y = stage(x)
                    if comm.is_last:
                        y = loss_fn(y, ts[i]) * (sizes[i] / total)
                        loss_sum += y.item()
                # 3) hand the activation on; keep (x, y) alive for this micro-batch's backward
                if not comm.is_last:
                    comm.send_forward(y.detach(), i)
                saved[i] = (x, y)
                rec.alive(len(saved))
            else:
                x, y = saved.pop(i)
                # 4) backward from the loss, or from the next stage's gradient of our output
                grad = None if comm.is_last else inbox.backward(i)
                with rec.compute("B", i):
                    torch.autograd.backward(y, grad)
                # 5) hand d(loss)/d(input) back to the previous stage
                if not comm.is_first:
                    comm.send_backward(x.grad, i)
                del x, y
    comm.wait()
    return {"events": rec.events, "loss": loss_sum if comm.is_last else None,
            "peak_in_flight": rec.peak_in_flight, "peak_activation_bytes": rec.peak_activation_bytes}


def _check_step_args(schedule, comm, batch_size, inputs, targets) -> list[int]:
    """What :func:`pipeline_step` needs before any message moves; returns the micro-batch sizes."""
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"schedule must be a PipelineSchedule (gc.make_schedule('gpipe', stages, chunks)), "
                        f"got {type(schedule).__name__}")
    if schedule.num_stages != comm.num_stages:
        raise ValueError(f"schedule has {schedule.num_stages} stages, the pipeline has {comm.num_stages}")
    if comm.is_first and inputs is None:
        raise ValueError("the first stage needs inputs=<the batch>")
    if comm.is_last and targets is None:
        raise ValueError("the last stage needs targets=<the labels>")
    sizes = microbatch_sizes(batch_size, schedule.num_microbatches)
    for name, value in (("inputs", inputs), ("targets", targets)):
        if value is not None and len(value) != batch_size:
            raise ValueError(f"{name} has {len(value)} samples, but batch_size is {batch_size}")
    return sizes


def make_schedule(schedule: str | PipelineSchedule, num_stages: int, chunks: int) -> PipelineSchedule:
    """``"gpipe"``/``"1f1b"`` → a :class:`PipelineSchedule` (a schedule is passed through, checked).

    Args:
        schedule: a name or a ready :class:`PipelineSchedule`.
        num_stages, chunks: the pipeline's size.

    Example::

        >>> make_schedule("1f1b", 2, 3).ops[1]
        [F0, B0, F1, B1, F2, B2]

    .. warning::
        Every stage of a pipeline must use the same schedule, or messages never pair up.
    """
    if isinstance(schedule, PipelineSchedule):
        if (schedule.num_stages, schedule.num_microbatches) != (num_stages, chunks):
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.num_stages} stages and "
                             f"{schedule.num_microbatches} micro-batches, not {num_stages} and {chunks}")
        return schedule
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(_SCHEDULES)} or a PipelineSchedule, "
                         f"got {schedule!r}")
    return _SCHEDULES[schedule](num_stages, chunks)


def microbatch_sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of :func:`~gpucourse.split_microbatches`'s pieces, without the batch.

    Args:
        batch_size: samples in the batch, an int >= 1.
        chunks: micro-batches, an int with ``1 <= chunks <= batch_size``.

    Example::

        >>> microbatch_sizes(10, 4)
        [3, 3, 2, 2]
        >>> microbatch_sizes(10, 0)
        Traceback (most recent call last):
        ...
        ValueError: chunks must be >= 1 (the number of micro-batches), got 0

    .. warning::
        Every stage of a pipeline computes these sizes itself (to allocate its receive buffers), so
        every stage must be given the same ``batch_size`` and ``chunks``.
    """
    check_int("batch_size", batch_size)
    check_int("chunks", chunks, 1, hint=" (the number of micro-batches)")
    if chunks > batch_size:
        raise ValueError(f"a batch of {batch_size} samples cannot be cut into {chunks} micro-batches; "
                         f"use chunks <= {batch_size}")
    return [batch_size // chunks + (1 if i < batch_size % chunks else 0) for i in range(chunks)]


def boundary_shapes(stages, sample: torch.Tensor) -> list[tuple[int, ...]]:
    """Per-sample shape of every stage's input, then of the last output (a dry run on ``sample``).

    Example::

        >>> import gpucourse as gc
        >>> boundary_shapes(gc.split_sequential(gc.MLP(8, 16, 4), 2), torch.zeros(1, 8))
        [(8,), (16,), (4,)]
    """
    shapes = [tuple(sample.shape[1:])]
    with torch.no_grad():
        x = sample
        for stage in stages:
            x = stage(x)
            shapes.append(tuple(x.shape[1:]))
    return shapes
