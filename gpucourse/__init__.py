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

# --- chapter 04: DistributedDataParallel ----------------------------------------------------

# --- chapter 05: multi-node initialisation ---------------------------------------------------
from .cost_model import (LINKS, AlphaBeta, StepPrediction, fit_alpha_beta, measure_all_reduce,
                         measure_point_to_point, predict_step_time, ring_all_reduce_bytes,
                         ring_all_reduce_time, scaling_table)
from .dist_env import DistEnv, dist_env_from, expand_slurm_nodelist, global_rank, rank_layout
from .network import EmulatedLink, emulated_link, netns_support, network_interfaces
from .nodes import NodeError, NodeResult, launch_nodes, torchrun_command
from .rendezvous import InitMethod, checked_init_process_group, parse_init_method

# --- chapter 06: mixed precision -------------------------------------------------------------

# --- chapter 07: model / pipeline parallelism ------------------------------------------------
