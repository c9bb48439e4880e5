"""Training with a pipeline: the per-rank driver, the one-process reference, and PyTorch's own.

Run with :func:`~gpucourse.launch` (notebooks, tests) or torchrun (one process per GPU)::

    gc.launch(functools.partial(gc.train_pipeline, model_fn=make_model, inputs=x, targets=y,
                                schedule="1f1b", chunks=8), 2)

or, from the parent, :func:`run_pipeline`, which launches the ranks and assembles their results.
One step of one stage is :func:`~gpucourse.pipeline_step` (:mod:`gpucourse.pipeline.pipeline_parallel`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .arguments import check_pipeline_args
from .communication import PipelineComm
from .gpipe import split_microbatches
from .grid import ParallelGrid
from .model_split import split_sequential
from .pipeline_parallel import boundary_shapes, pipeline_step
from .schedule import Timeline, gpipe_schedule  # noqa: F401  (gpipe_schedule: PipelineRun's example)
from .step_recorder import synced
from ..runtime import check_int

__all__ = ["train_pipeline", "train_sequential", "PipelineRun", "run_pipeline", "train_torch_pipelining"]


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
    check_int("dp_size", dp_size, 1)
    if world_size % dp_size:
        raise ValueError(f"world_size {world_size} is not divisible by dp_size {dp_size}")
    model = model_fn()
    sched = check_pipeline_args(model, inputs, targets, num_stages=world_size // dp_size,
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
        times.append(synced(time.perf_counter, comm.device) - start)
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
        model_fn, inputs, targets, schedule, chunks, steps: see :func:`train_pipeline`.
        lr, loss_fn, dp_size, balance, measure_activations: see :func:`train_pipeline`.
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
    check_pipeline_args(model_fn(), inputs, targets, num_stages=num_stages, schedule=schedule,
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
