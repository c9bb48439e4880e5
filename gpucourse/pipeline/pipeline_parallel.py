"""A real pipeline across processes: one stage per process, GPipe or 1F1B, timestamps recorded.

Run with :func:`~gpucourse.launch` (notebooks, tests) or torchrun (one process per GPU)::

    gc.launch(functools.partial(gc.train_pipeline, model_fn=make_model, inputs=x, targets=y,
                                schedule="1f1b", chunks=8), 2)

or, from the parent, :func:`run_pipeline`, which launches the ranks and assembles their results.
Every rank

1) builds the whole model with ``model_fn()`` (same seed, same weights everywhere) and keeps only
   its stage (a model too big for one device would build only its own stage);
2) for each step runs its stage's list of operations from the schedule
   (:mod:`gpucourse.pipeline_schedule`) — :func:`pipeline_step`: receive an activation, forward,
   send it on; receive a gradient, backward, send the input's gradient back
   (:class:`~gpucourse.PipelineComm`) — recording when each computation starts and ends;
3) with ``dp_size > 1`` (a 2-D grid, :class:`~gpucourse.ParallelGrid`) all-reduces its gradients
   with the same stage of the other pipelines;
4) updates its own parameters with SGD.

The last stage weights each micro-batch's (mean) loss by its share of the batch, so the gradients —
and the parameters after a step — equal those of the whole model trained on the whole batch in one
process (:func:`train_sequential`), whatever the schedule and however the batch divides.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from dataclasses import dataclass, field
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .activation_memory import SavedActivationMeter
from .model_split import split_sequential
from .grid import ParallelGrid
from .gpipe import _check_chunks, split_microbatches
from .communication import PipelineComm
from .schedule import (PipelineSchedule, Timeline, TimelineEvent, _check_int, gpipe_schedule,
                                one_f_one_b_schedule)

__all__ = ["microbatch_sizes", "boundary_shapes", "pipeline_step", "train_pipeline", "run_pipeline", "train_sequential", "PipelineRun",
           "make_schedule", "train_torch_pipelining"]

_SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def _synced(clock: Callable[[], float], device: torch.device) -> float:
    """Read the clock after the device has finished its queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


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
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__} {batch_size!r}")
    _check_chunks(chunks)
    if chunks > batch_size:
        raise ValueError(f"a batch of {batch_size} samples cannot be cut into {chunks} micro-batches; "
                         f"use chunks <= {batch_size}")
    return [batch_size // chunks + (1 if i < batch_size % chunks else 0) for i in range(chunks)]


def _check_pipeline_args(model: nn.Sequential, inputs: torch.Tensor, targets: torch.Tensor, *,
                        num_stages: int, schedule, chunks: int, steps: int = 1, dp_size: int = 1,
                        balance=None) -> PipelineSchedule:
    """Check a pipeline's arguments before any process starts; return the schedule.

    :func:`run_pipeline` calls it in the parent (so a mistake is a ``ValueError``/``TypeError``
    there, not a failure in every rank) and :func:`train_pipeline` in each rank.

    Args:
        model: the whole model (``model_fn()``), an ``nn.Sequential``.
        inputs, targets: the batch and its labels (same length).
        num_stages: pipeline stages; at most the number of layers.
        schedule: ``"gpipe"``, ``"1f1b"`` or a :class:`PipelineSchedule` of that size.
        chunks: micro-batches per batch, ``1 <= chunks <= `` each pipeline's share of the batch.
        steps: SGD steps, >= 1.
        dp_size: pipelines side by side, >= 1.
        balance: layers per stage, or ``None``.

    Example::

        >>> import gpucourse as gc
        >>> x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
        >>> sched = _check_pipeline_args(gc.MLP(4, 8, 2), x, y, num_stages=2, schedule="gpipe", chunks=3)
        >>> sched.name, sched.num_stages, sched.num_microbatches
        ('GPipe', 2, 3)
        >>> _check_pipeline_args(gc.MLP(4, 8, 2), x, y, num_stages=4, schedule="gpipe", chunks=3)
        Traceback (most recent call last):
        ...
        ValueError: num_stages=4: cannot cut 3 layers into 4 stages: every stage needs at least one layer

    .. warning::
        It checks the arguments, not the model: a layer whose input shape does not fit the previous
        layer's output still fails inside the ranks.
    """
    _check_int("num_stages", num_stages)
    _check_int("dp_size", dp_size)
    _check_int("steps", steps)
    _check_chunks(chunks)
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


def _agree_with_neighbours(comm: PipelineComm, schedule: PipelineSchedule, *, batch_size: int,
                           total_samples: int, in_shape, out_shape, dtype) -> None:
    """Exchange what each stage was told with its neighbours; raise if they differ.

    Stages given different schedules, micro-batch counts or batch sizes would post receives that no
    send matches and wait forever; one small message each way turns that into a clear error.
    """
    mine = {"schedule": schedule.name, "operations": zlib.crc32(str(schedule).encode()),
            "stages": schedule.num_stages, "micro-batches": schedule.num_microbatches,
            "batch_size": batch_size, "total_samples": total_samples, "dtype": str(dtype)}
    in_shape, out_shape = [int(d) for d in in_shape], [int(d) for d in out_shape]
    prev, nxt = comm.exchange_with_neighbours({**mine, "boundary shape": in_shape},
                                              {**mine, "boundary shape": out_shape})
    for other, stage, boundary in ((prev, comm.stage - 1, in_shape), (nxt, comm.stage + 1, out_shape)):
        if other is None:
            continue
        ours = {**mine, "boundary shape": boundary}
        diff = [f"{k} {ours[k]!r} here, {other.get(k)!r} there" for k in ours
                if k != "operations" and ours[k] != other.get(k)]
        if not diff and ours["operations"] != other.get("operations"):
            diff = [f"schedules both named {schedule.name!r} order their operations differently"]
        if diff:
            raise RuntimeError(
                f"stage {comm.stage} and stage {stage} were given different pipelines: "
                + "; ".join(diff) + ". Call pipeline_step on every stage with the same schedule "
                "(name and micro-batches), batch_size, total_samples and dtype, and with in_shape equal "
                "to the previous stage's out_shape")


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
        ``{"events": [TimelineEvent, ...], "loss": float or None (last stage), "peak_in_flight":
        int, "peak_activation_bytes": int or None}`` (bytes autograd saved for the backward,
        parameters not counted). Gradients are accumulated in ``stage``'s parameters.

    Receives are posted ahead — as many as the stage can have micro-batches in flight, plus one —
    so a neighbour's message lands in its buffer the moment it is sent.

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
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"schedule must be a PipelineSchedule (gc.make_schedule('gpipe', stages, chunks)), "
                        f"got {type(schedule).__name__}")
    s, m = comm.stage, schedule.num_microbatches
    if schedule.num_stages != comm.num_stages:
        raise ValueError(f"schedule has {schedule.num_stages} stages, the pipeline has {comm.num_stages}")
    if comm.is_first and inputs is None:
        raise ValueError("the first stage needs inputs=<the batch>")
    if comm.is_last and targets is None:
        raise ValueError("the last stage needs targets=<the labels>")
    sizes = microbatch_sizes(batch_size, m)
    for name, value in (("inputs", inputs), ("targets", targets)):
        if value is not None and len(value) != batch_size:
            raise ValueError(f"{name} has {len(value)} samples, but batch_size is {batch_size}")
    total = total_samples or batch_size
    if check_neighbours:
        _agree_with_neighbours(comm, schedule, batch_size=batch_size, total_samples=total,
                               in_shape=in_shape, out_shape=out_shape, dtype=dtype)
    xs = split_microbatches(inputs, m) if comm.is_first else None
    ts = split_microbatches(targets, m) if comm.is_last else None
    # the receives this stage will need, in order; keep `window` of them posted ahead
    needs = [op for op in schedule.ops[s]
             if (op.kind == "F" and not comm.is_first) or (op.kind == "B" and not comm.is_last)]
    window, posted = schedule.peak_in_flight()[s] + 1, 0

    def post_ahead(upto: int) -> None:
        nonlocal posted
        while posted < min(upto, len(needs)):
            op = needs[posted]
            if op.kind == "F":
                comm.post_recv_forward(op.microbatch, (sizes[op.microbatch], *in_shape), dtype)
            else:
                comm.post_recv_backward(op.microbatch, (sizes[op.microbatch], *out_shape), dtype)
            posted += 1

    saved: dict[int, tuple] = {}       # micro-batch -> (stage input, stage output or loss)
    events, loss_sum, in_flight, peak, received = [], 0.0, 0, 0, 0
    post_ahead(window)
    meter = SavedActivationMeter(ignore=stage.parameters()) if measure_activations else None
    with meter or contextlib.nullcontext():
        for op in schedule.ops[s]:
            i = op.microbatch
            if op.kind == "F":
                if comm.is_first:
                    x = xs[i]
                else:
                    x = comm.recv_forward(i).requires_grad_()
                    received += 1
                    post_ahead(received + window)
                start = _synced(clock, comm.device)
                y = stage(x)
                if comm.is_last:   # weight by the micro-batch's share: sum over i = full-batch mean
                    y = loss_fn(y, ts[i]) * (sizes[i] / total)
                    loss_sum += y.item()
                end = _synced(clock, comm.device)
                if not comm.is_last:
                    comm.send_forward(y.detach(), i)
                saved[i] = (x, y)
                in_flight += 1
                peak = max(peak, in_flight)
            else:
                x, y = saved.pop(i)
                grad = None
                if not comm.is_last:
                    grad = comm.recv_backward(i)
                    received += 1
                    post_ahead(received + window)
                start = _synced(clock, comm.device)
                torch.autograd.backward(y, grad)
                end = _synced(clock, comm.device)
                if not comm.is_first:
                    comm.send_backward(x.grad, i)
                del x, y
                in_flight -= 1
            events.append(TimelineEvent(s, op.kind, i, start, end))
    comm.wait()
    return {"events": events, "loss": loss_sum if comm.is_last else None,
            "peak_in_flight": peak, "peak_activation_bytes": meter.peak if meter else None}


