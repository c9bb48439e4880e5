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
from .models import MLP, Net, SmallConvNet, ToyModel
from .printing import print0, print_ordered, rank_prefix
from .timing import Timing, format_comparison, measure, speedup

# --- chapter 01: serial vs parallel ---------------------------------------------------------
from .amdahl import (amdahl_speedup, amdahl_widget, fit_serial_fraction, gustafson_speedup,
                     karp_flatt, measure_scaling, plot_amdahl)
from .parallel import (SharedTotal, accumulate_in_threads, chunk_sizes, intra_op_threads,
                       parallel_map, parallel_reduce, pinned_to_cpus, split_into_chunks)
from .roofline import (ThroughputPoint, arithmetic_intensity, matmul_flops, measure_throughput,
                       op_cost, plot_roofline, plot_throughput, roofline)
from .timeline import ChunkRecord, Trace, plot_timelines
from .vectorization import cpu_capability, dot_loop, time_with_cpu_capability
from .workloads import python_work, torch_work

# --- chapters 02-03: DataParallel, BalancedDataParallel ------------------------------------
from .data_parallel import BalancedDataParallel, DataParallel, balanced_chunk_sizes
from .device_workers import plot_timeline, record_timeline
from .memory import MemoryReport, MemoryTracker, dp_step_memory, memory_explorer, plot_memory
from .scatter_gather import chunk_sizes_of, gather, parallel_apply, replicate, scatter, scatter_kwargs

# --- chapter 04: DistributedDataParallel ----------------------------------------------------
from .checkpoint import load_checkpoint, save_checkpoint
from .collectives import all_reduce_timings, naive_all_reduce, ring_all_reduce, ring_schedule
from .ddp import MiniDDP, StepTrace, average_gradients, plot_step_trace
from .samplers import DistributedSampler
from .sync_batchnorm import sync_batch_stats

# --- chapter 05: multi-node initialisation ---------------------------------------------------
from .cost_model import (LINKS, AlphaBeta, StepPrediction, fit_alpha_beta, measure_all_reduce,
                         measure_point_to_point, predict_step_time, ring_all_reduce_bytes,
                         ring_all_reduce_time, scaling_table)
from .dist_env import DistEnv, dist_env_from, expand_slurm_nodelist, global_rank, rank_layout
from .network import EmulatedLink, emulated_link, netns_support, network_interfaces
from .nodes import NodeError, NodeResult, launch_nodes, torchrun_command
from .rendezvous import InitMethod, checked_init_process_group, parse_init_method

# --- chapter 06: mixed precision -------------------------------------------------------------
from .amp import AmpStepResult, AutocastModule, OpRecord, amp_step, autocast_op_dtypes, format_op_table
from .amp_speed import (ElementwiseNet, OpTimes, PrecisionRun, compare_precisions, op_time_shares,
                        plot_time_split, training_step)
from .loss_scaling import LossScaler, activation_gradients, update_scale
from .number_formats import (BitFields, CastReport, FloatFormat, bit_fields, cast_report, float_format,
                             format_table, lost_update_fraction, plot_log2_histogram, plot_ranges,
                             underflow_fraction)

# --- chapter 07: model / pipeline parallelism ------------------------------------------------
from .activation_memory import SavedActivationMeter
from .model_split import (ModelParallel, TwoDeviceToyModel, balanced_partition, layer_costs,
                          split_sequential, training_state_bytes)
from .parallel_grid import ParallelGrid
from .pipeline import GPipe, clock_cycles, merge_microbatches, split_microbatches
from .pipeline_comm import PipelineComm
from .pipeline_parallel import (PipelineRun, make_schedule, pipeline_step, run_pipeline,
                                train_pipeline, train_sequential, train_torch_pipelining)
from .pipeline_schedule import (PipelineOp, PipelineSchedule, Timeline, TimelineEvent,
                                bubble_fraction, gpipe_schedule, one_f_one_b_schedule)
