"""Profile DDP steps and measure DDP's options: run inside each rank (``gc.launch``), trace to a file.

:func:`profile_ddp_steps` wraps a model in ``DistributedDataParallel`` with the options asked for,
warms it up (the first iteration rebuilds the buckets), then records a few steps with
``torch.profiler`` and writes this rank's Chrome trace. :func:`measure_ddp_option` adds a timed
run without the profiler (the profiler slows every op down) and reads the bytes from the trace.

The options measured:

* ``bucket_cap_mb`` — the bucket size: small buckets start all-reducing early in backward (overlap);
  one huge bucket waits for the last gradient;
* ``gradient_as_bucket_view=True`` — ``.grad`` tensors *are* views into the buckets: no copy into
  the bucket and back, one gradient-sized buffer less of memory; same bytes sent;
* ``static_graph=True`` — the graph is the same every step, so DDP may skip per-step bookkeeping
  (and supports re-entrant checkpointing);
* ``comm_hook="bf16"`` — ``bf16_compress_hook``: cast each bucket to bfloat16, all-reduce, cast back —
  half the bytes, with bf16's 8-bit mantissa on the averaged gradient.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime import check_choice, check_int, check_positive

__all__ = ["DDPOptionResult", "measure_ddp_option", "profile_ddp_steps"]


def _ddp(model, bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
              static_graph=static_graph)
    if comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp


def profile_ddp_steps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, trace_path,
                      *, bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = False,
                      static_graph: bool = False, comm_hook: str | None = None, warmup: int = 2,
                      steps: int = 3):
    """Train ``steps`` DDP steps under ``torch.profiler`` on this rank and write its Chrome trace.

    Call it on every rank of a process group (each with its own ``trace_path``). Each step is
    ``zero_grad → forward → cross-entropy → backward → SGD step``, marked ``ProfilerStep#i`` as ``prof.step()`` does.

    Args:
        model: the plain model (wrapped in DDP here); same initial weights on every rank.
        inputs, targets: this rank's batch.
        trace_path: where this rank's ``.json`` trace goes.
        bucket_cap_mb, gradient_as_bucket_view, static_graph: passed to ``DistributedDataParallel``.
        comm_hook: ``None`` (plain all-reduce) or ``"bf16"`` (``bf16_compress_hook``).
        warmup: unprofiled steps first (bucket rebuild happens in the first one).
        steps: profiled steps.

    Returns:
        the DDP-wrapped model (after training).

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> def run(rank, world_size, folder):
        ...     torch.manual_seed(0)
        ...     path = os.path.join(folder, f"rank{rank}.json")
        ...     gc.profile_ddp_steps(gc.MLP(8, 16, 4), torch.randn(4, 8), torch.randint(0, 4, (4,)),
        ...                          path, warmup=1, steps=1)
        ...     return len(gc.step_traces(path)[0].comms)
        >>> gc.launch(run, 2, args=(tempfile.mkdtemp(),))
        [1, 1]

    .. warning::
        The profiler costs time on every operator: use the trace for *where* the time goes and
        *what overlaps*, and time steps without it (:func:`measure_ddp_option`).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    warmup = check_int("warmup", warmup, 0)
    steps = check_int("steps", steps, 1)
    check_choice("comm_hook", comm_hook, (None, "bf16"))
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")       # keep the profiler's own logging quiet
    ddp = _ddp(model, bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def train_step():
        optimizer.zero_grad(set_to_none=not gradient_as_bucket_view)
        F.cross_entropy(ddp(inputs), targets).backward()   # DDP all-reduces bucket by bucket in here
        optimizer.step()

    for _ in range(warmup):
        train_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for i in range(steps):
            with record_function(f"ProfilerStep#{i}"):      # the step marker prof.step() writes
                train_step()
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    prof.export_chrome_trace(os.fspath(trace_path))
    return ddp


@dataclass(frozen=True)
class DDPOptionResult:
    """One DDP configuration measured on one rank."""

    name: str
    bytes_per_step: int       # bytes all-reduced per step (from the trace)
    step_time: float          # median seconds per step, without the profiler
    hidden_fraction: float    # share of all-reduce time under backward (from the trace)


def measure_ddp_option(name: str, model_fn, inputs, targets, trace_path, *, bucket_cap_mb: float = 25.0,
                       gradient_as_bucket_view: bool = False, static_graph: bool = False,
                       comm_hook: str | None = None, steps: int = 5) -> DDPOptionResult:
    """Measure one DDP configuration on this rank: bytes and overlap from a trace, time without it.

    Args:
        name: a label for the table.
        model_fn: builds the plain model (call it with the same seed on every rank).
        inputs, targets: this rank's batch.
        trace_path: where this rank's trace goes.
        bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook: as in :func:`profile_ddp_steps`.
        steps: timed steps (median taken); the trace records 2.

    Example::

        >>> import os, tempfile, torch, gpucourse as gc
        >>> def run(rank, world_size, folder):
        ...     x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        ...     model_fn = lambda: (torch.manual_seed(0), gc.MLP(8, 16, 4))[1]
        ...     plain = gc.measure_ddp_option("plain", model_fn, x, y, f"{folder}/p{rank}.json", steps=2)
        ...     bf16 = gc.measure_ddp_option("bf16", model_fn, x, y, f"{folder}/b{rank}.json",
        ...                                  comm_hook="bf16", steps=2)
        ...     return plain.bytes_per_step, bf16.bytes_per_step
        >>> gc.launch(run, 2, args=(tempfile.mkdtemp(),))[0]       # (8*16+16+16*4+4) floats
        (848, 424)

    .. warning::
        Ratios of step times on a shared laptop CPU are noisy; repeat before you conclude.
    """
    from .trace_timeline import allreduce_overlap

    steps = check_int("steps", steps, 1)
    check_positive("bucket_cap_mb", bucket_cap_mb)
    ddp = profile_ddp_steps(model_fn(), inputs, targets, trace_path, bucket_cap_mb=bucket_cap_mb,
                            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                            comm_hook=comm_hook, warmup=3, steps=2)
    report = allreduce_overlap(trace_path)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=not gradient_as_bucket_view)
        F.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return DDPOptionResult(name, report.bytes_per_step, statistics.median(times[1:]), report.hidden_fraction)