def train_pipeline(rank: int, world_size: int, model_fn: Callable[[], nn.Sequential],
                   inputs: torch.Tensor, targets: torch.Tensor, *, schedule: str = "gpipe",
                   chunks: int = 4, steps: int = 1, lr: float = 0.1,
                   loss_fn: Callable = F.cross_entropy, dp_size: int = 1,
                   balance: list[int] | None = None, device: str | None = None,
                   measure_activations: bool = True) -> dict:
    """The per-rank function: train ``steps`` SGD steps of the pipelined model (see the module doc).

    Args:
        rank, world_size: as given by :func:`~gpucourse.launch` (``world_size = dp_size × stages``).
        model_fn: builds the whole ``nn.Sequential``, identically on every rank (seed inside).
        inputs, targets: the batch of every step (each pipeline takes its share when ``dp_size > 1``).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        chunks: micro-batches per batch (per pipeline).
        steps: SGD steps.
        lr: learning rate.
        loss_fn: mean-reducing loss, e.g. ``F.cross_entropy``.
        dp_size: number of pipelines side by side (data parallelism); stages = ``world_size / dp_size``.
        balance: layers per stage (default: as even as possible).
        device: where this rank's stage runs; default ``"cpu"`` with gloo, ``cuda:<local rank>``
            with NCCL.
        measure_activations: measure ``peak_activation_bytes`` (see :func:`pipeline_step`; off for
            speed measurements, then ``None``).

    Returns:
        a dict: ``stage``, ``dp_rank``, ``state_dict`` (this stage's parameters after the steps, keyed
        like the whole model's), ``losses`` (per step, last stage), ``events`` (per step, a list
        of :class:`~gpucourse.TimelineEvent`), ``step_times`` (seconds per step, all stages synchronised), ``peak_in_flight``,
        ``peak_activation_bytes``.

    Example::

        >>> import functools, gpucourse as gc
        >>> make = lambda: (torch.manual_seed(0), gc.MLP(8, 16, 16, 4))[1]
        >>> x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
        >>> out = gc.launch(functools.partial(train_pipeline, model_fn=make, inputs=x, targets=y,
        ...                                   schedule="1f1b", chunks=3, steps=2), 2)
        >>> [r["peak_in_flight"] for r in out], len(out[0]["events"]), len(out[0]["events"][-1])
        ([2, 1], 2, 6)

    .. warning::
        The timeline's clock is ``time.perf_counter``, which all processes on one machine share;
        timestamps from different machines are not comparable.
    """
    _check_int("dp_size", dp_size)
    if world_size % dp_size:
        raise ValueError(f"world_size {world_size} is not divisible by dp_size {dp_size}")
    model = model_fn()
    sched = _check_pipeline_args(model, inputs, targets, num_stages=world_size // dp_size,
                                 schedule=schedule, chunks=chunks, steps=steps, dp_size=dp_size,
                                 balance=balance)
    grid = ParallelGrid(dp_size=dp_size, pp_size=world_size // dp_size)
    pp_rank, dp_rank = grid.coords(rank)
    dp_group = None
    if dp_size > 1:   # every rank must create every group, in the same order
        for p in range(grid.pp_size):
            group = dist.new_group(grid.data_parallel_ranks(p))
            if p == pp_rank:
                dp_group = group
    if device is None:
        on_gpu = dist.get_backend() == "nccl"
        device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"
    stages = split_sequential(model, grid.pp_size, balance=balance)
    shapes = boundary_shapes(stages, inputs[:1])     # what crosses each stage boundary
    stage = stages[pp_rank].to(device)
    del stages
    comm = PipelineComm(grid.pipeline_ranks(dp_rank), device=device)
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    my_x = split_microbatches(inputs, dp_size)[dp_rank].to(device)
    my_y = split_microbatches(targets, dp_size)[dp_rank].to(device)
    losses, times, step_events, result = [], [], [], {}
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        result = pipeline_step(stage, sched, comm, batch_size=len(my_x), check_neighbours=step == 0,
                               in_shape=shapes[pp_rank], out_shape=shapes[pp_rank + 1],
                               inputs=my_x if comm.is_first else None,
                               targets=my_y if comm.is_last else None, loss_fn=loss_fn,
                               total_samples=len(targets), dtype=inputs.dtype,
                               measure_activations=measure_activations)
        if dp_group is not None:
            for p in stage.parameters():
                dist.all_reduce(p.grad, group=dp_group)   # losses were pre-weighted: sum = mean
        opt.step()
        dist.barrier()
        times.append(_synced(time.perf_counter, comm.device) - start)
        losses.append(result["loss"])
        step_events.append(result["events"])
    state = {k: v.cpu() for k, v in stage.state_dict().items()}
    return {"stage": pp_rank, "dp_rank": dp_rank, "state_dict": state,
            "losses": losses, "events": step_events, "step_times": times,
            "peak_in_flight": result["peak_in_flight"],
            "peak_activation_bytes": result["peak_activation_bytes"]}


def train_sequential(model_fn: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                     *, steps: int = 1, lr: float = 0.1, loss_fn: Callable = F.cross_entropy) -> dict:
    """The reference: the whole model, the whole batch, one process. Same returns as a pipeline run.

    Args:
        model_fn, inputs, targets, steps, lr, loss_fn: as in :func:`train_pipeline`.

    Example::

        >>> import gpucourse as gc
        >>> make = lambda: (torch.manual_seed(0), gc.MLP(8, 4))[1]
        >>> ref = train_sequential(make, torch.randn(6, 8), torch.randint(0, 4, (6,)), steps=2)
        >>> sorted(ref["state_dict"]), len(ref["losses"]), len(ref["step_times"])
        (['0.bias', '0.weight'], 2, 2)

    .. warning::
        For a fair speed comparison run it in a process with one thread, like each pipeline rank
        (``gc.launch(..., 1)`` does that).
    """
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"state_dict": model.state_dict(), "losses": losses, "step_times": times}


