"""Chapters 02–03 — DataParallel and the balanced DataParallel, from scratch.

- ``scatter_gather``  the four steps: scatter → replicate → parallel_apply → gather
- ``data_parallel``   ``DataParallel`` (the four steps in ``forward``) and ``BalancedDataParallel``
- ``concurrent_replicas``  how replicas run forward *and* backward at once on CPU virtual devices
- ``device_workers``  the transport: one persistent worker thread per (virtual) device
- ``device_timeline`` which device worker ran what when, recorded and drawn
- ``memory``          bytes per device during a step: why GPU 0 fills up
- ``memory_plots``    the bar chart and the interactive explorer over it
"""

from .data_parallel import BalancedDataParallel, DataParallel, balanced_chunk_sizes
from .device_timeline import plot_timeline, record_timeline
from .device_workers import current_device_index
from .memory import MemoryReport, MemoryTracker, dp_step_memory
from .memory_plots import memory_explorer, plot_memory
from .scatter_gather import chunk_sizes_of, gather, parallel_apply, replicate, scatter, scatter_kwargs

__all__ = ["BalancedDataParallel", "DataParallel", "balanced_chunk_sizes", "current_device_index",
           "plot_timeline", "record_timeline", "MemoryReport", "MemoryTracker", "dp_step_memory",
           "memory_explorer", "plot_memory", "chunk_sizes_of", "gather", "parallel_apply", "replicate",
           "scatter", "scatter_kwargs"]
