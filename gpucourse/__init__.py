"""gpucourse — the helper package of an interactive course on parallel training with PyTorch.

Every name exported here is part of the course's stable public API: notebooks, exercises and
outside checks rely on it. The modules inside are named after concepts (``launch``, ``devices``,
``timing`` …); import from the top level::

    import gpucourse as gc
    gc.launch(fn, 2)
"""

__version__ = "0.1.0"

# --- foundation: launching ranks, devices, printing, timing, data, models ------------------
from .data import CIFAR10_CLASSES, SyntheticCIFAR10, cifar10_or_synthetic, load_cifar10
from .devices import cpu_cores, virtual_devices, visible_devices
from .launcher import WorkerError, free_port, launch
from .models import MLP, Net, ToyModel
from .printing import print0, print_ordered, rank_prefix
from .timing import Timing, format_comparison, measure, speedup

# --- chapter 01: serial vs parallel ---------------------------------------------------------

# --- chapters 02-03: DataParallel, BalancedDataParallel ------------------------------------
from .data_parallel import BalancedDataParallel, DataParallel, balanced_chunk_sizes
from .device_workers import plot_timeline, record_timeline
from .memory import MemoryReport, MemoryTracker, dp_step_memory, memory_explorer, plot_memory
from .scatter_gather import chunk_sizes_of, gather, parallel_apply, replicate, scatter, scatter_kwargs

# --- chapter 04: DistributedDataParallel ----------------------------------------------------

# --- chapter 05: multi-node initialisation ---------------------------------------------------

# --- chapter 06: mixed precision -------------------------------------------------------------

# --- chapter 07: model / pipeline parallelism ------------------------------------------------