@dataclass
class PipelineRun:
    """What :func:`run_pipeline` returns: the pipeline's results gathered from all ranks.

    Example::

        >>> run = PipelineRun("gpipe", 2, 4, {}, [0.5], gpipe_schedule(2, 4).simulate(), [0.1])
        >>> run.peak_in_flight, run.timelines        # not filled in by hand here
        ([], [])
        >>> round(run.timeline.bubble(), 3)
        0.2

    .. warning::
        ``timeline`` and ``step_times`` come from one run on a shared machine: compare ratios
        measured in the same session, not absolute times across machines.
    """

    schedule: str
    num_stages: int
    chunks: int
    state_dict: dict                      # the whole model's parameters (first pipeline)
    losses: list[float]                   # per step
    timeline: Timeline                    # measured, last step
    step_times: list[float]               # seconds per step
    timelines: list[Timeline] = field(default_factory=list)          # measured, every step
    peak_in_flight: list[int] = field(default_factory=list)          # per stage
    peak_activation_bytes: list[int] = field(default_factory=list)   # per stage


def run_pipeline(model_fn: Callable[[], nn.Sequential], inputs: torch.Tensor, targets: torch.Tensor,
                 *, num_stages: int = 2, schedule: str = "gpipe", chunks: int = 4, steps: int = 1,
                 lr: float = 0.1, loss_fn: Callable = F.cross_entropy, dp_size: int = 1,
                 balance: list[int] | None = None, backend: str = "gloo",
                 timeout: float = 120.0, measure_activations: bool = True) -> PipelineRun:
    """Launch :func:`train_pipeline` in ``num_stages × dp_size`` processes and gather the results.

    Args:
        model_fn, inputs, targets, schedule, chunks, steps, lr, loss_fn, dp_size, balance,
            measure_activations: see :func:`train_pipeline`.
        num_stages: pipeline stages (processes per pipeline).
        backend: ``"gloo"`` (CPU processes) or ``"nccl"`` (one CUDA GPU per process).
        timeout: seconds for the whole run (see :func:`~gpucourse.launch`).

    Example::

        >>> import gpucourse as gc
        >>> make = lambda: (torch.manual_seed(0), gc.MLP(8, 16, 16, 4))[1]
        >>> x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
        >>> run = run_pipeline(make, x, y, num_stages=2, schedule="gpipe", chunks=3)
        >>> ref = train_sequential(make, x, y)
        >>> all(torch.allclose(run.state_dict[k], v, atol=1e-6) for k, v in ref["state_dict"].items())
        True
        >>> run.peak_in_flight, len(run.timeline.events)     # GPipe: all 3 micro-batches alive
        ([3, 3], 12)

    Raises:
        ValueError, TypeError: before any process starts, for arguments no pipeline can run: more
            stages than layers, ``chunks`` not an int >= 1, a batch smaller than ``chunks``, an
            unknown schedule, a ``balance`` that does not fit the model.

    .. warning::
        Each process runs with one thread (as under torchrun with ``OMP_NUM_THREADS=1``): compare
        its speed with a one-thread baseline, not with a single process using every core.
    """
    import functools

    from ..runtime import launch

    if not callable(model_fn):
        raise TypeError(f"model_fn must be a function that builds the model, got {type(model_fn).__name__}")
    _check_pipeline_args(model_fn(), inputs, targets, num_stages=num_stages, schedule=schedule,
                         chunks=chunks, steps=steps, dp_size=dp_size, balance=balance)
    # torch.optim imports torch._dynamo on first use (~1 s); do it once here, so that the forked
    # ranks inherit it instead of each paying for it at every launch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    fn = functools.partial(train_pipeline, model_fn=model_fn, inputs=inputs, targets=targets,
                           schedule=schedule, chunks=chunks, steps=steps, lr=lr, loss_fn=loss_fn,
                           dp_size=dp_size, balance=balance, measure_activations=measure_activations)
    out = launch(fn, num_stages * dp_size, backend=backend, timeout=timeout)
    first = [r for r in out if r["dp_rank"] == 0]
    state: dict = {}
    for r in first:
        state.update(r["state_dict"])
    name = schedule if isinstance(schedule, str) else schedule.name
    timelines = [Timeline.from_measured([e for r in first for e in r["events"][k]], num_stages,
                                        f"{name} (measured)") for k in range(steps)]
    return PipelineRun(
        schedule=name, num_stages=num_stages, chunks=chunks, state_dict=state,
        losses=[sum(r["losses"][k] for r in out if r["losses"][k] is not None) for k in range(steps)],
        timeline=timelines[-1], timelines=timelines, step_times=first[0]["step_times"],
        peak_in_flight=[r["peak_in_flight"] for r in first],
        peak_activation_bytes=[r["peak_activation_bytes"] for r in first])


