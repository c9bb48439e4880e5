"""Chapter 04 — DistributedDataParallel: one process per device, gradients all-reduced.

- ``collectives``     all-reduce from point-to-point messages: naive, and the ring
- ``all_reduce_timing``  timing them against gloo's own
- ``ddp``             ``MiniDDP``: same start, averaged gradients, buckets, ``no_sync``
- ``ddp_trace``       what a MiniDDP step looked like (backward vs bucket all-reduces), drawn
- ``samplers``        ``DistributedSampler``, step by step
- ``sync_batchnorm``  batch statistics over the global batch
- ``checkpoint``      save once on rank 0, atomically; load everywhere with ``weights_only=True``
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .all_reduce_timing import all_reduce_timings
from .collectives import naive_all_reduce, ring_all_reduce, ring_schedule
from .ddp import MiniDDP, average_gradients
from .ddp_trace import StepTrace, plot_step_trace
from .samplers import DistributedSampler
from .sync_batchnorm import sync_batch_stats

__all__ = ["load_checkpoint", "save_checkpoint", "all_reduce_timings", "naive_all_reduce",
           "ring_all_reduce", "ring_schedule", "MiniDDP", "StepTrace", "average_gradients",
           "plot_step_trace", "DistributedSampler", "sync_batch_stats"]