def train_torch_pipelining(rank: int, world_size: int, model_fn: Callable[[], nn.Sequential],
                           inputs: torch.Tensor, targets: torch.Tensor, *, schedule: str = "gpipe",
                           chunks: int = 4, steps: int = 1, lr: float = 0.1,
                           loss_fn: Callable = F.cross_entropy, frontend: str = "manual") -> dict:
    """The same training with PyTorch's own ``torch.distributed.pipelining`` (per-rank function).

    Each rank builds its stage — cut like :func:`train_pipeline` does — and runs PyTorch's
    ``ScheduleGPipe`` or ``Schedule1F1B``; the first stage feeds the batch, the last the targets.

    Args:
        rank, world_size: from :func:`~gpucourse.launch`; one stage per rank.
        model_fn, inputs, targets, chunks, steps, lr, loss_fn: as in :func:`train_pipeline`.
        schedule: ``"gpipe"`` (``ScheduleGPipe``) or ``"1f1b"`` (``Schedule1F1B``).
        frontend: ``"manual"`` — wrap our stage module in ``PipelineStage``; ``"trace"`` — let
            ``pipeline(model, mb_args, split_spec)`` trace the whole model (``torch.export``) and cut
            it at ``SplitPoint.BEGINNING`` of each stage's first layer, then ``build_stage``.

    Returns:
        ``stage``, ``state_dict`` (keyed like the model's), ``losses`` (per step, last stage) and
        ``step_times``.

    Example::

        >>> import functools, gpucourse as gc
        >>> make = lambda: (torch.manual_seed(0), gc.MLP(8, 16, 16, 4))[1]
        >>> x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
        >>> out = gc.launch(functools.partial(train_torch_pipelining, model_fn=make, inputs=x,
        ...                                   targets=y, chunks=3), 2)
        >>> ref = train_sequential(make, x, y)
        >>> torch.allclose(out[0]["state_dict"]["0.weight"], ref["state_dict"]["0.weight"], atol=1e-6)
        True

    .. warning::
        PyTorch averages the micro-batch losses with equal weights (``scale_grads=True``), so its
        gradients equal the full batch's only for micro-batches of equal size; in torch 2.14 a batch
        that does not divide by ``chunks`` fails on the last stage (output and target micro-batches
        of different sizes).
    """
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              SplitPoint, pipeline)

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in classes:
        raise ValueError(f"schedule must be one of {sorted(classes)}, got {schedule!r}")
    model = model_fn()
    stages = split_sequential(model, world_size)
    if frontend == "manual":
        stage_module = stages[rank]
        pipe_stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
        names = None
    elif frontend == "trace":
        firsts = [next(iter(stage._modules)) for stage in stages[1:]]   # "4": cut before layer 4
        pipe = pipeline(model, mb_args=(split_microbatches(inputs, chunks)[0],),
                        split_spec={name: SplitPoint.BEGINNING for name in firsts})
        pipe_stage = pipe.build_stage(rank, torch.device("cpu"))
        stage_module = pipe.get_stage_module(rank)
        names = {id(p): k for k, p in model.named_parameters()}      # traced names -> ours
    else:
        raise ValueError(f"frontend must be 'manual' or 'trace', got {frontend!r}")
    runner = classes[schedule](pipe_stage, n_microbatches=chunks, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage_module.parameters(), lr=lr)
    losses, times = [], []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mb_losses: list = []
        if rank == 0:
            runner.step(inputs)
        elif rank == world_size - 1:
            runner.step(target=targets, losses=mb_losses)
        else:
            runner.step()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(torch.stack(mb_losses).detach().mean()) if mb_losses else None)
    state = stage_module.state_dict()
    if names is not None:   # the traced module names parameters its own way; map back by identity
        state = {names.get(id(p), k): p.detach() for k, p in stage_module.named_parameters()}
    return {"stage": rank, "state_dict": state, "losses": losses, "step_times": times}
